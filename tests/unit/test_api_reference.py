"""The site's SDK reference (docs/reference/api.md, rendered by mkdocstrings) covers the public API,
and every public name it renders has a docstring to read there (issue 48)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest

import gemps
import gemps.aio
import gemps.pytorch

API_PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "api.md"
DIRECTIVE = re.compile(r"^::: ([\w.]+)$", re.MULTILINE)
# A module rendered whole: its members listed under `members:` beneath the directive.
MEMBER = re.compile(r"^        - (\w+)$", re.MULTILINE)
PUBLIC = [(gemps, name) for name in gemps.__all__] + [(gemps.pytorch, name) for name in gemps.pytorch.__all__]
PUBLIC += [(gemps.aio, "AsyncClient")]


def rendered() -> set[str]:
    """The names the page renders: its directives' objects, and the members listed for a module."""
    text = API_PAGE.read_text()
    names = {path.rsplit(".", 1)[-1] for path in DIRECTIVE.findall(text)}
    return names | set(MEMBER.findall(text))


def public_members(owner: type) -> list[tuple[str, object]]:
    return [(name, value) for name, value in vars(owner).items() if not name.startswith("_") and _is_api(value)]


def _is_api(value: object) -> bool:
    return isinstance(value, property | staticmethod | classmethod) or inspect.isfunction(value)


@pytest.mark.parametrize(("module", "name"), PUBLIC, ids=lambda value: getattr(value, "__name__", str(value)))
def test_every_public_name_is_on_the_reference_page(module: ModuleType, name: str) -> None:
    assert name in rendered(), f"{module.__name__}.{name} is public (__all__) but not in {API_PAGE.name}"


@pytest.mark.parametrize(("module", "name"), PUBLIC, ids=lambda value: getattr(value, "__name__", str(value)))
def test_every_public_name_and_its_members_have_docstrings(module: ModuleType, name: str) -> None:
    value = getattr(module, name)
    assert inspect.getdoc(value), f"{module.__name__}.{name} has no docstring"
    if inspect.isclass(value) and not issubclass(value, BaseException):
        undocumented = [
            member
            for member, attribute in public_members(value)
            if not (attribute.__doc__ if isinstance(attribute, property) else inspect.getdoc(attribute))
        ]
        assert not undocumented, f"{module.__name__}.{name}: no docstring on {undocumented}"
