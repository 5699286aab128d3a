"""gemps benchmarks: the parameter server against the transport and memory ceilings and its peers.

Run `gemps bench --help` (or `python -m benchmarks --help`); results go to docs/PERFORMANCE.md.
"""
