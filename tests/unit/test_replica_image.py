"""A replica's image: a primary's whole state at one version, encoded, decoded and adopted by a
backup, which then holds the same θ, rule state, workers and ledger bit for bit (issue 35)."""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from gemps_proto.schema import ParameterSpec, PayloadKind
from gemps_proto.tensor_codec import FLOAT32, INT64, EncodedBuffers, EncodedTensor
from gemps_server.domain import images
from gemps_server.domain.errors import NotFound
from gemps_server.domain.ledger import CommitLedger, LedgerImage, Receipt
from gemps_server.domain.records import ALL_OF_THETA, Commit, PartitionOf
from gemps_server.domain.replica_image import ReplicaImage
from gemps_server.domain.rules import ApplyStats, RuleRuntime, create_rule
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import RegisteredWorker, RegistryImage, WorkerRegistry
from gemps_server.native import compiled
from gemps_server.replication.image_codec import decode, digest, encode
from tests.helpers import encoded, training

SPEC = (ParameterSpec("layer.weight", (7, 9)), ParameterSpec("layer.bias", (7,)))
P = 70
BUFFER_SPEC = (ParameterSpec("bn.mean", (3,)), ParameterSpec("bn.batches", (), INT64))
CLIENT = "client-a"
KERNELS = ["numpy", pytest.param("compiled", marks=pytest.mark.skipif(compiled is None, reason="not built"))]


def new_state(rule: str = "gem", kernel: str = "numpy", partition: PartitionOf = ALL_OF_THETA) -> ServerState:
    return ServerState(
        training(rule, learning_rate=0.05),
        WorkerRegistry(max_workers=8, lease_ttl=3600),
        RuleRuntime(gem_kernel=kernel),
        partition=partition,
        noise_window=3,
    )


def buffers(floats: np.ndarray, integers: np.ndarray) -> EncodedBuffers:
    return EncodedBuffers(encoded(floats.astype(np.float32)), EncodedTensor(INT64, integers.shape, integers.tobytes()))


class Workload:
    """Workers and their commits, the same on any state that holds them (ids, versions, sequences)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.workers: list[str] = []
        self.sequence = 0
        self.last: Commit | None = None

    def register(self, state: ServerState, count: int = 3) -> None:
        initial = self.rng.normal(size=P).astype(np.float32)
        first = buffers(np.arange(3.0), np.array([5], np.int64))
        for index in range(count):
            client = CLIENT if index == 1 else ""
            registered = state.register(
                f"w{index}", SPEC, encoded(initial), buffer_spec=BUFFER_SPEC, initial_buffers=first, client_id=client
            )
            self.workers.append(registered.worker.worker_id)

    def commit(self, index: int, version: int) -> Commit:
        worker = self.workers[index % len(self.workers)]
        client = worker == self.workers[1]
        self.sequence += client
        kind = PayloadKind.UPDATE if index % 7 == 6 else PayloadKind.GRADIENT
        delta = buffers(self.rng.normal(size=3), np.array([1], np.int64)) if index % 3 == 0 else None
        self.last = Commit(
            worker,
            max(0, version - index % 3),
            kind,
            encoded(self.rng.normal(size=P).astype(np.float32) * 0.1),
            request_id=f"{worker[:6]}-{index}",
            sequence=self.sequence if client else 0,
            num_samples=32 + index % 4,
            buffer_delta=delta,
        )
        return self.last


def seeded(rule: str = "gem", kernel: str = "numpy", seed: int = 1, commits: int = 20) -> tuple[ServerState, Workload]:
    """A state with 3 workers (one with a client id), one more that left, and `commits` commits."""
    state, load = new_state(rule, kernel), Workload(seed)
    load.register(state, 4)
    state.core.commit_record(load.commit(3, 0))  # the fourth commits once and leaves: a departed scope, a free slot
    state.leave(load.workers.pop())
    for index in range(commits):
        state.core.commit_record(load.commit(index, state.core.version))
    return state, load


def stats_bytes(stats: ApplyStats) -> bytes:
    return np.array(dataclasses.astuple(stats), np.float64).tobytes()


def ledger_bytes(ledger: LedgerImage) -> str:
    """The ledger's entries in order, each receipt's statistics as their float64 bytes (NaN too)."""

    def receipt(r: Receipt) -> tuple[int, int, int, bytes]:
        return r.version, r.staleness, r.sequence, stats_bytes(r.stats)

    last = [(scope, request_id, receipt(r)) for scope, request_id, r in ledger.last]
    return repr((last, ledger.departed, [(request_id, receipt(r)) for request_id, r in ledger.legacy]))


def noise_bytes(state: ServerState) -> bytes:
    """The noise estimator's state (windows and averages), exactly."""
    n = state.core.noise.export()
    e = n.estimate
    numbers = [n.scale, n.small, n.inverse_batch, *n.gradient_square, *n.noise_trace]
    numbers += [e.gradient_square, e.noise_trace, e.batch_size, n.stride, n.size, n.count, n.pending, e.windows]
    numbers += [n.assumed, e.batch_size_assumed]
    return n.total.tobytes() + np.array(numbers, np.float64).tobytes()


