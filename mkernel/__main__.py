"""``python -m mkernel precompile|info``: see :mod:`mkernel.cli`."""
import sys

from mkernel.cli import main

if __name__ == "__main__":
    sys.exit(main())
