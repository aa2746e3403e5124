"""Writes the tiny arithmetic task: examples/tiny/data/{train,test}.{jsonl,parquet} and the tokenizer.

    python tools/make_tiny_task.py                    # data + tokenizer (seconds)
    python tools/make_tiny_task.py --base-model       # also retrain examples/tiny/base_model (minutes)

The outputs are deterministic: rerunning reproduces the committed files byte for byte
(the base model given the same torch version and thread count).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_rl.data import tiny_task  # noqa: E402
from megatron_rl.data.tiny_tokenizer import save_tiny_tokenizer  # noqa: E402

logger = logging.getLogger("make_tiny_task")


def write_task(out_dir: Path, *, seed: int = 1234) -> None:
    """Writes train/test rows (jsonl + parquet) and the tokenizer files (in `out_dir/tokenizer`)."""
    train, test = tiny_task.build_splits(seed=seed)
    for split, problems in (("train", train), ("test", test)):
        rows = [tiny_task.problem_to_row(p, index=i, split=split) for i, p in enumerate(problems)]
        tiny_task.write_rows(rows, out_dir / split)
        logger.info("wrote %d %s rows to %s.{jsonl,parquet}", len(rows), split, out_dir / split)
    save_tiny_tokenizer(out_dir / "tokenizer")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "examples/tiny/data"))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--base-model", action="store_true", help="also run tools/train_tiny_base.py")
    ap.add_argument("--base-model-out", default=str(ROOT / "examples/tiny/base_model"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    write_task(Path(args.out), seed=args.seed)
    if args.base_model:
        sys.path.insert(0, str(ROOT / "tools"))
        import train_tiny_base

        return train_tiny_base.main(["--out", args.base_model_out, "--task-seed", str(args.seed)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
