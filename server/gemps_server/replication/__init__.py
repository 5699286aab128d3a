"""Replicated partitions (DESIGN §3d): a primary and backups per partition of θ.

The primary journals every state change in its applied order and forwards it to each backup,
which applies it through the same domain code; a commit is acknowledged once every backup in the
in-sync set applied it. Who is primary is decided by etcd (election.py): a lease-bound key per
partition, whose revision is the epoch. The server is composed with it through
`layer.layer()`: the one name app.py calls.
"""
