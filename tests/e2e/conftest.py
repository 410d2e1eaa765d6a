"""`make e2e`: one real node on this machine (tests/e2e/cluster.py), the chart installed on
it the way a user installs it, and diagnostics attached to any failure."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cluster import CACHE, STATE, Cluster  # noqa: E402

IMAGE_CACHE = Path(os.environ.get("CPUSERVE_IMAGE_CACHE", Path.home() / ".cache" / "cpuserve-images"))
VERSION = "0.1.0"


@pytest.fixture(scope="session")
def node():
    assets = Path(os.environ.get("KUBEBUILDER_ASSETS", ""))
    node_bin = Path(os.environ.get("CPUSERVE_E2E_BIN", CACHE / "bin"))
    images = [node_bin.parent / "pause.oci.tar",
              *(IMAGE_CACHE / "oci" / f"cpuserve-{n}-{VERSION}.oci.tar" for n in ("operator", "engine"))]
    cluster = Cluster(assets, node_bin, images)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failure: the cluster's state and the tails of every component's log."""
    outcome = yield
    rep = outcome.get_result()
    cluster = item.funcargs.get("node") if hasattr(item, "funcargs") else None
    if rep.failed and isinstance(cluster, Cluster) and cluster.procs:
        parts = []
        for args in (("get", "nodes,pods,cms,svc", "-A", "-o", "wide"), ("describe", "pods", "-A"),
                     ("get", "events", "-A", "--sort-by=.lastTimestamp"),
                     ("logs", "-n", "cpuserve-system", "deploy/cpuserve-operator", "--tail=40")):
            r = cluster.kubectl(*args, check=False)
            parts.append(f"$ kubectl {' '.join(args)}\n{r.stdout[-6000:]}{r.stderr[-1000:]}")
        for name in cluster.procs:
            parts.append(f"--- {name} (log: {cluster.logs / (name + '.log')})\n{cluster.tail(name, 15)}")
        (STATE / "logs" / "diagnostics.txt").write_text("\n\n".join(parts))
        rep.sections.append(("e2e diagnostics", "\n\n".join(parts)[-20000:]))
