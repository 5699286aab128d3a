"""The domain: the central variable, its version, the commit rules and the registered workers.

`state` (ServerState: every operation, run by the FIFO `applier`), `records` (what goes in and
out: Commit, CommitOutcome, Snapshot, ...), `validation` (the checks on requests, each with its
Reason), `rules` (the commit rules), `ledger` (exactly-once commits), `workers` (the registry)
and `errors` (refusals). It knows nothing of gRPC, protobuf or the wire (import contracts in
pyproject.toml): the service (../service.py) is its one door.
"""
