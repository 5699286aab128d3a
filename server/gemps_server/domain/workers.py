"""Registered workers: identities, data-shard slots, leases and their recent commits."""

from __future__ import annotations

import heapq
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gemps_proto.reasons import Reason
from gemps_proto.schema import Shard
from gemps_proto.status import RecentCommits, WorkerStatus
from gemps_server.domain.errors import NotFound, ResourceExhausted
from gemps_server.domain.namesakes import SharedNames
from gemps_server.domain.recent import RecentWindow
from gemps_server.domain.rules.base import ApplyStats

# A registration that a newer one of its name supersedes (its process restarted: a new client id,
# the same name) is gone once silent for SUPERSEDED_GAPS times the longest of its last PACE_GAPS
# gaps between requests (its pace now, not a start-up's waits), at least SUPERSEDED_FLOOR_SECONDS
# and at most the lease. A live worker of that name is heard from well within that and keeps its
# place. One whose pace is not known yet (killed in its set-up, or at its first step) is gone after
# the floor, unless its name is found shared by live processes (namesakes.py) or it was taken over
# from an image (a new primary times nothing it did not see): then it keeps the whole lease.
SUPERSEDED_GAPS = 4
PACE_GAPS = 16
SUPERSEDED_FLOOR_SECONDS = 1.0
LEASE_EXPIRED = "lease expired"
SUPERSEDED = "superseded by a newer registration of its name"
SERVER_FULL = "server full; no commit for longer than the lease"


@dataclass
class WorkerRecord:
    worker_id: str
    name: str
    slot: int  # distinct among active workers: the worker's shard index
    last_seen: float  # its last request (commit or pull): the lease
    commits: int = 0
    last_commit: float = 0.0  # when it last committed (registered, before its first commit)
    client_id: str = ""  # the client's identity across its registrations ("" when it sent none)
    recent: RecentWindow = field(default_factory=lambda: RecentWindow(0.0))  # its commits of the last minute
    registered: float = 0.0  # when it registered here (a replica: when it took the worker over)
    # Its last PACE_GAPS gaps between requests (the wait from registering to its first request,
    # which may hold a model's set-up, is not one); None: no request since registering.
    gaps: deque[float] | None = None
    taken_over: bool = False  # adopted from a replica image, not seen registering here

    def heard(self, now: float) -> None:
        """A request from this worker now: its lease, and its pace."""
        if self.gaps is None:
            self.gaps = deque(maxlen=PACE_GAPS)
        else:
            self.gaps.append(now - self.last_seen)
        self.last_seen = now

    @property
    def pace(self) -> float:
        """The longest of its recent gaps between requests; 0 while none is known."""
        return max(self.gaps) if self.gaps else 0.0

    @property
    def scope(self) -> str:
        """Whose request ids this worker's are (see ledger.py): its client's, else its own."""
        return self.client_id or self.worker_id


@dataclass(frozen=True)
class RegisteredWorker:
    """A worker as a replica takes it over: its record without the per-process times."""

    worker_id: str
    name: str
    slot: int
    commits: int = 0
    client_id: str = ""


@dataclass(frozen=True)
class RegistryImage:
    """The registered workers in registration order, and the slots bookkeeping (free slots as the
    heap holds them, the next new slot): what `WorkerRegistry.adopt` rebuilds a registry from."""

    workers: tuple[RegisteredWorker, ...] = ()
    free_slots: tuple[int, ...] = ()
    next_slot: int = 0


