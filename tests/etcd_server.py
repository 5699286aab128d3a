"""A real etcd for the tests that need one (Debian's `etcd-server`, from tools/install-system-deps).

Without the binary these tests skip, unless GEMPS_REQUIRE_ETCD is set (`make test` sets it after
installing the system packages, etcd among them): there they fail.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gemps_server.replication.local_etcd import EtcdNotInstalled, LocalEtcd, find_etcd


def require_etcd() -> str:
    """The etcd binary; skips the test (or fails it, where system packages are required) without."""
    try:
        return find_etcd()
    except EtcdNotInstalled as missing:
        if os.environ.get("GEMPS_REQUIRE_ETCD"):
            pytest.fail(str(missing))
        pytest.skip(str(missing))


@contextmanager
def etcd_server(secure: bool = False) -> Iterator[LocalEtcd]:
    """A private etcd on free loopback ports for the block's duration; its data is removed after.
    Plain http unless `secure` (then clients need its `access`): the tests of elections and
    replicas are not about who may reach etcd, tests/integration/test_etcd_security.py is."""
    with LocalEtcd(require_etcd(), secure=secure) as etcd:
        yield etcd
