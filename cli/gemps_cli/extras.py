"""Which of a command's extras are missing, read from the installed gemps's own metadata.

`pip install gemps` is the SDK alone; the server, the workers and Ray come with extras
(`gemps[server]`, `gemps[torch]`, `gemps[ray]`). A command checks every distribution its extras
list before it starts, so a missing one is named at once, not as an ImportError from deep inside
(some are imported only on some paths: etcd3gw with --replicas, prometheus-client with --partitions).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from importlib import metadata

DISTRIBUTION = "gemps"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def requirements(extra: str) -> list[str] | None:
    """The distributions gemps's `extra` lists; None when gemps runs uninstalled (from its source folders)."""
    try:
        declared = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return None
    names = []
    for requirement in declared:
        spec, _, marker = requirement.partition(";")
        found = _EXTRA.search(marker)
        name = _NAME.match(spec.strip())
        if found is not None and found.group(1) == extra and name is not None:
            names.append(name.group(0))
    return names


def missing(extras: Sequence[str]) -> list[str]:
    """The distributions of `extras` that are not installed (none known when gemps is uninstalled)."""
    absent = []
    for extra in extras:
        for name in requirements(extra) or []:
            try:
                metadata.distribution(name)
            except metadata.PackageNotFoundError:
                absent.append(name)
    return list(dict.fromkeys(absent))  # once each: prometheus-client is in two extras


def install_hint(command: str, extras: Sequence[str]) -> str:
    """What a user reads when `command` lacks its extras: the pip line that installs them."""
    named = f"the {extras[0]} extra" if len(extras) == 1 else f"the {', '.join(extras[:-1])} and {extras[-1]} extras"
    return f"{command} needs {named}: pip install 'gemps[{','.join(extras)}]'"
