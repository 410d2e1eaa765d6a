"""`cpuserve-operator`: one active replica by a Lease (the others stand by), kopf's handlers
once leading, a liveness endpoint in both states, Prometheus metrics."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse


def lease_identity() -> str:
    """This replica's name as the Lease's holder: the pod's name (downward API POD_NAME), else
    the hostname, which is the pod's name too."""
    return os.environ.get("POD_NAME") or socket.gethostname()


class _Healthz(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        ok = self.path.split("?")[0] == "/healthz"
        self.send_response(200 if ok else 404)
        self.end_headers()
        self.wfile.write(b'{"standby": true}' if ok else b"")

    def log_message(self, *_):
        pass


def _standby_liveness(url: str) -> ThreadingHTTPServer:
    """Answers /healthz while this replica waits for the Lease (kopf's endpoint takes over once leading)."""
    u = urlparse(url)
    srv = ThreadingHTTPServer((u.hostname or "0.0.0.0", u.port or 8080), _Healthz)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="cpuserve-operator")
    p.add_argument("--namespace", action="append", help="watch these namespaces (default: the whole cluster)")
    p.add_argument("--standalone", action="store_true", help="no leader election: this process always acts")
    p.add_argument("--lease-namespace", default=env("POD_NAMESPACE", "default"),
                   help="namespace of the leader Lease (default: POD_NAMESPACE, else default)")
    p.add_argument("--lease-name", default=env("CPUSERVE_OPERATOR_LEASE", "cpuserve-operator"))
    p.add_argument("--lease-duration", type=float, default=float(env("CPUSERVE_OPERATOR_LEASE_DURATION", "15")),
                   help="seconds without renewal before a standby takes over (client-go's default 15)")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL")
    p.add_argument("--metrics-port", type=int, default=int(env("CPUSERVE_OPERATOR_METRICS_PORT", "8081")),
                   help="Prometheus /metrics port (0: none)")
    p.add_argument("--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.namespace:  # handlers read it: node events reconcile only servers in these namespaces
        os.environ["CPUSERVE_OPERATOR_NAMESPACES"] = ",".join(a.namespace)
    import kopf
    from kubernetes import config
    from prometheus_client import start_http_server

    from cpuserve_operator import handlers  # noqa: F401 - registers the handlers
    from cpuserve_operator.leader import Elector
    from cpuserve_operator.metrics import LEADER

    if a.metrics_port:
        start_http_server(a.metrics_port)
    elector = keeper = None
    if not a.standalone:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        me = lease_identity()
        elector = Elector(a.lease_namespace, a.lease_name, me, a.lease_duration,
                          renew_deadline=a.lease_duration * 2 / 3, retry=max(0.5, a.lease_duration / 7.5))
        logging.getLogger("cpuserve_operator").info("%s standing by for Lease %s/%s", me, a.lease_namespace,
                                                    a.lease_name)
        health = _standby_liveness(a.liveness)
        elector.wait_until_leading()
        health.shutdown()
        health.server_close()
        LEADER.set(1)
        # a leader that cannot renew stops at once: a standby is about to act
        keeper = threading.Thread(target=elector.keep_leading, args=(lambda: os._exit(3),), daemon=True)
        keeper.start()
    try:
        asyncio.run(kopf.operator(standalone=True, clusterwide=not a.namespace, namespaces=a.namespace or [],
                                  liveness_endpoint=a.liveness))
    finally:
        if elector is not None:
            # renewals stop before the Lease is handed over (one after it would take it back), and
            # no thread is left calling the API server while the interpreter shuts down
            elector.stop()
            keeper.join(timeout=30)
            elector.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
