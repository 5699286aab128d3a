from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT8_BLOCK: _ClassVar[DType]
    DTYPE_INT4_BLOCK: _ClassVar[DType]
    DTYPE_TOPK_BLOCK: _ClassVar[DType]

class PayloadKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAYLOAD_KIND_UNSPECIFIED: _ClassVar[PayloadKind]
    PAYLOAD_KIND_GRADIENT: _ClassVar[PayloadKind]
    PAYLOAD_KIND_UPDATE: _ClassVar[PayloadKind]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
DTYPE_INT64: DType
DTYPE_INT8_BLOCK: DType
DTYPE_INT4_BLOCK: DType
DTYPE_TOPK_BLOCK: DType
PAYLOAD_KIND_UNSPECIFIED: PayloadKind
PAYLOAD_KIND_GRADIENT: PayloadKind
PAYLOAD_KIND_UPDATE: PayloadKind

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ParameterSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class TrainingConfig(_message.Message):
    __slots__ = ("rule", "learning_rate", "rule_options", "batch_size", "lr_schedule", "lr_warmup_commits", "lr_step_size", "lr_gamma", "lr_total_commits", "lr_min", "momentum", "kappa", "pi_max", "worker_mode")
    class RuleOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RULE_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    RULE_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    LR_WARMUP_COMMITS_FIELD_NUMBER: _ClassVar[int]
    LR_STEP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LR_GAMMA_FIELD_NUMBER: _ClassVar[int]
    LR_TOTAL_COMMITS_FIELD_NUMBER: _ClassVar[int]
    LR_MIN_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    KAPPA_FIELD_NUMBER: _ClassVar[int]
    PI_MAX_FIELD_NUMBER: _ClassVar[int]
    WORKER_MODE_FIELD_NUMBER: _ClassVar[int]
    rule: str
    learning_rate: float
    rule_options: _containers.ScalarMap[str, float]
    batch_size: int
    lr_schedule: str
    lr_warmup_commits: int
    lr_step_size: int
    lr_gamma: float
    lr_total_commits: int
    lr_min: float
    momentum: float
    kappa: float
    pi_max: float
    worker_mode: str
    def __init__(self, rule: _Optional[str] = ..., learning_rate: _Optional[float] = ..., rule_options: _Optional[_Mapping[str, float]] = ..., batch_size: _Optional[int] = ..., lr_schedule: _Optional[str] = ..., lr_warmup_commits: _Optional[int] = ..., lr_step_size: _Optional[int] = ..., lr_gamma: _Optional[float] = ..., lr_total_commits: _Optional[int] = ..., lr_min: _Optional[float] = ..., momentum: _Optional[float] = ..., kappa: _Optional[float] = ..., pi_max: _Optional[float] = ..., worker_mode: _Optional[str] = ...) -> None: ...

class Shard(_message.Message):
    __slots__ = ("index", "count", "shared_with")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SHARED_WITH_FIELD_NUMBER: _ClassVar[int]
    index: int
    count: int
    shared_with: int
    def __init__(self, index: _Optional[int] = ..., count: _Optional[int] = ..., shared_with: _Optional[int] = ...) -> None: ...

