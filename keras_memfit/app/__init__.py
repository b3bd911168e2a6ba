"""keras_memfit's applications, built on the library's public API (which never imports them).

- `cli`: the `keras-memfit` command line: the parser, its subcommands, one-line errors.
- `predict_file`: `keras-memfit predict`'s work in the child process.
- `inputs`: reading `.npy`/`.npz`/Kaggle `.csv` and fitting them to the model's inputs.
- `outputs`: writing `.npy`/`.csv` atomically.
- `models`: checking and loading saved models.
- `demo`: the Digit Recognizer OOM demo.
- `reference`: plain Keras's `fit` without the memory cap, in a process of its own.
- `digits`: generated Kaggle-shaped digits; reading Kaggle's CSVs, writing its submission.
- `worker`: running work in a child process, any failure as one line.
- `env`: the memory-limited environment a worker starts with (`capped_cpu_env`, `host_tensor`).
- `records`: what the work reports (the `keras_memfit` logger's records, the batch sizes run).
- `errors`: the applications' one-line errors.

Importing this package (or `cli`, `worker`, `env`) imports no TensorFlow: the
work that needs it runs in the child.
"""
