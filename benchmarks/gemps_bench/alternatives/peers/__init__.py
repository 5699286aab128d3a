"""The comparison's peers: torchft (fault-tolerant DDP, LocalSGD, DiLoCo) and hivemind's Optimizer,
each a worker program of the CONTRACT (../CONTRACT.md) run from their own virtualenv (.venv-peers,
`make peers-venv`); peers.json tells the harness how to start them."""