class Partition(_message.Message):
    __slots__ = ("address", "start", "stop")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    address: str
    start: int
    stop: int
    def __init__(self, address: _Optional[str] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("index", "partitions", "num_parameters")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    index: int
    partitions: _containers.RepeatedCompositeFieldContainer[Partition]
    num_parameters: int
    def __init__(self, index: _Optional[int] = ..., partitions: _Optional[_Iterable[_Union[Partition, _Mapping]]] = ..., num_parameters: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("spec", "initial_parameters", "worker_name", "omit_parameters", "buffer_spec", "initial_buffers", "client_id", "initial_integer_buffers", "job", "versions")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    INITIAL_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    OMIT_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SPEC_FIELD_NUMBER: _ClassVar[int]
    INITIAL_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    INITIAL_INTEGER_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    spec: _containers.RepeatedCompositeFieldContainer[ParameterSpec]
    initial_parameters: Tensor
    worker_name: str
    omit_parameters: bool
    buffer_spec: _containers.RepeatedCompositeFieldContainer[ParameterSpec]
    initial_buffers: Tensor
    client_id: str
    initial_integer_buffers: Tensor
    job: str
    versions: Versions
    def __init__(self, spec: _Optional[_Iterable[_Union[ParameterSpec, _Mapping]]] = ..., initial_parameters: _Optional[_Union[Tensor, _Mapping]] = ..., worker_name: _Optional[str] = ..., omit_parameters: _Optional[bool] = ..., buffer_spec: _Optional[_Iterable[_Union[ParameterSpec, _Mapping]]] = ..., initial_buffers: _Optional[_Union[Tensor, _Mapping]] = ..., client_id: _Optional[str] = ..., initial_integer_buffers: _Optional[_Union[Tensor, _Mapping]] = ..., job: _Optional[str] = ..., versions: _Optional[_Union[Versions, _Mapping]] = ...) -> None: ...

class RegisterChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: RegisterRequest
    data: bytes
    def __init__(self, header: _Optional[_Union[RegisterRequest, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("worker_id", "lease_ttl_seconds", "config", "shard", "version", "parameters", "initialized_central", "buffers", "history", "integer_buffers", "job", "layout", "data_plane", "versions")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_CENTRAL_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    INTEGER_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_ttl_seconds: float
    config: TrainingConfig
    shard: Shard
    version: int
    parameters: Tensor
    initialized_central: bool
    buffers: Tensor
    history: str
    integer_buffers: Tensor
    job: str
    layout: Layout
    data_plane: DataPlane
    versions: Versions
    def __init__(self, worker_id: _Optional[str] = ..., lease_ttl_seconds: _Optional[float] = ..., config: _Optional[_Union[TrainingConfig, _Mapping]] = ..., shard: _Optional[_Union[Shard, _Mapping]] = ..., version: _Optional[int] = ..., parameters: _Optional[_Union[Tensor, _Mapping]] = ..., initialized_central: _Optional[bool] = ..., buffers: _Optional[_Union[Tensor, _Mapping]] = ..., history: _Optional[str] = ..., integer_buffers: _Optional[_Union[Tensor, _Mapping]] = ..., job: _Optional[str] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., data_plane: _Optional[_Union[DataPlane, _Mapping]] = ..., versions: _Optional[_Union[Versions, _Mapping]] = ...) -> None: ...

class Versions(_message.Message):
    __slots__ = ("software", "protocol", "oldest_protocol")
    SOFTWARE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    OLDEST_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    software: str
    protocol: int
    oldest_protocol: int
    def __init__(self, software: _Optional[str] = ..., protocol: _Optional[int] = ..., oldest_protocol: _Optional[int] = ...) -> None: ...

class DataPlane(_message.Message):
    __slots__ = ("port", "ticket", "local_socket")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    port: int
    ticket: bytes
    local_socket: str
    def __init__(self, port: _Optional[int] = ..., ticket: _Optional[bytes] = ..., local_socket: _Optional[str] = ...) -> None: ...

class DataPlaneChallenge(_message.Message):
    __slots__ = ("worker_id", "nonce")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    nonce: bytes
    def __init__(self, worker_id: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class DataPlaneAnswer(_message.Message):
    __slots__ = ("nonce", "proof")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    proof: bytes
    def __init__(self, nonce: _Optional[bytes] = ..., proof: _Optional[bytes] = ...) -> None: ...

class DataPlaneHello(_message.Message):
    __slots__ = ("worker_id", "proof")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    proof: bytes
    def __init__(self, worker_id: _Optional[str] = ..., proof: _Optional[bytes] = ...) -> None: ...

class DataPlaneAttach(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...

class DataPlaneError(_message.Message):
    __slots__ = ("code", "message", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reason: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker_id", "known_version", "reply_dtype", "known_history", "wait_seconds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KNOWN_HISTORY_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    known_version: int
    reply_dtype: DType
    known_history: str
    wait_seconds: float
    def __init__(self, worker_id: _Optional[str] = ..., known_version: _Optional[int] = ..., reply_dtype: _Optional[_Union[DType, str]] = ..., known_history: _Optional[str] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("version", "parameters", "unchanged", "buffers", "history", "integer_buffers", "round_takes_next")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    INTEGER_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    ROUND_TAKES_NEXT_FIELD_NUMBER: _ClassVar[int]
    version: int
    parameters: Tensor
    unchanged: bool
    buffers: Tensor
    history: str
    integer_buffers: Tensor
    round_takes_next: bool
    def __init__(self, version: _Optional[int] = ..., parameters: _Optional[_Union[Tensor, _Mapping]] = ..., unchanged: _Optional[bool] = ..., buffers: _Optional[_Union[Tensor, _Mapping]] = ..., history: _Optional[str] = ..., integer_buffers: _Optional[_Union[Tensor, _Mapping]] = ..., round_takes_next: _Optional[bool] = ...) -> None: ...

class PullResponseChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PullResponse
    data: bytes
    def __init__(self, header: _Optional[_Union[PullResponse, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("worker_id", "base_version", "kind", "payload", "loss", "num_samples", "request_id", "reply_dtype", "buffer_delta", "integer_buffer_delta", "sequence", "held_copy", "known_history", "gradient_sums")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REPLY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BUFFER_DELTA_FIELD_NUMBER: _ClassVar[int]
    INTEGER_BUFFER_DELTA_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    HELD_COPY_FIELD_NUMBER: _ClassVar[int]
    KNOWN_HISTORY_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_SUMS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    base_version: int
    kind: PayloadKind
    payload: Tensor
    loss: float
    num_samples: int
    request_id: str
    reply_dtype: DType
    buffer_delta: Tensor
    integer_buffer_delta: Tensor
    sequence: int
    held_copy: int
    known_history: str
    gradient_sums: GradientSums
    def __init__(self, worker_id: _Optional[str] = ..., base_version: _Optional[int] = ..., kind: _Optional[_Union[PayloadKind, str]] = ..., payload: _Optional[_Union[Tensor, _Mapping]] = ..., loss: _Optional[float] = ..., num_samples: _Optional[int] = ..., request_id: _Optional[str] = ..., reply_dtype: _Optional[_Union[DType, str]] = ..., buffer_delta: _Optional[_Union[Tensor, _Mapping]] = ..., integer_buffer_delta: _Optional[_Union[Tensor, _Mapping]] = ..., sequence: _Optional[int] = ..., held_copy: _Optional[int] = ..., known_history: _Optional[str] = ..., gradient_sums: _Optional[_Union[GradientSums, _Mapping]] = ...) -> None: ...

class GradientSums(_message.Message):
    __slots__ = ("square_sum", "difference_square", "steps", "differences", "samples")
    SQUARE_SUM_FIELD_NUMBER: _ClassVar[int]
    DIFFERENCE_SQUARE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DIFFERENCES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    square_sum: float
    difference_square: float
    steps: int
    differences: int
    samples: int
    def __init__(self, square_sum: _Optional[float] = ..., difference_square: _Optional[float] = ..., steps: _Optional[int] = ..., differences: _Optional[int] = ..., samples: _Optional[int] = ...) -> None: ...

class CommitChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: CommitRequest
    data: bytes
    def __init__(self, header: _Optional[_Union[CommitRequest, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class CommitResponseChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: CommitResponse
    data: bytes
    def __init__(self, header: _Optional[_Union[CommitResponse, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("version", "parameters", "staleness", "scaling_mean", "scaling_median", "scaling_at_zero", "scaling_at_max", "buffers", "integer_buffers", "epoch", "copy", "difference_of", "round_pending", "unchanged")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    SCALING_MEAN_FIELD_NUMBER: _ClassVar[int]
    SCALING_MEDIAN_FIELD_NUMBER: _ClassVar[int]
    SCALING_AT_ZERO_FIELD_NUMBER: _ClassVar[int]
    SCALING_AT_MAX_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    INTEGER_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    DIFFERENCE_OF_FIELD_NUMBER: _ClassVar[int]
    ROUND_PENDING_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    version: int
    parameters: Tensor
    staleness: int
    scaling_mean: float
    scaling_median: float
    scaling_at_zero: float
    scaling_at_max: float
    buffers: Tensor
    integer_buffers: Tensor
    epoch: int
    copy: int
    difference_of: int
    round_pending: int
    unchanged: bool
    def __init__(self, version: _Optional[int] = ..., parameters: _Optional[_Union[Tensor, _Mapping]] = ..., staleness: _Optional[int] = ..., scaling_mean: _Optional[float] = ..., scaling_median: _Optional[float] = ..., scaling_at_zero: _Optional[float] = ..., scaling_at_max: _Optional[float] = ..., buffers: _Optional[_Union[Tensor, _Mapping]] = ..., integer_buffers: _Optional[_Union[Tensor, _Mapping]] = ..., epoch: _Optional[int] = ..., copy: _Optional[int] = ..., difference_of: _Optional[int] = ..., round_pending: _Optional[int] = ..., unchanged: _Optional[bool] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EvaluationReport(_message.Message):
    __slots__ = ("version", "loss", "accuracy", "num_samples", "dataset")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    version: int
    loss: float
    accuracy: float
    num_samples: int
    dataset: str
    def __init__(self, version: _Optional[int] = ..., loss: _Optional[float] = ..., accuracy: _Optional[float] = ..., num_samples: _Optional[int] = ..., dataset: _Optional[str] = ...) -> None: ...

class ReportEvaluationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("name", "shard", "commits", "seconds_since_seen", "seconds_since_commit", "recent")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_SEEN_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_COMMIT_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    shard: int
    commits: int
    seconds_since_seen: float
    seconds_since_commit: float
    recent: RecentCommits
    def __init__(self, name: _Optional[str] = ..., shard: _Optional[int] = ..., commits: _Optional[int] = ..., seconds_since_seen: _Optional[float] = ..., seconds_since_commit: _Optional[float] = ..., recent: _Optional[_Union[RecentCommits, _Mapping]] = ...) -> None: ...

class RecentCommits(_message.Message):
    __slots__ = ("seconds", "commits", "samples", "loss_commits", "loss", "staleness", "scaling_mean", "scaling_at_zero", "scaling_at_max")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_COMMITS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    SCALING_MEAN_FIELD_NUMBER: _ClassVar[int]
    SCALING_AT_ZERO_FIELD_NUMBER: _ClassVar[int]
    SCALING_AT_MAX_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    commits: int
    samples: int
    loss_commits: int
    loss: float
    staleness: float
    scaling_mean: float
    scaling_at_zero: float
    scaling_at_max: float
    def __init__(self, seconds: _Optional[float] = ..., commits: _Optional[int] = ..., samples: _Optional[int] = ..., loss_commits: _Optional[int] = ..., loss: _Optional[float] = ..., staleness: _Optional[float] = ..., scaling_mean: _Optional[float] = ..., scaling_at_zero: _Optional[float] = ..., scaling_at_max: _Optional[float] = ...) -> None: ...

class GradientNoise(_message.Message):
    __slots__ = ("gradient_square", "noise_trace", "batch_size", "windows", "window", "batch_size_assumed")
    GRADIENT_SQUARE_FIELD_NUMBER: _ClassVar[int]
    NOISE_TRACE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_ASSUMED_FIELD_NUMBER: _ClassVar[int]
    gradient_square: float
    noise_trace: float
    batch_size: float
    windows: int
    window: int
    batch_size_assumed: bool
    def __init__(self, gradient_square: _Optional[float] = ..., noise_trace: _Optional[float] = ..., batch_size: _Optional[float] = ..., windows: _Optional[int] = ..., window: _Optional[int] = ..., batch_size_assumed: _Optional[bool] = ...) -> None: ...

class BackupLag(_message.Message):
    __slots__ = ("name", "in_sync", "lag_commits", "lag_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IN_SYNC_FIELD_NUMBER: _ClassVar[int]
    LAG_COMMITS_FIELD_NUMBER: _ClassVar[int]
    LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    in_sync: bool
    lag_commits: int
    lag_seconds: float
    def __init__(self, name: _Optional[str] = ..., in_sync: _Optional[bool] = ..., lag_commits: _Optional[int] = ..., lag_seconds: _Optional[float] = ...) -> None: ...

class ReplicationStatus(_message.Message):
    __slots__ = ("name", "role", "epoch", "replicas", "primary", "backups", "forwarded", "applied", "failovers", "unavailable")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    BACKUPS_FIELD_NUMBER: _ClassVar[int]
    FORWARDED_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    epoch: int
    replicas: int
    primary: str
    backups: _containers.RepeatedCompositeFieldContainer[BackupLag]
    forwarded: int
    applied: int
    failovers: int
    unavailable: str
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., epoch: _Optional[int] = ..., replicas: _Optional[int] = ..., primary: _Optional[str] = ..., backups: _Optional[_Iterable[_Union[BackupLag, _Mapping]]] = ..., forwarded: _Optional[int] = ..., applied: _Optional[int] = ..., failovers: _Optional[int] = ..., unavailable: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("initialized", "version", "active_workers", "num_parameters", "config", "commits_applied", "commits_rejected", "spec", "uptime_seconds", "last_evaluation", "learning_rate", "buffer_spec", "workers", "lease_ttl_seconds", "gradient_noise", "replication", "data_plane", "layout", "versions", "memory_budget_bytes", "rule_state_bytes", "recent", "gem_state", "worker_state_bytes", "shared_rule_state_bytes", "restored", "job", "rounds")
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    COMMITS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    COMMITS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_EVALUATION_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SPEC_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_NOISE_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RULE_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    GEM_STATE_FIELD_NUMBER: _ClassVar[int]
    WORKER_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_RULE_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    initialized: bool
    version: int
    active_workers: int
    num_parameters: int
    config: TrainingConfig
    commits_applied: int
    commits_rejected: int
    spec: _containers.RepeatedCompositeFieldContainer[ParameterSpec]
    uptime_seconds: float
    last_evaluation: EvaluationReport
    learning_rate: float
    buffer_spec: _containers.RepeatedCompositeFieldContainer[ParameterSpec]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    lease_ttl_seconds: float
    gradient_noise: GradientNoise
    replication: ReplicationStatus
    data_plane: DataPlane
    layout: Layout
    versions: Versions
    memory_budget_bytes: int
    rule_state_bytes: int
    recent: RecentCommits
    gem_state: str
    worker_state_bytes: int
    shared_rule_state_bytes: int
    restored: RestoredCheckpoint
    job: str
    rounds: Rounds
    def __init__(self, initialized: _Optional[bool] = ..., version: _Optional[int] = ..., active_workers: _Optional[int] = ..., num_parameters: _Optional[int] = ..., config: _Optional[_Union[TrainingConfig, _Mapping]] = ..., commits_applied: _Optional[int] = ..., commits_rejected: _Optional[int] = ..., spec: _Optional[_Iterable[_Union[ParameterSpec, _Mapping]]] = ..., uptime_seconds: _Optional[float] = ..., last_evaluation: _Optional[_Union[EvaluationReport, _Mapping]] = ..., learning_rate: _Optional[float] = ..., buffer_spec: _Optional[_Iterable[_Union[ParameterSpec, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., lease_ttl_seconds: _Optional[float] = ..., gradient_noise: _Optional[_Union[GradientNoise, _Mapping]] = ..., replication: _Optional[_Union[ReplicationStatus, _Mapping]] = ..., data_plane: _Optional[_Union[DataPlane, _Mapping]] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., versions: _Optional[_Union[Versions, _Mapping]] = ..., memory_budget_bytes: _Optional[int] = ..., rule_state_bytes: _Optional[int] = ..., recent: _Optional[_Union[RecentCommits, _Mapping]] = ..., gem_state: _Optional[str] = ..., worker_state_bytes: _Optional[int] = ..., shared_rule_state_bytes: _Optional[int] = ..., restored: _Optional[_Union[RestoredCheckpoint, _Mapping]] = ..., job: _Optional[str] = ..., rounds: _Optional[_Union[Rounds, _Mapping]] = ...) -> None: ...

class Rounds(_message.Message):
    __slots__ = ("closed", "size", "held")
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    closed: int
    size: int
    held: int
    def __init__(self, closed: _Optional[int] = ..., size: _Optional[int] = ..., held: _Optional[int] = ...) -> None: ...

class RestoredCheckpoint(_message.Message):
    __slots__ = ("version", "path")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    version: int
    path: str
    def __init__(self, version: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...
