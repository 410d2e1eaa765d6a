#!/bin/sh
# The `cpuserve` command of the engine image (pip would write this console script).
exec python3 -m cpuserve "$@"
