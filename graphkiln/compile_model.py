"""`python -m graphkiln.compile_model MODEL -o OUT ...`: the compile-model command."""

import sys

from graphkiln.cli import compile_model_main

if __name__ == "__main__":
    sys.exit(compile_model_main())
