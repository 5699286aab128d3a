"""What the server trains with: the training configuration it announces, and how it takes workers
and applies their commits."""

from __future__ import annotations

from dataclasses import dataclass, field

from gemps_proto.ranges import INT64_MAX, RANGE, SECONDS, UINT32_MAX, Range
from gemps_proto.schema import TrainingConfig
from gemps_server.domain.noise import NOISE_WINDOW_AUTO, NOISE_WINDOW_HELP, NOISE_WINDOWS
from gemps_server.domain.rules import GEM_STATES, training_problems
from gemps_server.domain.rules.gem_base import GEM_KERNELS, GEM_OWN_STEP
from gemps_server.memory_budget import MIB
from gemps_server.memory_claims import AUTO, OFF, option_problems
from gemps_server.native import compiled

#: --commit-core: compiled (csrc/core.c where it applies), python (domain/core.py alone), auto (compiled if built)
COMMIT_CORES = ("auto", "compiled", "python")


@dataclass(frozen=True)
class TrainingOptions:
    """The training configuration (gemps_proto.schema.TrainingConfig) the server announces at Register:
    its fields are flags of their own (`--learning-rate`, `GEMPS_LEARNING_RATE`), and so is each
    option a registered rule declares (`--momentum`); one given for a rule that does not take it
    is refused (the rule registry's training_problems)."""

    training: TrainingConfig = field(default_factory=TrainingConfig)

    def problems(self) -> list[str]:
        """An unknown rule, then the training config's own problems, then its rule's options'."""
        return training_problems(self.training)


@dataclass(frozen=True)
class WorkerOptions:
    """The workers the server takes (how many, how long a silent one keeps its place, their data
    shards, the memory their rule state may take) and how their commits are applied (GEM's
    kernel and state, the noise estimate's window)."""

    commit_core: str = field(
        default="auto",
        metadata={
            "help": "how a commit runs: compiled (csrc/core.c: the common case, GEM's exact state on the compiled "
            "kernel, in C; everything else in Python), python (domain/core.py alone: the reference the compiled "
            "core is tested against); auto: compiled if built",
            "choices": COMMIT_CORES,
        },
    )
    gem_kernel: str = field(
        default="auto",
        metadata={
            "help": "GEM's update: compiled (one C pass, exact statistics), numpy (blocked); auto: compiled if built",
            "choices": GEM_KERNELS,
        },
    )
    gem_own_step: str = field(
        default="counted",
        metadata={
            "help": "what GEM's c = |theta - s_i| counts of a worker's own previous step: counted (the paper's "
            "reference code; with one worker GEM is then not momentum SGD), excluded (s_i taken after the step)",
            "choices": GEM_OWN_STEP,
        },
    )
    gem_state: str = field(
        default="exact",
        metadata={
            "help": "how GEM keeps each worker's m_i and s_i: exact (two float32 vectors, 8 bytes per worker per "
            "parameter) or compact (8-bit codes, about 2.25 bytes, plus two copies of theta the workers share; "
            "DESIGN §1a)",
            "choices": GEM_STATES,
        },
    )
    lease_ttl: float = field(
        default=60.0,
        metadata={
            "help": "seconds without a commit or pull before a worker is evicted; on a full server, a worker "
            "this long without a commit gives its place to a newcomer (a named worker whose restart registered "
            "under its name goes sooner, once silent for 4x its recent pace, or 1 s before its pace shows)",
            RANGE: SECONDS,
        },
    )
    max_workers: int = field(
        default=256, metadata={"help": "most workers registered at once", RANGE: Range(1, UINT32_MAX)}
    )
    memory_budget_mb: int = field(
        default=0,
        metadata={
            "help": "memory for the rule's per-worker state (GEM: 8 bytes per parameter per worker, compact about 2), "
            "MiB, and for difference replies' copies of θ (2 bytes per parameter) in what the workers' state leaves; "
            "a registration past it is refused RESOURCE_EXHAUSTED (memory_budget). 0: what the server may still "
            "use when θ is initialised (the tightest of RLIMIT_AS, its cgroup's limit and available memory), "
            "less a reserve for θ's copies",
            RANGE: Range(0, INT64_MAX // MIB, unit="MiB"),
        },
    )
    memory_share: int = field(
        default=1,
        metadata={
            "help": "with memory_budget_mb 0: this many servers share this host's memory, each admitting its share of "
            "what it may use (gemps server --partitions/--replicas sets it for the processes it starts)",
            RANGE: Range(1, UINT32_MAX),
        },
    )
    memory_claims_dir: str = field(
        default=AUTO,
        metadata={
            "help": "with memory_budget_mb 0: a folder the gemps servers of this user on this host share, where each "
            "claims the memory it could admit when θ is initialised, so that separate jobs each admit only what "
            f"the others left (an absolute path; {AUTO}: /dev/shm/gemps-memory-claims-<uid>; {OFF}: none)",
        },
    )
    noise_window: int = field(default=NOISE_WINDOW_AUTO, metadata={"help": NOISE_WINDOW_HELP, RANGE: NOISE_WINDOWS})
    num_shards: int = field(
        default=0,
        metadata={
            "help": "disjoint data shards; 0: every worker uses all data in its own order",
            RANGE: Range(0, UINT32_MAX),
        },
    )

    @property
    def compiled_core(self) -> bool:
        """Whether commits take the compiled core where it applies (--commit-core)."""
        return self.commit_core != "python" and compiled is not None

    def problems(self) -> list[str]:
        """An unknown GEM kernel or commit core, or a compiled one where it was not built (the ranges: ServerConfig)."""
        if self.commit_core not in COMMIT_CORES:
            return [f"unknown commit_core {self.commit_core!r} (choose from {', '.join(COMMIT_CORES)})"]
        if self.commit_core == "compiled" and compiled is None:
            return ["commit_core 'compiled' is not built here (no C compiler at install?): use auto or python"]
        if self.gem_kernel not in GEM_KERNELS:
            return [f"unknown gem_kernel {self.gem_kernel!r} (choose from {', '.join(GEM_KERNELS)})"]
        if self.gem_kernel == "compiled" and compiled is None:
            return ["gem_kernel 'compiled' is not built here (no C compiler at install?): use auto or numpy"]
        if self.gem_own_step not in GEM_OWN_STEP:
            return [f"unknown gem_own_step {self.gem_own_step!r} (choose from {', '.join(GEM_OWN_STEP)})"]
        if self.gem_state not in GEM_STATES:
            return [f"unknown gem_state {self.gem_state!r} (choose from {', '.join(GEM_STATES)})"]
        return option_problems(self.memory_claims_dir)
