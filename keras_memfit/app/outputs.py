"""Writing `keras-memfit predict`'s output as `.npy` or `.csv`, atomically (renamed into place)."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

from keras_memfit.app.errors import PredictError, one_line

OUTPUT_KINDS = (".npy", ".csv")
_CSV_CHUNK_ROWS = 8192  # rows formatted at once when writing a CSV


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """Turns an OSError while writing `path` into a one-line PredictError."""
    try:
        yield
    except OSError as err:
        raise PredictError(f"cannot write {path}: {one_line(err)}") from err


def temporary_path(out_path: str) -> str:
    """A fresh path prefix next to the output, so the final rename is atomic."""
    import tempfile

    folder, base = os.path.split(out_path)
    handle, path = tempfile.mkstemp(prefix=f".{base}.", suffix=".partial", dir=folder)
    os.close(handle)
    os.remove(path)
    return path


def write_csv(path: str, values: Any, argmax: bool) -> None:
    """Write labels (`argmax`) as `ImageId,Label` or outputs as `ImageId,p0..pK`, chunk by chunk."""
    import numpy as np

    n = int(values.shape[0])
    width = int(np.prod(values.shape[1:], dtype=np.int64))
    fmt = "%d"
    if values.dtype.kind == "f":  # enough digits for the value to read back exactly
        fmt = "%.17g" if values.dtype.itemsize > 4 else "%.9g"
    header = "ImageId,Label" if argmax else "ImageId," + ",".join(f"p{i}" for i in range(width))
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(header + "\n")
        for begin in range(0, n, _CSV_CHUNK_ROWS):
            stop = min(n, begin + _CSV_CHUNK_ROWS)
            block = np.asarray(values[begin:stop]).reshape(stop - begin, width).tolist()
            f.write("".join(
                f"{i}," + ",".join(fmt % v for v in row) + "\n"
                for i, row in zip(range(begin + 1, stop + 1), block)
            ))
