"""The operator's Prometheus metrics (served by `cpuserve-operator --metrics-port`): how often
it reconciles and fails, how long a trigger waits for its server's turn, how long a pass
takes, which replica of the operator leads, and each server's replicas by state."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("cpuserve_operator_reconciles", "Reconcile passes by result", ["result"])
RECONCILE_SECONDS = Histogram("cpuserve_operator_reconcile_duration_seconds", "Duration of one reconcile pass",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
QUEUE_SECONDS = Histogram("cpuserve_operator_queue_wait_seconds",
                          "Time a trigger waits for the server's previous reconcile to finish",
                          buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30))
EVENTS = Counter("cpuserve_operator_events", "Events recorded on CPUModelServers", ["type", "reason"])
REPLICAS = Gauge("cpuserve_operator_replicas", "Replicas of a CPUModelServer by state (desired, current, ready, "
                 "failing)", ["namespace", "server", "state"])
SERVERS = Gauge("cpuserve_operator_servers", "CPUModelServers by phase", ["phase"])
LEADER = Gauge("cpuserve_operator_leader", "1 while this operator process holds the leader Lease")

_phases: dict[tuple[str, str], str] = {}


def observe_server(ns: str, name: str, phase: str | None, replicas: dict[str, int]) -> None:
    """Records a server's phase and replica counts; phase None: the server is gone."""
    if phase is None:
        _phases.pop((ns, name), None)
        for state in ("desired", "current", "ready", "failing"):
            try:
                REPLICAS.remove(ns, name, state)
            except KeyError:
                pass
    else:
        _phases[(ns, name)] = phase
        for state, n in replicas.items():
            REPLICAS.labels(ns, name, state).set(n)
    for p in ("Pending", "Loading", "Ready", "Degraded", "Failed"):
        SERVERS.labels(p).set(sum(1 for v in _phases.values() if v == p))
