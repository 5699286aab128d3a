"""The partition router: one session per server process, in θ order, and θ assembled from them.

θ may be partitioned across several server processes (docs/ARCHITECTURE.md): the client is given
one address, learns the layout from that server's Register (or Status) reply, and then sends each
commit's slices to their partitions concurrently (gemps.fan_out: every call started, then each
awaited; a large one's exchanges on a thread per partition), tracks each partition's version, and
assembles θ from the replies. Buffers live on partition 0.

Partitions can move (restarted on another machine, on fresh ports). When one stops answering, its
transport (gemps.following) asks the router where it is now: partition 0 through the client's
resolver (gemps.resolver), any other through the layout partition 0 announces now.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from typing import TypeVar

from gemps import errors
from gemps.compression import Compressor
from gemps.fan_out import FanOut
from gemps.job_vote import listed_job, status_of_job
from gemps.primary_watch import PrimaryWatch, ReplicaProbes
from gemps.records import (
    Buffers,
    CentralVariable,
    CommitResult,
    Evaluation,
    Layout,
    ParameterSpec,
    Registration,
    ServerStatus,
)
from gemps.reply_buffers import ReplyBuffers
from gemps.resolver import REPLICA_SEPARATOR, Replicas, Resolver
from gemps.retry import Retrier
from gemps.server_session import ServerSession, refuse_partition_count_change
from gemps.transport import CommitCall, Committed, Enrolment, Pending, Transport, refuse_non_finite
from gemps_proto import vectors
from gemps_proto.gradient_sums import GradientSums, per_partition
from gemps_proto.reasons import Reason
from gemps_proto.rule_options import ROUND_SIZE
from gemps_proto.schema import PayloadKind
from gemps_proto.tensor_codec import num_elements
from gemps_proto.vectors import Vector

T = TypeVar("T")
log = logging.getLogger("gemps.client")


def resolve_address(announced: str, reached: str) -> str:
    """Where a partition is, from the layout another one announced: "" is `reached` itself,
    ":PORT" is `reached`'s host with that port, anything else a target as it stands; replicas
    ("A|B") each so."""
    if REPLICA_SEPARATOR in announced:
        return REPLICA_SEPARATOR.join(resolve_address(one, reached) for one in announced.split(REPLICA_SEPARATOR))
    if REPLICA_SEPARATOR in reached:
        raise ValueError(f"cannot tell which replica of {reached!r} {announced!r} is relative to")
    if not announced:
        return reached
    if announced.startswith(":"):
        host, separator, _port = reached.rpartition(":")
        if not separator:
            raise ValueError(f"cannot tell the host of {reached!r} to reach partition at {announced!r}")
        return host + announced
    return announced


def merge_commit_figures(replies: Sequence[Committed], sizes: Sequence[int], central: CentralVariable) -> CommitResult:
    """One commit's figures from its replies, one per partition of θ (`sizes`: how many values
    each holds). With several, the version is partition 0's, the staleness the largest, and each
    scaling statistic the mean of the partitions' weighted by their sizes (the median: an estimate)."""
    if len(replies) == 1:
        reply = replies[0]
        return CommitResult(
            version=reply.version,
            staleness=reply.staleness,
            scaling_mean=reply.scaling_mean,
            parameters=central,
            scaling_median=reply.scaling_median,
            scaling_at_zero=reply.scaling_at_zero,
            scaling_at_max=reply.scaling_at_max,
            epochs=(reply.epoch,),
            round_pending=reply.round_pending,
        )
    total = sum(sizes)

    def weighted(name: str) -> float:
        return float(sum(getattr(reply, name) * size for reply, size in zip(replies, sizes, strict=True))) / total

    return CommitResult(
        version=replies[0].version,
        staleness=max(reply.staleness for reply in replies),
        scaling_mean=weighted("scaling_mean"),
        parameters=central,
        scaling_median=weighted("scaling_median"),
        scaling_at_zero=weighted("scaling_at_zero"),
        scaling_at_max=weighted("scaling_at_max"),
        epochs=tuple(reply.epoch for reply in replies),
        round_pending=max(reply.round_pending for reply in replies),
    )


