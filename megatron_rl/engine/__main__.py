"""``python -m megatron_rl.engine``: run the embedded rollout server (flags: ``--help``)."""

import sys

from megatron_rl.engine.server import main

if __name__ == "__main__":
    sys.exit(main())
