"""gemps parameter server: GEM and other asynchronous commit rules behind a gRPC service.

Public API, for the command line and tools: `config` (ServerConfig), `app` (ParameterServer,
serve), `rules` (the commit rules: strategies by name), `checkpoints` (the checkpoint file
format: load, export) and `allocator` (process memory tuning). Every other module is internal
to the server; the import contracts in pyproject.toml enforce it (docs/ARCHITECTURE.md).
"""

import importlib.metadata

__version__ = importlib.metadata.version("gemps")  # pyproject.toml's, the one definition
