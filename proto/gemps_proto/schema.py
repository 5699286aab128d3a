"""The protocol's shared data types in plain Python (no protobuf): what server, SDK and tools agree on.

Each type here is the typed face of one message or enum of `gemps.v1` (parameter_server.proto);
tests/unit/test_schema.py pins the two together, so a field added to one and not the other
fails the build. Everything else derives from these definitions: the server's flags and GEMPS_*
variables, its checkpoint metadata, Status and logs, the SDK's records, the demo's and the
experiments' options. The records of Status (the server's state, its workers, noise estimate and
replication) build on these and are gemps_proto.status's.

`TrainingConfig` is the configuration the server owns and announces at Register. Its field
metadata carries the help text and, where the protocol fixes them, the valid choices; the valid
commit rules are the server's (its rule registry), so they are checked there. A rule's own
options (GEM's mu, kappa, pi_max) are no fields of it: they are one name -> value map
(`rule_options`), declared by the rules (gemps_proto.rule_options).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gemps_proto import vectors
from gemps_proto.ranges import FLOAT32_MAX, INT64_MAX, RANGE, UINT32_MAX, Range, out_of_range
from gemps_proto.rule_options import DECLARED, OptionValues
from gemps_proto.schedules import AFTER_WARMUP, CONSTANT, SCHEDULES
from gemps_proto.tensor_codec import FLOAT32, INT64
from gemps_proto.vectors import ArrayLike, Vector
from gemps_proto.versions import Versions


class PayloadKind(enum.IntEnum):
    """What a commit carries: gemps.v1.PayloadKind, whose wire values these are (0 is unspecified)."""

    GRADIENT = 1  # the server's rule applies the update -eta * g
    UPDATE = 2  # applied as given (e.g. accumulated local steps)

    @property
    def label(self) -> str:
        """How users name it: "gradient", "update"."""
        return self.name.lower()

    @property
    def wire_name(self) -> str:
        """Its name in the .proto: PAYLOAD_KIND_GRADIENT, PAYLOAD_KIND_UPDATE."""
        return f"PAYLOAD_KIND_{self.name}"


def _option(default: Any, help: str, choices: Sequence[str] | None = None, within: Range | None = None) -> Any:
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if within is not None:
        metadata[RANGE] = within
    return field(default=default, metadata=metadata)


# What the training options' types hold. Factors multiply float32 values of θ (a larger one makes
# every update infinite, and every commit is refused); counts of versions are int64 like the
# versions they are compared with (uint64 on the wire); the batch size is a uint32 on the wire.
POSITIVE_FACTOR = Range(0, FLOAT32_MAX, low_open=True)
VERSIONS = Range(0, INT64_MAX, unit="versions")
SOME_VERSIONS = Range(1, INT64_MAX, unit="versions")

#: The longest a Pull may ask the server to hold its reply until θ moves (PullRequest.wait_seconds):
#: a worker waiting for its round asks again after it; a held pull keeps one of the server's
#: concurrent calls (--max-concurrent-rpcs) or its data-plane connection meanwhile.
MAX_PULL_WAIT_SECONDS = 10.0
PULL_WAITS = Range(0, MAX_PULL_WAIT_SECONDS, unit="seconds")


@dataclass(frozen=True)
class TrainingConfig:
    """The training configuration the server owns (gemps.v1.TrainingConfig): the commit rule, the
    learning rate and its schedule, the rule's own options, and the batch size announced to
    workers. Defaults are the GEM paper's."""

    rule: str = _option("gem", "commit rule")
    learning_rate: float = _option(
        0.05,
        "eta: a gradient g is applied as -eta*g; an update commit (a worker's own steps) reaches the rule without eta",
        within=POSITIVE_FACTOR,
    )
    # The rule's options by name (its declarations: gemps_proto.rule_options, one flag each). The
    # server announces every option of its rule, those not set at their defaults (its registry's
    # with_rule_defaults).
    rule_options: Mapping[str, float] = field(
        default_factory=OptionValues, metadata={"help": "the rule's own options", DECLARED: "the rule's options"}
    )
    batch_size: int = _option(64, "mini-batch size announced to workers", within=Range(1, UINT32_MAX))
    # eta at central version v (commits applied): learning_rate * warm-up(v) * decay(v), see schedules.py
    lr_schedule: str = _option(CONSTANT, "eta's decay over central versions v (commits applied)", SCHEDULES)
    lr_warmup_commits: int = _option(0, "linear warm-up: eta scaled by min(1, (v+1)/this); 0: none", within=VERSIONS)
    lr_step_size: int = _option(1000, "step: multiply eta by lr_gamma every this many versions", within=SOME_VERSIONS)
    lr_gamma: float = _option(0.1, "step: the factor", within=Range(0, 1, low_open=True))
    lr_total_commits: int = _option(
        10000, "cosine, warmup-cosine, warmup-linear: versions until eta reaches lr_min", within=SOME_VERSIONS
    )
    lr_min: float = _option(
        0.0, "cosine, warmup-cosine, warmup-linear: the final eta, at most learning_rate", within=Range(0, FLOAT32_MAX)
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "rule_options", OptionValues(self.rule_options))

    def problems(self) -> list[str]:
        """What is wrong with these values (empty when nothing is): each outside its range, an
        unknown schedule, and lr_min above learning_rate; the same in every process. The rule's
        name and options are the server's to check (its registry: gemps_server.domain.rules)."""
        found = out_of_range(self)
        if self.lr_schedule not in SCHEDULES:
            found.append(f"unknown lr_schedule {self.lr_schedule!r} (choose from {', '.join(SCHEDULES)})")
        if self.lr_min > self.learning_rate:
            found.append("lr_min must be in [0, learning_rate]")
        if self.lr_schedule in AFTER_WARMUP and self.lr_total_commits <= self.lr_warmup_commits:
            found.append(
                f"lr_schedule {self.lr_schedule} decays after the warm-up: lr_total_commits ({self.lr_total_commits}) "
                f"must be above lr_warmup_commits ({self.lr_warmup_commits})"
            )
        return found

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> TrainingConfig:
        """The config `as_dict` gives: the config's fields by name, every other name an option of the rule."""
        names = {f.name for f in dataclasses.fields(cls)} - {"rule_options"}
        options = {name: value for name, value in values.items() if name not in names}
        return cls(**{name: value for name, value in values.items() if name in names}, rule_options=options)

    def as_dict(self) -> dict[str, Any]:
        """Field name -> value, the rule's options by their own names in place of `rule_options`
        (checkpoint metadata, logs, the info metric's labels, `gemps status`)."""
        found: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            found.update(dict(value) if f.name == "rule_options" else {f.name: value})
        return found


