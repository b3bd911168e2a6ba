"""`python -m keras_memfit ...`: the `keras-memfit` command line (see `keras_memfit.cli`)."""

import sys

from keras_memfit.cli import main

if __name__ == "__main__":
    sys.exit(main())
