"""How fast connections that never prove a ticket may cost the data plane's thread (DESIGN §3b:
resources before trust are budgeted; issue 42, items 2 to 4).

Refusing a connection is cheap, not free: its accept, a read, the refusal, its close took the
loop about 60 µs, and a local process that connected, passed descriptors and was refused over
and over (6,700 times a second) took 0.4 of a core from the thread that serves every worker's
commits: theirs fell to 0.38-0.45x. So each listener has a budget of connections that end
without proving a ticket (refused, evicted, timed out), --data-plane-refusals-per-second with
bursts of BURST_SECONDS' worth: spent, the listener is not accepted from until it refills. The
connections that arrive meanwhile wait in the kernel's queue, which slows whoever floods it
(their connects wait too); workers already connected are not touched, and a newcomer is accepted
in its turn when accepting resumes (the SDK uses gRPC meanwhile).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gemps_server.token_bucket import TokenBucket

BURST_SECONDS = 2.0


class RefusalBudget(TokenBucket):
    """A token bucket: `charge()` for each connection that ended without proving a ticket;
    `delay()` is 0 while one may still be accepted, else the seconds until one may (0 per second:
    no limit)."""

    def __init__(self, per_second: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(per_second, per_second * BURST_SECONDS, clock)
