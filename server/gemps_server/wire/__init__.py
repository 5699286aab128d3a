"""The gRPC wire: everything that knows gRPC and the protobuf messages.

`grpc_servicer` (the RPC methods, thin: parse, call the service, frame; the `rpc` decorator that
maps refusals to status codes), `streams` (client-stream assembly), `reply_budget` (replies held
until read), `stream_buffers` (the CommitStream buffer pool), `messages` (requests into domain
records, outcomes into replies, and the commit reply writers) and `health` (grpc.health.v1).
"""
