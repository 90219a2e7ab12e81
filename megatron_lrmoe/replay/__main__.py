"""``python -m megatron_lrmoe.replay`` (see megatron_lrmoe/replay/cli.py)."""

import sys

from megatron_lrmoe.replay.cli import main

if __name__ == "__main__":
    sys.exit(main())
