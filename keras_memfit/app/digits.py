"""Generated handwritten-like digits in the layout of Kaggle's Digit Recognizer.

The demo (`python -m keras_memfit demo`) and the notebooks need MNIST-shaped
data on machines with no network, so this module draws it: each digit class is
a stroke skeleton (polylines and elliptical arcs in a unit box); every image
jitters the skeleton's vertices, applies a random affine map (shift, scale,
rotation, shear), renders the strokes anti-aliased with a random pen width
and adds pixel noise. Images are 28x28 `uint8` in 0..255, white ink on black,
centred in a 20x20 box like MNIST. A small CNN learns them to well over 90%
accuracy in one short epoch, and they are different enough from one another
that predictions are not trivially right.

Everything is vectorised numpy (no PIL): 70,000 images take a few seconds.
Generation is deterministic for a given seed, and the test set does not depend
on the number of training samples asked for.

Kaggle's CSV formats are covered too: `to_kaggle_csv` / `load_kaggle_csv` for
`train.csv` (`label,pixel0,...,pixel783`) and `test.csv` (`pixel0,...,pixel783`),
and `write_submission` for `submission.csv` (`ImageId,Label`, ImageId
counting from 1).

Example:
    >>> from keras_memfit.app import digits
    >>> x_train, y_train, x_test = digits.load_digits(train_samples=1000)
    >>> x_train.shape, x_train.dtype, y_train[:5], x_test.shape
    ((1000, 28, 28), dtype('uint8'), array([...]), (28000, 28, 28))
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = [
    "IMAGE_SIZE",
    "KAGGLE_TEST_SAMPLES",
    "KAGGLE_TRAIN_SAMPLES",
    "generate_digits",
    "load_digits",
    "load_kaggle_csv",
    "to_kaggle_csv",
    "write_submission",
]

IMAGE_SIZE = 28
KAGGLE_TRAIN_SAMPLES = 42000  # rows of Kaggle's train.csv
KAGGLE_TEST_SAMPLES = 28000  # rows of Kaggle's test.csv
_PIXELS = IMAGE_SIZE * IMAGE_SIZE
_BOX = 20.0  # MNIST centres each digit in a 20x20 box
_CHUNK = 2048  # images rendered at once (bounds the temporaries to ~100 MiB)

PathLike = Union[str, "os.PathLike[str]"]


# --------------------------------------------------------------------------
# Stroke skeletons
# --------------------------------------------------------------------------
def _arc(cx: float, cy: float, rx: float, ry: float, start: float, stop: float,
         n: int) -> List[Tuple[float, float]]:
    """Points on an ellipse; angles in degrees, 0 = right, 90 = down (y grows down)."""
    angles = np.radians(np.linspace(start, stop, n + 1))
    return [(cx + rx * np.cos(a), cy + ry * np.sin(a)) for a in angles]


def _skeletons() -> List[List[List[Tuple[float, float]]]]:
    """Per digit, a list of polylines (x right, y down, in the unit box)."""
    return [
        # 0: one closed oval.
        [_arc(0.5, 0.5, 0.30, 0.45, -90, 270, 12)],
        # 1: a stem with a short flag.
        [[(0.34, 0.22), (0.55, 0.05), (0.55, 0.95)]],
        # 2: a hook over the top, a diagonal, a base.
        [_arc(0.5, 0.30, 0.29, 0.25, 190, 390, 6) + [(0.15, 0.95), (0.88, 0.95)]],
        # 3: two bowls open to the left.
        [_arc(0.47, 0.27, 0.27, 0.22, 200, 450, 6), _arc(0.47, 0.72, 0.31, 0.23, 270, 510, 7)],
        # 4: a closed top: down stroke, diagonal, crossbar.
        [[(0.64, 0.95), (0.64, 0.05), (0.10, 0.66), (0.90, 0.66)]],
        # 5: top bar, short down stroke, a bowl.
        [[(0.82, 0.05), (0.30, 0.05), (0.26, 0.47)]
         + _arc(0.50, 0.68, 0.31, 0.27, 235, 500, 7)],
        # 6: a curved down stroke into a loop at the bottom.
        [[(0.74, 0.05), (0.45, 0.20), (0.27, 0.48)] + _arc(0.51, 0.70, 0.25, 0.25, 180, 540, 9)],
        # 7: top bar and a long diagonal.
        [[(0.12, 0.05), (0.88, 0.05), (0.40, 0.95)]],
        # 8: two stacked loops.
        [_arc(0.5, 0.26, 0.23, 0.21, 0, 360, 9), _arc(0.5, 0.71, 0.29, 0.24, 0, 360, 10)],
        # 9: a loop at the top and a stem.
        [_arc(0.47, 0.30, 0.26, 0.25, 0, 360, 9), [(0.73, 0.30), (0.70, 0.95)]],
    ]


def _templates() -> List[Tuple[np.ndarray, np.ndarray]]:
    """Per digit: vertices [V, 2] and segments as vertex index pairs [S, 2]."""
    templates = []
    for polylines in _skeletons():
        vertices: List[Tuple[float, float]] = []
        segments: List[Tuple[int, int]] = []
        for line in polylines:
            base = len(vertices)
            vertices.extend(line)
            segments.extend((base + i, base + i + 1) for i in range(len(line) - 1))
        templates.append((np.asarray(vertices, np.float32), np.asarray(segments, np.intp)))
    return templates


_TEMPLATES = _templates()
_COORDS = np.arange(IMAGE_SIZE, dtype=np.float32)  # pixel centres along x and y


def _render(label: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` float32 images [n, 784] in 0..1 of digit `label`."""
    vertices, segments = _TEMPLATES[label]
    # Handwriting wobble: move every vertex a little, consistently along a stroke.
    pts = vertices[None] + rng.normal(0.0, 0.035, (n,) + vertices.shape).astype(np.float32)
    pts -= 0.5
    # Random affine map into pixel coordinates.
    angle = np.radians(rng.uniform(-14.0, 14.0, n))
    shear = rng.uniform(-0.25, 0.25, n)
    scale = rng.uniform(0.78, 1.05, n)
    aspect = rng.uniform(0.8, 1.1, n)
    sx, sy = _BOX * scale * aspect, _BOX * scale
    cos, sin = np.cos(angle), np.sin(angle)
    # [x'; y'] = R(angle) @ Shear @ diag(sx, sy) @ [x; y]
    m00, m01 = cos * sx, (cos * shear - sin) * sy
    m10, m11 = sin * sx, (sin * shear + cos) * sy
    matrix = np.stack([np.stack([m00, m01], -1), np.stack([m10, m11], -1)], -2)
    shift = 13.5 + rng.uniform(-2.0, 2.0, (n, 2))
    pts = np.einsum("nij,nvj->nvi", matrix.astype(np.float32), pts)
    pts += shift[:, None].astype(np.float32)

    # Squared distance from every pixel to the nearest segment. Pixel x and y
    # offsets broadcast ([n, 1, 28] and [n, 28, 1]), so each segment costs a
    # handful of passes over [n, 28, 28] float32 that stay in cache.
    dist2 = np.full((n, IMAGE_SIZE, IMAGE_SIZE), np.inf, np.float32)
    for i, j in segments:
        ax, ay = pts[:, i, 0, None, None], pts[:, i, 1, None, None]
        dx, dy = pts[:, j, 0, None, None] - ax, pts[:, j, 1, None, None] - ay
        length = np.maximum(np.sqrt(dx * dx + dy * dy), np.float32(1e-3))
        px = _COORDS[None, None, :] - ax  # [n, 1, 28]
        py = _COORDS[None, :, None] - ay  # [n, 28, 1]
        along = px * (dx / length) + py * (dy / length)  # projection on the segment
        d2 = px * px + py * py
        clamped = np.maximum(along, np.float32(0.0))
        np.minimum(clamped, length, out=clamped)
        # |p - a|^2 - 2 c (p - a).u + c^2 with c the clamped projection
        along *= 2.0
        along -= clamped
        along *= clamped
        d2 -= along
        np.minimum(dist2, d2, out=dist2)
    dist = np.sqrt(np.maximum(dist2, np.float32(0.0))).reshape(n, _PIXELS)

    # Anti-aliased pen of random width, brightest on the stroke's centre line.
    half_width = rng.uniform(0.9, 1.9, (n, 1)).astype(np.float32)
    ink = np.clip(half_width + 0.6 - dist, 0.0, 1.0)
    ink *= rng.uniform(0.75, 1.0, (n, 1)).astype(np.float32)
    # Pixel noise, and a few faint specks in the background.
    noise = rng.standard_normal(ink.shape, dtype=np.float32)
    noise *= np.float32(0.05)
    ink += noise
    specks = rng.integers(0, ink.size, ink.size // 250)
    ink.reshape(-1)[specks] += rng.uniform(0.2, 0.6, specks.size).astype(np.float32)
    return np.clip(ink, 0.0, 1.0, out=ink)


def generate_digits(n: int, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Draw `n` labelled handwritten-like digit images.

    Args:
        n: Number of images (0 or more).
        seed: Seed; the same seed always gives the same images and labels.

    Returns:
        `(images, labels)`: `uint8` array [n, 28, 28] (0..255, white ink on
        black) and `int64` array [n] of digits 0..9, roughly balanced.

    Raises:
        ValueError: If `n` is negative or not an int.

    Example:
        >>> images, labels = generate_digits(5, seed=1)
        >>> images.shape, images.dtype, labels.dtype
        ((5, 28, 28), dtype('uint8'), dtype('int64'))
    """
    _check_count("n", n)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n).astype(np.int64)
    images = np.empty((n, _PIXELS), np.uint8)
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        chunk_labels = labels[start:stop]
        for digit in range(10):
            index = np.flatnonzero(chunk_labels == digit) + start
            if index.size:
                images[index] = np.rint(_render(digit, index.size, rng) * 255.0).astype(np.uint8)
    return images.reshape(n, IMAGE_SIZE, IMAGE_SIZE), labels


def load_digits(
    train_samples: int = KAGGLE_TRAIN_SAMPLES,
    test_samples: int = KAGGLE_TEST_SAMPLES,
    seed: int = 0,
    *,
    return_test_labels: bool = False,
) -> Tuple[np.ndarray, ...]:
    """Generated digits split like Kaggle's Digit Recognizer (no download).

    The training and test sets come from independent streams of `seed`, so
    the test set is the same whatever `train_samples` is.

    Args:
        train_samples: Number of labelled training images (Kaggle: 42,000).
        test_samples: Number of test images (Kaggle: 28,000).
        seed: Seed; equal seeds give equal data.
        return_test_labels: Also return the test set's labels (Kaggle keeps
            them secret; here they let you score a submission).

    Returns:
        `(x_train, y_train, x_test)`, or `(x_train, y_train, x_test, y_test)`
        when `return_test_labels`: images `uint8` [n, 28, 28], labels `int64` [n].

    Raises:
        ValueError: If a sample count is negative or not an int.

    Example:
        >>> x_train, y_train, x_test = load_digits(train_samples=6000)
        >>> x_test.shape
        (28000, 28, 28)
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


# --------------------------------------------------------------------------
# Kaggle's CSV formats
# --------------------------------------------------------------------------
_NUMBERS = np.array([str(i) for i in range(256)], dtype=object)


def to_kaggle_csv(path: PathLike, images: np.ndarray, labels: Optional[np.ndarray] = None) -> None:
    """Write images (and labels) as Kaggle's Digit Recognizer CSV.

    With labels it writes `train.csv`'s layout (`label,pixel0,...,pixel783`),
    without them `test.csv`'s (`pixel0,...,pixel783`); one row per image,
    pixels row-major, integers 0..255.

    Args:
        path: File to write (overwritten).
        images: Integer array [n, 28, 28] or [n, 784] with values in 0..255.
        labels: Optional integer array [n] of digits 0..9.

    Raises:
        ValueError: If the shapes, dtypes or value ranges are not Kaggle's.
        OSError: If the file cannot be written.

    Example:
        >>> x_train, y_train, x_test = load_digits(1000, 500)
        >>> to_kaggle_csv("train.csv", x_train, y_train)
        >>> to_kaggle_csv("test.csv", x_test)
    """
    flat = _as_pixels(images)
    if labels is not None:
        labels = np.asarray(labels)
        if labels.shape != (flat.shape[0],):
            raise ValueError(
                f"labels must have shape ({flat.shape[0]},), one per image; received "
                f"shape {labels.shape}"
            )
        _check_labels(labels, "labels")
    header = ([] if labels is None else ["label"]) + [f"pixel{i}" for i in range(_PIXELS)]
    with open(path, "w", newline="") as f:
        f.write(",".join(header) + "\n")
        for start in range(0, flat.shape[0], 1024):
            block = _NUMBERS[flat[start:start + 1024]]
            if labels is not None:
                block = np.concatenate(
                    [_NUMBERS[labels[start:start + 1024].astype(np.intp)][:, None], block], axis=1
                )
            f.write("".join(",".join(row) + "\n" for row in block))


def load_kaggle_csv(path: PathLike) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """Read Kaggle's Digit Recognizer `train.csv` or `test.csv`.

    Args:
        path: A CSV whose header is `label,pixel0,...,pixel783` (train) or
            `pixel0,...,pixel783` (test).

    Returns:
        `(images, labels)`: `uint8` array [n, 28, 28] and `int64` array [n],
        or None for labels when the file has no `label` column.

    Raises:
        ValueError: If the header or a row is not in Kaggle's format.
        OSError: If the file cannot be read.

    Example:
        >>> images, labels = load_kaggle_csv("train.csv")
        >>> images, _ = load_kaggle_csv("test.csv")
    """
    with open(path, "r") as f:
        header = f.readline().strip().split(",")
        body = f.read()
    pixel_header = [f"pixel{i}" for i in range(_PIXELS)]
    if header == ["label"] + pixel_header:
        columns, has_labels = _PIXELS + 1, True
    elif header == pixel_header:
        columns, has_labels = _PIXELS, False
    else:
        shown = ",".join(header[:3]) + (",..." if len(header) > 3 else "")
        raise ValueError(
            f"{os.fspath(path)} is not a Digit Recognizer CSV: its header starts "
            f"{shown!r}; expected 'label,pixel0,...,pixel783' or 'pixel0,...,pixel783'"
        )
    lines = body.count("\n") + (0 if not body or body.endswith("\n") else 1)
    text = body.replace("\r", "").replace("\n", ",").strip(",")
    values = (
        np.fromstring(text, dtype=np.int64, sep=",") if text else np.empty(0, np.int64)
    )  # fast C parser; np.loadtxt takes ~10x longer on 42,000 rows
    if values.size != lines * columns or values.size % columns:
        raise ValueError(
            f"{os.fspath(path)}: expected {columns} integer columns on each of "
            f"{lines} rows; found {values.size} values in all"
        )
    table = values.reshape(-1, columns)
    labels = None
    if has_labels:
        labels, table = table[:, 0].copy(), table[:, 1:]
        _check_labels(labels, f"{os.fspath(path)}: label")
    if table.size and (table.min() < 0 or table.max() > 255):
        raise ValueError(f"{os.fspath(path)}: pixel values must be in 0..255")
    return table.astype(np.uint8).reshape(-1, IMAGE_SIZE, IMAGE_SIZE), labels


def write_submission(path: PathLike, labels: Sequence[int], start_id: int = 1) -> None:
    """Write predicted digits as Kaggle's `submission.csv` (`ImageId,Label`).

    Args:
        path: File to write (overwritten).
        labels: Predicted digit (0..9) of each test image, in test.csv's order.
        start_id: ImageId of the first row (Kaggle counts from 1).

    Raises:
        ValueError: If `labels` is not one-dimensional or holds values outside 0..9.
        OSError: If the file cannot be written.

    Example:
        >>> labels = safe_predict(model, x_test, batch_size=28000,
        ...                       postprocess=lambda y: keras.ops.argmax(y, axis=-1))
        >>> write_submission("submission.csv", labels)
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(
            f"labels must be one-dimensional (one digit per image); received shape "
            f"{labels.shape}"
        )
    _check_labels(labels, "labels")
    ids = np.arange(start_id, start_id + labels.size)
    with open(path, "w", newline="") as f:
        f.write("ImageId,Label\n")
        f.write("".join(f"{i},{int(d)}\n" for i, d in zip(ids.tolist(), labels.tolist())))


def _as_pixels(images: np.ndarray) -> np.ndarray:
    images = np.asarray(images)
    if images.ndim == 3 and images.shape[1:] == (IMAGE_SIZE, IMAGE_SIZE):
        flat = images.reshape(images.shape[0], _PIXELS)
    elif images.ndim == 2 and images.shape[1] == _PIXELS:
        flat = images
    else:
        raise ValueError(
            f"images must have shape [n, 28, 28] or [n, 784]; received shape {images.shape}"
        )
    if not np.issubdtype(flat.dtype, np.integer):
        raise ValueError(f"images must hold integers 0..255; received dtype {flat.dtype}")
    if flat.size and (flat.min() < 0 or flat.max() > 255):
        raise ValueError("images must hold integers 0..255")
    return flat.astype(np.intp, copy=False)


def _check_labels(labels: np.ndarray, name: str) -> None:
    if labels.size and (
        not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0 or labels.max() > 9
    ):
        raise ValueError(f"{name} must be digits 0..9 (integers)")

