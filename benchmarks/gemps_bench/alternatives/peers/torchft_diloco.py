"""System torchft-diloco: torchft's DiLoCo.

Local SGD steps; every --sync-every steps the outer Nesterov step on the averaged change.
The program, its set-up and what it logs: torchft_peer.py.
"""

from gemps_bench.alternatives.peers.torchft_peer import main

if __name__ == "__main__":
    raise SystemExit(main("diloco"))
