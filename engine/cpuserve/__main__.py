import sys

from cpuserve.entrypoints.cli import main

sys.exit(main())
