"""HF safetensors -> megatron-core dist checkpoint (streaming); same as `megatron-rl convert to-megatron`.

Usage: .venv/bin/python tools/convert_hf_to_megatron.py --hf MODEL_DIR --out OUT_DIR
       [--tensor-model-parallel-size N] [--make-vocab-size-divisible-by 128] [--dtype bfloat16] [--no-progress]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert", "to-megatron", *sys.argv[1:]]))
