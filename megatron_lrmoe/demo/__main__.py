"""``python -m megatron_lrmoe.demo``: same as ``lrmoe-demo``."""

import sys

from megatron_lrmoe.demo.main import main

if __name__ == "__main__":
    sys.exit(main())