def raw(state: ServerState) -> dict[str, bytes | str]:
    """What must be equal between replicas, as bytes (reprs for the ledger: its NaN energies too)."""
    assert state.core.rule is not None
    image = images.checkpoint(state)
    found: dict[str, bytes | str] = {
        "theta": state.core.theta_copy().tobytes(),
        "buffers": image.buffers.floats.tobytes() + image.buffers.integers.tobytes(),
        "ledger": ledger_bytes(state.core.ledger.export()),
        "workers": repr(state.registry.export()),
        "counts": repr((state.core.version, state.core.commits_applied, state.history)),
    }
    for worker in state.registry.export().workers:
        for name, value in state.core.rule.worker_state(worker.worker_id).items():
            found[f"{worker.worker_id}.{name}"] = value.tobytes()
    for name, value in state.core.rule.global_state().items():
        found[f"rule.{name}"] = value.tobytes()
    return found


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rule", ["gem", "momentum", "delayed-nesterov"])
def test_an_adopted_image_goes_on_bit_for_bit(rule: str, kernel: str) -> None:
    primary, load = seeded(rule, kernel)
    image = images.take(primary)
    backup = new_state(rule, kernel)
    images.adopt(backup, decode(encode(image)))
    assert raw(backup) == raw(primary)
    assert digest(images.take(backup)) == digest(image)
    if rule == "gem":  # per-worker state came across (and differs between workers)
        assert primary.core.rule is not None and backup.core.rule is not None
        proxies = [backup.core.rule.worker_state(worker)["proxy"].tobytes() for worker in load.workers]
        assert len(set(proxies)) == 3 and b"\x00" * 4 * P not in proxies
    for index in range(20, 30):
        commit = load.commit(index, primary.core.version)
        a, b = primary.core.commit_record(commit), backup.core.commit_record(commit)
        assert (a.staleness, stats_bytes(a.stats), a.duplicate) == (b.staleness, stats_bytes(b.stats), b.duplicate)
        assert a.snapshot.version == b.snapshot.version
    assert raw(backup) == raw(primary)
    assert digest(images.take(backup)) == digest(images.take(primary))
    assert noise_bytes(backup) == noise_bytes(primary) and primary.core.noise.estimate.windows > 3
    # The backup recognises a retry of the last commit as the primary would.
    assert load.last is not None
    retried = backup.core.commit_record(load.last)
    assert retried.duplicate and backup.core.version == primary.core.version
    assert stats_bytes(retried.stats) == stats_bytes(primary.core.commit_record(load.last).stats)
    # One more commit on one side only: the two differ, and the digest says so.
    primary.core.commit_record(load.commit(30, primary.core.version))
    assert raw(backup)["theta"] != raw(primary)["theta"]
    assert digest(images.take(backup)) != digest(images.take(primary))


def test_the_image_is_a_copy_taken_at_its_version() -> None:
    primary, load = seeded()
    image = images.take(primary)
    before = digest(image)
    assert image.state is not None and image.noise is not None
    theta, noise = image.state.theta.tobytes(), image.noise.total.tobytes()
    primary.core.commit_record(load.commit(20, primary.core.version))
    assert digest(image) == digest(decode(encode(image))) == before  # (the bytes' header order varies)
    assert (image.state.theta.tobytes(), image.noise.total.tobytes()) == (theta, noise)
    assert digest(images.take(primary)) != before


def test_the_digest_leaves_out_the_history_the_noise_estimate_and_the_bound() -> None:
    primary, _ = seeded()
    image = images.take(primary)
    assert image.noise is not None and image.noise.estimate.windows > 0  # a window of 3 closed
    other = dataclasses.replace(image, history="another", noise=None)
    assert digest(other) == digest(image)
    assert digest(dataclasses.replace(image, theta_bound=1.0)) == digest(image)
    assert image.state is not None
    theta = image.state.theta.copy()
    theta[0] = np.nextafter(theta[0], np.float32(np.inf))
    assert digest(dataclasses.replace(image, state=dataclasses.replace(image.state, theta=theta))) != digest(image)


