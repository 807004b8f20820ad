#!/usr/bin/env python3
"""Container health probe: exit 0 when kvkeeper's grpc.health.v1 says SERVING, else 1.

    kvkeeper-healthcheck [URL] [--timeout SECONDS] [--service NAME]

URL: any form the client library takes (kvkeeper.client.url: unix:///abs/path.sock,
host:port, tcp://host:port, ...); default $KVKEEPER_HEALTH_URL, then
$KVKEEPER_URL, then unix:///run/kvkeeper/kvkeeper.sock. The daemon answers
NOT_SERVING from the moment it starts draining (SIGTERM), so a stopping
container turns unhealthy at once.

(`kvkeeper status` is not used here: it exits 0 whatever the health status,
as long as the daemon answers.)
"""
from __future__ import annotations

import argparse
import os
import sys

DEFAULT_URL = "unix:///run/kvkeeper/kvkeeper.sock"


def check(url: str, timeout: float, service: str = "") -> tuple[bool, str]:
    """(healthy, one line saying why)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    # The daemon's own URL grammar, so $KVKEEPER_URL means here what it means to the
    # kvkeeper command and the connector. ValueError (a bad URL) makes the probe fail.
    from kvkeeper.client.url import parse_url

    parsed = parse_url(url)
    if parsed.path is not None and not os.path.exists(parsed.path):
        return False, f"no socket at {parsed.path}"
    with grpc.insecure_channel(parsed.target) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return False, f"{url}: {e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, f"{url}: {status}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvkeeper-healthcheck", description=__doc__.split("\n")[0])
    parser.add_argument("url", nargs="?", default=os.environ.get("KVKEEPER_HEALTH_URL")
                        or os.environ.get("KVKEEPER_URL") or DEFAULT_URL)
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--service", default="", help='health service name ("" = the whole daemon)')
    args = parser.parse_args(argv)
    try:
        ok, why = check(args.url, args.timeout, args.service)
    except Exception as e:  # noqa: BLE001 - a probe reports, it does not crash
        ok, why = False, f"{args.url}: {type(e).__name__}: {e}"
    print(("healthy: " if ok else "unhealthy: ") + why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
