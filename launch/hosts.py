"""DeepSpeed hostfiles (``host slots=N`` lines) from a Slurm allocation, an AWS Batch multi-node job, or a
list.

AWS Batch multi-node parallel jobs give each node only the job size, its own index, the main node's index and
(on child nodes only) the main node's private IP. We join the nodes with a small TCP registration service:

* the main node listens on ``--port`` (default 29499) and waits, up to ``--timeout`` seconds, for every child;
* each child connects from the address it claims (retrying while the main container starts), sends one JSON
  line ``{index, ip, slots, token}``, and keeps the connection open; ``token`` is an HMAC-SHA256 of the claim
  and the job id (``AWS_BATCH_JOB_ID``) under the job's secret (``WP_REGISTRATION_SECRET``, from the job
  definition), so a host outside the job cannot make one;
* the main node refuses (logs, and waits on) a registration with a wrong token or whose claimed address is not
  the address it connects from;
* when all children are in, the main node orders the hosts by node index (main first, so it is node rank 0 and
  the rendezvous address), writes the hostfile and sends the same hostfile text to every child, which writes
  it.

Every node then starts ``deepspeed --no_ssh --node_rank R --master_addr MAIN_IP --hostfile H``: no sshd in the
container, no shared filesystem needed. The registration carries nothing but validated addresses and integers.
torch.distributed's own store and rendezvous are unauthenticated by design: the cluster network must be
private to the job (a placement group and a security group that admits only the job's instances).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from common.atomic import atomic_write_text
from common.errors import UserError
from common.log import get_logger
from common.net import UNKNOWN_ADDRESS, own_address

log = get_logger("launch.hosts")

DEFAULT_REGISTRATION_PORT = 29499
_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def validate_host(name: str) -> str:
    """Return ``name`` if it is a hostname (RFC 1123 labels) or an IPv4/IPv6 address; else a one-line
    UserError.

    Host names end up in shell commands (pdsh, ssh, our job scripts); anything else (spaces, quotes, ``;``,
    ``$``, backticks, ...) is refused here rather than quoted later.
    """
    if not isinstance(name, str) or not name:
        raise UserError("empty host name")
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(name)
        return name
    if not _HOSTNAME_RE.match(name):
        raise UserError(f"invalid host name {name!r}: only letters, digits, '-' and '.' (or an IP address)")
    return name


def _split_top_level(text: str) -> list[str]:
    """Split a Slurm node list on the commas that are outside brackets."""
    parts: list[str] = []
    depth = 0
    cur: list[str] = []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise UserError(f"bad Slurm node list {text!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise UserError(f"bad Slurm node list {text!r}: unbalanced '['")
    parts.append("".join(cur))
    return [p for p in (s.strip() for s in parts) if p]


def _expand_range_list(body: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        if re.fullmatch(r"\d+", item):
            out.append(item)
            continue
        m = re.fullmatch(r"(\d+)-(\d+)", item)
        if not m:
            raise UserError(f"bad Slurm node list {whole!r}: cannot read range {item!r}")
        lo, hi = m.group(1), m.group(2)
        if int(hi) < int(lo):
            raise UserError(f"bad Slurm node list {whole!r}: range {item!r} runs backwards")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed syntax (``node[01-03,07],gpu-[1-2]-x[3,4]``) the way ``scontrol`` does.

    Used when ``scontrol show hostnames`` is not available (tests, login nodes without Slurm tools).
    Zero padding follows the range's lower bound, as in Slurm.
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist):
        pieces = [""]
        rest = part
        while rest:
            m = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", rest)
            if not m:
                pieces = [p + rest for p in pieces]
                break
            prefix, body, rest = m.groups()
            values = _expand_range_list(body, nodelist)
            pieces = [p + prefix + v for p in pieces for v in values]
        hosts.extend(pieces)
    return [validate_host(h) for h in hosts]


def slurm_hostnames(nodelist: str) -> list[str]:
    """Host names of a Slurm allocation: ``scontrol show hostnames`` when present, our expander otherwise."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True)
        if out.returncode == 0:
            return [validate_host(h) for h in out.stdout.split()]
        log.warning(f"scontrol show hostnames failed ({out.stderr.strip()}); expanding the node list ourselves")
    return expand_slurm_nodelist(nodelist)


