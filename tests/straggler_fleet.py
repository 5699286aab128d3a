"""Three workers against one real server, one of them deliberately slowed: the straggler GEM damps.

Each worker is a gemps.Client in a thread committing random gradients of one scale. The fast ones
pause FAST_PAUSE between commits (so they do not hold a core each), the straggler SLOW_PAUSE, so
every one of its commits arrives after the fast ones moved θ many steps (staleness in the tens), and GEM's
c = |θ - s_i| then outweighs its proxy's energy: π goes to 0 on most parameters.
"""

from __future__ import annotations

import threading
from types import TracebackType

import numpy as np

from gemps import Client
from tests.helpers import wait_for

FAST = ("fast-a", "fast-b")
SLOW = "straggler"
SLOW_PAUSE = 0.2  # seconds between the straggler's commits
FAST_PAUSE = 0.002  # and between the others' commits
PARAMETERS = 256


class StragglerFleet:
    """`with StragglerFleet(target) as fleet: fleet.wait(commits)`: the workers commit until the end."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._stop = threading.Event()
        self.commits = {name: 0 for name in (*FAST, SLOW)}
        self.failures: list[BaseException] = []
        self._threads = [threading.Thread(target=self._run, args=(name,)) for name in self.commits]

    def __enter__(self) -> StragglerFleet:
        # The straggler registers first and initialises θ; the others start after it registered.
        self._threads[-1].start()
        wait_for(lambda: self.commits[SLOW] > 0 or bool(self.failures), 30, "the straggler's first commit")
        for thread in self._threads[:-1]:
            thread.start()
        return self

    def _run(self, name: str) -> None:
        rng = np.random.default_rng(len(name))
        try:
            with Client(self.target, name=name) as client:
                client.register({"w": np.zeros(PARAMETERS, np.float32)})
                while not self._stop.is_set():
                    client.commit(rng.normal(size=PARAMETERS).astype(np.float32), loss=1.0, num_samples=8)
                    self.commits[name] += 1
                    self._stop.wait(SLOW_PAUSE if name == SLOW else FAST_PAUSE)
                client.leave()
        except BaseException as error:  # reported by `wait`
            self.failures.append(error)

    def wait(self, slow_commits: int, timeout: float = 30.0) -> None:
        """Until the straggler has made `slow_commits` commits beside the fast ones."""
        wait_for(lambda: self.commits[SLOW] >= slow_commits or bool(self.failures), timeout, "the straggler")
        if self.failures:
            raise AssertionError(f"a worker failed: {self.failures!r}")

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
