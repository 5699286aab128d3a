"""Training data: scikit-learn's bundled digits (offline default), MNIST and Fashion-MNIST (IDX
files from a folder, or downloaded with checksum verification), a synthetic set, and the Python
standard library's source as next-character windows (text_data.py, offline)."""

from __future__ import annotations

import gzip
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gemps_worker.idx import IdxFile, IdxSource, fetch, read_idx
from gemps_worker.text_data import VOCABULARY, stdlib_text

# Held-out fraction and split seed are fixed so every worker and the evaluator agree on the split.
TEST_FRACTION = 0.2
SPLIT_SEED = 0


@dataclass(frozen=True)
class Dataset:
    name: str
    train_x: np.ndarray  # float32, (N, C, H, W) images or (N, D) vectors; int64 (N, T) token ids for text
    train_y: np.ndarray  # int64 class labels; (N, T) next tokens for text
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])


def _split(name: str, x: np.ndarray, y: np.ndarray, num_classes: int) -> Dataset:
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    n_test = round(len(x) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return Dataset(name, x[train], y[train], x[test], y[test], num_classes)


def bundled_digits_file() -> Path | None:
    """scikit-learn's digits.csv.gz, found without importing scikit-learn: importing it loads
    scipy, which costs every worker some 75 MB of memory and a second of start-up."""
    try:
        spec = importlib.util.find_spec("sklearn")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.submodule_search_locations is None:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


def read_digits_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(pixels 0..16, labels) from the bundled CSV, as scikit-learn's load_digits parses it."""
    with gzip.open(path, "rt") as text:
        table = np.loadtxt(text, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    """(pixels 0..16, labels) through scikit-learn itself: where its data file is not found."""
    from sklearn.datasets import load_digits as sklearn_load_digits

    raw = sklearn_load_digits()
    return raw.data, raw.target


def load_digits() -> Dataset:
    """1,797 real 8x8 handwritten digits shipped with scikit-learn (no download)."""
    path = bundled_digits_file()
    pixels, labels = read_digits_csv(path) if path is not None else sklearn_digits()
    x = (pixels.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    return _split("digits", x, labels.astype(np.int64), 10)


def load_synthetic(samples: int = 4096, features: int = 32, classes: int = 4, seed: int = 1) -> Dataset:
    """Linearly separable Gaussian blobs: any size, for load tests."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=3.0, size=(classes, features)).astype(np.float32)
    y = rng.integers(0, classes, size=samples)
    x = centers[y] + rng.normal(size=(samples, features)).astype(np.float32)
    return _split("synthetic", x.astype(np.float32), y.astype(np.int64), classes)


MNIST = IdxSource(
    mirrors=("https://ossci-datasets.s3.amazonaws.com/mnist", "https://storage.googleapis.com/cvdf-datasets/mnist"),
    train_images=IdxFile("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
    train_labels=IdxFile("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432"),
    test_images=IdxFile("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3"),
    test_labels=IdxFile("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c"),
)
FASHION_MNIST = IdxSource(
    mirrors=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com",),
    train_images=IdxFile("train-images-idx3-ubyte.gz", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
    train_labels=IdxFile("train-labels-idx1-ubyte.gz", "25c81989df183df01b3e8a0aad5dffbe"),
    test_images=IdxFile("t10k-images-idx3-ubyte.gz", "bef4ecab320f06d8554ea6380940ec79"),
    test_labels=IdxFile("t10k-labels-idx1-ubyte.gz", "bb300cfdad3c16e7a12a480ee83cd310"),
)
# (source, subfolder of --data-dir, pixel mean, pixel std) for standardising 0..1 pixels
IDX_DATASETS = {
    "mnist": (MNIST, "mnist", 0.1307, 0.3081),
    "fashion-mnist": (FASHION_MNIST, "fashion-mnist", 0.2860, 0.3530),
}
DATASETS = ("digits", "mnist", "fashion-mnist", "synthetic", "stdlib-text")


def load_idx_dataset(name: str, source: IdxSource, folder: Path, mean: float, std: float, download: bool) -> Dataset:
    """A 28x28 IDX dataset with its official train/test split, standardised per pixel value."""
    paths = fetch(source, folder, download)

    def images(file: IdxFile) -> np.ndarray:
        pixels = read_idx(paths[file.name]).astype(np.float32) / 255.0
        return ((pixels - mean) / std)[:, None, :, :]

    def labels(file: IdxFile) -> np.ndarray:
        return read_idx(paths[file.name]).astype(np.int64)

    return Dataset(
        name,
        images(source.train_images),
        labels(source.train_labels),
        images(source.test_images),
        labels(source.test_labels),
        10,
    )


def load_dataset(name: str, data_dir: str | Path = "data", download: bool = True) -> Dataset:
    if name == "digits":
        return load_digits()
    if name == "synthetic":
        return load_synthetic()
    if name == "stdlib-text":
        return Dataset(name, *stdlib_text(), num_classes=VOCABULARY)
    if name in IDX_DATASETS:
        source, folder, mean, std = IDX_DATASETS[name]
        return load_idx_dataset(name, source, Path(data_dir) / folder, mean, std, download)
    raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
