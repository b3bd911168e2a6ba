"""`python -m keras_memfit ...`: the `keras-memfit` command line (see `keras_memfit.app.cli`)."""

from keras_memfit.app.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
