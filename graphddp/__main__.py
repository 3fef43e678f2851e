"""``python -m graphddp ...`` (and ``torchrun -m graphddp ...``): the ``graphddp`` command line."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