def hostfile_text(hosts: Iterable[Host]) -> str:
    """DeepSpeed/MPI hostfile text; refuses duplicates (runner.py does too, later and less clearly)."""
    seen: set[str] = set()
    lines = []
    for h in hosts:
        validate_host(h.name)
        if h.slots <= 0:
            raise UserError(f"host {h.name}: slots must be positive (got {h.slots})")
        if h.name in seen:
            raise UserError(f"host {h.name} listed twice; DeepSpeed needs one line per host")
        seen.add(h.name)
        lines.append(f"{h.name} slots={h.slots}\n")
    if not lines:
        raise UserError("no hosts: the hostfile would be empty")
    return "".join(lines)


def parse_hostfile(path: str | os.PathLike) -> list[Host]:
    """Read a hostfile back (same rules as DeepSpeed's runner: ``name slots=N``, ``#`` comments)."""
    hosts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"(\S+)\s+slots=(\d+)", line)
        if not m:
            raise UserError(f"{path}:{n}: expected 'host slots=N', got {line!r}")
        hosts.append(Host(validate_host(m.group(1)), int(m.group(2))))
    return hosts


# ----------------------------------------------------------------------------- AWS Batch registration


def _first_hostname_ip() -> str:
    """This node's first address from ``hostname -I`` (what DeepSpeed's runner uses for --master_addr)."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = []
    if not out:
        raise UserError("cannot find this node's IP address (hostname -I); pass --ip")
    return out[0]


def _recv_line(conn: socket.socket, deadline: float, limit: int = 1 << 20) -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed before a full line arrived")
        buf += chunk
        if len(buf) > limit:
            raise ConnectionError("registration message too long")
    return buf.decode()


SECRET_ENV = "WP_REGISTRATION_SECRET"


def registration_token(secret: str, job_id: str, index: int, ip: str, slots: int) -> str:
    """HMAC-SHA256 of a child's claim under the job's secret, bound to the job: only the job's nodes (which
    hold the secret from the job definition) can make one, and only for this job."""
    claim = f"{job_id.split('#')[0]}|{index}|{ip}|{slots}".encode()
    return hmac.new(secret.encode(), claim, hashlib.sha256).hexdigest()


def job_credentials() -> tuple[str, str]:
    """(secret, job id) from the environment of a multi-node AWS Batch job; one-line errors otherwise."""
    secret = os.environ.get(SECRET_ENV, "")
    if len(secret) < 16:
        raise UserError(
            f"{SECRET_ENV} is {'too short' if secret else 'not set'}: a multi-node AWS Batch job needs a "
            "secret of 16+ characters in its job definition (python -m launch render awsbatch sets one) so "
            "that only the job's nodes can register"
        )
    job_id = os.environ.get("AWS_BATCH_JOB_ID", "")
    if not job_id:
        raise UserError("AWS_BATCH_JOB_ID is not set (is this an AWS Batch multi-node parallel job?)")
    return secret, job_id


def serve_registration(
    num_nodes: int,
    main_index: int,
    main_ip: str,
    slots: int,
    port: int,
    timeout_s: float,
    secret: str,
    job_id: str,
    bind: str = "0.0.0.0",
) -> list[Host]:
    """Main node: wait for ``num_nodes - 1`` children, answer each with the hostfile, return the hosts in
    order.

    A registration is accepted only when it carries the job's token for its claim, and when the address it
    claims is the address it connects from; others are logged and refused, and the main node waits on."""
    validate_host(main_ip)
    deadline = time.monotonic() + timeout_s
    registered: dict[int, tuple[Host, socket.socket]] = {}
    with socket.create_server((bind, port), reuse_port=False) as srv:
        srv.settimeout(1.0)
        log.info(f"waiting for {num_nodes - 1} child node(s) on port {port}")
        try:
            while len(registered) < num_nodes - 1:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(num_nodes)) - set(registered) - {main_index})
                    raise UserError(f"AWS Batch registration: nodes {missing} did not register within {timeout_s:.0f}s")
                try:
                    conn, peer = srv.accept()
                except TimeoutError:
                    continue
                try:
                    msg = json.loads(_recv_line(conn, min(deadline, time.monotonic() + 30)))
                    index, ip, n = int(msg["index"]), validate_host(str(msg["ip"])), int(msg["slots"])
                    want = registration_token(secret, job_id, index, ip, n)
                    if not hmac.compare_digest(str(msg.get("token", "")), want):
                        raise ValueError("wrong token (not a node of this job)")
                    if ip != peer[0]:
                        raise ValueError(f"claims address {ip} but connects from {peer[0]}")
                    if not 0 <= index < num_nodes or index == main_index:
                        raise ValueError(f"node index {index} out of range")
                    if index in registered:
                        raise ValueError(f"node index {index} registered twice")
                except (ValueError, KeyError, TypeError, ConnectionError, UserError, TimeoutError) as e:
                    log.warning(f"rejected registration from {peer[0]}: {e}")
                    conn.close()
                    continue
                registered[index] = (Host(ip, n), conn)
                log.info(f"node {index} registered as {ip} (slots={n})")
            hosts = [Host(main_ip, slots)] + [registered[i][0] for i in sorted(registered)]
            text = hostfile_text(hosts)
            for _, conn in registered.values():
                conn.sendall(json.dumps({"hostfile": text}).encode() + b"\n")
            return hosts
        finally:
            for _, conn in registered.values():
                conn.close()


def register_with_main(
    main_ip: str, port: int, index: int, ip: str, slots: int, timeout_s: float, secret: str, job_id: str
) -> list[Host]:
    """Child node: register with the main node (retrying until it listens) and return the job's hosts. The
    connection leaves from the claimed address, which the main node checks."""
    validate_host(ip)
    deadline = time.monotonic() + timeout_s
    last_err: Exception | None = None
    token = registration_token(secret, job_id, index, ip, slots)
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((main_ip, port), timeout=5, source_address=(ip, 0)) as conn:
                msg = {"index": index, "ip": ip, "slots": slots, "token": token}
                conn.sendall(json.dumps(msg).encode() + b"\n")
                reply = json.loads(_recv_line(conn, deadline))
            hosts = []
            for line in reply["hostfile"].splitlines():
                name, s = line.split(" slots=")
                hosts.append(Host(validate_host(name), int(s)))
            return hosts
        except (OSError, ConnectionError, ValueError, KeyError) as e:
            last_err = e
            time.sleep(1.0)
    raise UserError(
        f"AWS Batch registration: main node {main_ip}:{port} did not answer in {timeout_s:.0f}s ({last_err})"
    )


def _env_int(name: str) -> int:
    v = os.environ.get(name)
    if v is None:
        raise UserError(f"{name} is not set (is this an AWS Batch multi-node parallel job?)")
    try:
        return int(v)
    except ValueError:
        raise UserError(f"{name}={v!r} is not an integer") from None


def awsbatch_hosts(slots: int, port: int, timeout_s: float, ip: str | None) -> tuple[list[Host], int, str]:
    """Run the registration for this node; return (hosts, this node's rank, master address)."""
    num_nodes = _env_int("AWS_BATCH_JOB_NUM_NODES")
    index = _env_int("AWS_BATCH_JOB_NODE_INDEX")
    main_index = _env_int("AWS_BATCH_JOB_MAIN_NODE_INDEX")
    if index == main_index:
        my_ip = validate_host(ip or _first_hostname_ip())
        if num_nodes == 1:
            return [Host(my_ip, slots)], 0, my_ip
        secret, job_id = job_credentials()
        return (
            serve_registration(num_nodes, main_index, my_ip, slots, port, timeout_s, secret, job_id),
            0,
            my_ip,
        )
    main_ip = os.environ.get("AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS")
    if not main_ip:
        raise UserError("AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS is not set on this child node")
    validate_host(main_ip)
    if ip is None:
        ip = own_address(main_ip)
        if ip == UNKNOWN_ADDRESS:
            raise UserError(f"no route from this node to the main node {main_ip}; pass --ip")
    my_ip = validate_host(ip)
    hosts = register_with_main(main_ip, port, index, my_ip, slots, timeout_s, *job_credentials())
    names = [h.name for h in hosts]
    if my_ip not in names:
        raise UserError(f"AWS Batch registration: this node ({my_ip}) is missing from the main node's hostfile")
    return hosts, names.index(my_ip), hosts[0].name


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="source", choices=["slurm", "awsbatch", "list"], default="list")
    parser.add_argument("--hosts", default="", help="comma-separated host names or IPs (--from list)")
    parser.add_argument("--slots", type=int, default=None, help="accelerators per node (slurm: SLURM_GPUS_ON_NODE)")
    parser.add_argument("--out", required=True, help="hostfile to write")
    parser.add_argument("--port", type=int, default=DEFAULT_REGISTRATION_PORT, help="awsbatch registration port")
    parser.add_argument("--timeout", type=float, default=600.0, help="awsbatch: seconds to wait for all nodes")
    parser.add_argument("--ip", default=None, help="awsbatch: this node's address (default: detected)")
    parser.add_argument(
        "--env-out",
        default=None,
        help="also write NODE_RANK, MASTER_ADDR, NUM_NODES for this node to this file (for `source`)",
    )