@dataclass(frozen=True)
class ParameterSpec:
    """One named parameter of the model (gemps.v1.ParameterSpec; the central variable is float32),
    or one buffer: float32 (any floating buffer) or int64 (an integer one, carried exactly)."""

    name: str
    shape: tuple[int, ...]
    dtype: int = FLOAT32  # a gemps_proto.tensor_codec dtype: FLOAT32, or INT64 for an integer buffer

    @property
    def size(self) -> int:
        """How many values: the product of the shape."""
        return math.prod(self.shape)

    @property
    def integer(self) -> bool:
        """Whether the entry is an int64 buffer (carried exactly), not float32."""
        return self.dtype == INT64

    def describe(self) -> str:
        """For messages: the name and shape, like "'fc.weight' [10, 64]" (and "int64" for such a buffer)."""
        return f"{self.name!r} {list(self.shape)}" + (" int64" if self.integer else "")


def spec_of(parameters: Mapping[str, Vector]) -> tuple[ParameterSpec, ...]:
    """The spec of named arrays, in mapping order."""
    return tuple(ParameterSpec(name, vectors.shape(value)) for name, value in parameters.items())


def buffer_spec_of(buffers: Mapping[str, Vector]) -> tuple[ParameterSpec, ...]:
    """The buffer spec of named arrays, in mapping order: integer (and boolean) arrays are int64
    entries, carried exactly; the others float32."""
    return tuple(
        ParameterSpec(name, vectors.shape(value), INT64 if integral(value) else FLOAT32)
        for name, value in buffers.items()
    )


