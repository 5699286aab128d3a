"""gemps benchmarks: the parameter server against the transport and memory ceilings and its peers.

Run `gemps bench --help`; results go to docs/PERFORMANCE.md. Lives in benchmarks/, installed as
gemps_bench so that `gemps bench` works from any install (the top layer: it may use every package).
"""
