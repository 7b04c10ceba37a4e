"""``python -m launch bundle``: a folder of wheels that installs the project on a machine with no internet.

    python -m launch bundle --out BUNDLE --python-version 3.12 --platform manylinux_2_28_x86_64 \\
        --platform manylinux2014_x86_64 --have torch==2.11.0 --have transformers --sample
    # on the target:  pip install --no-index --find-links BUNDLE wikipretrain

What it does, in order:
1. builds the project's own wheel from this checkout (``pip wheel --no-deps``, in a scratch copy);
2. builds a DeepSpeed wheel from its sdist (the package index has no DeepSpeed wheel) unless the target
   already has a satisfying DeepSpeed: ``DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation
   deepspeed==VERSION`` (ops are compiled just in time on the target, so the wheel is pure Python and fits
   any platform);
3. resolves what the target must install with pip's own resolver (``pip install --dry-run --report`` with
   ``--only-binary=:all: --python-version --platform``; only metadata is fetched). pip runs in a stand-in of
   the target's environment: a folder of bare ``.dist-info`` entries, one per package the target already has
   (from its ``pip freeze`` or ``--have``), so pip keeps what satisfies and upgrades what does not, exactly as
   it will on the target, and never looks at the dependencies of what is already there (torch's CUDA
   libraries);
4. downloads those wheels (``pip download --no-deps --only-binary=:all:``) next to the two built ones, and
   checks that pip, seeing only the bundle (``--no-index --find-links``), installs the project on the target;
5. optionally copies the enwiki sample dump, and writes MANIFEST.json (name, version, size and sha256 of
   each file).

pip evaluates environment markers (``; python_version < "3.12"``) for the interpreter that runs this command,
so run it with the target's Python minor version when the dependencies have such markers.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from common.errors import UserError
from common.log import get_logger
from common.packages import installed_version
from data.sample import sample_dump_path

log = get_logger("bundle")

PROJECT_ROOT = Path(__file__).resolve().parents[1]
MANIFEST = "MANIFEST.json"
SAMPLE_DIR = "sample"

# Wheel platform tags pip understands (PEP 425/600/656 and the legacy manylinux aliases).
_PLATFORM_RE = re.compile(
    r"^(?:(?P<linux>manylinux_\d+_\d+|manylinux1|manylinux2010|manylinux2014|musllinux_\d+_\d+|linux)"
    r"_(?P<lmach>x86_64|i686|aarch64|ppc64le|s390x|armv7l|riscv64)"
    r"|(?P<mac>macosx_\d+_\d+)_(?P<mmach>x86_64|arm64|universal2|intel)"
    r"|(?P<win>win_amd64|win32|win_arm64))$"
)


@dataclass
class Target:
    """The machine the bundle is for: interpreter, platform tags and what it already has installed."""

    python_version: str
    platforms: list[str]
    implementation: str = "cp"
    have: dict[str, str] = field(default_factory=dict)  # canonical name -> version

    def pip_target_args(self) -> list[str]:
        args = ["--only-binary=:all:", "--python-version", self.python_version, "--implementation"]
        args.append(self.implementation)
        for p in self.platforms:
            args += ["--platform", p]
        return args

    def has(self, req: Requirement) -> bool:
        """The target has a distribution that satisfies ``req``."""
        ver = self.have.get(canonicalize_name(req.name))
        return ver is not None and req.specifier.contains(ver, prereleases=True)


def check_platforms(platforms: list[str]) -> None:
    kinds = set()
    for p in platforms:
        m = _PLATFORM_RE.match(p)
        if m is None:
            raise UserError(
                f"--platform {p}: unknown wheel platform tag (e.g. manylinux_2_28_x86_64, "
                "manylinux2014_x86_64, "
                "macosx_11_0_arm64, win_amd64)"
            )
        kinds.add("linux" if m.group("linux") else "mac" if m.group("mac") else "win")
    if len(kinds) > 1:
        raise UserError(f"--platform {' '.join(platforms)}: tags for different operating systems; give one")


def parse_have_line(line: str, where: str) -> tuple[str, str | None] | None:
    """One ``pip freeze`` line (or a --have value) -> (canonical name, version or None); None to skip it."""
    line = line.split("#", 1)[0].strip()
    if not line or line.startswith("-"):  # comments, -e editable installs, options
        return None
    if " @ " in line:  # "name @ file:///..." (a direct install): version not in the line
        name, ver = line.split(" @ ", 1)[0].strip(), None
    elif "==" in line:
        name, _, ver = line.partition("==")
        name, ver = name.strip(), ver.strip()
        try:
            Version(ver)
        except InvalidVersion:
            raise UserError(f"{where}: {line!r} has an invalid version {ver!r}") from None
    else:
        name, ver = line, None
    if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", name):
        raise UserError(f"{where}: {line!r} is neither NAME==VERSION nor NAME")
    return canonicalize_name(name), ver


def read_have(freeze: str | None, have: list[str]) -> dict[str, str]:
    """What the target has: name -> version. A name without a version is taken at this machine's version."""
    out: dict[str, str] = {}
    lines: list[tuple[str, str, bool]] = []
    if freeze:
        path = Path(freeze)
        if not path.is_file():
            raise UserError(f"--target-freeze {freeze}: no such file")
        text = path.read_text(encoding="utf-8")
        lines += [(ln, f"{freeze}:{i}", False) for i, ln in enumerate(text.splitlines(), 1)]
    lines += [(value, f"--have {value}", True) for value in have]
    for line, where, strict in lines:
        got = parse_have_line(line, where)
        if got is None:
            continue
        name, ver = got
        if ver is None:
            ver = installed_version(name)
            if ver is None:
                if strict:
                    raise UserError(f"{where}: no version given and {name} is not installed here; use NAME==VERSION")
                continue  # a freeze line without a version for a package unknown here: not counted as present
            log.info(f"{where}: no version given; taking this machine's {name}=={ver}")
        out[name] = ver
    return out


