"""megatron-core dist checkpoint (a run dir, iter folder or converted checkpoint) -> HF safetensors
(streaming, 5 GB shards, tokenizer copied); same as `megatron-rl convert to-hf`.

Usage: .venv/bin/python tools/convert_megatron_to_hf.py --checkpoint RUN_DIR_OR_CKPT --out OUT_DIR
       [--hf-config-dir DIR] [--dtype bfloat16] [--no-progress]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert", "to-hf", *sys.argv[1:]]))
