"""A script of the repository (scripts/, deploy/grafana/) loaded as a module, for tests of its parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str) -> ModuleType:
    """`path` run as module `name`, as when run as a script: its folder first on sys.path (it may
    import its siblings), and the module in sys.modules while it runs (dataclasses look it up there)."""
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
