"""How much memory the commit rule's per-worker state may take (GEM: m_i and s_i, two float32
vectors of θ's size per registered worker), so that a registration the memory cannot hold is
refused cleanly instead of failing half-way or waking the kernel's OOM killer later.

The budget is `--memory-budget-mb` when set; by default it is settled when θ is initialised (the
first moment P is known): what the process may still allocate then, under the tightest of its
address-space limit (RLIMIT_AS), its cgroup's memory limit (v2 memory.max or v1
memory.limit_in_bytes) and the host's available memory, less what other gemps servers on the host
have claimed and not taken yet (memory_claims.py), less a reserve for θ's own working copies.
Counting the rule's vectors in full matters under a cgroup: GEM's m_i is calloc'd and costs
nothing until the worker's first commit writes it, so memory in use would undercount what the
registered workers are owed.
"""

from __future__ import annotations

import contextlib
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gemps_server.logs import event
from gemps_server.memory_claims import MemoryClaims, Outstanding

log = logging.getLogger("gemps.server")

MIB = 1 << 20
GIB = 1 << 30
#: θ-sized vectors the server holds besides the workers' rule state, kept out of the budget: the
#: rule's spare θ and spare m_i (out-of-place commits; compact GEM's two references instead), θ's
#: encoded reply (or a difference reply's code and new copy, whose arithmetic runs a chunk at a
#: time: gemps_proto.reply_differences), a commit's payload
RESERVED_VECTORS = 4
#: and bytes for everything else (threads, connections, requests in flight)
RESERVED_BYTES = 256 * MIB
# A cgroup v1 without a limit reports a page-rounded 2**63: anything this large is no limit.
NO_LIMIT = 1 << 60
NO_CLAIMS = Outstanding()


@dataclass(frozen=True)
class Headroom:
    """Bytes this process may still allocate, and what limits it."""

    bytes: int
    source: str
    per_process: bool = False  # this process's own limit (RLIMIT_AS), not memory it shares with others


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _status_kib(field: str) -> int:
    """A figure of /proc/self/status in KiB (0 when it is not there)."""
    for line in _read(Path("/proc/self/status")).splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def _address_space() -> Headroom | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    room = soft - _status_kib("VmSize") * 1024
    return Headroom(room, f"its address-space limit (RLIMIT_AS {soft // MIB} MiB)", per_process=True)


