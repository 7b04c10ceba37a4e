"""Network helpers shared by training, the launch tools and the tests: one copy of each."""

from __future__ import annotations

import socket

UNKNOWN_ADDRESS = "unknown"


def own_address(peer: str) -> str:
    """The local IP the kernel routes towards ``peer`` (a UDP connect sends no packet).

    Returns ``UNKNOWN_ADDRESS`` when there is no route (or ``peer`` does not resolve): the callers that only
    record the address keep going; the ones that need it check for that value.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return s.getsockname()[0]
    except OSError:
        return UNKNOWN_ADDRESS


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (others may run DeepSpeed jobs on the default 29500).

    The port is released before returning, so another process can take it in between: good enough for test
    and benchmark rendezvous, whose failure is loud.
    """
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
