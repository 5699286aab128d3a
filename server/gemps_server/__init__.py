"""gemps parameter server: GEM and other asynchronous commit rules behind a gRPC service.

Layout: `wire/` holds everything gRPC (the servicer, client-stream assembly, the reply budget,
the stream buffer pool, the protobuf messages); `service` is the one door to the domain;
`domain/` holds the central variable and what moves it (state, records, validation, rules,
applier, ledger, workers, errors) and knows no protobuf. Around them: `app` wires the process
together, with `config`, `metrics`, `logs`, `security`, `token_bucket` (every rate limit's),
`snapshot_codec` and `snapshot_sections` (a state's bytes, for checkpoints and replicas' seeds),
`checkpoint_files` (the on-disk format) and `checkpoint_writer` (when, and on which thread, to
write one).

Public API, for the command line and tools: `config` (ServerConfig), `app` (ParameterServer,
serve), `domain.rules` (the commit rules: strategies by name), `checkpoint_files` (the checkpoint
file format: load, export), `allocator` (process memory tuning), `directory_lock`,
`process_title` and the `replication` package's own names (a local etcd, a supervisor's secret,
the replication metrics). Every other module is internal to the server, a new one included; the
import contracts in pyproject.toml enforce it (docs/ARCHITECTURE.md).
"""

import importlib.metadata

__version__ = importlib.metadata.version("gemps")  # pyproject.toml's, the one definition
