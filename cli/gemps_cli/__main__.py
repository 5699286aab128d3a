import sys

from gemps_cli.main import main

sys.exit(main())
