"""The gemps protocol: what the server and every client agree on, and nothing else.

Each module has one job, its docstring's first line (listed in docs/ARCHITECTURE.md):

- `v1/`: parameter_server.proto and the code generated from it (proto/generate.py; do not edit).
- `schema`: the shared messages' typed Python face (TrainingConfig, ParameterSpec, Layout, ...).
- `status`: Status's records on those types (ServerStatus, its workers, noise, replication).
- `rule_options`: a commit rule's own options (RuleOption) and the catalog of the rules known here.
- `schema_proto`: their paired to_proto / from_proto functions.
- `tensor_codec`: numpy arrays <-> a tensor's raw bytes (float32, bfloat16, int64).
- `protobuf_wire`: protobuf's wire format by hand, where copying θ matters.
- `grpc_framing`: θ inside gRPC's messages and streams, framed by hand.
- `data_plane_frames`, `data_plane_events`, `data_plane_protocol`: the data plane's frames, its
  events, and its protocol without I/O (both ends' state machines).
- `reasons`: why a request is refused (the `gemps-reason` trailing metadata).
- `ranges`, `schedules`: each option's range; the learning-rate schedules.
- `versions`: this build's software and protocol versions, and the compatibility rule.
"""