def _pip_error(output: str) -> str:
    """The informative line of a failed pip run."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln.removeprefix("ERROR:").strip() for ln in lines if ln.startswith("ERROR:")]
    errors = [e for e in errors if not e.startswith("Ignored the following")] or errors
    return (errors or lines or ["(no output)"])[-1]


def pip(
    args: list[str],
    what: str,
    env: dict[str, str] | None = None,
    isolated: bool = False,
) -> str:
    """Run ``python -m pip ARGS`` (``python -S`` when ``isolated``); a failure becomes one line."""
    cmd = [sys.executable, *(["-S"] if isolated else []), "-m", "pip", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        err = _pip_error(res.stderr + "\n" + res.stdout)
        m = re.match(r"No matching distribution found for (\S+)", err)
        if m and "--only-binary=:all:" in args:
            err = f"{m.group(1)} has no wheel for this target on the package index (sdists cannot be bundled)"
        raise UserError(f"{what}: {err}")
    return res.stdout


def wheel_metadata(whl: Path) -> dict[str, Any]:
    """Name, version, requirements and extras from a wheel's METADATA."""
    with zipfile.ZipFile(whl) as z:
        names = [n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        if not names:
            raise UserError(f"{whl}: not a wheel (no .dist-info/METADATA)")
        msg = Parser().parsestr(z.read(names[0]).decode("utf-8"))
    return {
        "name": msg["Name"],
        "version": msg["Version"],
        "requires_dist": msg.get_all("Requires-Dist") or [],
        "provides_extra": [canonicalize_name(e) for e in msg.get_all("Provides-Extra") or []],
    }


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_project_wheel(src: Path, dest: Path) -> Path:
    """The project's wheel, built from a scratch copy of the checkout (which so gets no build/ folder)."""
    if not (src / "pyproject.toml").is_file():
        raise UserError(f"{src}: no pyproject.toml; run the bundle command from a source checkout (or --project)")
    skip = shutil.ignore_patterns(
        ".git",
        ".venv",
        "venv",
        "runs",
        "build",
        "dist",
        "*.egg-info",
        "__pycache__",
        ".*_cache",
        "wandb",
        "*.tmp",
    )
    with tempfile.TemporaryDirectory(prefix="bundle-src-") as tmp:
        copy = Path(tmp) / "src"
        shutil.copytree(src, copy, ignore=skip, symlinks=True)
        before = set(dest.glob("*.whl"))
        args = ["wheel", "--no-deps", "-q", "-w", str(dest)]
        if importlib.util.find_spec("setuptools") is not None:
            args.append("--no-build-isolation")  # the build backend is here: no network needed for it
        pip([*args, str(copy)], f"{src}: building the project wheel")
    new = sorted(set(dest.glob("*.whl")) - before)
    if len(new) != 1:
        raise UserError(f"{src}: building the project wheel produced {len(new)} wheels, expected 1")
    return new[0]


def deepspeed_version(spec: Requirement, wanted: str | None) -> str:
    """The DeepSpeed to build: --deepspeed, else the one installed here if it fits, else the newest."""
    if wanted:
        if not spec.specifier.contains(wanted, prereleases=True):
            raise UserError(f"--deepspeed {wanted}: the project requires {spec}")
        return wanted
    here = installed_version("deepspeed")
    if here and spec.specifier.contains(here, prereleases=True):
        return Version(here).public
    return ""


def build_deepspeed_wheel(spec: Requirement, wanted: str | None, dest: Path) -> Path:
    """A pure-Python DeepSpeed wheel built from the sdist with DS_BUILD_OPS=0 (needs torch installed here)."""
    ver = deepspeed_version(spec, wanted)
    req = f"deepspeed=={ver}" if ver else str(spec)
    env = dict(os.environ, DS_BUILD_OPS="0")
    before = set(dest.glob("*.whl"))
    args = [
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-binary",
        "deepspeed",
        "-q",
        "-w",
        str(dest),
        req,
    ]
    pip(args, f"{req}: building the DeepSpeed wheel from its sdist", env=env)
    new = sorted(p for p in set(dest.glob("*.whl")) - before if p.name.lower().startswith("deepspeed-"))
    if len(new) != 1:
        raise UserError(f"{req}: building the DeepSpeed wheel produced {len(new)} wheels, expected 1")
    if not new[0].name.endswith("-py3-none-any.whl"):
        raise UserError(f"{new[0].name}: the DeepSpeed wheel is platform-specific; rebuild with DS_BUILD_OPS=0")
    return new[0]


def stand_in_site(target: Target, scratch: Path) -> Path:
    """A folder pip reads as the target's site-packages: a bare ``.dist-info`` per package it already has."""
    site = scratch / "target-site"
    site.mkdir()
    for name, ver in sorted(target.have.items()):
        info = site / f"{name.replace('-', '_')}-{ver}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n")
        (info / "INSTALLER").write_text("stand-in\n")
    return site


