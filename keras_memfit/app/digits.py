"""Generated Kaggle Digit Recognizer digits (28x28 `uint8`, one pen stroke each), and its CSVs."""

from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple, Union

import numpy as np

IMAGE_SIZE = 28
KAGGLE_TRAIN_SAMPLES = 42000  # rows of Kaggle's train.csv
KAGGLE_TEST_SAMPLES = 28000  # rows of Kaggle's test.csv
_PIXELS = IMAGE_SIZE * IMAGE_SIZE
_CHUNK = 4096  # images drawn at once (bounds the temporaries)

PathLike = Union[str, "os.PathLike[str]"]

# Each digit, 0 to 9, is one stroke through points "x,y" of a grid 4 wide and
# 6 tall (x right, y down).
_STROKES = (
    "1,0 3,0 4,1 4,5 3,6 1,6 0,5 0,1 1,0",
    "1,1 2,0 2,6",
    "0,1 1,0 3,0 4,1 4,2 0,6 4,6",
    "0,0 4,0 2,2 3,2 4,3 4,5 3,6 1,6 0,5",
    "3,6 3,0 0,4 4,4",
    "4,0 0,0 0,3 3,3 4,4 4,5 3,6 0,6",
    "3,0 1,1 0,3 0,5 1,6 3,6 4,5 4,4 3,3 1,3 0,4",
    "0,0 4,0 1,6",
    "1,3 0,2 0,1 1,0 3,0 4,1 4,2 3,3 1,3 0,4 0,5 1,6 3,6 4,5 4,4 3,3",
    "4,2 3,3 1,3 0,2 0,1 1,0 3,0 4,1 4,6",
)
_STEP = 0.25  # grid units between the dots a stroke is inked with (under a pixel)


