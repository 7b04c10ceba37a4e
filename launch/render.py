"""Job templates (``launch/templates``): Slurm sbatch script, AWS Batch job definition + entrypoint,
deepspeed command.

Shell templates have ``{{NAME}}`` slots; every value is inserted with ``shlex.quote`` (or, for ``#SBATCH``
lines, which the shell never parses, validated to a safe character set), and a slot left unfilled is an error.
The AWS Batch job definition is built as data (``json``) from its template, never by string substitution.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
from pathlib import Path
from typing import Any

from common.atomic import atomic_write_text
from common.errors import UserError
from launch.hosts import DEFAULT_REGISTRATION_PORT, SECRET_ENV
from launch.profiles import load_profile

TEMPLATES = Path(__file__).resolve().parent / "templates"
REPO = Path(__file__).resolve().parents[1]
_SLOT_RE = re.compile(r"\{\{([A-Z_]+)\}\}")
_JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def fill(template: str, values: dict[str, str]) -> str:
    """Replace ``{{NAME}}`` slots with already-safe text; an unknown or unfilled slot is an error."""

    def sub(m: re.Match[str]) -> str:
        if m.group(1) not in values:
            raise UserError(f"template slot {{{{{m.group(1)}}}}} has no value")
        return values[m.group(1)]

    return _SLOT_RE.sub(sub, template)


def _job_name(name: str) -> str:
    if not _JOB_NAME_RE.match(name):
        raise UserError(f"--job-name {name!r}: letters, digits, '_', '.', '-' only (max 128)")
    return name


def _positive(name: str, v: int) -> str:
    if v <= 0:
        raise UserError(f"{name} must be positive (got {v})")
    return str(v)


def render_slurm(args: argparse.Namespace) -> str:
    """sbatch script: builds the hostfile from the allocation, then one ssh launcher or srun-per-node
    --no_ssh."""
    q = shlex.quote
    return fill(
        (TEMPLATES / "slurm.sbatch").read_text(),
        {
            "JOB_NAME": _job_name(args.job_name),
            "NODES": _positive("--nodes", args.nodes),
            "GPUS_PER_NODE": _positive("--gpus-per-node", args.gpus_per_node),
            "REPO": q(str(args.repo)),
            "CONFIG": q(args.config),
            "SCRIPT": q(args.script),
            "PROFILE": q(args.profile),
            "MODE": q(args.mode),
            "MASTER_PORT": _positive("--master-port", args.master_port),
            **_elastic_slots(args),
        },
    )


def _elastic_slots(args: argparse.Namespace) -> dict[str, str]:
    """--mode elastic: the node range and restart budget of `launch elastic` (checked here, at render)."""
    nodes = int(_positive("--nodes", args.nodes))
    low = args.min_nodes if args.min_nodes is not None else nodes
    if not 1 <= low <= nodes:
        raise UserError(f"--min-nodes must be between 1 and --nodes={nodes}, got {low}")
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    return {"MIN_NODES": str(low), "MAX_RESTARTS": str(args.max_restarts)}


def render_entrypoint(args: argparse.Namespace) -> str:
    q = shlex.quote
    return fill(
        (TEMPLATES / "awsbatch_entrypoint.sh").read_text(),
        {
            "REPO": q(str(args.repo)),
            "CONFIG": q(args.config),
            "SCRIPT": q(args.script),
            "PROFILE": q(args.profile),
            "GPUS_PER_NODE": _positive("--gpus-per-node", args.gpus_per_node),
            "MASTER_PORT": _positive("--master-port", args.master_port),
            "REGISTRATION_PORT": _positive("--registration-port", args.registration_port),
            "MODE": "elastic" if args.mode == "elastic" else "deepspeed",
            **_elastic_slots(args),
        },
    )


def render_awsbatch_jobdef(args: argparse.Namespace) -> dict[str, Any]:
    """Multi-node parallel job definition: every node runs the entrypoint; EFA devices passed through."""
    profile = load_profile(args.profile)
    if not args.image:
        raise UserError("--image is required for awsbatch (the container image with the repository)")
    jd = json.loads((TEMPLATES / "awsbatch_jobdef.json").read_text())
    jd["jobDefinitionName"] = _job_name(args.job_name)
    nodes = jd["nodeProperties"]
    nodes["numNodes"] = int(_positive("--nodes", args.nodes))
    c = nodes["nodeRangeProperties"][0]["container"]
    c["image"] = args.image
    c["command"] = [args.entrypoint, *getattr(args, "passthrough", [])]
    instance = args.instance_type or profile.instance_type
    if instance:
        c["instanceType"] = instance
    else:
        del c["instanceType"]
    c["resourceRequirements"] = [{"type": "GPU", "value": str(args.gpus_per_node)}]
    if args.vcpus:
        c["resourceRequirements"].append({"type": "VCPU", "value": str(args.vcpus)})
    if args.memory_mib:
        c["resourceRequirements"].append({"type": "MEMORY", "value": str(args.memory_mib)})
    if args.mode == "elastic":  # the outer layer: a preempted job (exit 3) or a lost host runs again
        jd["retryStrategy"] = {
            "attempts": 3,
            "evaluateOnExit": [
                {"onExitCode": "3", "action": "RETRY"},
                {"onStatusReason": "Host EC2*", "action": "RETRY"},
                {"onReason": "*", "action": "EXIT"},
            ],
        }
    c["environment"] = [
        {"name": "WP_CONFIG", "value": args.config},
        {"name": "WP_PROFILE", "value": args.profile},
        {"name": "WP_GPUS_PER_NODE", "value": str(args.gpus_per_node)},
        {"name": "WP_MASTER_PORT", "value": str(args.master_port)},
        {"name": "WP_REGISTRATION_PORT", "value": str(args.registration_port)},
    ]
    # The registration secret: only the job's nodes may register with the main node (launch.hosts). From
    # Secrets Manager when an ARN is given, else a fresh random one in the job definition itself (readable by
    # whoever may describe the job definition).
    if args.registration_secret_arn:
        c["secrets"] = [{"name": SECRET_ENV, "valueFrom": args.registration_secret_arn}]
    else:
        c["environment"].append({"name": SECRET_ENV, "value": secrets.token_hex(32)})
    efa = args.efa_devices if args.efa_devices is not None else profile.efa_devices
    c["linuxParameters"]["devices"] = [
        {
            "hostPath": f"/dev/infiniband/uverbs{i}",
            "containerPath": f"/dev/infiniband/uverbs{i}",
            "permissions": ["READ", "WRITE", "MKNOD"],
        }
        for i in range(efa)
    ]
    return jd


def render_deepspeed(args: argparse.Namespace) -> str:
    q = shlex.quote
    return fill(
        (TEMPLATES / "deepspeed.sh").read_text(),
        {
            "REPO": q(str(args.repo)),
            "HOSTFILE": q(args.hostfile),
            "MASTER_PORT": _positive("--master-port", args.master_port),
            "SCRIPT": q(args.script),
            "CONFIG": q(args.config),
        },
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=["slurm", "awsbatch", "deepspeed"])
    parser.epilog = "Arguments after -- go to the training script (awsbatch: appended to the container command)."
    parser.add_argument("--config", required=True, help="training config YAML (path as seen on the nodes)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--profile", default="efa", help="cluster profile name or YAML (default efa)")
    parser.add_argument("--script", default="train.py", help="training entry point (default train.py)")
    parser.add_argument("--repo", default=str(REPO), help="repository path on the nodes / in the container")
    parser.add_argument("--job-name", default="wikipretrain")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument(
        "--mode",
        choices=["ssh", "srun", "elastic"],
        default="srun",
        help="slurm: ssh launcher, srun --no_ssh, or elastic (launch elastic per node, requeue on exit 3); "
        "awsbatch: elastic, or else one deepspeed launcher per node",
    )
    parser.add_argument(
        "--min-nodes", type=int, default=None, help="elastic: the fewest nodes the job goes on with (default --nodes)"
    )
    parser.add_argument("--max-restarts", type=int, default=3, help="elastic: restarts after failures")
    parser.add_argument("--hostfile", default="hostfile", help="deepspeed: hostfile path")
    parser.add_argument("--image", default=None, help="awsbatch: container image URI")
    parser.add_argument(
        "--registration-secret-arn",
        default=None,
        help="awsbatch: Secrets Manager ARN of the node-registration secret (default: a random secret "
        "written into the job definition)",
    )
    parser.add_argument("--instance-type", default=None, help="awsbatch: default from the profile")
    parser.add_argument("--efa-devices", type=int, default=None, help="awsbatch: /dev/infiniband/uverbs* count")
    parser.add_argument("--vcpus", type=int, default=None)
    parser.add_argument("--memory-mib", type=int, default=None)
    parser.add_argument("--registration-port", type=int, default=DEFAULT_REGISTRATION_PORT)
    parser.add_argument(
        "--entrypoint",
        default="/opt/wikipretrain/awsbatch_entrypoint.sh",
        help="awsbatch: path of the rendered entrypoint inside the image",
    )
    parser.add_argument("--out", required=True, help="file to write (awsbatch: the job definition JSON)")
    parser.add_argument(
        "--entrypoint-out",
        default=None,
        help="awsbatch: also write the entrypoint script here (default: beside --out)",
    )


def _write_script(path: str | os.PathLike, text: str) -> None:
    atomic_write_text(path, text)
    os.chmod(path, 0o755)


def run(args: argparse.Namespace) -> int:
    if args.kind == "slurm":
        _write_script(args.out, render_slurm(args))
    elif args.kind == "deepspeed":
        _write_script(args.out, render_deepspeed(args))
    else:
        jd = render_awsbatch_jobdef(args)
        entry = args.entrypoint_out or str(Path(args.out).with_name("awsbatch_entrypoint.sh"))
        _write_script(entry, render_entrypoint(args))
        atomic_write_text(args.out, json.dumps(jd, indent=2) + "\n")
        print(f"wrote {entry} (copy it into the image at {args.entrypoint})")
    print(f"wrote {args.out}")
    return 0
