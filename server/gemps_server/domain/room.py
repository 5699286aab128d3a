"""Room for one more worker: `--max-workers`, and the memory budget of the commit rule's per-worker
state (memory_budget.py), both checked before a registration allocates anything; and the refusal
of one whose allocation failed all the same."""

from __future__ import annotations

from gemps_proto.reasons import Reason
from gemps_server.domain.errors import ResourceExhausted
from gemps_server.memory_budget import MemoryBudget, size


def capacity(max_workers: int, memory: MemoryBudget, per_worker: int) -> int:
    """Workers the server takes of `per_worker` bytes of rule state each: --max-workers, or fewer
    when the memory budget holds fewer."""
    fit = memory.workers(per_worker)
    return max_workers if fit is None else min(fit, max_workers)


def check_room(staying: int, max_workers: int, memory: MemoryBudget, per_worker: int) -> None:
    """ResourceExhausted unless one more worker fits beside `staying`: --max-workers first, then
    the memory budget, each refusal naming its limit and how to raise it."""
    if staying >= max_workers:
        raise ResourceExhausted(
            f"server is full: {max_workers} workers registered (raise --max-workers)", Reason.MAX_WORKERS
        )
    if staying < capacity(max_workers, memory, per_worker):
        return
    raise ResourceExhausted(
        f"the server's memory budget is full: {staying} workers hold {size(staying * per_worker)} of rule "
        f"state ({size(per_worker)} each) and the budget is {memory.describe()}; raise it with "
        "--memory-budget-mb (or give the server more memory), or wait for a worker to leave",
        Reason.MEMORY_BUDGET,
    )


def out_of_memory(per_worker: int) -> ResourceExhausted:
    """The refusal of a registration whose allocations failed (MemoryError): nothing was kept."""
    return ResourceExhausted(
        f"out of memory registering this worker (its rule state: {size(per_worker)}); nothing was kept: "
        "give the server more memory, or set --memory-budget-mb below what it has so that such "
        "registrations are refused before they are tried",
        Reason.OUT_OF_MEMORY,
    )
