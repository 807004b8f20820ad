"""Free loopback ports for the servers that benchmarks and tests start.

A server binds its port a moment after the port was chosen. A port from
`bind(("127.0.0.1", 0))` lies in the kernel's ephemeral range, the range
outgoing connections take their source ports from: any connection opened
meanwhile (a started Redis Cluster node's gossip, an engine's client) can take
it. CI saw exactly that: a cluster node failed with "Address already in use"
on port 55510. So the ports here come from outside that range, and are
checked free when chosen (a server that still loses its port says so, and its
launcher may choose again)."""
from __future__ import annotations

import random
import socket

PORT_FLOOR = 10000   # below it lie well-known services' ports
CHOICES = 200


class NoFreePort(RuntimeError):
    """Every port tried outside the ephemeral range was taken."""


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' source ports (Linux's default
    where /proc does not say)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(pair_offset: int = 0) -> int:
    """A loopback port, free now and outside the ephemeral range; with
    `pair_offset`, port + pair_offset too (a Redis Cluster node's bus port)."""
    lo, hi = ephemeral_range()

    def outside(p: int) -> bool:
        return not lo <= p <= hi

    top = 65535 - pair_offset
    wanted = [p for p in range(PORT_FLOOR, top + 1)
              if outside(p) and (not pair_offset or outside(p + pair_offset))]
    rng = random.Random()
    for _ in range(CHOICES if wanted else 0):
        port = rng.choice(wanted)
        if bindable(port) and (not pair_offset or bindable(port + pair_offset)):
            return port
    raise NoFreePort(f"no free loopback port{' pair' if pair_offset else ''} outside the "
                     f"ephemeral range {lo}-{hi}")


__all__ = ["NoFreePort", "bindable", "ephemeral_range", "free_port"]
