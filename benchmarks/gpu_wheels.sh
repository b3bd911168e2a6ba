#!/usr/bin/env bash
# Fill the ignored wheels/ folder with what `python -m benchmarks.gpu` needs on
# the lent GPU machine and that machine lacks (no network there): Keras and the
# two of its dependencies its image does not hold, namex (pure Python) and
# optree (compiled: the CPython 3.12 x86-64 wheel). Keras's other dependencies
# (absl-py, h5py, ml-dtypes, numpy, packaging, rich) and optree's
# (typing-extensions) are in that image (.library/device/KINDS.md lists it);
# keras_memfit's own (nvidia-ml-py) too. The command that carries and installs
# them is at the top of benchmarks/gpu.py.
#
# Then it checks, in a fresh Python 3.12 virtualenv holding only numpy, jax[cpu]
# and the image's packages Keras needs, that the wheels install with
# --no-index and that Keras and keras_memfit (from this checkout, as there)
# import and train on JAX.
#
# Usage: bash benchmarks/gpu_wheels.sh        (from anywhere; ~1-2 min)
# PYTHON312 names a Python 3.12 interpreter for the check (default: pyenv's 3.12.1, as .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

KERAS="keras==3.15.1"  # the newest Keras keras_memfit is tested with
WHEELS=wheels
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

rm -rf "$WHEELS"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$WHEELS" "$KERAS" namex optree
ls -l "$WHEELS"

# The check: a virtualenv as bare as the GPU machine's image, for Keras's purposes.
PYTHON312="${PYTHON312:-$HOME/.pyenv/versions/3.12.1/bin/python3.12}"
CHECK=$(mktemp -d)
trap 'rm -rf "$CHECK"' EXIT
"$PYTHON312" -m venv "$CHECK/venv"
"$CHECK/venv/bin/pip" install -q numpy "jax[cpu]" absl-py h5py ml-dtypes packaging rich \
    typing-extensions
"$CHECK/venv/bin/pip" install -q --no-index --no-deps --no-compile --target "$CHECK/site" \
    "$WHEELS"/*.whl
KERAS_BACKEND=jax PYTHONPATH="$CHECK/site:$PWD" "$CHECK/venv/bin/python" -c '
import keras, keras_memfit, numpy as np
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
model.compile("adam", "mse")
model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0, callbacks=[keras_memfit.MemFit()])
keras_memfit.safe_predict(model, np.ones((4, 2)), verbose=0)
print(f"wheels/ ok: Keras {keras.__version__} and keras_memfit train on {keras.backend.backend()}")'
