"""The `gemps` command line: one entry point, a subcommand per job (server, worker, demo, ...).

The top layer: it may import every other package, and imports each subcommand's dependencies
only when that subcommand runs, so `gemps server` starts without torch installed.
"""
