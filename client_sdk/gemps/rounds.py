"""Waiting for a round: under a rule that moves θ a round of commits at a time (the server's
`adamw`), a commit's reply says how many commits the round it joined still needs (`round_pending`)
and carries no θ: the θ the round found, which the commit named as held (CommitRequest.known_history),
is the one the client holds. The worker's next gradient belongs on θ after the round: one
taken before the round closes arrives after it, and the server drops it as stale. So the commit
hands θ back once it moved, pulling until then: the server answers a pull of the θ the caller
holds with no payload, whatever commits the round took meanwhile.

Each pull asks the server to hold its reply until θ moves (`Client.pull(wait=...)`, PullRequest.
wait_seconds, up to `hold`: below the client's attempt timeout): the worker hears of the round's
close as the closing commit is counted, with one call, where polls heard of it at their next pull
and kept the server answering them meanwhile. A reply that comes back unchanged well before its
wait (a server older than wait_seconds, or one stopping) is polled as before: the pulls start 1 ms
apart and double up to an eighth of the client's recent waits (at least 20 ms, at most 0.5 s),
since 16 workers polling every 20 ms kept a server of 0.3 of a core busy enough to halve its
rounds' pace on the comparison's rig. A dropped gradient's reply says 0: its θ is the open round's,
to take the next gradient on.

A round can want the waiting workers' next gradients rather than others': a worker left or was
evicted after the others committed to it, so it holds every commit it waits for and nobody commits
to close it; or its size (round_size) is above the workers, so it needs more than one gradient of
some. The server answers the held pulls as that happens, saying so (PullResponse.round_takes_next,
from every server of θ): the wait ends at once, and the caller's next gradient, taken on θ as it
is, goes to the round (after a departure, the first closes it and the others' are dropped as stale,
a gradient each). A round can also wait for commits that will not come, from a worker killed
without leaving, until the server stops counting it: so a wait ends after four times the longest
round this client has waited for (at least IDLE_SECONDS; the first one after ROUND_WAIT_SECONDS),
with a WARNING; the caller's next gradient joins the same round.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from gemps.records import CentralVariable, CommitResult
from gemps_proto.schema import MAX_PULL_WAIT_SECONDS, PULL_WAITS

log = logging.getLogger("gemps.rounds")

#: the longest a commit waits for its round to close
ROUND_WAIT_SECONDS = 60.0
#: the shortest wait before a commit gives up on its round
IDLE_SECONDS = 1.0
#: the pulls' first pause, and the bounds of the longest (an eighth of the recent waits between them)
FIRST_PAUSE, LONGEST_PAUSE, SLOWEST_PAUSE = 0.001, 0.02, 0.5


def check_pull_wait(wait: float, attempt_timeout: float) -> None:
    """ValueError unless a pull may ask the server to hold it `wait` seconds: within PULL_WAITS,
    and below `attempt_timeout`, whose deadline the held attempt keeps."""
    if not (PULL_WAITS.admits(wait) and wait < attempt_timeout):
        raise ValueError(f"wait {wait!r} must be within {PULL_WAITS} and below attempt_timeout ({attempt_timeout:g} s)")


def longest_hold(attempt_timeout: float) -> float:
    """How long a round's pulls ask to be held: the most a server holds, and half the attempt's deadline."""
    return min(MAX_PULL_WAIT_SECONDS, attempt_timeout / 2)


class RoundWaits:
    """One client's waits for its rounds, and the longest it saw (what a wait is bounded by)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        hold: float = MAX_PULL_WAIT_SECONDS,
    ) -> None:
        self.clock, self.sleep = clock, sleep
        self.hold = hold  # the longest a pull asks the server to hold it (below the attempt's deadline)
        self.longest: float | None = None  # the longest wait for a round that closed, in seconds
        self.recent = 0.0  # the waits for rounds that closed, a running mean (1/4 the newest's weight)

    def longest_pause(self) -> float:
        """The pulls' pause once it stopped doubling."""
        return min(SLOWEST_PAUSE, max(LONGEST_PAUSE, self.recent / 8))

    def limit(self) -> float:
        """How long the next wait goes on before it gives up on its round."""
        if self.longest is None:
            return ROUND_WAIT_SECONDS
        return min(ROUND_WAIT_SECONDS, max(IDLE_SECONDS, 4 * self.longest))

    def after(
        self,
        result: CommitResult,
        pull: Callable[[float], CentralVariable],
        takes_next: Callable[[], bool] = lambda: False,
    ) -> CommitResult:
        """`result` with θ once it moved after this commit's round (`pull(wait)`: the client's
        pull, held up to `wait` seconds by the server until θ moves; `takes_next()`: whether that
        pull said the round takes this client's next commit); `result` itself when the commit
        moved θ, the rule has no rounds, or the round takes the next commit."""
        if not result.round_pending:
            return result
        started, limit, pause, longest_pause = self.clock(), self.limit(), FIRST_PAUSE, self.longest_pause()
        held = result.parameters
        while True:
            asked = min(self.hold, max(0.0, limit - (self.clock() - started)))
            before = self.clock()
            central = pull(asked)
            now = self.clock()
            waited = now - started
            if central.version != held.version:  # θ moved
                self.longest = waited if self.longest is None else max(self.longest, waited)
                self.recent = waited if self.recent == 0 else 0.75 * self.recent + 0.25 * waited
                return dataclasses.replace(result, parameters=central)
            if takes_next():  # the normal flow of a round_size above the workers: not logged above DEBUG
                log.debug(
                    "the round takes this worker's next gradient: going on from θ as it is (version %d)", held.version
                )
                return result
            if waited >= limit:
                log.warning(
                    "θ did not move for %.1f s after a commit its round needed %d more for: going on from "
                    "θ as it is (version %d), whose gradient joins that round",
                    *(waited, result.round_pending, held.version),
                )
                return result
            if now - before < asked / 2:  # answered before its wait: a server that holds no pull
                self.sleep(pause)
                pause = min(longest_pause, 2 * pause)


class TellsOfRounds(Protocol):
    """What a client's last pull heard of the round open on its servers (gemps.router)."""

    @property
    def round_takes_next(self) -> bool: ...


class WaitsForRounds(Protocol):
    """A client whose commits wait for their round: its waits, its pull (a call of its own), and
    what that pull heard of the round."""

    @property
    def _rounds(self) -> RoundWaits: ...

    @property
    def _router(self) -> TellsOfRounds: ...

    def pull(self, *, wait: float = 0.0) -> CentralVariable: ...


P = ParamSpec("P")
C = TypeVar("C", bound=WaitsForRounds)


def waits_for_round(commit: Callable[Concatenate[C, P], CommitResult]) -> Callable[Concatenate[C, P], CommitResult]:
    """`commit`, then the wait for its round (RoundWaits.after): each pull a call of the client's
    own, with its own deadline, so a round slower than the client's `timeout` is no failure."""

    @functools.wraps(commit)
    def committed(self: C, /, *args: P.args, **kwargs: P.kwargs) -> CommitResult:
        router = self._router
        return self._rounds.after(
            commit(self, *args, **kwargs), lambda wait: self.pull(wait=wait), lambda: router.round_takes_next
        )

    return committed
