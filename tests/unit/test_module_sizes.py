"""Every library module stays one job's size: at most MAX_LINES lines, the compiled loops' C
sources (a package's `csrc/*.c` and `*.h`) as much as its Python.

A module past the bound has grown a second job; split it by concern rather than raise the bound.
The generated protobuf code (`*_pb2*.py`) is not ours to split, and tests and scripts are not the
library.
"""

from __future__ import annotations

from pathlib import Path

MAX_LINES = 450
ROOT = Path(__file__).resolve().parents[2]
# The library's packages, and its one stand-alone module.
PACKAGES = (
    "proto/gemps_proto",
    "server/gemps_server",
    "client_sdk/gemps",
    "worker/gemps_worker",
    "cli/gemps_cli",
    "benchmarks/gemps_bench",
)
STANDALONE = ("deploy/grafana/generate.py",)


SOURCE_PATTERNS = ("*.py", "*.c", "*.h")


def library_modules() -> list[Path]:
    found = [
        path for package in PACKAGES for pattern in SOURCE_PATTERNS for path in sorted((ROOT / package).rglob(pattern))
    ]
    found += [ROOT / module for module in STANDALONE]
    return [path for path in found if "_pb2" not in path.name]


def test_the_compiled_loops_are_measured_too() -> None:
    """C sources count: a module split into C does not leave the rule's sight."""
    assert any(path.suffix == ".c" for path in library_modules())


def line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_the_library_is_where_this_test_looks() -> None:
    """A package moved or renamed would otherwise leave its modules unmeasured."""
    missing = [name for name in (*PACKAGES, *STANDALONE) if not (ROOT / name).exists()]
    assert not missing, f"not found under {ROOT}: {', '.join(missing)}"


def test_every_library_module_is_at_most_450_lines() -> None:
    sizes = {path.relative_to(ROOT).as_posix(): line_count(path) for path in library_modules()}
    over = sorted((count, name) for name, count in sizes.items() if count > MAX_LINES)
    listed = "\n".join(f"  {name}: {count} lines" for count, name in reversed(over))
    assert not over, f"{len(over)} module(s) over {MAX_LINES} lines (split each by concern):\n{listed}"