def _slots(args: argparse.Namespace) -> int:
    slots = args.slots
    if slots is None and args.source == "slurm":
        raw = os.environ.get("SLURM_GPUS_ON_NODE") or os.environ.get("SLURM_NTASKS_PER_NODE")
        if raw and raw.isdigit():
            slots = int(raw)
    if slots is None:
        raise UserError("--slots is required (accelerators per node)")
    if slots <= 0:
        raise UserError(f"--slots must be positive (got {slots})")
    return slots


def build_hosts(args: argparse.Namespace) -> tuple[list[Host], int | None, str]:
    slots = _slots(args)
    if args.source == "list":
        names = [h.strip() for h in args.hosts.split(",") if h.strip()]
        if not names:
            raise UserError("--from list needs --hosts a,b,c")
        hosts = [Host(validate_host(n), slots) for n in names]
        return hosts, None, hosts[0].name
    if args.source == "slurm":
        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
        if not nodelist:
            raise UserError("SLURM_JOB_NODELIST is not set (run inside an sbatch/salloc allocation)")
        hosts = [Host(n, slots) for n in slurm_hostnames(nodelist)]
        node_id = os.environ.get("SLURM_NODEID")
        return hosts, int(node_id) if node_id and node_id.isdigit() else None, hosts[0].name
    hosts, rank, master = awsbatch_hosts(slots, args.port, args.timeout, args.ip)
    return hosts, rank, master


def run(args: argparse.Namespace) -> int:
    hosts, node_rank, master = build_hosts(args)
    atomic_write_text(args.out, hostfile_text(hosts))
    if args.env_out:
        lines = [f"NUM_NODES={len(hosts)}", f"MASTER_ADDR={master}"]
        if node_rank is not None:
            lines.append(f"NODE_RANK={node_rank}")
        atomic_write_text(args.env_out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}: {len(hosts)} host(s), {sum(h.slots for h in hosts)} slots")
    return 0


def write_hostfile(path: str | os.PathLike, hosts: Sequence[Host]) -> None:
    """Write ``hosts`` atomically as a DeepSpeed hostfile."""
    atomic_write_text(path, hostfile_text(hosts))
