"""IDX parsing and downloads with checksum verification, against a local HTTP server."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gemps_worker.datasets import DATASETS, load_dataset, load_idx_dataset
from gemps_worker.idx import DatasetError, IdxFile, IdxSource, fetch, parse_idx


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + np.array(array.shape, dtype=">u4").tobytes()
    return header + array.astype(np.uint8).tobytes()


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A local HTTP server serving four small gzipped IDX files; yields (url, md5 by name)."""
    served = tmp_path / "served"
    served.mkdir()
    rng = np.random.default_rng(0)
    contents = {
        "train-images-idx3-ubyte.gz": idx_bytes(rng.integers(0, 256, (12, 28, 28))),
        "train-labels-idx1-ubyte.gz": idx_bytes(np.arange(12) % 10),
        "t10k-images-idx3-ubyte.gz": idx_bytes(rng.integers(0, 256, (5, 28, 28))),
        "t10k-labels-idx1-ubyte.gz": idx_bytes(np.arange(5)),
    }
    md5 = {}
    for name, raw in contents.items():
        packed = gzip.compress(raw)
        (served / name).write_bytes(packed)
        md5[name] = hashlib.md5(packed).hexdigest()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}", md5
    httpd.shutdown()
    httpd.server_close()


def source_for(url: str, md5: dict[str, str]) -> IdxSource:
    files = [IdxFile(n, md5[n]) for n in md5]
    return IdxSource((url,), *files)


def test_parse_idx_round_trip_and_errors() -> None:
    array = np.arange(24).reshape(2, 3, 4)
    np.testing.assert_array_equal(parse_idx(idx_bytes(array)), array)
    with pytest.raises(DatasetError, match="bad magic"):
        parse_idx(b"\x01\x00\x08\x01")
    with pytest.raises(DatasetError, match="needs 24"):
        parse_idx(idx_bytes(array)[:-1])


def test_download_with_right_checksums_then_load(mirror: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    url, md5 = mirror
    data = load_idx_dataset("tiny", source_for(url, md5), tmp_path / "data", 0.5, 0.25, download=True)
    assert data.train_x.shape == (12, 1, 28, 28) and data.test_x.shape == (5, 1, 28, 28)
    assert data.train_y.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    assert data.train_x.min() >= (0 - 0.5) / 0.25 and data.train_x.max() <= (1 - 0.5) / 0.25
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == sorted(md5)  # no partial files left


def test_wrong_checksum_is_refused_and_leaves_nothing(mirror: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    url, md5 = mirror
    tampered = {**md5, "train-labels-idx1-ubyte.gz": "0" * 32}
    with pytest.raises(DatasetError, match="checksum mismatch"):
        fetch(source_for(url, tampered), tmp_path / "data", download=True)
    assert not (tmp_path / "data" / "train-labels-idx1-ubyte.gz").exists()
    assert not list((tmp_path / "data").glob("*.part"))


def test_corrupt_local_file_is_reported(mirror: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    url, md5 = mirror
    folder = tmp_path / "data"
    fetch(source_for(url, md5), folder, download=True)
    (folder / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not the file")
    with pytest.raises(DatasetError, match="corrupt"):
        fetch(source_for(url, md5), folder, download=False)


def test_missing_files_without_download(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="missing and downloads are off"):
        load_dataset("mnist", tmp_path, download=False)


def test_unreachable_mirror_names_the_url(tmp_path: Path) -> None:
    source = IdxSource(("http://127.0.0.1:9",), *[IdxFile(f"f{i}.gz", "0" * 32) for i in range(4)])
    with pytest.raises(DatasetError, match=re.escape("127.0.0.1:9/f0.gz")):
        fetch(source, tmp_path, download=True)


@pytest.mark.parametrize("name", ["digits", "synthetic"])
def test_offline_datasets(name: str) -> None:
    data = load_dataset(name)
    assert len(data.train_x) > len(data.test_x) > 0
    assert set(np.unique(data.train_y)) == set(range(data.num_classes))
    assert name in DATASETS
