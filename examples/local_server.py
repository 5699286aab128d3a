"""The gemps server an example trains on: the one at `--server`, or one it starts on this machine.

    with server_address(args.server, rule="gem", learning_rate=0.1) as address:
        optimizer = RemoteOptimizer(model, address)

Without an address, `gemps server` runs as a child process on free ports (its options are the
server's flags by field name: `learning_rate=0.1` is `--learning-rate 0.1`) and is stopped, gracefully,
when the block ends. With one, the options are not used: that server's own settings apply.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def server_address(address: str | None, **options: Any) -> Iterator[str]:
    """`address` itself, or the address of a `gemps server` started here with `options` for the block."""
    if address:
        yield address
        return
    from gemps_worker.cluster import ServerProcess  # the full install's harness: only to start one here

    with ServerProcess(**options) as server:
        print(f"started gemps server {server.target} ({' '.join(f'{k}={v}' for k, v in options.items())})", flush=True)
        yield server.target
