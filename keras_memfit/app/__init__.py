"""keras_memfit's applications, built on the library's public API.

The library (everything in `keras_memfit` outside this package) never imports
from here. Modules, each one concept:

- `cli`: the `keras-memfit` command line (also `python -m keras_memfit`):
  the parser, the `demo`, `predict` and `report` subcommands, one-line errors.
- `predict_file`: `keras-memfit predict`'s work in the child process.
- `inputs`: reading `.npy`/`.npz`/Kaggle `.csv` and fitting them to the
  model's inputs.
- `outputs`: writing `.npy`/`.csv` atomically.
- `models`: checking and loading saved models.
- `demo`: the Digit Recognizer OOM demo.
- `reference`: plain Keras's `fit` without the memory cap, in a process of
  its own, for comparing MemFit's weights with (the demo, the notebook).
- `digits`: the generated Kaggle-shaped digits the demo (and the notebooks
  and benchmarks) use; reading Kaggle's CSVs, writing its submission.
- `worker`: running work in a child process and turning any failure into one
  line.
- `env`: the memory-limited environment a worker starts with
  (`capped_cpu_env(mb)`, the one capped-allocator recipe, shared with the
  notebooks, the benchmarks and the tests; `host_tensor` for inputs under it).
- `records`: what the work reports (the `keras_memfit` logger's records, the
  batch sizes run).
- `errors`: the applications' one-line errors.

Importing this package (or `cli`, `worker`, `env`) imports no TensorFlow: the
work that needs it runs in the child.
"""
