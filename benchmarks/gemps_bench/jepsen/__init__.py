"""A Jepsen-style fault suite for replicated partitions (issue 41): randomized, seeded faults on
simulated hosts, and a checker of what the workers were told against what the replicas hold.

One trial: etcd on a host of its own, R replicas of one partition each on its own host, counting
workers on another (`client`: every acknowledgement recorded with its epoch and replica), a
monitor polling every replica's Status (`monitor`). A seeded plan (`plan`) kills, pauses, parts,
slows and heals the primary, a backup and etcd, and wipes etcd's data; the rig (`rig`) applies it.
With a second job (issue 77, item 1; `job`: each job's replicas and workers) job B runs beside,
its own replicas under another etcd job name, each job's workers' replica list ending with the
other job's primary, and the plan also faults B's primary and backup. The checker (`check`)
reports, per job, acknowledged commits lost, applied twice or in the wrong job's θ, epochs held by
two replicas, epochs reused, recovery after each fault and workers wedged while a safe primary
existed. `trial` runs one trial end to end; scripts/jepsen_replicas.py runs many.
"""
