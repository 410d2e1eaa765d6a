"""What a rank does while no request is waiting: the start-up work left for later
(platform/pages.py): the weights turned into huge pages first (every decode step gains from
then on: 2-3% at batch 1 on one VM, nothing measurable on the Zen 3 VM), then the rest of the
KV cache's pages populated (each block's faults are taken once either way; its first 256 MiB
were populated before ready), then the cache turned into huge pages as well (attention's
reads scattered over it: 0.9x the time from 2 MiB pages on one VM). Each piece runs a slice at
a time (one 2 MiB page of weights or cache to collapse, 8 MiB of the cache to populate), with a
look for a request between slices."""
from __future__ import annotations

QUIET_S = 0.05  # idle this long (no request) before doing any: not in the gaps between requests


class IdleWork:
    """The pieces (each with `pending` and `run_while(keep_going)`), in order."""

    def __init__(self, *pieces):
        self.pieces = [p for p in pieces if p is not None and p.pending]

    @property
    def pending(self) -> bool:
        return any(p.pending for p in self.pieces)

    def run_while(self, keep_going) -> None:
        for p in self.pieces:
            if p.pending:
                p.run_while(keep_going)
            if p.pending:  # stopped for a request (or keep_going said so): the rest waits
                return
