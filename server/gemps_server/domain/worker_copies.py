"""The copies of θ that difference-reply workers hold, as the server keeps them (issue 47, item 3).

A worker whose commits ask for difference replies (reply_dtype a block code) holds a copy of θ
in bfloat16 values; the server keeps the same bits here, numbered, and answers each commit with
the quantised difference from that copy when the commit names it (held_copy), else with θ whole
in bfloat16 as a new copy (gemps_proto.reply_differences has the arithmetic both sides share).

2 bytes a parameter per worker that asks, beside the rule's state, shown as
gemps_reply_copy_bytes, and held within the memory budget the rule's state is (memory_budget.py):
the registered workers' state comes first, a copy is kept only in what it leaves, and a worker
admitted later (by its rule state alone) makes the copies renewed longest ago go until the rest
fit again (`fit`; issue 77, item 7: they had stayed, 1.12x the budget with 5 workers). Soft state,
never checkpointed nor replicated: a restarted server or a new primary holds no copies, so each
worker's next reply is whole (one bfloat16 θ), as after a lost reply or a new registration. A copy
the budget has no room for, or that cannot be allocated (MemoryError), is not kept: that reply is
whole and numbered 0, so the worker asks for θ whole again next time (counted: `unkept`,
gemps_reply_copies_unkept).
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
from collections.abc import Callable

import numpy as np

from gemps_proto.reply_differences import WHOLE_DTYPE, difference
from gemps_server.domain.records import CommitOutcome, CopyReply
from gemps_server.memory_budget import MemoryBudget


class WorkerCopies:
    """Each difference-reply worker's copy of θ (bfloat16 bits) and its number; on the applier."""

    def __init__(self, memory: MemoryBudget | None = None, rule_state: Callable[[], int] = int) -> None:
        self._memory = memory  # the budget the copies share with the rule's state (None: no bound)
        self._rule_state = rule_state  # bytes of rule state the registered workers hold now
        self._copies: dict[str, tuple[int, np.ndarray]] = {}
        # Numbers from a random start: a client holding a number from another server's life (a
        # restart, another primary) is not mistaken for holding this server's copy.
        self._numbers = itertools.count(secrets.randbits(62) + 1)
        self.nbytes = 0  # what the copies take (read from the event loop: one int)
        self.unkept = 0  # whole replies numbered 0: no room for the copy (since start)

    def __len__(self) -> int:
        return len(self._copies)

    def reply(
        self,
        outcome: CommitOutcome,
        worker_id: str,
        held_copy: int,
        reply_dtype: int,
        theta: np.ndarray,
        whole: Callable[[], bytes],
    ) -> tuple[CommitOutcome, bytes | memoryview]:
        """`outcome` with how its reply moves `worker_id`'s copy, and the reply's bytes: the
        difference θ - copy in `reply_dtype` when the worker holds the copy we keep (`held_copy`),
        else `whole()` (θ's bfloat16 bytes at this version) as a new copy."""
        kept = self._copies.get(worker_id)
        number = next(self._numbers)
        try:
            if kept is not None and held_copy == kept[0] and kept[1].size == theta.size:
                try:
                    code, bits = difference(theta, kept[1], reply_dtype, in_place=True)
                except BaseException:  # moved part-way in place: never the base of a difference again
                    self.forget(worker_id)
                    raise
                self._keep(worker_id, number, bits)
                return dataclasses.replace(outcome, reply=CopyReply(reply_dtype, number, kept[0])), memoryview(code)
            data = whole()
            if self._room(2 * theta.size - (0 if kept is None else kept[1].nbytes)):
                self._keep(worker_id, number, np.frombuffer(data, "<u2").copy())
                return dataclasses.replace(outcome, reply=CopyReply(WHOLE_DTYPE, number)), data
        except MemoryError:
            pass
        self.forget(worker_id)  # no room: θ whole, numbered 0, and no copy kept
        self.unkept += 1
        return dataclasses.replace(outcome, reply=CopyReply(WHOLE_DTYPE, 0)), whole()

    def held(self, worker_id: str) -> tuple[int, np.ndarray] | None:
        """The number and bits of the copy kept for `worker_id`, if any."""
        return self._copies.get(worker_id)

    def fit(self) -> None:
        """Forget copies, those renewed longest ago first, until the rest fit in the budget beside
        the workers' rule state (grown by a registration): their workers' next replies are whole."""
        while self._copies and not self._room(0):
            self.forget(next(iter(self._copies)))  # kept in the order last renewed (_keep re-inserts)

    def _room(self, more: int) -> bool:
        budget = None if self._memory is None else self._memory.bytes
        return budget is None or self._rule_state() + self.nbytes + more <= budget

    def forget(self, worker_id: str) -> None:
        kept = self._copies.pop(worker_id, None)
        if kept is not None:
            self.nbytes -= kept[1].nbytes

    def _keep(self, worker_id: str, number: int, bits: np.ndarray) -> None:
        self.forget(worker_id)
        self._copies[worker_id] = (number, bits)
        self.nbytes += bits.nbytes