def cgroup(root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")) -> Headroom | None:
    """The memory cgroup's limit less its usage: v2's memory.max, else v1's memory.limit_in_bytes
    (at the process's cgroup path, or at the mount's root as a container sees its own)."""
    for line in _read(membership).splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            files, limit_name, usage_name = [root / path.lstrip("/"), root], "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            mount = root / "memory"
            files = [mount / path.lstrip("/"), mount]
            limit_name, usage_name = "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        for folder in files:
            limit, usage = _read(folder / limit_name).strip(), _read(folder / usage_name).strip()
            if limit.isdigit() and usage.isdigit():
                if int(limit) >= NO_LIMIT:
                    break
                return Headroom(int(limit) - int(usage), f"its cgroup's memory limit ({int(limit) // MIB} MiB)")
    return None


def _available() -> Headroom | None:
    for line in _read(Path("/proc/meminfo")).splitlines():
        if line.startswith("MemAvailable:"):
            return Headroom(int(line.split()[1]) * 1024, "the host's available memory")
    return None


def headroom() -> Headroom | None:
    """The tightest of the limits this process runs under, None where none can be read."""
    found = [h for h in (_address_space(), cgroup(), _available()) if h is not None]
    return min(found, key=lambda h: h.bytes) if found else None


def _shared(found: Headroom | None, share: int) -> Headroom | None:
    if found is None or share <= 1:
        return found
    return Headroom(found.bytes // share, f"a 1/{share} share of {found.source}")


def _unclaimed(found: Headroom | None, others: Outstanding) -> Headroom | None:
    if found is None or not others.bytes:
        return found
    servers = f"{len(others.pids)} other gemps server{'s' if len(others.pids) > 1 else ''}"
    pids = ", ".join(str(pid) for pid in others.pids)
    claimed = f"{size(others.bytes)} claimed by {servers} (pid{'s' if len(others.pids) > 1 else ''} {pids})"
    if found.per_process:  # the claims are of memory the host shares, not of this process's address space
        host = _available()
        if host is None or host.bytes - others.bytes >= found.bytes:
            return found
        found = host
    return Headroom(found.bytes - others.bytes, f"{found.source} less {claimed}")


def size(count: int) -> str:
    """Bytes for humans: '1.5 GiB', '300 MiB'."""
    return f"{count / GIB:.1f} GiB" if count >= GIB else f"{count / MIB:.0f} MiB"


class MemoryBudget:
    """Bytes of per-worker rule state this server may hold: `configured_mb` MiB when set, else
    settled from `probe` when θ is initialised (`settle`); None (no bound) until then, or when
    no limit can be read. With `claims`, what the host's other gemps servers claimed and have not
    taken is not this one's, and this one claims what it could admit."""

    def __init__(
        self,
        configured_mb: int = 0,
        probe: Callable[[], Headroom | None] = headroom,
        share: int = 1,
        claims: MemoryClaims | None = None,
    ) -> None:
        # `share` servers on this host (a supervisor's partitions and replicas) each take 1/share of
        # what it may use: their rule state is allocated lazily, so each one's probe sees it all.
        self._host, self._share = probe, share
        self.claims = claims
        self.configured = configured_mb * MIB if configured_mb else None
        self.bytes: int | None = self.configured
        self.source = "--memory-budget-mb" if configured_mb else ""

    def _probe(self, others: Outstanding = NO_CLAIMS) -> Headroom | None:
        """What this process may use less the other jobs' claims (`others`), then its share of that."""
        return _shared(_unclaimed(self._host(), others), self._share)

    def workers(self, per_worker: int) -> int | None:
        """How many workers' rule state of `per_worker` bytes fit; None: no bound."""
        if self.bytes is None or per_worker <= 0:
            return None
        return self.bytes // per_worker

    def check_at_start(self, max_workers: int, largest_per_worker: int) -> None:
        """A WARNING when `max_workers` workers of the largest model allowed (`largest_per_worker`
        bytes of rule state each) would not fit in what this process may use now: their bound is
        lowered once θ's size is known (`settle`), and registrations past it are refused."""
        found = None if self.configured is not None else self._probe()
        room, where = (self.configured, self.source) if found is None else (found.bytes, found.source)
        need = max_workers * largest_per_worker
        if room is None or need <= room:
            return
        event(
            log,
            "memory budget below --max-workers",
            level=logging.WARNING,
            needs=f"{size(need)} for {max_workers} workers of a model of --max-parameters",
            budget=f"{size(room)} ({where})",
            fit=room // largest_per_worker if largest_per_worker else None,
            then="the workers' bound is set when θ is initialised; registrations past it are refused",
        )

    def settle(self, theta_bytes: int, per_worker: int, max_workers: int) -> None:
        """θ (`theta_bytes`) is initialised: the budget, unless configured, is what the process may
        use now less a reserve for θ's working copies; a WARNING when it holds fewer than
        `max_workers` workers of `per_worker` bytes. With claims, the other servers' claims are
        subtracted first (not from a configured budget), and this one's is written."""
        claims = self.claims
        reserve = RESERVED_VECTORS * theta_bytes + RESERVED_BYTES
        with claims.settling() if claims is not None else contextlib.nullcontext():
            if self.configured is None:
                found = self._probe(claims.outstanding() if claims is not None else NO_CLAIMS)
                self.bytes = None if found is None else max(0, found.bytes - reserve)
                self.source = "" if found is None else f"{found.source}, less {size(reserve)} for θ's copies"
            if claims is not None:  # each worker's rule state and the bfloat16 copy a difference reply keeps
                claims.claim(self._claimed(max_workers * (per_worker + theta_bytes // 2), reserve))
        fit = self.workers(per_worker)
        if fit is not None and fit < max_workers:
            event(
                log,
                "workers bound lowered by the memory budget",
                level=logging.WARNING,
                workers=fit,
                max_workers=max_workers,
                per_worker=size(per_worker),
                budget=f"{size(self.bytes or 0)} ({self.source})",
                raise_it="--memory-budget-mb, or more memory for the server",
            )

    def _claimed(self, most: int, reserve: int) -> int:
        """What this server could ever take: its budget, at most `most` (--max-workers' state),
        and its reserve; within what the host has (a configured budget may be larger)."""
        found = self._host() if self.configured is not None else None
        held = (most if self.bytes is None else min(most, self.bytes)) + reserve
        return max(0, held if found is None else min(held, found.bytes))

    def describe(self) -> str:
        """'3.2 GiB (its cgroup's memory limit ..., less 1.0 GiB for θ's copies)'."""
        return "none" if self.bytes is None else f"{size(self.bytes)} ({self.source})"
