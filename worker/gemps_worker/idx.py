"""IDX files (the MNIST family's format): parsing, and downloading with checksum verification."""

from __future__ import annotations

import gzip
import hashlib
import logging
import shutil
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("gemps.worker")

_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class DatasetError(RuntimeError):
    """A data file is missing, corrupt or could not be fetched."""


@dataclass(frozen=True)
class IdxFile:
    name: str  # e.g. train-images-idx3-ubyte.gz
    md5: str


@dataclass(frozen=True)
class IdxSource:
    """Where a dataset's four IDX files come from, with their published MD5 checksums."""

    mirrors: tuple[str, ...]
    train_images: IdxFile
    train_labels: IdxFile
    test_images: IdxFile
    test_labels: IdxFile

    def files(self) -> tuple[IdxFile, ...]:
        return (self.train_images, self.train_labels, self.test_images, self.test_labels)


def parse_idx(data: bytes) -> np.ndarray:
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DatasetError("not an IDX file: bad magic number")
    dtype, ndim = data[2], data[3]
    if dtype not in _IDX_DTYPES:
        raise DatasetError(f"unsupported IDX element type 0x{dtype:02x}")
    header = 4 + 4 * ndim
    shape = tuple(int(d) for d in np.frombuffer(data[4:header], dtype=">u4"))
    element = _IDX_DTYPES[dtype]
    expected = int(np.prod(shape)) * element.itemsize
    if len(data) - header != expected:
        raise DatasetError(f"IDX body is {len(data) - header} bytes, shape {list(shape)} needs {expected}")
    return np.frombuffer(data, dtype=element, offset=header).reshape(shape)


def read_idx(path: Path) -> np.ndarray:
    raw = path.read_bytes()
    return parse_idx(gzip.decompress(raw) if path.suffix == ".gz" else raw)


def md5_of(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(source: IdxSource, data_dir: Path, download: bool) -> dict[str, Path]:
    """Local paths of the four files, downloading (and verifying) any that are missing.

    A file already in `data_dir` under its .gz name is checked against its checksum; one
    stored decompressed (name without .gz) is taken as is.
    """
    paths = {}
    for file in source.files():
        paths[file.name] = _ensure(file, source.mirrors, data_dir, download)
    return paths


def _ensure(file: IdxFile, mirrors: tuple[str, ...], data_dir: Path, download: bool) -> Path:
    unpacked = data_dir / file.name.removesuffix(".gz")
    if unpacked.exists():
        return unpacked
    packed = data_dir / file.name
    if packed.exists():
        actual = md5_of(packed)
        if actual == file.md5:
            return packed
        raise DatasetError(f"{packed} is corrupt: md5 {actual}, expected {file.md5}; delete it to download again")
    if not download:
        raise DatasetError(f"{packed} is missing and downloads are off (--download false)")
    errors = []
    for mirror in mirrors:
        url = mirror.rstrip("/") + "/" + file.name
        try:
            return _download(url, packed, file.md5)
        except (OSError, DatasetError) as error:
            errors.append(f"{url}: {error}")
    raise DatasetError(f"could not fetch {file.name}: " + "; ".join(errors))


def _download(url: str, target: Path, md5: str) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s", url)
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False, suffix=".part") as partial:
        partial_path = Path(partial.name)
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                shutil.copyfileobj(response, partial)
        except BaseException:
            partial_path.unlink(missing_ok=True)
            raise
    actual = md5_of(partial_path)
    if actual != md5:
        partial_path.unlink()
        raise DatasetError(f"checksum mismatch: md5 {actual}, expected {md5}")
    partial_path.replace(target)  # only verified files ever carry the real name
    return target
