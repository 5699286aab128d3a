"""The distribution's metadata, checked from pyproject.toml and the sources (no wheel or venv built):
the base install is the SDK's runtime needs and nothing more, the floors are the generated code's
own guards, the license ships in the wheel, and the Pythons claimed are the one the suite runs on.
The sizes and the floors as measured in fresh venvs are in docs/guides/install.md (the README's "Install" section once).
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import tomllib
from gemps_cli.main import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
PROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
GENERATED = ROOT / "proto" / "gemps_proto" / "v1"
# The SDK and the protocol: what `pip install gemps` is for. The torch layer (the gemps.pytorch
# package) needs the torch extra on top.
SDK_FOLDERS = (ROOT / "client_sdk" / "gemps", ROOT / "proto" / "gemps_proto")
FIRST_PARTY = {"gemps", "gemps_proto"}
# SDK modules of opt-in features -> the extra their imports come from (imported only when used, or
# only where installed: gemps_proto.vectors). tests/integration/test_sdk_without_numpy.py runs the
# SDK where numpy cannot be imported.
OPT_IN = {
    "metrics": "metrics",
    "vectors": "numpy",
    "tensor_codec": "numpy",
    "block_quantisation": "numpy",
    "block_topk": "numpy",
}


def _name(requirement: str) -> str:
    found = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert found is not None, requirement
    return found.group(0).lower().replace("_", "-")


def _requirement(name: str, listed: list[str]) -> str:
    return next(r for r in listed if _name(r) == name)


def _runtime_imports(path: Path) -> set[str]:
    """Top-level modules `path` imports when it runs (lazy imports included; TYPE_CHECKING blocks not)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for statement in node.body for child in ast.walk(statement))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names and name not in FIRST_PARTY}


@functools.cache
def _providers() -> Mapping[str, list[str]]:
    return metadata.packages_distributions()  # reads every installed distribution's file list: once


def _distributions_of(module: str) -> set[str]:
    """The installed distributions that provide top-level `module` (grpc -> grpcio, google -> protobuf, ...)."""
    return {_name(d) for d in _providers().get(module, [])}


def _is_torch_layer(path: Path) -> bool:
    return path.parent == ROOT / "client_sdk" / "gemps" / "pytorch"


def test_the_base_install_is_what_the_sdk_imports_and_no_more() -> None:
    base = {_name(r) for r in PROJECT["dependencies"]}
    used: set[str] = set()
    for folder in SDK_FOLDERS:
        for path in sorted(folder.rglob("*.py")):
            imports = _runtime_imports(path)
            extra = "torch" if _is_torch_layer(path) else OPT_IN.get(path.stem)
            allowed = base | ({_name(r) for r in PROJECT["optional-dependencies"][extra]} if extra else set())
            for module in imports:
                providers = _distributions_of(module)
                assert providers & allowed, f"{path.relative_to(ROOT)} imports {module}, not in the base dependencies"
                used |= providers & base
    assert used == base, f"base dependencies the SDK never imports: {sorted(base - used)} (move them to an extra)"


def test_the_server_and_the_workers_get_theirs_from_extras() -> None:
    extras: dict[str, list[str]] = PROJECT["optional-dependencies"]
    for command, (_, _, needed) in COMMANDS.items():
        assert set(needed) <= set(extras), f"gemps {command} names an extra pyproject.toml lacks: {needed}"
    assert COMMANDS["status"][2] == (), "gemps status is part of the SDK's install"
    for module in ("safetensors", "etcd3gw", "cryptography", "setproctitle", "grpc_health", "grpc_reflection"):
        assert _distributions_of(module) <= {_name(r) for r in extras["server"]}, module


def test_the_floors_are_the_generated_codes_own_guards() -> None:
    """The committed code refuses a runtime older than the one that generated it: those are the floors."""
    grpc_guard = re.search(
        r"GRPC_GENERATED_VERSION = '([\d.]+)'", (GENERATED / "parameter_server_pb2_grpc.py").read_text()
    )
    protobuf_guard = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),",
        (GENERATED / "parameter_server_pb2.py").read_text(),
    )
    assert grpc_guard is not None and protobuf_guard is not None
    major, minor, patch = protobuf_guard.groups()
    base: list[str] = PROJECT["dependencies"]
    assert _requirement("grpcio", base).replace(" ", "") == f"grpcio>={grpc_guard.group(1)}"
    assert _requirement("protobuf", base).replace(" ", "") == f"protobuf>={major}.{minor}.{patch},<{int(major) + 1}"
    # the generator's pin is the same release: a fresh run reproduces the committed code
    assert f"grpcio-tools=={grpc_guard.group(1)}" in PROJECT["optional-dependencies"]["dev"]


def test_the_license_ships_in_the_wheel() -> None:
    assert PROJECT["license"] == "Apache-2.0"  # an SPDX expression: the wheel's License-Expression
    assert PROJECT["license-files"] == ["LICENSE"]  # copied into the wheel's .dist-info/licenses/
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
    assert "setuptools>=77" in build["requires"]  # the first setuptools that reads license-files (PEP 639)
    assert not any(c.startswith("License ::") for c in PROJECT["classifiers"])  # PEP 639: the expression only


def test_the_pythons_claimed_are_the_one_the_suite_runs_on() -> None:
    """CI runs the suite on one Python (.ci/run); the claim moves when CI does."""
    claimed = [c.rsplit(" ", 1)[1] for c in PROJECT["classifiers"] if re.fullmatch(r"Programming .* :: 3\.\d+", c)]
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert claimed == [running], f"classifiers claim {claimed}, the suite runs on {running}"
    assert PROJECT["requires-python"] == f">={running}"


def test_the_changelog_covers_this_version() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert changelog.startswith("# Changelog") and f"## {PROJECT['version']}" in changelog
    assert all(not url.startswith("https://example.") for url in PROJECT["urls"].values()), "placeholder URLs"


def test_a_command_missing_its_extras_names_them_and_what_to_install(tmp_path: Path) -> None:
    """gemps's metadata says what each extra lists; a command whose extra is not installed says so
    whatever its flags, without importing the server (a stand-in dist-info first on the path)."""
    info = tmp_path / "gemps-0.1.0.dist-info"
    info.mkdir()
    requires = [f'Requires-Dist: {r}; extra == "server"' for r in PROJECT["optional-dependencies"]["server"]]
    absent = 'Requires-Dist: gemps-test-absent>=1; extra == "server"'
    (info / "METADATA").write_text(
        "\n".join(["Metadata-Version: 2.4", "Name: gemps", "Version: 0.1.0", *requires, absent])
    )
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from gemps_cli.main import main
        sys.exit(main(["server", "--port", "0", "--replicas", "2"]))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "gemps server needs the server extra: pip install 'gemps[server]' (missing: gemps-test-absent)"
    )


@pytest.mark.parametrize(
    ("needed", "said"),
    [(("torch",), "the torch extra"), (("ray", "server", "torch"), "the ray, server and torch extras")],
)
def test_the_install_hint_names_each_extra(needed: tuple[str, ...], said: str) -> None:
    from gemps_cli.extras import install_hint

    assert install_hint("gemps x", needed) == f"gemps x needs {said}: pip install 'gemps[{','.join(needed)}]'"


def test_the_torch_layer_without_numpy_names_the_extra() -> None:
    """`pip install gemps torch` without numpy: gemps.pytorch says what to install, not only that
    numpy is missing."""
    ran = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['numpy'] = None; import gemps.pytorch"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode != 0
    assert "gemps.pytorch needs the torch extra (numpy is not installed): pip install 'gemps[torch]'" in ran.stderr
