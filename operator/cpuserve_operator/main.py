"""`cpuserve-operator`: runs the kopf operator (peering for HA, a liveness endpoint)."""
from __future__ import annotations

import argparse
import asyncio
import logging


def peering_identity() -> str:
    """This replica's name among its peers: the pod's name (kopf's default, user@host, looks the
    uid up in /etc/passwd, which fails for a uid the image does not list)."""
    import os
    import socket

    return os.environ.get("POD_NAME") or socket.gethostname()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cpuserve-operator")
    p.add_argument("--namespace", action="append", help="watch these namespaces (default: the whole cluster)")
    p.add_argument("--standalone", action="store_true", help="no peering with other operator replicas")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL")
    p.add_argument("--verbose", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import kopf

    from cpuserve_operator import handlers  # noqa: F401 - registers the handlers

    asyncio.run(kopf.operator(standalone=a.standalone, clusterwide=not a.namespace, namespaces=a.namespace or [],
                              liveness_endpoint=a.liveness, identity=peering_identity()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
