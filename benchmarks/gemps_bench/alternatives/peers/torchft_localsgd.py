"""System torchft-localsgd: torchft's LocalSGD.

Local SGD steps; the model averaged every --sync-every steps under the Lighthouse's quorum.
The program, its set-up and what it logs: torchft_peer.py.
"""

from gemps_bench.alternatives.peers.torchft_peer import main

if __name__ == "__main__":
    raise SystemExit(main("localsgd"))
