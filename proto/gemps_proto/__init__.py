"""The gemps protocol: what the server and every client agree on, and nothing else.

- `v1/`: parameter_server.proto and the code generated from it (proto/generate.py; do not edit).
- `schema`: the shared messages' typed Python face (TrainingConfig, ParameterSpec, status, ...).
- `serde`: their paired to_proto / from_proto functions.
- `codec`: numpy arrays <-> Tensor bytes (float32, bfloat16 as a wire format).
- `chunks`: CommitStream's data pieces, framed in protobuf's wire format by hand.
- `reasons`: why a request is refused (the `gemps-reason` trailing metadata).
"""
