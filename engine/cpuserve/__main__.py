import sys

from cpuserve.cli import main

sys.exit(main())
