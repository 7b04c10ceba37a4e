"""Cluster profiles (``configs/cluster/*.yaml``) and the ``.deepspeed_env`` file written from them.

Why a file: DeepSpeed's launcher (``deepspeed/launcher/runner.py``) forwards to the other nodes only variables
whose names start with NCCL, PYTHON, UCX, MV2, MLFLOW (plus the accelerator's own list), and the KEY=VALUE
lines of ``.deepspeed_env`` found in ``~`` or the working directory (name overridable with ``DS_ENV_FILE``).
FI_*, GLOO_*, LD_LIBRARY_PATH reach the remote ranks only through that file.

Two details of runner.py shape the format:

* every line is split on the first ``=`` with no comment or blank-line handling, so the file holds nothing
  else;
* with ``--no_ssh`` the runner does not read the file at all, so our job scripts also ``source`` it on every
  node (``set -a; . .deepspeed_env; set +a``). Values are therefore restricted to characters that mean the
  same to the shell and to the runner (pdsh exports them unquoted): no spaces, quotes, ``$``, ``;``,
  backticks.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.atomic import atomic_write_text
from common.errors import UserError

REPO = Path(__file__).resolve().parents[1]
PROFILE_DIR = REPO / "configs" / "cluster"

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SAFE_VALUE_RE = re.compile(r"^[A-Za-z0-9_./:,=+@%^-]*$")
_REF_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class EnvVar:
    name: str
    value: str
    why: str


@dataclass(frozen=True)
class Profile:
    """A cluster profile: environment variables (each with its reason) and the facts cost projections need."""

    name: str
    path: Path
    description: str = ""
    env: tuple[EnvVar, ...] = ()
    accelerator: str | None = None
    accelerators_per_node: int | None = None
    instance_type: str | None = None
    price_per_instance_hour: float | None = None
    efa_devices: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def profile_path(name_or_path: str) -> Path:
    """A profile name (``efa``) maps to ``configs/cluster/efa.yaml``; anything with a suffix or slash is a
    path."""
    if name_or_path.endswith((".yaml", ".yml")) or os.sep in name_or_path:
        return Path(name_or_path)
    return PROFILE_DIR / f"{name_or_path}.yaml"


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str) -> Profile:
    """Load and validate a profile; every problem is a one-line UserError naming the file and key."""
    path = profile_path(name_or_path)
    if not path.is_file():
        raise UserError(f"cluster profile {path} not found (known profiles: {', '.join(available_profiles())})")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping at the top level")
    env_raw = raw.get("env", {}) or {}
    if not isinstance(env_raw, dict):
        raise UserError(f"{path}: 'env' must be a mapping NAME: {{value: ..., why: ...}}")
    env: list[EnvVar] = []
    for name, spec in env_raw.items():
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise UserError(f"{path}: env name {name!r} is not a valid variable name")
        if not isinstance(spec, dict) or "value" not in spec:
            raise UserError(f"{path}: env.{name} must be a mapping with 'value' and 'why'")
        why = str(spec.get("why", "") or "").strip()
        if not why:
            raise UserError(f"{path}: env.{name} has no 'why' (every variable says why it is set)")
        env.append(EnvVar(name, str(spec["value"]), why))

    def opt_num(key: str, kind: type) -> Any:
        v = raw.get(key)
        if v is None:
            return None
        try:
            num = kind(v)
        except (TypeError, ValueError):
            raise UserError(f"{path}: {key} must be a number (got {v!r})") from None
        if num <= 0:
            raise UserError(f"{path}: {key} must be positive (got {v!r})")
        return num

    known = {"name", "description", "env", "accelerator", "accelerators_per_node", "instance_type"}
    known |= {"price_per_instance_hour", "efa_devices"}
    return Profile(
        name=str(raw.get("name", path.stem)),
        path=path,
        description=str(raw.get("description", "")),
        env=tuple(env),
        accelerator=raw.get("accelerator"),
        accelerators_per_node=opt_num("accelerators_per_node", int),
        instance_type=raw.get("instance_type"),
        price_per_instance_hour=opt_num("price_per_instance_hour", float),
        efa_devices=int(raw.get("efa_devices", 0) or 0),
        extra={k: v for k, v in raw.items() if k not in known},
    )


def resolve_env(profile: Profile, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Expand ``${VAR}`` from ``environ`` and check each value is safe both for the runner and for ``source``.

    An expansion that leaves an empty path element (``a::b`` or a trailing ``:``) is tidied, so an unset
    LD_LIBRARY_PATH does not add the current directory to the loader path.
    """
    environ = dict(os.environ if environ is None else environ)
    out: dict[str, str] = {}
    for var in profile.env:
        value = _REF_RE.sub(lambda m: environ.get(m.group(1), ""), var.value)
        if var.value != value and ":" in value:
            value = ":".join(p for p in value.split(":") if p)
        if not _SAFE_VALUE_RE.match(value):
            raise UserError(
                f"{profile.path}: env.{var.name} expands to {value!r}, which has characters (space, quote, "
                "$, ;, backtick, ...) that DeepSpeed's runner would pass unquoted to the shell"
            )
        out[var.name] = value
    return out


def render_env_file(profile: Profile, environ: dict[str, str] | None = None) -> str:
    """The ``.deepspeed_env`` text: KEY=VALUE lines only (runner.py cannot skip comments or blank lines)."""
    return "".join(f"{k}={v}\n" for k, v in resolve_env(profile, environ).items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile", required=True, help=f"profile name ({', '.join(available_profiles())}) or YAML path"
    )
    parser.add_argument("--out", default=".deepspeed_env", help="file to write (default: ./.deepspeed_env)")
    parser.add_argument("--explain", action="store_true", help="also print each variable with why it is set")


def run(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    text = render_env_file(profile)
    atomic_write_text(args.out, text)
    print(f"wrote {args.out} ({len(profile.env)} variables from {profile.path})")
    if args.explain:
        for var in profile.env:
            print(f"  {var.name}={var.value}\n      why: {var.why}")
    return 0
