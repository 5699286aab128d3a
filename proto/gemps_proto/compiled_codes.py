"""The codec's compiled passes (csrc/codes.c, the module gemps_proto._codes), None where not built.

The extension is optional, as the server's (`pip install` builds it where a C compiler is at hand
and goes on without it). block_quantisation and reply_differences take a pass from it where one
covers the call and keep their numpy code as the reference it is held to, byte for byte and bit
for bit (tests/unit/test_wire_codes.py): a test sets `compiled` to None to run the numpy code.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def optional_extension(name: str) -> ModuleType | None:
    """The compiled module `name`, or None where the install built none (no C compiler at hand):
    this one and the server's loops (gemps_server.native)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


compiled = optional_extension("gemps_proto._codes")
