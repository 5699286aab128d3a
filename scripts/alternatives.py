"""Rerun any cell of the comparison with the alternatives (issue 58), write its JSON, table and figure:
the command line of `python -m gemps_bench.alternatives` (docs/guides/alternatives.md).

    .venv/bin/python scripts/alternatives.py --scenarios b --systems gemps-gem,ddp --workload digits --seeds 0,1,2
"""

from __future__ import annotations

import sys

from gemps_bench.alternatives.main import main

if __name__ == "__main__":
    sys.exit(main())