class WorkerRegistry:
    """Tracks active workers; a worker silent for longer than the lease TTL is expired."""

    def __init__(self, max_workers: int, lease_ttl: float, clock: Callable[[], float] = time.monotonic):
        self.max_workers = max_workers
        self.lease_ttl = lease_ttl
        self.clock = clock  # monotonic seconds: leases and the recent windows
        self._workers: dict[str, WorkerRecord] = {}
        self._by_client: dict[str, str] = {}  # client id -> its registered worker's id
        self._by_slot: list[WorkerRecord | None] = []  # the worker holding each slot (None: free)
        self._free_slots: list[int] = []  # min-heap of slots released by departed workers
        self._next_slot = 0
        self.recent = RecentWindow(clock())  # every commit applied here in the last minute, whoever left since
        self.shared_names = SharedNames()  # names more than one live process registers under

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def records(self) -> list[WorkerRecord]:
        """The registered workers' records, in registration order."""
        return list(self._workers.values())

    def of_client(self, client_id: str) -> WorkerRecord | None:
        """The registered worker of `client_id`, if any (never for "")."""
        worker_id = self._by_client.get(client_id) if client_id else None
        return self._workers.get(worker_id) if worker_id is not None else None

    def add(self, name: str, client_id: str = "", worker_id: str = "") -> WorkerRecord:
        """A new worker record; `worker_id` is a new random one unless given (a replica replaying
        its primary's registration)."""
        if len(self._workers) >= self.max_workers:
            raise ResourceExhausted(
                f"server is full: {self.max_workers} workers registered (raise --max-workers)",
                Reason.MAX_WORKERS,
            )
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        else:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
        now = self.clock()
        worker_id = worker_id or uuid.uuid4().hex
        record = WorkerRecord(
            worker_id, name, slot, now, last_commit=now, client_id=client_id, recent=RecentWindow(now), registered=now
        )
        self._workers[record.worker_id] = record
        if client_id:
            self._by_client[client_id] = record.worker_id
        self._hold(slot, record)
        return record

    def _hold(self, slot: int, record: WorkerRecord | None) -> None:
        if slot >= len(self._by_slot):
            self._by_slot.extend([None] * (slot + 1 - len(self._by_slot)))
        self._by_slot[slot] = record

    def get(self, worker_id: str) -> WorkerRecord:
        try:
            return self._workers[worker_id]
        except KeyError:
            raise self._unknown(worker_id) from None

    def find(self, worker_id: str) -> WorkerRecord | None:
        """`worker_id`'s record, None when it is not registered (the compiled commit core asks)."""
        return self._workers.get(worker_id)

    def slot_of(self, worker_id: str) -> int:
        """The slot `worker_id` holds (what the commit core indexes workers by); -1 if none (the
        core refuses it as an unknown worker, in the protocol's order of checks: `in_slot`)."""
        record = self._workers.get(worker_id)
        return -1 if record is None else record.slot

    def in_slot(self, slot: int, worker_id: str) -> WorkerRecord:
        """The worker in `slot`, which must be `worker_id` (a slot looked up before that worker
        left is another's, or no one's, by now): NotFound otherwise, as for an unknown worker."""
        record = self._by_slot[slot] if 0 <= slot < len(self._by_slot) else None
        if record is None or record.worker_id != worker_id:
            raise self._unknown(worker_id)
        return record

    def _unknown(self, worker_id: str) -> NotFound:
        return NotFound(
            f"unknown worker {worker_id!r}: never registered, left, evicted after {self.lease_ttl:g}s "
            "without a request, or silent after a newer registration of its name; register again",
            Reason.UNKNOWN_WORKER,
        )

    def touch(self, worker_id: str, committed: bool = False) -> WorkerRecord:
        record = self.get(worker_id)
        record.heard(self.clock())
        if committed:
            record.last_commit = record.last_seen
        return record

    def committed(
        self, record: WorkerRecord, staleness: int, loss: float | None, num_samples: int | None, stats: ApplyStats
    ) -> None:
        """`record`'s commit was applied now, with what it reported and how the rule scaled it:
        its lease, counts and recent commits."""
        record.commits += 1
        record.heard(now := self.clock())
        record.last_commit = now
        record.recent.add(now, staleness, loss, num_samples, stats)
        self.recent.add(now, staleness, loss, num_samples, stats)

    def recent_commits(self) -> RecentCommits:
        """Every commit applied here in the last minute (Status: the rate and training loss)."""
        return self.recent.summary(self.clock())

    def shard(self, record: WorkerRecord, count: int) -> Shard:
        """`record`'s data shard of `count` (0: no sharding, the slot seeds its order): its slot
        modulo `count`, and how many other registered workers hold that index (more workers than
        shards wrap around: they read the same batches)."""
        if count == 0:
            return Shard(record.slot, 0)
        index = record.slot % count
        shared = sum(w.slot % count == index for w in self._workers.copy().values() if w is not record)
        return Shard(index, count, shared)

    @property
    def full(self) -> bool:
        return len(self._workers) >= self.max_workers

    def idlest(self, excluding: Sequence[str] = ()) -> WorkerRecord | None:
        """The worker longest without a commit (but those `excluding`), if that is longer than the
        lease TTL: a full registry gives its place to a newcomer. Pulls keep a lease alive, not a place in a full
        server: otherwise cheap pulls let registrations that never commit (each holding GEM
        state of 2P floats) lock honest workers out for as long as they like."""
        candidates = [record for record in self._workers.values() if record.worker_id not in excluding]
        if not candidates:
            return None
        idle = min(candidates, key=lambda record: record.last_commit)
        return idle if self.clock() - idle.last_commit > self.lease_ttl else None

    def listing(self, num_shards: int = 0) -> tuple[WorkerStatus, ...]:
        """The registered workers by slot, each with its shard's index of `num_shards`, how long ago
        it was last seen and last committed, and its commits of the last minute. Status reads it on
        the event loop while the applier's thread may add or remove a worker: the dict is copied in
        one step (under the GIL) before it is walked."""
        now = self.clock()
        return tuple(
            WorkerStatus(
                w.name,
                w.slot % num_shards if num_shards else w.slot,
                w.commits,
                now - w.last_seen,
                now - w.last_commit,
                w.recent.summary(now),
            )
            for w in sorted(self._workers.copy().values(), key=lambda w: w.slot)
        )

    def remove(self, worker_id: str) -> WorkerRecord | None:
        record = self._workers.pop(worker_id, None)
        if record is not None:
            heapq.heappush(self._free_slots, record.slot)
            self._hold(record.slot, None)
            if self._by_client.get(record.client_id) == worker_id:
                del self._by_client[record.client_id]
        return record

    def export(self) -> RegistryImage:
        """The registered workers and slots, for a replica (images.take)."""
        workers = tuple(
            RegisteredWorker(w.worker_id, w.name, w.slot, w.commits, w.client_id) for w in self._workers.values()
        )
        return RegistryImage(workers, tuple(self._free_slots), self._next_slot)

    def adopt(self, image: RegistryImage) -> None:
        """Replace every worker and slot by `image`'s, each worker seen and committed now; a
        ValueError naming the problem, with nothing changed, when the image is inconsistent."""
        self.check(image)
        now = self.clock()
        self._workers = {
            w.worker_id: WorkerRecord(
                w.worker_id, w.name, w.slot, now, w.commits, now, w.client_id, RecentWindow(now), registered=now,
                taken_over=True,
            )
            for w in image.workers
        }  # fmt: skip
        self._by_client = {w.client_id: w.worker_id for w in image.workers if w.client_id}
        self._by_slot = [None] * image.next_slot
        for record in self._workers.values():
            self._by_slot[record.slot] = record
        self._free_slots = list(image.free_slots)
        self._next_slot = image.next_slot

    def check(self, image: RegistryImage) -> None:
        """ValueError unless `image` fits this registry: distinct ids, clients and slots, every slot
        below the next either held or free, no more workers than `max_workers`."""
        workers = image.workers
        if len(workers) > self.max_workers:
            raise ValueError(f"{len(workers)} workers registered; this server holds at most {self.max_workers}")
        ids = [w.worker_id for w in workers]
        clients = [w.client_id for w in workers if w.client_id]
        if not all(ids) or len(set(ids)) != len(ids) or len(set(clients)) != len(clients):
            raise ValueError("worker ids must be distinct and not empty, client ids distinct")
        if any(w.commits < 0 for w in workers):
            raise ValueError("a worker with a negative commit count")
        slots, free = [w.slot for w in workers], list(image.free_slots)
        if len(slots) + len(free) != image.next_slot or sorted(slots + free) != list(range(image.next_slot)):
            raise ValueError(f"the workers' slots and the free slots are not each of 0..{image.next_slot - 1} once")
        if any(free[(i - 1) // 2] > free[i] for i in range(1, len(free))):
            raise ValueError("the free slots are not in heap order")

    def expired(self) -> list[str]:
        """The workers silent for longer than the lease."""
        deadline = self.clock() - self.lease_ttl
        return [w.worker_id for w in self._workers.values() if w.last_seen < deadline]

    def superseded(self) -> list[str]:
        """The named workers not heard from since a newer registration of their name, and silent
        past their pace (SUPERSEDED_GAPS): a restarted process registers under the name its dead
        one held, which need not wait out the lease."""
        now = self.clock()
        newest: dict[str, float] = {}  # a name's latest registration
        for w in self._workers.values():
            if w.name:
                newest[w.name] = max(newest.get(w.name, w.registered), w.registered)
        return [
            w.worker_id
            for w in self._workers.values()
            if w.name and newest[w.name] > w.last_seen and self._past_its_pace(w, now)
        ]

    def silent_namesake(self, name: str, excluding: Sequence[str] = ()) -> WorkerRecord | None:
        """A registered worker of `name` (not "") silent past its pace, if any (the longest silent):
        a registration of that name now supersedes it at once, its slot and shard free for it."""
        now = self.clock()
        silent = [
            w
            for w in self._workers.values()
            if name and w.name == name and w.worker_id not in excluding and self._past_its_pace(w, now)
        ]
        return min(silent, key=lambda record: record.last_seen, default=None)

    def _past_its_pace(self, record: WorkerRecord, now: float) -> bool:
        return now - record.last_seen > self._superseded_silence(record)

    def _superseded_silence(self, record: WorkerRecord) -> float:
        pace = record.pace
        if pace <= 0.0:  # not known yet: a name is one process's, unless found shared
            keeps_lease = record.taken_over or record.name in self.shared_names
            return self.lease_ttl if keeps_lease else min(self.lease_ttl, SUPERSEDED_FLOOR_SECONDS)
        return min(self.lease_ttl, max(SUPERSEDED_FLOOR_SECONDS, SUPERSEDED_GAPS * pace))