def _template(stroke: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A stroke's centred vertices, and its dots: dot k is `fraction[k]` along `segment[k]`."""
    vertices = np.array([point.split(",") for point in stroke.split()], np.float64) - (2, 3)
    segments, fractions = [], []
    for i, length in enumerate(np.linalg.norm(np.diff(vertices, axis=0), axis=1)):
        along = np.arange(0.0, length, _STEP) / length
        segments.append(np.full(along.size, i))
        fractions.append(along)
    segments.append([len(vertices) - 2])  # the stroke's last point
    fractions.append([1.0])
    return vertices, np.concatenate(segments), np.concatenate(fractions)[:, None]


_TEMPLATES = [_template(stroke) for stroke in _STROKES]


def _render(digit: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` images [n, 28, 28] `uint8` of `digit`."""
    vertices, segment, fraction = _TEMPLATES[digit]
    # Handwriting wobble: every point of the stroke moves a little.
    wobbled = vertices + rng.normal(0.0, 0.18, (n,) + vertices.shape)
    dots = wobbled[:, segment] * (1.0 - fraction) + wobbled[:, segment + 1] * fraction
    # A random rotation, shear, scale (6 grid units span about MNIST's 20-pixel
    # box) and shift.
    angle, shear = rng.uniform(-0.25, 0.25, (2, n, 1))
    scale = rng.uniform(0.8, 1.05, (n, 1)) * (20.0 / 6.0)
    x = dots[..., 0] + shear * dots[..., 1]
    y = dots[..., 1]
    cos, sin = np.cos(angle) * scale, np.sin(angle) * scale
    px = cos * x - sin * y + rng.uniform(11.5, 15.5, (n, 1))
    py = sin * x + cos * y + rng.uniform(11.5, 15.5, (n, 1))
    # Each dot's ink shared among its four nearest pixels.
    ink = np.zeros(n * _PIXELS)
    first = np.arange(n)[:, None] * _PIXELS
    for column in (np.floor(px), np.floor(px) + 1):
        for row in (np.floor(py), np.floor(py) + 1):
            weight = (1.0 - np.abs(px - column)) * (1.0 - np.abs(py - row))
            inside = (column >= 0) & (column < IMAGE_SIZE) & (row >= 0) & (row < IMAGE_SIZE)
            index = (first + row * IMAGE_SIZE + column)[inside].astype(np.intp)
            ink += np.bincount(index, weight[inside], n * _PIXELS)
    # A pen of random width: spread the ink over the neighbouring pixels.
    padded = np.pad(ink.reshape(n, IMAGE_SIZE, IMAGE_SIZE), ((0, 0), (1, 1), (1, 1)))
    ink = padded[:, :-2] + 2.0 * padded[:, 1:-1] + padded[:, 2:]
    ink = ink[..., :-2] + 2.0 * ink[..., 1:-1] + ink[..., 2:]
    ink *= rng.uniform(0.12, 0.3, (n, 1, 1))
    ink += rng.normal(0.0, 0.05, ink.shape)
    return np.rint(np.clip(ink, 0.0, 1.0) * 255.0).astype(np.uint8)


def generate_digits(n: int, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """`(images, labels)`: `n` digits, `uint8` [n, 28, 28] and `int64` [n]; the same for a seed."""
    _check_count("n", n)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n).astype(np.int64)
    images = np.empty((n, IMAGE_SIZE, IMAGE_SIZE), np.uint8)
    for start in range(0, n, _CHUNK):
        chunk_labels = labels[start:start + _CHUNK]
        for digit in range(10):
            index = np.flatnonzero(chunk_labels == digit) + start
            if index.size:
                images[index] = _render(digit, index.size, rng)
    return images, labels


def load_digits(
    train_samples: int = KAGGLE_TRAIN_SAMPLES,
    test_samples: int = KAGGLE_TEST_SAMPLES,
    seed: int = 0,
    *,
    return_test_labels: bool = False,
) -> Tuple[np.ndarray, ...]:
    """`(x_train, y_train, x_test[, y_test])` generated, by default as many as Kaggle's.

    The test set has its own stream of `seed`: the same whatever `train_samples` is.
    """
    _check_count("train_samples", train_samples)
    _check_count("test_samples", test_samples)
    train_seed, test_seed = np.random.SeedSequence(seed).spawn(2)
    x_train, y_train = generate_digits(train_samples, train_seed)
    x_test, y_test = generate_digits(test_samples, test_seed)
    if return_test_labels:
        return x_train, y_train, x_test, y_test
    return x_train, y_train, x_test


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative int; received {name}={value!r}")


def load_kaggle_csv(path: PathLike) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """Kaggle's `train.csv` or `test.csv` as `(images, labels)`, labels None without a `label`.

    Raises:
        ValueError: If the header or a row is not in Kaggle's format.
    """
    with open(path, "r") as f:
        header = f.readline().strip().split(",")
        body = f.read()
    pixel_header = [f"pixel{i}" for i in range(_PIXELS)]
    if header not in (["label"] + pixel_header, pixel_header):
        shown = ",".join(header[:3]) + (",..." if len(header) > 3 else "")
        raise ValueError(
            f"{os.fspath(path)} is not a Digit Recognizer CSV: its header starts "
            f"{shown!r}; expected 'label,pixel0,...,pixel783' or 'pixel0,...,pixel783'"
        )
    columns = len(header)
    lines = body.count("\n") + (0 if not body or body.endswith("\n") else 1)
    text = body.replace("\r", "").replace("\n", ",").strip(",")
    values = (
        np.fromstring(text, dtype=np.int64, sep=",") if text else np.empty(0, np.int64)
    )  # fast C parser; np.loadtxt is much slower
    if values.size != lines * columns:
        raise ValueError(
            f"{os.fspath(path)}: expected {columns} integer columns on each of "
            f"{lines} rows; found {values.size} values in all"
        )
    table = values.reshape(-1, columns)
    labels = None
    if columns > _PIXELS:  # a label column first
        labels, table = table[:, 0].copy(), table[:, 1:]
        _check_labels(labels, f"{os.fspath(path)}: label")
    if table.size and (table.min() < 0 or table.max() > 255):
        raise ValueError(f"{os.fspath(path)}: pixel values must be in 0..255")
    return table.astype(np.uint8).reshape(-1, IMAGE_SIZE, IMAGE_SIZE), labels


def write_submission(path: PathLike, labels: Sequence[int], start_id: int = 1) -> None:
    """Write `labels` (test.csv's order) as Kaggle's `submission.csv`, ImageIds from `start_id`."""
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(
            f"labels must be one-dimensional (one digit per image); received shape "
            f"{labels.shape}"
        )
    _check_labels(labels, "labels")
    with open(path, "w", newline="") as f:
        f.write("ImageId,Label\n")
        f.write("".join(f"{i},{int(d)}\n" for i, d in enumerate(labels.tolist(), start_id)))


def _check_labels(labels: np.ndarray, name: str) -> None:
    if labels.size and (
        not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0 or labels.max() > 9
    ):
        raise ValueError(f"{name} must be digits 0..9 (integers)")