def integral(value: Vector) -> bool:
    """Whether an array holds integers (or booleans): an int64 buffer, carried exactly."""
    return vectors.is_integral(value)


def buffer_numbers(name: str, value: Any) -> vectors.Vector:
    """A buffer's values in their own kind (vectors.as_numbers: Python integers as int64), an
    integer int64 cannot hold refused naming the buffer (Int64RangeError), numpy or not."""
    try:
        return vectors.as_numbers(value)
    except vectors.Int64RangeError as error:
        raise vectors.Int64RangeError(f"buffer {name!r}: {error}") from None


def _buffer_values(entry: ParameterSpec, value: Any) -> vectors.Vector:
    """A buffer's values in its kind: float32, or int64 (Int64RangeError naming the buffer for a
    value int64 cannot hold)."""
    if not entry.integer:
        return vectors.as_float32(value)
    try:
        return vectors.as_int64(value)
    except vectors.Int64RangeError as error:
        raise vectors.Int64RangeError(f"buffer {entry.name!r}: {error}") from None


@dataclass(frozen=True)
class Buffers:
    """A model's buffer values by kind, each flat in buffer-spec order: the float32 entries'
    (`floats`) and the int64 entries' (`integers`, exact: batch norm's num_batches_tracked passes
    2**24, where float32 stops counting). The wire carries each as a tensor of its own."""

    floats: Vector = field(default_factory=vectors.empty_float32)
    integers: Vector = field(default_factory=vectors.empty_int64)

    @property
    def size(self) -> int:
        return vectors.size(self.floats) + vectors.size(self.integers)

    @property
    def nbytes(self) -> int:
        return int(self.floats.nbytes + self.integers.nbytes)

    @classmethod
    def of(cls, values: Mapping[str, ArrayLike] | ArrayLike, spec: Sequence[ParameterSpec]) -> Buffers:
        """Values by name, or one flat array of every entry in spec order, split by the spec's kinds;
        ValueError unless they are exactly the spec's entries, each of its size."""
        if not isinstance(values, Mapping):
            flat = vectors.flat(vectors.as_numbers(values))
            if len(flat) != sum(entry.size for entry in spec):
                raise ValueError(f"{len(flat)} values where the spec has {sum(entry.size for entry in spec)}")
            values = dict(_views(flat, spec))
        unknown = sorted(set(values) - {entry.name for entry in spec})
        if unknown:
            raise ValueError(f"no buffer named {', '.join(unknown)} in the spec")
        converted = {entry.name: _buffer_values(entry, values[entry.name]) for entry in spec}
        for entry in spec:
            if (size := vectors.size(converted[entry.name])) != entry.size:
                raise ValueError(f"{entry.name} has {size} values, the spec {entry.size}")
        floats = [converted[e.name] for e in spec if not e.integer]
        integers = [converted[e.name] for e in spec if e.integer]
        return cls(vectors.concatenate(floats), vectors.concatenate(integers, integers=True))

    def named(self, spec: Sequence[ParameterSpec]) -> dict[str, Vector]:
        """Per-buffer views (no copy), in spec order: float32 and int64 arrays by kind."""
        floats = _views(self.floats, [e for e in spec if not e.integer])
        integers = _views(self.integers, [e for e in spec if e.integer])
        found = {**dict(floats), **dict(integers)}
        return {entry.name: found[entry.name] for entry in spec}


def buffer_counts(spec: Sequence[ParameterSpec]) -> tuple[int, int]:
    """(float32 values, int64 values) a buffer spec describes."""
    integers = sum(entry.size for entry in spec if entry.integer)
    return sum(entry.size for entry in spec) - integers, integers


def flatten(parameters: Mapping[str, Vector]) -> Vector:
    """Concatenate named arrays, in mapping order, into one float32 vector (the wire's layout)."""
    return vectors.concatenate([vectors.as_float32(v) for v in parameters.values()])


