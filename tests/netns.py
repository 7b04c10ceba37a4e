"""Two "nodes" on one machine: two network namespaces joined by a veth pair (10.77.0.1/24 <-> 10.77.0.2/24).

Each namespace has its own interfaces, addresses, routes and ports, so a DeepSpeed job with one launcher per
namespace (``deepspeed --no_ssh --node_rank R``) crosses a real network boundary, and "node 1" can be killed
or cut off without touching node 0. Needs ``ip`` (Debian package iproute2) and CAP_NET_ADMIN (root in CI).

Names carry the pid so parallel test sessions on one machine do not collide; teardown deletes the namespaces
(which removes the veth pair) and runs even when the test fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

SUBNET = "10.77.0"


@dataclass(frozen=True)
class Node:
    ns: str  # namespace name
    ifname: str  # its end of the veth pair
    addr: str  # its address

    def cmd(self, *argv: str) -> list[str]:
        """``argv`` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]


def own_host(hostname: str, argv: list[str]) -> list[str]:
    """``argv`` as the only process tree of a host of its own: its own host name (a UTS namespace) and its own
    PID namespace (with its own /proc), so that it shares neither host name nor pids with the other node,
    as a real second node would not (the boot id stays this kernel's)."""
    script = 'hostname "$0" && exec "$@"'
    return ["unshare", "--uts", "--pid", "--fork", "--mount-proc", "sh", "-c", script, hostname, *argv]


def unavailable_reason() -> str | None:
    """Why namespaces cannot be created here, or None when they can (tried for real, then removed)."""
    if shutil.which("ip") is None:
        return "the `ip` command is missing (install the iproute2 package)"
    probe = f"wpprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create network namespaces (need root/CAP_NET_ADMIN): {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_nodes(tag: str = "") -> Iterator[tuple[Node, Node]]:
    """Create ns0/ns1 joined by veth, bring everything (and ``lo``) up, yield the two nodes, always tear
    down."""
    sfx = f"{os.getpid() % 100000}{tag}"
    nodes = (
        Node(f"wp{sfx}n0", f"wpv{sfx}a"[:15], f"{SUBNET}.1"),
        Node(f"wp{sfx}n1", f"wpv{sfx}b"[:15], f"{SUBNET}.2"),
    )
    created: list[str] = []
    try:
        for n in nodes:
            _ip("netns", "add", n.ns)
            created.append(n.ns)
        a, b = nodes
        _ip("link", "add", a.ifname, "netns", a.ns, "type", "veth", "peer", "name", b.ifname, "netns", b.ns)
        for n in nodes:
            _ip("-n", n.ns, "addr", "add", f"{n.addr}/24", "dev", n.ifname)
            _ip("-n", n.ns, "link", "set", n.ifname, "up")
            _ip("-n", n.ns, "link", "set", "lo", "up")
        yield nodes
    finally:
        for ns in created:  # deleting a namespace kills its veth end, which removes the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def kill_namespace_processes(node: Node) -> list[int]:
    """SIGKILL every process running in ``node``'s namespace (what a node's sudden death looks like)."""
    r = subprocess.run(["ip", "netns", "pids", node.ns], capture_output=True, text=True)
    pids = [int(p) for p in r.stdout.split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    return pids
