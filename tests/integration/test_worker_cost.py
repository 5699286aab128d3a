"""The worker-cost harness runs end to end, and the worker's digits loader (which skips
importing scikit-learn) gives exactly what scikit-learn gives."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from gemps_bench.worker_cost import measure_worker_cost

from gemps_worker import datasets
from gemps_worker.datasets import bundled_digits_file, load_digits, read_digits_csv, sklearn_digits


def test_harness_reports_positive_figures_and_targets() -> None:
    figures = measure_worker_cost(repeats=1, max_steps=3)  # asserts the harness works, not the numbers
    for key in (
        "bare_import_peak_rss_mb",
        "bare_import_wall_s",
        "bare_import_until_imported_s",
        "worker_peak_rss_mb",
        "worker_startup_to_first_commit_s",
        "rss_ratio",
        "startup_ratio",
        "startup_ratio_until_imported",
    ):
        value = figures[key]
        assert isinstance(value, float) and value > 0, key
    assert figures["repeats"] == 1
    assert (figures["rss_target"], figures["startup_target"]) == (1.25, 2.0)
    assert isinstance(figures["rss_target_met"], bool) and isinstance(figures["startup_target_met"], bool)
    assert len(str(figures["worker_peak_rss_mb_samples"]).split(",")) == 1


def test_bundled_digits_csv_matches_scikit_learn() -> None:
    path = bundled_digits_file()
    assert path is not None, "scikit-learn's digits.csv.gz was not found"
    for ours, theirs in zip(read_digits_csv(path), sklearn_digits(), strict=True):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        np.testing.assert_array_equal(ours, theirs)


def test_digits_fall_back_to_scikit_learn_without_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    direct = load_digits()
    monkeypatch.setattr(datasets, "bundled_digits_file", lambda: None)
    fallback = load_digits()
    for name in ("train_x", "train_y", "test_x", "test_y"):
        np.testing.assert_array_equal(getattr(direct, name), getattr(fallback, name))
        assert getattr(direct, name).dtype == getattr(fallback, name).dtype


def test_digits_file_is_not_found_where_scikit_learn_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert bundled_digits_file() is None


def test_digits_csv_is_read_as_scikit_learn_parses_it(tmp_path: Path) -> None:
    path = tmp_path / "digits.csv.gz"
    path.write_bytes(gzip.compress(b"0,16,3\n5,1,7\n"))
    pixels, labels = read_digits_csv(path)
    np.testing.assert_array_equal(pixels, [[0.0, 16.0], [5.0, 1.0]])
    np.testing.assert_array_equal(labels, [3, 7])