def unflatten(flat: Vector, spec: Sequence[ParameterSpec]) -> dict[str, Vector]:
    """Per-parameter views (no copy) of a flat vector laid out in spec order."""
    return dict(_views(flat, spec))


def _views(flat: Vector, spec: Sequence[ParameterSpec]) -> Iterator[tuple[str, Vector]]:
    offset = 0
    for entry in spec:
        yield entry.name, vectors.shaped(flat[offset : offset + entry.size], entry.shape)
        offset += entry.size


@dataclass(frozen=True)
class Shard:
    """The slice of the training data a worker should use (gemps.v1.Shard)."""

    index: int  # the worker's slot (distinct among active workers) modulo `count`; the slot when count is 0
    count: int  # disjoint shards; 0: the whole training set, in an order seeded by `index`
    shared_with: int = 0  # other active workers holding `index` at registration: they read the same batches

    def __iter__(self) -> Iterator[int]:
        """`index, count = shard`, the shape the SDK guide gives it."""
        return iter((self.index, self.count))

    def describe(self) -> str:
        """For a worker's log: "shard 1 of 4", "all data (no sharding), order 3", and when the
        shard is shared, with how many others and what that means."""
        if self.count == 0:
            return f"all data (no sharding), in an order seeded by {self.index}"
        line = f"shard {self.index} of {self.count}"
        if self.shared_with:
            others = f"{self.shared_with} other worker{'s' if self.shared_with > 1 else ''}"
            line += f", shared with {others}: more workers than shards read the same batches"
        return line


@dataclass(frozen=True)
class Partition:
    """One server process's share of θ (gemps.v1.Partition): elements [start, stop)."""

    address: str  # "": the address the reply came from; ":PORT": that host, this port; else a target
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Layout:
    """How θ is split across server processes (gemps.v1.Layout), as one of them announces it."""

    index: int  # the partition that announced it
    partitions: tuple[Partition, ...]
    num_parameters: int  # P, the whole central variable


def partition_bounds(num_parameters: int, count: int) -> list[tuple[int, int]]:
    """[start, stop) of each of `count` contiguous partitions of P elements, balanced by element
    count: the first P mod count partitions hold one element more."""
    if count < 1:
        raise ValueError(f"partition count must be >= 1, not {count}")
    base, extra = divmod(num_parameters, count)
    bounds, start = [], 0
    for index in range(count):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


# A partitioned server's checkpoint directory D holds partition i's in D/partition-i (the local
# supervisor and the Ray job write them there; `gemps export D` finds them by this pattern).
PARTITION_FOLDER = re.compile(r"partition-(\d+)")


def partition_folder(index: int) -> str:
    return f"partition-{index}"


@dataclass(frozen=True)
class DataPlane:
    """Where a server's data plane listens, and one registration's ticket to it (gemps.v1.DataPlane)."""

    port: int  # on the host the client reached the server at
    ticket: bytes = field(repr=False)  # a secret: kept out of logs and reprs
    local_socket: str = ""  # the abstract Unix socket for a client on the server's host ("": none)


@dataclass(frozen=True)
class Registration:
    """What the server tells a worker that registered (gemps.v1.RegisterResponse, θ aside)."""

    worker_id: str
    lease_ttl_seconds: float  # commit or pull at least this often, or be evicted
    config: TrainingConfig
    shard: Shard
    version: int  # of the central variable when the worker registered
    initialized_central: bool = False  # this worker's initial values became the central variable
    layout: Layout | None = None  # set when θ is partitioned (version is then this partition's)
    data_plane: DataPlane | None = None  # set when the server offers its data plane
    versions: Versions | None = None  # the server's (gemps_proto.versions); None: not said
    job: str = ""  # the job whose θ the server holds: sent in every later registration ("": not said)


@dataclass(frozen=True)
class Evaluation:
    """An evaluator's held-out figures of the central variable at one version (gemps.v1.EvaluationReport)."""

    version: int
    loss: float
    accuracy: float  # in [0, 1]
    num_samples: int
    dataset: str = ""
