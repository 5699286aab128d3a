"""The SDK's table of the GEMPS_* variables it reads (gemps.variables) is the names its modules
read, no more and no less, and the generated reference says for each that the SDK reads it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from gemps_cli import reference_docs

from gemps import variables

SDK = Path(__file__).resolve().parents[2] / "client_sdk" / "gemps"
NAME = re.compile(r"GEMPS_[A-Z_]+")


def names_read(path: Path) -> set[str]:
    """The string constants of `path` that are a whole GEMPS_* name (docstrings and messages are not)."""
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value)
    }


def test_the_table_is_what_the_sdk_reads() -> None:
    read = set().union(*(names_read(path) for path in SDK.rglob("*.py") if path.name != "variables.py"))
    assert read == set(variables.READ_BY_THE_SDK)


def test_the_reference_says_the_sdk_reads_each() -> None:
    page = reference_docs.commands_markdown()
    rows = dict(re.findall(r"^\| `(GEMPS_[A-Z_]+)` \| (.*) \|$", page, re.MULTILINE))
    for name, option in variables.READ_BY_THE_SDK.items():
        assert f"the SDK: `{option}`" in rows[name], name
