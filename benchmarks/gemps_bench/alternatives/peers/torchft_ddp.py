"""System torchft-ddp: torchft's fault-tolerant DDP (DistributedDataParallel + Optimizer).

Every step commits under the Lighthouse's per-step quorum.
The program, its set-up and what it logs: torchft_peer.py.
"""

from gemps_bench.alternatives.peers.torchft_peer import main

if __name__ == "__main__":
    raise SystemExit(main("ddp"))
