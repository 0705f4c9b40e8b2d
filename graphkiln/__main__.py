"""`python -m graphkiln ...`: the graphkiln command."""

import sys

from graphkiln.cli import main

if __name__ == "__main__":
    sys.exit(main())
