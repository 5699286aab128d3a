"""The server's wires: everything that knows gRPC, the protobuf messages and the data plane's
frames; each calls the service (the one door to the domain).

gRPC: `grpc_server` (the door: the server's options, its bind and graceful stop), `grpc_servicer`
(the RPC methods, thin: parse, call the service, frame; the `rpc` decorator
that maps refusals to status codes), `streams` (client-stream assembly), `reply_budget` (replies
held until read), `stream_buffers` (the CommitStream and data-plane buffer pools), `messages`
(requests into domain records, outcomes into replies, and the commit reply writers) and `health`
(grpc.health.v1). `status_codes`: the refusal → status code table both wires use.

The data plane (DESIGN §3c, gemps_proto/data_plane_frames.py): `data_plane` (the listener, connection
limit, TLS, graceful stop), `data_plane_loop` (one thread serving every connection, non-blocking),
`data_plane_calls` (one connection's protocol: HELLO and ticket, then Commit and Pull frames) and
`data_plane_io` (non-blocking reads into buffers, writes from θ's memory).
"""
