"""What a gemps job on a Ray cluster is made of: one frozen dataclass, flags and GEMPS_* variables
by gemps.options' naming (`gemps ray --help` lists them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gemps_proto.ranges import INT32_MAX, INT64_MAX, RANGE, Range, out_of_range
from gemps_proto.schema import TrainingConfig
from gemps_proto.tensor_codec import WIRE_DTYPE_NAMES
from gemps_worker.datasets import DATASETS
from gemps_worker.models import MODELS

COUNT = Range(1, INT32_MAX)  # partitions, workers, epochs
NON_NEGATIVE = Range(0, INT32_MAX)  # CPUs or GPUs Ray reserves (0: none), restarts
POSITIVE = Range(0, INT32_MAX, low_open=True)  # CPUs of a partition: a bundle cannot be empty
SECONDS = Range(0, INT32_MAX, low_open=True, unit="s")


@dataclass(frozen=True)
class RayJobOptions:
    training: TrainingConfig = field(default_factory=TrainingConfig)
    address: str = field(
        default="auto",
        metadata={
            "help": "Ray cluster to join: auto (RAY_ADDRESS, else the one `ray start` runs on this machine), "
            "HOST:PORT of its head, or ray://HOST:10001 (Ray Client)"
        },
    )
    partitions: int = field(
        default=1,
        metadata={
            "help": "server processes holding one range of θ each, one Ray actor each, spread over nodes",
            RANGE: COUNT,
        },
    )
    replicas: int = field(
        default=1,
        metadata={
            "help": "replicas of each partition (DESIGN §3d): a primary and R-1 backups, each a server process in "
            "an actor of its own on a distinct node (a placement group per partition, STRICT_SPREAD); a lost "
            "node's replica restarts elsewhere and rejoins as a backup while the survivor serves",
            RANGE: Range(1, 9),
        },
    )
    pack_replicas: bool = field(
        default=False,
        metadata={
            "help": "with fewer nodes than --replicas: run a partition's replicas on the nodes there are (SPREAD, "
            "with a warning; they then outlive a process's death, not a node's) instead of refusing to start"
        },
    )
    etcd: str = field(
        default="",
        metadata={
            "help": "etcd endpoints deciding each replicated partition's primary (http://HOST:2379, comma-separated); "
            "empty with --replicas > 1: a private etcd on the driver's machine, on its address as Ray knows it "
            "(or --host), which every node must reach"
        },
    )
    workers: int = field(default=4, metadata={"help": "worker actors", RANGE: COUNT})
    epochs: int = field(
        default=10, metadata={"help": "reference worker: epochs per worker over the training set", RANGE: COUNT}
    )
    model: str = field(default="digits-cnn", metadata={"help": "model", "choices": tuple(MODELS)})
    dataset: str = field(default="digits", metadata={"help": "dataset", "choices": DATASETS})
    data_dir: str = field(default="data", metadata={"help": "folder of IDX files for mnist / fashion-mnist, per node"})
    wire_dtype: str = field(
        default="float32", metadata={"help": "wire format of commits and replies", "choices": tuple(WIRE_DTYPE_NAMES)}
    )
    partition_cpus: float = field(
        default=1.0,
        metadata={"help": "CPUs Ray reserves for each partition (a bundle cannot be empty)", RANGE: POSITIVE},
    )
    worker_cpus: float = field(default=1.0, metadata={"help": "CPUs Ray reserves for each worker", RANGE: NON_NEGATIVE})
    worker_gpus: float = field(
        default=0.0, metadata={"help": "GPUs Ray reserves for each worker (it trains on CUDA)", RANGE: NON_NEGATIVE}
    )
    evaluator_cpus: float = field(
        default=1.0, metadata={"help": "CPUs Ray reserves for the evaluator", RANGE: NON_NEGATIVE}
    )
    evaluate: bool = field(default=True, metadata={"help": "run the held-out evaluator (reference models only)"})
    interval: float = field(
        default=2.0,
        metadata={
            "help": "seconds between status samples and evaluations (progress lines: every 5 s at most)",
            RANGE: SECONDS,
        },
    )
    worker_restarts: int = field(
        default=3,
        metadata={
            "help": "times Ray restarts a worker actor, or the evaluator, that died or lost its node (on a "
            "surviving node; a worker registers again and trains its budget again); then the job fails",
            RANGE: NON_NEGATIVE,
        },
    )
    partition_restarts: int = field(
        default=3,
        metadata={
            "help": "times Ray restarts a partition actor that died or lost its node (from its checkpoints; on "
            "another node with --work-dir on storage every node sees); then the job fails",
            RANGE: NON_NEGATIVE,
        },
    )
    checkpoint_every: int = field(
        default=100,
        metadata={
            "help": "partitions checkpoint after this many commits: what a restarted partition can lose",
            RANGE: Range(1, INT64_MAX),
        },
    )
    work_dir: str = field(
        default="",
        metadata={
            "help": "folder on each node for the partitions' checkpoints and logs (partition-<i>/; storage every "
            "node sees lets a partition move to another node when its node is lost); empty: gemps-ray/<job> in "
            "the node's temporary folder"
        },
    )
    host: str = field(
        default="", metadata={"help": "address partitions listen on; empty: their node's IP address as Ray knows it"}
    )
    out: str = field(
        default="runs/ray",
        metadata={"help": "folder on the driver: model.safetensors, summary.json, prometheus-targets.json"},
    )
    startup_timeout: float = field(
        default=120.0,
        metadata={"help": "seconds for the placement group and each partition to come up", RANGE: SECONDS},
    )

    def problems(self) -> list[str]:
        return out_of_range(self)
