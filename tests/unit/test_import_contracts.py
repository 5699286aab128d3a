"""The import contracts cover a new module by default (pyproject.toml's [tool.importlinter]).

Each contract that guards a package names the package, not its modules one by one: a module added
tomorrow is held to it without an edit there. A copy of the sources gets the new modules a
contract must catch, and the real `lint-imports` runs over it; the public surface the server's
contract leaves open names modules that exist (a misspelt line would open nothing, silently).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parents[2]
LINTER: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
FOLDERS = ("proto", "server", "client_sdk", "worker", "cli", "benchmarks")  # [tool.setuptools.packages.find]
SOURCE_OF = {
    "gemps_proto": "proto",
    "gemps_server": "server",
    "gemps": "client_sdk",
    "gemps_worker": "worker",
    "gemps_cli": "cli",
    "gemps_bench": "benchmarks",
}


def _contract(starts: str) -> dict[str, Any]:
    return next(c for c in LINTER["contracts"] if c["name"].startswith(starts))


def _exists(module: str) -> bool:
    """Whether `module` (dotted, no wildcard) is a module or a package of this tree."""
    root, *rest = module.split(".")
    path = ROOT / SOURCE_OF[root] / root / Path(*rest) if rest else ROOT / SOURCE_OF[root] / root
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_the_server_is_protected_whole_and_each_public_line_names_a_module() -> None:
    contract = _contract("Only the server imports its internals")
    assert contract["protected_modules"] == ["gemps_server"] and contract["allowed_importers"] == ["gemps_server"]
    public = [line.split("->") for line in contract["ignore_imports"]]
    assert public and all(importer.strip() == "**" for importer, _ in public), contract["ignore_imports"]
    for _, imported in public:
        module = imported.strip().removesuffix(".**")
        assert module.startswith("gemps_server.") and _exists(module), f"{imported.strip()}: no such module"


def test_the_sdk_contracts_hold_every_module_but_named_exceptions_that_exist() -> None:
    torch = _contract("The protocol, the server and the SDK's core never import torch")
    assert torch["source_modules"] == ["gemps_proto", "gemps_server", "gemps", "gemps.*"]
    assert torch["ignore_imports"] == ["gemps.pytorch -> torch", "gemps.pytorch.** -> torch"]
    assert _exists("gemps.pytorch")

    seam = _contract("Above the transport seam the SDK knows no wire")
    assert seam["source_modules"] == ["gemps", "gemps.*"]
    for line in seam["ignore_imports"]:
        importer, imported = (side.strip().removesuffix(".**") for side in line.split("->"))
        assert _exists(importer) and (imported == "**" or _exists(imported)), line


def _copy_of_the_sources(folder: Path) -> None:
    for name in FOLDERS:
        shutil.copytree(ROOT / name, folder / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", folder / "pyproject.toml")


def test_a_new_module_is_held_to_the_contracts_without_an_edit_to_them(tmp_path: Path) -> None:
    _copy_of_the_sources(tmp_path)
    added = {
        # a new server module, imported from the command line: internal by default
        "server/gemps_server/brand_new.py": "VALUE = 1\n",
        "cli/gemps_cli/uses_brand_new.py": "from gemps_server.brand_new import VALUE\n",
        # a new SDK module that imports the wire
        "client_sdk/gemps/brand_new.py": "from gemps_proto.v1 import parameter_server_pb2\n",
        # a new SDK module that imports the torch layer (so torch, with `import gemps`)
        "client_sdk/gemps/also_new.py": "import gemps.pytorch\n",
        # a new protocol module with a socket
        "proto/gemps_proto/brand_new.py": "import socket\n",
    }
    for path, text in added.items():
        (tmp_path / path).write_text(text)
    environment = {"PYTHONPATH": ":".join(str(tmp_path / name) for name in FOLDERS), "PATH": "/usr/bin:/bin"}
    ran = subprocess.run(
        [Path(sys.executable).parent / "lint-imports", "--no-cache", "--no-logo"],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = " ".join(ran.stdout.split())  # import-linter wraps its lines at 80 columns
    assert ran.returncode == 1, report
    assert "gemps_cli.uses_brand_new -> gemps_server.brand_new (l.1)" in report
    assert "gemps.brand_new is not allowed to import gemps_proto.v1" in report
    assert "gemps.also_new is not allowed to import gemps.pytorch" in report
    assert "gemps_proto is not allowed to import socket" in report
    assert "Contracts: 6 kept, 4 broken." in report, report
