import sys

from megatron_rl_fp8.cli import main

if __name__ == "__main__":
    sys.exit(main())
