"""keras_memfit's applications; this package, `cli`, `worker` and `env` import no TensorFlow.

- `cli`: the `keras-memfit` command line.
- `predict_file`: `keras-memfit predict`'s work in the child process.
- `inputs`: reading `.npy`/`.npz`/Kaggle `.csv` onto the model's inputs.
- `outputs`: writing `.npy`/`.csv` atomically.
- `models`: checking and loading saved models.
- `demo`: the Digit Recognizer OOM demo.
- `reference`: plain Keras's `fit` without the memory cap, in a process of its own.
- `digits`: generated Kaggle-shaped digits, and Kaggle's CSVs.
- `worker`: running work in a child process, any failure as one line.
- `env`: the memory-limited environment a worker starts with.
- `records`: what the work reports (logged messages, batch sizes run).
- `errors`: the applications' one-line errors.
"""
