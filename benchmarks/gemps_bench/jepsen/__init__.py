"""A Jepsen-style fault suite for replicated partitions (issue 41): randomized, seeded faults on
simulated hosts, and a checker of what the workers were told against what the replicas hold.

One trial: etcd on a host of its own, R replicas of one partition each on its own host, counting
workers on another (`client`: every acknowledgement recorded with its epoch and replica), a
monitor polling every replica's Status (`monitor`). A seeded plan (`plan`) kills, pauses, parts,
slows and heals the primary, a backup and etcd, and wipes etcd's data; the rig (`rig`) applies it.
The checker (`check`) reports acknowledged commits lost, applied twice, epochs held by two
replicas, epochs reused, recovery after each fault and workers wedged while a safe primary
existed. `trial` runs one trial end to end; scripts/jepsen_replicas.py runs many.
"""