def test_adopting_keeps_the_workers_and_their_slots() -> None:
    primary, load = seeded()
    backup = new_state()
    images.adopt(backup, decode(encode(images.take(primary))))
    assert backup.registry.listing() != () and [(w.name, w.shard, w.commits) for w in backup.registry.listing()] == [
        (w.name, w.shard, w.commits) for w in primary.registry.listing()
    ]
    assert backup.registry.of_client(CLIENT) is not None
    assert backup.registry.of_client(CLIENT).worker_id == load.workers[1]  # type: ignore[union-attr]
    # The slot the fourth worker left is the next one handed out, on both.
    ours = primary.register("new", SPEC, None, buffer_spec=BUFFER_SPEC).worker
    theirs = backup.register("new", SPEC, None, buffer_spec=BUFFER_SPEC).worker
    assert ours.slot == theirs.slot == 3


def test_an_image_of_a_server_nobody_registered_with() -> None:
    empty = images.take(new_state())
    assert not empty.initialized and empty.state is None
    decoded = decode(encode(empty))
    assert not decoded.initialized and decoded.history == empty.history
    target, load = seeded()
    images.adopt(target, decoded)
    assert (
        not target.core.initialized
        and target.core.version == 0
        and len(target.registry) == 0
        and len(target.core.ledger) == 0
    )
    assert target.core.num_parameters == 0 and target.history == empty.history
    with pytest.raises(NotFound):
        target.registry.get(load.workers[0])
    again = Workload(5)
    again.register(target)  # initialised again by the first registration, as a fresh server would be
    assert target.core.initialized and target.core.num_parameters == P


def test_adopting_replaces_an_initialised_state() -> None:
    primary, load = seeded(seed=1)
    target, old = seeded(seed=2, commits=5)
    images.adopt(target, decode(encode(images.take(primary))))
    assert raw(target) == raw(primary)
    with pytest.raises(NotFound):
        target.registry.get(old.workers[0])
    commit = load.commit(20, primary.core.version)  # the primary's workers carry on with it
    assert stats_bytes(target.core.commit_record(commit).stats) == stats_bytes(primary.core.commit_record(commit).stats)
    # Nothing of the replaced state is served: its snapshot encodings are gone.
    assert target.core.encoded(FLOAT32).data(FLOAT32) == primary.core.encoded(FLOAT32).data(FLOAT32)


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[:-10],
        lambda data: data[:5],
        lambda data: b"",
        lambda data: b"not an image at all",
        lambda data: data[:-1] + bytes([data[-1] ^ 0x40]),  # a tensor byte: the CRC
        lambda data: data.replace(b"gemps-replica-image", b"gemps-replica-imagX"),
    ],
)
def test_a_damaged_encoding_is_refused(damage: Callable[[bytes], bytes]) -> None:
    primary, _ = seeded()
    data = encode(images.take(primary))
    with pytest.raises(ValueError, match="replica image"):
        decode(damage(data))


def rewritten(data: bytes, key: str, change: Callable[[Any], Any]) -> bytes:
    """`data` with metadata `key`'s JSON changed by `change` (tensors and CRC kept)."""
    (length,) = struct.unpack_from("<Q", data)
    metadata = json.loads(data[8 : 8 + length])["__metadata__"]
    metadata[key] = json.dumps(change(json.loads(metadata[key])))
    return bytes(safetensors.numpy.save(dict(safetensors.numpy.load(data)), metadata=metadata))


def test_an_inconsistent_image_is_refused_and_changes_nothing() -> None:
    primary, _ = seeded()
    data = encode(images.take(primary))
    target, _ = seeded(seed=2)
    before = raw(target)

    def clash(workers: dict[str, list[list[object]]]) -> dict[str, list[list[object]]]:
        workers["registered"][1][2] = workers["registered"][0][2]  # two workers in one slot
        return workers

    with pytest.raises(ValueError, match="slots"):
        images.adopt(target, decode(rewritten(data, "workers", clash)))

    def lost_receipt(ledger: dict[str, list[object]]) -> dict[str, list[object]]:
        ledger["last"] = ledger["last"][1:]  # one receipt fewer than the tensors hold
        return ledger

    with pytest.raises(ValueError, match="receipts"):
        decode(rewritten(data, "ledger", lost_receipt))
    with pytest.raises(ValueError, match="version"):
        decode(rewritten(data, "version", lambda version: -1))  # the version, text as a checkpoint holds it
    assert raw(target) == before