class PartitionRouter:
    """The server at `target`, then (when θ is partitioned) the others, each through a transport
    that `connect` opens for an address; and what the client holds of θ: spec, slices, buffers."""

    def __init__(
        self,
        resolver: Resolver,
        connect: Callable[[str], Transport],
        retrier: Retrier,
        *,
        worker_name: str,
        client_id: str,
        compressor: Compressor | None = None,
        reply_code: int = 0,
        job: str = "",
    ) -> None:
        self.resolver = resolver
        self.compressor = compressor  # commits compressed, with their residuals (compression.py)
        self.reply_code = reply_code  # difference replies in this code (0: θ in the wire dtype)
        self.target = resolver.resolve()  # where partition 0 is now
        self.connect = connect
        self.retrier = retrier
        self.worker_name = worker_name
        self.client_id = client_id
        self._calls = FanOut()  # one call to each partition at once
        self._assembled = ReplyBuffers()  # where θ is assembled from the slices: pages kept, not mapped anew
        self._probes = ReplicaProbes(connect)  # a replicated partition's other replicas, asked while a call waits
        self.sessions = [self._session(0, connect(self.target))]
        self.layout: Layout | None = None  # how θ is partitioned; None: one server holds it all
        self.spec: tuple[ParameterSpec, ...] = ()
        self.buffer_spec: tuple[ParameterSpec, ...] = ()
        self.registered_with: Vector | None = None  # the initial values registered
        self.buffers = Buffers()  # the newest central buffers received (partition 0's)
        self.central: CentralVariable | None = None  # the newest central variable received
        self.round_takes_next = False  # the last pull's: each server's open round takes our next commit
        self._sequence = 0  # the number of this client's last commit (see CommitCall.sequence)
        # Request ids: a prefix of this router's own, random, then the commit's number: unique per
        # client (the ledger's scope), and never one of the 32-hex-digit ids older checkpoints hold.
        self._request_prefix = uuid.uuid4().hex[:16] + "-"
        self._replicas: dict[int, Replicas] = {}  # partitions announced as replica sets, by index
        self.job = job  # its θ's (gemps_proto.jobs): named, else the list's (gemps.job_vote) or the first server's

    @property
    def registration(self) -> Registration | None:
        return self.sessions[0].registration

    @property
    def targets(self) -> list[str]:
        return [session.target for session in self.sessions]

    # -- the calls -------------------------------------------------------------------------------

    def register(
        self,
        spec: tuple[ParameterSpec, ...],
        initial: Vector,
        buffer_spec: tuple[ParameterSpec, ...],
        buffers: Buffers,
    ) -> CentralVariable:
        """Register with every server: the first with all of θ (its reply tells the layout and
        adds the others), the others with their slice."""
        self.spec, self.buffer_spec = spec, buffer_spec
        self.registered_with, self.buffers = initial, buffers
        if self.compressor is not None:
            self.compressor.reset()
        self.job = self.job or listed_job(self.resolver, self._probes)  # sent at every registration, and followed
        self._register_at(0, initial)  # its reply tells the layout, which adds the others
        for index in range(1, len(self.sessions)):
            self._register_at(index, initial)
        self.central = self._assemble()
        return self.central

    def pull(self, wait: float = 0.0) -> CentralVariable:
        """The newest central variable from every server (no payload when ours is current);
        unregistered, with the parameter spec and layout from the server's Status. `wait`: how
        long each server may hold its reply while our slice of θ is current (until it moves)."""
        if self.registration is None and not self.spec:  # an observer: from a server of its job (gemps.job_vote)
            self.job = self.job or listed_job(self.resolver, self._probes)
            status = status_of_job(self.resolver, self.job, self.status, self.sessions[0].link.suspect)
            if not status.initialized:
                # Refused here, not by the pull: a worker may initialise θ in between (the spec then not θ's).
                message = "central variable not initialised: no worker has registered yet"
                raise errors.FailedPreconditionError(message, reason=Reason.NOT_INITIALIZED)
            self.spec, self.buffer_spec = status.spec, status.buffer_spec
            self._adopt(status.layout)
        sessions = self.sessions
        replies = _all_or_raise(
            self._fan_out(lambda i: sessions[i].start_pull(wait), lambda i: sessions[i].pull(self._enrolment(i), wait))
        )
        changed = False
        for session, pulled in zip(sessions, replies, strict=True):
            if pulled.parameters is not None:
                session.received(pulled.version, pulled.parameters, pulled.history)
                self._received_buffers(pulled.buffers)
                changed = True
        self.round_takes_next = all(pulled.round_takes_next for pulled in replies)  # gemps.rounds
        if changed or self.central is None:
            self.central = self._assemble()
        return self.central

    def commit(
        self,
        flat: Vector,
        *,
        kind: PayloadKind,
        loss: float | None,
        num_samples: int | None,
        base_version: int | None,
        buffer_delta: Buffers | None,
        gradient_sums: Sequence[GradientSums] | None = None,
    ) -> CommitResult:
        """Each server's slice of `flat`, concurrently; θ, versions and figures from the replies. Every
        attempt has the same request id and number: each server applies it at most once (CommitCall)."""
        sessions = self.sessions
        sums = per_partition(gradient_sums, len(sessions))
        # One server sent the payload as it is: its transport checks it where it copies it anyway
        # (the shared memory). Else here, before any server sees it: no partition applies a commit
        # another would refuse, and no compressor encodes what is refused.
        deferred = len(sessions) == 1 and self.compressor is None
        if not deferred:
            refuse_non_finite("payload", flat)
        self._sequence += 1
        request_id = f"{self._request_prefix}{self._sequence}"
        slices, bases = self._slices(flat), self._base_versions(base_version)
        size = 4 * vectors.size(flat)  # large: each slice coded, each reply read, on a thread (fan_out.py)
        encoded = self._encoded(slices, size)
        # Under a rule of rounds a reply may be θ unchanged: the commit says which θ it holds.
        rounds = self.registration is not None and ROUND_SIZE in self.registration.config.rule_options
        calls = [
            CommitCall(
                sessions[i].worker_id, bases[i], kind, slices[i], loss, num_samples, request_id,
                buffer_delta if i == 0 else None,  # buffers live on partition 0
                self._sequence, encoded[i][0], self.reply_code, sessions[i].copy.number, deferred,
                sessions[i].known_history(bases[i], self.reply_code) if rounds else "", sums[i],
            )
            for i in range(len(sessions))
        ]  # fmt: skip
        outcomes = self._fan_out(
            lambda i: sessions[i].start_commit(calls[i]), lambda i: sessions[i].commit(calls[i], self._enrolment(i))
        )
        taken = self._calls.each(
            len(sessions),
            lambda i: None if isinstance(got := outcomes[i], errors.GempsError) else sessions[i].took(got, calls[i]),
            nbytes=size if self.reply_code else 0,
        )
        replies: dict[int, Committed] = {}
        refusals: dict[int, errors.GempsError] = {}
        for index, outcome in enumerate(outcomes):
            if isinstance(outcome, errors.GempsError):
                refusals[index] = outcome
                continue
            replies[index] = outcome  # kept also when another partition refused: θ moved there
            taken[index].result()  # raises what reading its reply raised
            if self.compressor is not None and (residual := encoded[index][1]) is not None:
                self.compressor.applied(index, residual)  # this server applied it: its residual moves on
            self._received_buffers(outcome.buffers)
        if refusals:
            refusal = next(iter(refusals.values()))
            if not replies:
                raise refusal
            self.central = self._assemble()
            raise errors.PartiallyAppliedError.of(refusal, list(replies), list(refusals), self.central) from refusal
        self.central = self._assemble()
        return merge_commit_figures(list(replies.values()), [session.size for session in sessions], self.central)

    def _encoded(self, slices: list[Vector], nbytes: int) -> list[tuple[tuple[int, bytes] | None, Vector | None]]:
        """Each server's slice compressed once for every attempt, and the residual it leaves."""
        if (compressor := self.compressor) is None:
            return [(None, None)] * len(slices)
        coded = self._calls.each(len(slices), lambda i: compressor.encode(i, slices[i]), nbytes=nbytes)
        return [((compressor.dtype, data), residual) for data, residual in (done.result() for done in coded)]

    def leave(self) -> None:
        for session in self.sessions:
            session.leave()

    def status(self) -> ServerStatus:
        return self.sessions[0].status()

    def statuses(self) -> list[ServerStatus]:
        first = self.status()
        self._adopt(first.layout)
        return [first, *(session.status() for session in self.sessions[1:])]

    def report_evaluation(self, evaluation: Evaluation) -> None:
        self.sessions[0].report_evaluation(evaluation)

    def interrupt(self) -> None:
        """End every call in flight, on every server (each fails as unavailable)."""
        for session in self.sessions:
            session.link.interrupt()

    def close(self) -> None:
        for session in self.sessions:
            session.link.close()
        self._probes.close()
        self._calls.close()

    # -- internals -------------------------------------------------------------------------------

    def _slices(self, flat: Vector) -> list[Vector]:
        """Each server's slice of a payload (views); one server: all of it (the server checks its size)."""
        if self.layout is None:
            return [flat]
        if vectors.size(flat) != self.layout.num_parameters:
            raise errors.InvalidArgumentError(
                f"payload has {vectors.size(flat)} values but the central variable has {self.layout.num_parameters}",
                errors.InvalidArgumentError.code,
                Reason.BAD_SHAPE,
            )
        return [flat[session.start : session.stop] for session in self.sessions]

    def _base_versions(self, base_version: int | None) -> list[int]:
        """Each server's base version: the version of its slice last received, or as many
        versions behind it as `base_version` is behind partition 0's."""
        assert self.central is not None
        behind = None if base_version is None else self.central.version - base_version
        return [session.version if behind is None else max(0, session.version - behind) for session in self.sessions]

    def _fan_out(self, start: Callable[[int], Pending[T]], blocking: Callable[[int], T]) -> list[T | errors.GempsError]:
        """One call per server, concurrently (gemps.fan_out); a failed one retried by `blocking`.
        One server: `blocking`, whose failure is raised."""
        sessions = self.sessions
        if len(sessions) == 1:
            return [blocking(0)]
        return self._calls.calls(
            len(sessions),
            start,
            blocking,
            lambda index, error: sessions[index].link.suspect(error),
            nbytes=4 * sum(session.size for session in sessions),  # θ's float32 bytes: a payload's or a reply's
        )

    def _register_at(self, index: int, initial: Vector) -> None:
        enrolment = self._enrolment(index, initial)
        assert enrolment is not None
        session = self.sessions[index]
        registered = session.register(enrolment)
        if index == 0:
            self.job = self.job or registered.registration.job
            self._adopt(registered.registration.layout)
        self._received_buffers(registered.buffers)
        session.hold(registered, enrolment.values)

    def _enrolment(self, index: int, values: Vector | None = None) -> Enrolment | None:
        """What server `index` registers with: by default our newest copy of θ, which re-initialises
        a server that lost its state (None before registering). The first gets all of θ and the buffers."""
        if values is None:
            values = self.central.flat if self.central is not None else self.registered_with
            if values is None:
                return None
        if index > 0:
            session = self.sessions[index]
            mine = values[session.start : session.stop]
            return Enrolment(self.spec, self.worker_name, self.client_id, mine, job=self.job)
        return Enrolment(
            self.spec, self.worker_name, self.client_id, values, self.buffer_spec, self.buffers, self.layout, self.job
        )

    def _adopt(self, layout: Layout | None) -> None:
        """Take the layout a server announced: each session's range, and transports to partitions
        not reached yet (addresses relative to the one this client was given)."""
        if layout is None:
            self.sessions[0].start, self.sessions[0].stop = 0, sum(num_elements(entry.shape) for entry in self.spec)
            return
        if self.layout is None:
            for index in range(len(self.sessions), len(layout.partitions)):
                address = self._address_of(index, layout)
                self.sessions.append(self._session(index, self.connect(address)))
        refuse_partition_count_change(self.target, self.layout, layout)
        for session, partition in zip(self.sessions, layout.partitions, strict=True):
            session.start, session.stop = partition.start, partition.stop
        self.layout = layout

    def _session(self, index: int, transport: Transport) -> ServerSession:
        """Partition `index`'s session: it follows the partition when it moves, and (replicated)
        leaves a primary that stopped answering for the replica that took over. Partition 0 is at
        the address the user gave; the others where partition 0 announces them."""
        watch = PrimaryWatch(lambda: self._replica_set(index), self._probes, lambda: self.job)
        return ServerSession(transport, self.retrier, lambda: self._follow(index), watch, announced=index > 0)

    def _replica_set(self, index: int) -> Replicas | None:
        """Partition `index`'s replicas, if it is replicated (partition 0's may be the target given)."""
        replicas = self._replicas.get(index)
        if replicas is None and index == 0 and isinstance(self.resolver, Replicas):
            return self.resolver
        return replicas

    def _follow(self, index: int) -> Transport | None:
        """A transport to partition `index` at its address now, when that is not where its session
        is: partition 0's from the resolver, another's from the layout partition 0 announces now
        (one attempt: the caller retries). None when it did not move, or nobody can say."""
        try:
            if index == 0:
                address = self.resolver.resolve()
            else:
                layout = self.sessions[0].transport.status().layout
                if layout is None or len(layout.partitions) != len(self.sessions):
                    return None
                address = self._address_of(index, layout)
        except Exception as error:  # a resolver of the user's may raise anything: keep the last address
            if index in self._replicas:  # partition 0 cannot say (its primary died too): its replicas can
                address = self._replicas[index].resolve()
            else:
                log.debug("where partition %d is now is not known (%s): trying %s again", index, error, self.target)
                return None
        if address == self.sessions[index].target:
            return None
        self.target = address if index == 0 else self.target
        return self.connect(address)

    def _address_of(self, index: int, layout: Layout) -> str:
        """Partition `index`'s address as `layout` announces it; of a replicated one, the next
        replica of its set (asked again: the last one failed or was not its primary)."""
        address = resolve_address(layout.partitions[index].address, self.target)
        if REPLICA_SEPARATOR not in address:
            return address
        replicas = self._replicas.get(index)
        if replicas is None or REPLICA_SEPARATOR.join(replicas.addresses) != address:
            replicas = self._replicas[index] = Replicas.parse(address)
        return replicas.resolve()

    def _assemble(self) -> CentralVariable:
        """The central variable from the slices held (one server: its θ as received, no copy)."""
        if len(self.sessions) == 1:
            flat = self.sessions[0].flat
        else:  # read-only, as a single server's (a view of its reply); in pages kept (reply_buffers.py)
            kept = self._assembled.take(4 * sum(session.size for session in self.sessions))
            flat = vectors.read_only(vectors.concatenate([session.flat for session in self.sessions], into=kept))
        versions = tuple(session.version for session in self.sessions)
        return CentralVariable(
            versions[0], flat, self.spec, self.buffers.floats, self.buffer_spec, versions, self.buffers.integers
        )

    def _received_buffers(self, buffers: Buffers | None) -> None:
        self.buffers = self.buffers if buffers is None else buffers  # left out for a model without buffers


def _all_or_raise(outcomes: Sequence[T | errors.GempsError]) -> list[T]:
    """Every call's result, or the first failure raised."""
    for outcome in outcomes:
        if isinstance(outcome, errors.GempsError):
            raise outcome
    return [outcome for outcome in outcomes if not isinstance(outcome, errors.GempsError)]
