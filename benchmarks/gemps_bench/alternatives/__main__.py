"""`python -m gemps_bench.alternatives`: main.py's command line."""

import sys

from gemps_bench.alternatives.main import main

sys.exit(main())