def test_whether_the_noise_batch_was_assumed_crosses_and_an_older_image_reads_as_not() -> None:
    """Issue 43: the estimate says when --batch-size stood in for commits that reported no
    num_samples (these do not); an image from before that field reads as none assumed."""
    primary, load = seeded()
    for index in range(21, 27):  # gradients that report no num_samples: at least one whole window of 3
        primary.core.commit_record(dataclasses.replace(load.commit(index, primary.core.version), num_samples=None))
    image = images.take(primary)
    assert image.noise is not None and image.noise.estimate.batch_size_assumed and image.noise.assumed > 0
    crossed = decode(encode(image)).noise
    assert crossed is not None and crossed.estimate.batch_size_assumed and crossed.assumed == image.noise.assumed
    older = decode(rewritten(encode(image), "noise", lambda counts: counts[:6])).noise
    assert older is not None and not older.estimate.batch_size_assumed and older.assumed == 0
    with pytest.raises(ValueError, match="noise"):
        decode(rewritten(encode(image), "noise", lambda counts: [*counts[:7], 1]))  # a flag that is not a bool


def test_another_partitions_or_rules_image_is_refused() -> None:
    half = PartitionOf(0, 2)
    primary = new_state(partition=half)
    Workload(3).register(primary)
    image = decode(encode(images.take(primary)))
    assert image.partition == half and image.state is not None and image.state.theta.size == P // 2
    other = new_state(partition=PartitionOf(1, 2))
    with pytest.raises(ValueError, match="partition 0 of 2"):
        images.adopt(other, image)
    with pytest.raises(ValueError, match="rule 'gem'"):
        images.adopt(new_state("momentum", partition=half), image)
    images.adopt(new_state(partition=half), image)  # its own partition's
    assert not other.core.initialized


def test_an_image_holds_no_rule_state_of_unknown_workers() -> None:
    primary, _ = seeded()
    image = images.take(primary)
    with pytest.raises(ValueError, match="not registered"):
        dataclasses.replace(image, worker_rule_state={"stranger": {}, **image.worker_rule_state})
    with pytest.raises(ValueError, match="not initialised"):
        ReplicaImage("h", workers=RegistryImage((RegisteredWorker("w", "w", 0),), (), 1))


def test_the_ledger_and_registry_keep_their_order() -> None:
    stats = ApplyStats(1.0, 1.0, 0.0, 0.0)
    ledger = CommitLedger(capacity=2)
    for scope in ("a", "b", "c"):
        ledger.record(scope, f"r-{scope}", Receipt(1, 0, stats))
    ledger.depart("b")
    ledger.depart("a")
    copy = CommitLedger(capacity=2)
    copy.adopt(ledger.export())
    assert copy.export() == ledger.export() and copy.export().departed == ("b", "a")
    with pytest.raises(ValueError, match="capacity"):
        CommitLedger(capacity=1).adopt(ledger.export())
    with pytest.raises(ValueError, match="departed"):
        copy.adopt(LedgerImage(departed=("a",)))
    registry = WorkerRegistry(max_workers=4, lease_ttl=60)
    with pytest.raises(ValueError, match="heap"):
        registry.adopt(RegistryImage((), (2, 0, 1), 3))
    with pytest.raises(ValueError, match="at most 4"):
        registry.adopt(RegistryImage(tuple(RegisteredWorker(f"w{i}", "w", i) for i in range(5)), (), 5))


def test_bounds_from_elsewhere_are_raised_to_the_values_they_bound() -> None:
    rule = create_rule(training("downpour"), 4)
    theta = np.array([1.0, -3.0, 2.0, 0.0], np.float32)
    rule.load_theta_bound(theta, 0.5)
    assert rule.theta_bound(theta) == 3.0 and rule.theta_bound(theta.copy()) is None
    rule.load_theta_bound(theta, 7.0)
    assert rule.theta_bound(theta) == 7.0


@pytest.mark.skipif(compiled is None, reason="the compiled GEM kernel is not built")
def test_gem_peaks_of_a_numpy_kernels_image_are_raised_for_the_compiled_kernel() -> None:
    primary, load = seeded("gem", "numpy")  # the numpy kernel keeps no bounds: its peaks stay 0
    backup = new_state("gem", "compiled")
    images.adopt(backup, decode(encode(images.take(primary))))
    assert backup.core.rule is not None and primary.core.rule is not None
    for worker in load.workers:
        assert primary.core.rule.worker_state(worker)["proxy_peak"] == 0.0
        state = backup.core.rule.worker_state(worker)
        assert state["proxy_peak"] == np.abs(state["proxy"]).max() > 0.0
        assert state["last_seen_peak"] == np.abs(state["last_seen_theta"]).max() > 0.0
