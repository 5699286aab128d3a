"""What a gemps job on a Ray cluster is made of: one frozen dataclass, flags and GEMPS_* variables
by gemps.options' naming (`gemps ray --help` lists them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gemps_proto.codec import WIRE_DTYPE_NAMES
from gemps_proto.schema import TrainingConfig
from gemps_worker.datasets import DATASETS
from gemps_worker.models import MODELS


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
        metadata={"help": "server processes holding one range of θ each, one Ray actor each, spread over nodes"},
    )
    workers: int = field(default=4, metadata={"help": "worker actors"})
    epochs: int = field(default=10, metadata={"help": "reference worker: epochs per worker over the training set"})
    model: str = field(default="digits-cnn", metadata={"help": "model", "choices": tuple(MODELS)})
    dataset: str = field(default="digits", metadata={"help": "dataset", "choices": DATASETS})
    data_dir: str = field(default="data", metadata={"help": "folder of IDX files for mnist / fashion-mnist, per node"})
    wire_dtype: str = field(
        default="float32", metadata={"help": "wire format of commits and replies", "choices": tuple(WIRE_DTYPE_NAMES)}
    )
    partition_cpus: float = field(default=1.0, metadata={"help": "CPUs Ray reserves for each partition (> 0)"})
    worker_cpus: float = field(default=1.0, metadata={"help": "CPUs Ray reserves for each worker"})
    worker_gpus: float = field(default=0.0, metadata={"help": "GPUs Ray reserves for each worker (it trains on CUDA)"})
    evaluator_cpus: float = field(default=1.0, metadata={"help": "CPUs Ray reserves for the evaluator"})
    evaluate: bool = field(default=True, metadata={"help": "run the held-out evaluator (reference models only)"})
    interval: float = field(default=2.0, metadata={"help": "seconds between progress lines and evaluations"})
    worker_restarts: int = field(
        default=3, metadata={"help": "times Ray restarts a worker actor that died (it registers again)"}
    )
    partition_restarts: int = field(
        default=3, metadata={"help": "times Ray restarts a partition actor that died (from its checkpoints)"}
    )
    checkpoint_every: int = field(
        default=100,
        metadata={"help": "partitions checkpoint after this many commits: what a restarted partition can lose"},
    )
    work_dir: str = field(
        default="",
        metadata={
            "help": "folder on each node for the partitions' checkpoints and logs (partition-<i>/; shared storage "
            "lets a partition move to another node); empty: gemps-ray/<job> in the node's temporary folder"
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
        default=120.0, metadata={"help": "seconds for the placement group and each partition to come up"}
    )

    def problems(self) -> list[str]:
        found = []
        if self.partitions < 1 or self.workers < 1 or self.epochs < 1:
            found.append("partitions, workers and epochs must be at least 1")
        if not self.partition_cpus > 0:
            found.append("partition_cpus must be > 0 (a placement group bundle cannot be empty)")
        if self.worker_cpus < 0 or self.worker_gpus < 0 or self.evaluator_cpus < 0:
            found.append("worker_cpus, worker_gpus and evaluator_cpus must be >= 0")
        if self.worker_restarts < 0 or self.partition_restarts < 0:
            found.append("worker_restarts and partition_restarts must be >= 0")
        if self.checkpoint_every < 1:
            found.append("checkpoint_every must be >= 1 (restarts resume from checkpoints)")
        if not self.interval > 0 or not self.startup_timeout > 0:
            found.append("interval and startup_timeout must be > 0")
        return found
