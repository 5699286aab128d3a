"""How long the driver of a Ray job waits for its actors before going on without them."""

STOP_TIMEOUT = 60.0  # seconds a worker gets to finish its step and leave, a partition to shut down
LOOK_TIMEOUT = 10.0  # seconds for a look at partition 0 or the evaluator before going on without it
#: seconds a sample waits for a replica's status: one on a node just lost does not answer until
#: Ray marks the node dead, and the others' (the new primary's) are what the sample is for
REPLICA_LOOK_TIMEOUT = 1.0