def resolve(target: Target, roots: list[str], scratch: Path, offline_from: Path | None = None) -> list[dict]:
    """What pip would install on the target for ``roots`` (metadata only): the entries of its install report.

    pip runs as ``python -S`` (no site-packages of this environment) with only itself and the stand-in site on
    its path, so "already installed" means "the target has it". With ``offline_from``, pip sees nothing but
    that folder (``--no-index --find-links``, no configuration file, no PIP_* variable), as on the target.
    """
    import pip as _pip  # on call: only resolving runs pip, and an environment may lack it

    work = scratch / ("verify" if offline_from else "resolve")
    pip_root = work / "pip-root"
    pip_root.mkdir(parents=True)
    (pip_root / "pip").symlink_to(Path(_pip.__file__).resolve().parent, target_is_directory=True)
    site = stand_in_site(target, work)
    env = dict(os.environ, PYTHONPATH=f"{pip_root}{os.pathsep}{site}", PYTHONNOUSERSITE="1")
    args = ["install", "--dry-run", "-q", "--report", str(work / "report.json"), *target.pip_target_args()]
    what = f"resolving for python {target.python_version} / {' '.join(target.platforms)}"
    if offline_from is not None:
        env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull
        args += ["--no-index", "--find-links", str(offline_from)]
        what = f"checking that {offline_from} installs offline"
    pip([*args, *roots], what, env=env, isolated=True)
    return json.loads((work / "report.json").read_text())["install"]


