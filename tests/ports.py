"""A free TCP port on loopback for a server or a rendezvous the tests start.

The port is taken below the kernel's ephemeral range (Linux: /proc/sys/net/ipv4/ip_local_port_range), so that
between the check here and the server's own bind no ephemeral socket -- torchrun's rendezvous store, gloo's
connections, any client -- can be handed it (a port from bind(0) can: a torchrun-launched server once failed with
"address already in use" on its own HTTP port)."""
from __future__ import annotations

import random
import socket

__all__ = ["free_port"]

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_low() -> int:
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768   # (Linux's default; elsewhere: below it)


def free_port() -> int:
    """A port on 127.0.0.1 that nothing is bound to now, outside the ephemeral range where one is found (else one
    the kernel picks)."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
