"""Which local address this process uses to reach the rendezvous host (recorded by multi-node runs)."""

from __future__ import annotations

import socket


def own_address(master_addr: str) -> str:
    """The local IP the kernel routes towards ``master_addr`` (a UDP connect sends no packet)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, 9))
            return s.getsockname()[0]
    except OSError:
        return "unknown"