def download_build_backend(project: Path, target: Target, out: Path, scratch: Path) -> set[str]:
    """Wheels of the project's [build-system] requires, so ``pip install -e .`` works offline on the target
    (pip's build isolation installs them from the bundle). Returns their canonical names."""
    try:
        import tomllib  # on call: Python 3.10 lacks it, and only --build-backend reads a pyproject.toml
    except ImportError:  # Python 3.10
        raise UserError("--build-backend reads pyproject.toml with tomllib: run with Python >= 3.11") from None
    path = project / "pyproject.toml"
    try:
        requires = tomllib.loads(path.read_text(encoding="utf-8"))["build-system"]["requires"]
    except (tomllib.TOMLDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{path}: no readable [build-system] requires ({e})") from None
    dest = scratch / "build-backend"
    args = ["download", "-q", "-d", str(dest), *target.pip_target_args(), *requires]
    log.info(f"downloading the build backend: {' '.join(requires)}")
    pip(args, f"{path}: downloading the build backend {' '.join(requires)}")
    names: set[str] = set()
    for whl in dest.glob("*.whl"):
        names.add(canonicalize_name(str(wheel_metadata(whl)["name"])))
        if not (out / whl.name).exists():
            shutil.copy2(whl, out / whl.name)
    return names


def build_bundle(
    out: Path,
    target: Target,
    extras: list[str],
    sample: bool = False,
    project: Path = PROJECT_ROOT,
    deepspeed: str | None = None,
    build_backend: bool = False,
) -> dict:
    """Write the bundle into ``out`` (absent, empty or a previous bundle) and return the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bundle-") as tmp:
        scratch = Path(tmp)
        built = scratch / "built"
        built.mkdir()
        proj_whl = build_project_wheel(project, built)
        meta = wheel_metadata(proj_whl)
        proj_name = canonicalize_name(str(meta["name"]))
        extras = [canonicalize_name(x) for x in extras]
        unknown = [x for x in extras if x not in meta["provides_extra"]]
        if unknown:
            raise UserError(
                f"--extras {','.join(unknown)}: {meta['name']} has no such extra "
                f"(it has: {', '.join(meta['provides_extra']) or 'none'})"
            )
        target.have.pop(proj_name, None)  # the bundle always carries the project itself
        requires = [str(r) for r in meta["requires_dist"]]

        local: dict[str, Path] = {proj_name: proj_whl}
        ds_req = next((Requirement(r) for r in requires if canonicalize_name(Requirement(r).name) == "deepspeed"), None)
        if ds_req is not None and not target.has(ds_req):
            log.info("building DeepSpeed from its sdist (DS_BUILD_OPS=0) ...")
            local["deepspeed"] = build_deepspeed_wheel(ds_req, deepspeed, built)

        extra_s = f"[{','.join(extras)}]" if extras else ""
        roots = [f"{proj_name}{extra_s} @ {proj_whl.as_uri()}"]
        roots += [f"{name} @ {whl.as_uri()}" for name, whl in local.items() if name != proj_name]
        log.info(f"resolving {proj_name}{extra_s} for python {target.python_version} / {' '.join(target.platforms)}")
        wanted = resolve(target, roots, scratch)

        # Clear a previous bundle's files only now that the new one resolved.
        for old in [*out.glob("*.whl"), out / MANIFEST, out / SAMPLE_DIR]:
            if old.is_dir():
                shutil.rmtree(old)
            elif old.exists():
                old.unlink()
        pins = []
        for e in wanted:
            name = canonicalize_name(e["metadata"]["name"])
            if name in local:
                shutil.copy2(local[name], out / local[name].name)
            else:
                pins.append(f"{name}=={e['metadata']['version']}")
        if pins:
            log.info(f"downloading {len(pins)} wheels: {' '.join(sorted(pins))}")
            args = ["download", "--no-deps", "-q", "-d", str(out), *target.pip_target_args(), *sorted(pins)]
            pip(args, f"downloading for python {target.python_version} / {' '.join(target.platforms)}")
        backend: set[str] = set()
        if build_backend:
            backend = download_build_backend(project, target, out, scratch)
        # The proof: pip, seeing only the bundle and the target's packages, installs the project.
        check = resolve(target, [f"{proj_name}{extra_s}"], scratch, offline_from=out)
        log.info(f"checked: pip --no-index --find-links {out} installs {len(check)} packages on the target")

    files: list[dict[str, Any]] = []
    for whl in sorted(out.glob("*.whl")):
        m = wheel_metadata(whl)
        name = canonicalize_name(str(m["name"]))
        source = "built" if name in local else "index"
        if name in backend and name not in {canonicalize_name(e["metadata"]["name"]) for e in wanted}:
            source = "build-backend"
        files.append(
            {
                "file": whl.name,
                "name": name,
                "version": m["version"],
                "source": source,
                "size": whl.stat().st_size,
                "sha256": sha256(whl),
            }
        )
    if sample:
        dump = sample_dump_path()
        (out / SAMPLE_DIR).mkdir()
        dst = out / SAMPLE_DIR / dump.name
        shutil.copy2(dump, dst)
        files.append(
            {
                "file": f"{SAMPLE_DIR}/{dump.name}",
                "name": "enwiki-sample",
                "version": "",
                "source": "sample",
                "size": dst.stat().st_size,
                "sha256": sha256(dst),
            }
        )
    manifest = {
        "project": proj_name,
        "version": meta["version"],
        "extras": extras,
        "python_version": target.python_version,
        "implementation": target.implementation,
        "platforms": target.platforms,
        "target_has": {k: v for k, v in sorted(target.have.items())},
        "upgraded": sorted(
            f"{f['name']} {target.have[f['name']]} -> {f['version']}" for f in files if f["name"] in target.have
        ),
        "install": f"pip install --no-index --find-links {out} '{proj_name}{extra_s}'",
        "total_bytes": sum(f["size"] for f in files),
        "files": files,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="bundle folder (absent, empty, or a previous bundle)")
    parser.add_argument(
        "--python-version",
        default=f"{sys.version_info[0]}.{sys.version_info[1]}",
        help="target interpreter, e.g. 3.12 (default: this one)",
    )
    parser.add_argument(
        "--platform",
        action="append",
        default=None,
        help="target wheel platform tag, repeatable (e.g. manylinux_2_28_x86_64); default: this one",
    )
    parser.add_argument("--implementation", default="cp", help="target Python implementation tag (default cp)")
    parser.add_argument(
        "--target-freeze",
        default=None,
        help="the target's `pip freeze`: what it has is left out of the bundle",
    )
    parser.add_argument(
        "--have",
        action="append",
        default=[],
        help="NAME==VERSION (or NAME, any version) the target already has; repeatable",
    )
    parser.add_argument("--extras", default="", help="comma list of the project's extras to include (e.g. wandb)")
    parser.add_argument("--deepspeed", default=None, help="DeepSpeed version to build (default: the one here)")
    parser.add_argument("--sample", action="store_true", help="also carry the enwiki sample dump (sample/*.bz2)")
    parser.add_argument(
        "--build-backend",
        action="store_true",
        help="also carry the build backend (setuptools), so `pip install -e .` of a checkout works offline",
    )
    parser.add_argument("--project", default=str(PROJECT_ROOT), help="source checkout to build (default: this one)")


def host_platforms() -> list[str]:
    """This machine's most specific manylinux tag and the manylinux2014 alias (pip accepts older ones too)."""
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    if plat.startswith("linux_"):
        machine = plat.removeprefix("linux_")
        libc, ver = platform.libc_ver()
        if libc == "glibc" and ver:
            major, minor = ver.split(".")[:2]
            return [f"manylinux_{major}_{minor}_{machine}", f"manylinux2014_{machine}", f"linux_{machine}"]
    return [plat]


def run(args: argparse.Namespace) -> int:
    if not re.fullmatch(r"3\.\d{1,2}", args.python_version):
        raise UserError(f"--python-version {args.python_version}: expected MAJOR.MINOR such as 3.12")
    platforms = args.platform or host_platforms()
    check_platforms(platforms)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise UserError(f"--out {out}: folder is not empty and holds no {MANIFEST}; give a new or empty folder")
    target = Target(args.python_version, platforms, args.implementation, read_have(args.target_freeze, args.have))
    extras = [x.strip() for x in args.extras.split(",") if x.strip()]
    m = build_bundle(
        out,
        target,
        extras,
        sample=args.sample,
        project=Path(args.project),
        deepspeed=args.deepspeed,
        build_backend=args.build_backend,
    )
    width = max((len(f["file"]) for f in m["files"]), default=10)
    for f in m["files"]:
        print(f"{f['file']:<{width}}  {f['size'] / 2**20:8.2f} MiB  {f['source']}")
    print(f"{len(m['files'])} files, {m['total_bytes'] / 2**20:.1f} MiB in {out}")
    print(f"on the target: {m['install']}")
    return 0
