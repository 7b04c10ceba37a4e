"""The two GPU calls (``bash scripts/gpu.sh [--dry-run] [--cpu] CALL BUNDLE_DIR``), planned to fit a lent GPU.

A lent GPU comes for 15 minutes of device time in all, a machine start included, at most 10 minutes a command,
and it stays warm only 30 s after a call: two calls of at most 330 s, back to back. Each call is a list of
steps run one after the other against the call's deadline (``CALL_S``, 330 s from the start):

* a step starts only when its expected seconds (the cost table, ``scripts/gpu_costs.json``) fit before the
  deadline; otherwise it is skipped with its line, and a skipped run leaves a ``status: skipped`` record;
* a step is cut at twice its expected seconds or at the deadline, whichever comes first;
* every run appends its record to ``$OUT/rows.jsonl`` the moment it ends (``benchmarks/bench_train.py
  --records``), a run cut at its limit included (``status: timeout``): a call cut short still returns every
  figure it measured.

Install and data are skipped when already done (a warm machine: the call before); work goes under ``$WORK``
(``/tmp/wikipretrain-gpu``), never under ``$OUT`` (what comes back: at most 8 files) nor ``/dev/shm`` (small on
some machines). ``$OUT`` gets ``rows.jsonl``, ``opcheck.json`` (the attention
operator's check), ``versions.txt`` (device, driver, torch, CUDA, DeepSpeed, transformers; ``nvidia-smi``),
``logs.tar.gz`` (every log of the call), and in call 2 ``profile.txt`` and ``tier.txt``.

``--dry-run`` prints each step with its expected seconds and the call's total on a cold machine (install and
data included) and a warm one, and names the cost entries not measured yet. ``--cpu`` runs the same steps on
the CPU at debug sizes (bert-debug, neox-debug, the Trainer on the CPU): what CI runs, not a measurement.

Environment: ``PYTHON`` (default: this interpreter; on the GPU image, python3 is a venv that already holds CUDA
torch: everything is installed into it), ``OUT`` (default runs/gpu), ``WORK``, ``CALL_S``, ``COSTS`` (another
cost table), ``LARGEST=1`` (each side's largest micro-batch too: many more runs), ``LANES`` (3: the tier's
concurrent pytest lanes), ``WIKIPRETRAIN_DEVICE_MEMORY_GIB`` (default 78 on a card bigger than an H100 80GB: what
an H100 leaves its allocator; the tier's lanes share it).

Only the standard library: the call installs the project before anything imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CALL_S = 330.0
"""A call's seconds: two calls and a machine start fit 15 minutes with room to run one step again."""
H100_GIB = 78
"""What an H100 80GB leaves its allocator after the CUDA context and library buffers: the cap on a bigger card."""
MEMORY_CAP_ENV = "WIKIPRETRAIN_DEVICE_MEMORY_GIB"
ROW_STEPS, ROW_WARMUP = 6, 3
"""Measured and warm-up optimizer steps of each timed run."""
SEEN_PASSING = (  # the tier's tests that passed on the H200 on 2026-11-26 (docs/gpu-notes.md): run last
    "test_bert_trains_on_one_gpu",
    "test_lamb_activation_checkpointing_and_background_saves_on_one_gpu",
    "test_neox_trains_on_one_gpu",
    "test_deterministic_resume_is_exact_on_gpu",
)
OOM_TEST = "test_a_micro_batch_out_of_device_memory_is_one_line"


class CallError(Exception):
    """Bad input: one line, exit 2."""


@dataclass(frozen=True)
class Step:
    name: str
    cost: str
    """Its entry in the cost table."""
    kind: str
    """install, versions, data, opcheck, run, tier, archive."""
    row: str | None = None
    only: str | None = None
    """benchmarks/bench_train.py's --only: ours:OPTIMIZER, peer, profile."""
    optional: bool = False
    """Runs only if the deadline allows (not counted in the call's totals)."""
    unless_measured: bool = False
    """Skipped when an earlier call on this machine already measured it (``$WORK/records.jsonl``)."""


def run_step(row: str, only: str, cost: str, **kw) -> Step:
    return Step(f"{row} {only}", cost, "run", row=row, only=only, **kw)


CALLS: dict[str, tuple[Step, ...]] = {
    "call1": (
        Step("install from the bundle", "install", "install"),
        Step("versions and nvidia-smi", "versions", "versions"),
        Step("bert-large-p1 shards", "data-bert128", "data", row="bert-large-p1"),
        Step("neox-1.3b shards", "data-gpt2048", "data", row="neox-1.3b"),
        Step("attention operator check", "opcheck", "opcheck"),
        run_step("bert-large-p1", "ours:lans", "bert-large-p1 ours"),
        run_step("bert-large-p1", "peer", "bert-large-p1 peer"),
        run_step("neox-1.3b", "ours:adamw", "neox-1.3b ours"),
        run_step("neox-1.3b", "peer", "neox-1.3b peer", optional=True),
        Step("logs archive", "archive", "archive"),
    ),
    "call2": (
        Step("install from the bundle", "install", "install"),
        Step("versions and nvidia-smi", "versions", "versions"),
        Step("bert-large-p1 shards", "data-bert128", "data", row="bert-large-p1"),
        Step("bert-large-p2 shards", "data-bert512", "data", row="bert-large-p2"),
        Step("neox-1.3b shards", "data-gpt2048", "data", row="neox-1.3b"),
        run_step("bert-large-p2", "ours:lans", "bert-large-p2 ours"),
        run_step("bert-large-p2", "peer", "bert-large-p2 peer"),
        run_step("neox-1.3b", "peer", "neox-1.3b peer", unless_measured=True),
        run_step("bert-large-p1", "profile", "bert-large-p1 profile"),
        Step("GPU tier (pytest -m cuda) in lanes, to the deadline", "tier", "tier"),
        Step("logs archive", "archive", "archive"),
    ),
}
COLD_ONLY = ("install", "data")
"""Step kinds done once per machine: a warm machine (the call before) skips them."""


# ------------------------------------------------------------------------------------------- the cost table


def load_costs(path: Path) -> dict[str, dict]:
    """The cost table: each entry ``{"seconds": S, "measured": "DATE CARD"}`` or ``{"seconds": S,
    "unmeasured": "why this bound"}`` (``tier``: ``per_test`` and ``tests``, its seconds what the lanes
    need)."""
    try:
        table = json.loads(path.read_text(encoding="utf-8"))["entries"]
    except (OSError, ValueError, KeyError) as e:
        raise CallError(f"{path}: not a cost table ({e})") from None
    for key, entry in table.items():
        if not isinstance(entry.get("seconds"), int | float) or ("measured" in entry) == ("unmeasured" in entry):
            raise CallError(f"{path}: entry {key!r} needs seconds and one of measured/unmeasured")
    return table


def expected(step: Step, costs: dict[str, dict]) -> float:
    if step.cost not in costs:
        raise CallError(f"the cost table has no entry {step.cost!r} (step {step.name})")
    return float(costs[step.cost]["seconds"])


def dry_run(call: str, costs: dict[str, dict], call_s: float) -> int:
    """Each step with its expected seconds and where the figure comes from; the cold and warm totals."""
    steps = CALLS[call]
    cold = sum(expected(s, costs) for s in steps if not s.optional and s.kind != "tier")
    warm = sum(expected(s, costs) for s in steps if not s.optional and s.kind not in ("tier", *COLD_ONLY))
    print(f"{call}: {len(steps)} steps, deadline {call_s:.0f} s after the start")
    for step in steps:
        entry = costs[step.cost]
        secs = expected(step, costs)
        source = f"measured {entry['measured']}" if "measured" in entry else f"UNMEASURED, bound: {entry['unmeasured']}"
        note = " (if the deadline allows; not in the totals)" if step.optional else ""
        note += " (warm: done already)" if step.kind in COLD_ONLY else ""
        note += " (skipped if an earlier call measured it)" if step.unless_measured else ""
        if step.kind == "tier":
            secs = max(secs, call_s - cold)
            note += f" (the rest of the call, at least {expected(step, costs):.0f} s: {tier_need(entry)})"
        print(f"  {secs:6.0f} s  {step.name}{note}  [{step.cost}: {source}]")
    tier = next((s for s in steps if s.kind == "tier"), None)
    if tier is not None:
        least = expected(tier, costs)
        cold, warm = cold + max(least, call_s - cold), warm + max(least, call_s - warm)
    print(f"{call}: cold total {cold:.0f} s (install and data included), warm total {warm:.0f} s")
    unmeasured = sorted({s.cost for s in steps if "unmeasured" in costs[s.cost]})
    print(f"{call}: unmeasured entries: {', '.join(unmeasured) if unmeasured else 'none'}")
    return 0


def tier_need(entry: dict) -> str:
    per, tests, lanes = float(entry["per_test"]), int(entry["tests"]), lanes_wanted()
    need = -(-tests // lanes) * per
    return (
        f"{tests} tests x {per:.0f} s in {lanes} lanes need {need:.0f} s; it stops at the deadline, the tests "
        "not reached listed in tier.txt, those seen passing on 2026-11-26 last"
    )


# ------------------------------------------------------------------------------------------------ the call


def lanes_wanted() -> int:
    return max(1, int(os.environ.get("LANES", "3")))


class Call:
    def __init__(self, call: str, bundle: Path, cpu: bool, costs: dict[str, dict], call_s: float) -> None:
        self.call, self.bundle, self.cpu, self.costs = call, bundle, cpu, costs
        self.py = interpreter()
        self.out = Path(os.environ.get("OUT", "runs/gpu")).resolve()
        self.work = Path(os.environ.get("WORK", "/tmp/wikipretrain-gpu")).resolve()
        self.bench = self.work / "bench"
        self.logs = self.work / "logs"
        self.start = time.monotonic()
        self.cut = False
        self.deadline = self.start + call_s
        self.records = self.out / "rows.jsonl"
        self.history = self.work / "records.jsonl"  # every call's records on this machine
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        self.env.setdefault("OMP_NUM_THREADS", "1" if cpu else "4")
        self.env["TOKENIZERS_PARALLELISM"] = "false"
        self.env["HF_HUB_OFFLINE"] = "1"
        if (bundle / "shared-data").is_dir():
            self.env["WIKIPRETRAIN_SHARED_DATA"] = str(bundle / "shared-data")
        dumps = sorted((bundle / "sample").glob("*.bz2"))
        if dumps:
            self.env["WIKIPRETRAIN_SAMPLE_DUMP"] = str(dumps[0])

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, line: str) -> None:
        stamp = f"[{time.monotonic() - self.start:5.0f}s]"
        print(f"{stamp} {line}", flush=True)
        with open(self.logs / f"{self.call}.log", "a", encoding="utf-8") as f:
            f.write(f"{stamp} {line}\n")

    def run(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.bench.mkdir(parents=True, exist_ok=True)
        self.say(f"{self.call} ({'CPU, debug sizes' if self.cpu else 'GPU'}): {self.left():.0f} s to the deadline")
        failed = []
        for step in CALLS[self.call]:
            ok = self.step(step)
            if ok is False:
                failed.append(step.name)
        self.say(f"{self.call} done, {self.left():.0f} s before the deadline; results in {self.out}")
        if failed:
            self.say(f"steps that did not end well: {', '.join(failed)}")
        return 1 if failed else 0

    def step(self, step: Step) -> bool | None:
        """Run ``step`` if it fits before the deadline: True (done), False (failed), None (skipped)."""
        secs = expected(step, self.costs)
        done = self.already_done(step)
        if done:
            self.say(f"== {step.name}: already done ({done})")
            return True
        if step.kind not in ("tier", "archive") and self.left() < secs:
            self.say(
                f"== {step.name} skipped: expects {secs:.0f} s, {max(self.left(), 0):.0f} s left before the deadline"
            )
            if step.kind == "run":
                self.skipped_record(step, f"expects {secs:.0f} s, {max(self.left(), 0):.0f} s left before the deadline")
            return None
        limit = {"tier": self.left() - 5, "archive": 60.0}.get(step.kind, min(self.left(), 2 * secs))
        limit = max(1.0, limit)
        self.say(f"== {step.name} (expected {secs:.0f} s, cut at {limit:.0f} s)")
        t0 = time.monotonic()
        try:
            ok = getattr(self, f"do_{step.kind}")(step, limit)
        except (OSError, subprocess.SubprocessError, ValueError) as e:  # one step's, never the call's end
            self.say(f"   {type(e).__name__}: {e}")
            ok = False
        self.say(f"== {step.name}: {'done' if ok else 'FAILED'} in {time.monotonic() - t0:.0f} s")
        return ok

    def already_done(self, step: Step) -> str | None:
        if step.kind == "install" and self.installed():
            return "the project and its dependencies import from this checkout"
        if step.unless_measured and self.measured_before(step):
            return f"measured by an earlier call ({self.history})"
        return None

    # ------------------------------------------------------------------ steps

    def command(self, cmd: list[str], name: str, limit: float, stdout: Path | None = None) -> bool:
        """``cmd`` with its output in ``$WORK/logs/NAME.log`` (and ``stdout``), cut at ``limit`` seconds: whether
        it ended well (``self.cut``: whether it was cut)."""
        self.cut = False
        log_path = self.logs / f"{name}.log"
        with open(log_path, "w", encoding="utf-8") as f:
            f.write(f"$ {shlex.join(cmd)}\n")
            f.flush()
            proc = subprocess.Popen(
                cmd, cwd=REPO, env=self.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                end_group(proc)
                self.cut = True
                self.say(f"   cut at {limit:.0f} s; see {log_path}")
                return False
        if stdout is not None:
            shutil.copyfile(log_path, stdout)
        if rc != 0:
            tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
            self.say(f"   exit {rc}: {tail[0] if tail else 'no output'} (see {log_path})")
        return rc == 0

    def installed(self) -> bool:
        probe = "import deepspeed, accelerate, h5py, tokenizers, training; print(training.__file__)"
        res = subprocess.run(
            [self.py, "-c", probe], cwd="/", env=dict(self.env, PYTHONPATH=""), capture_output=True, text=True
        )
        return res.returncode == 0 and Path(res.stdout.strip()).resolve().is_relative_to(REPO)

    def do_install(self, step: Step, limit: float) -> bool:
        if not (self.bundle / "MANIFEST.json").is_file():
            self.say(f"   {self.bundle}: no MANIFEST.json, not a bundle from scripts/gpu_bundle.sh")
            return False
        pip = [self.py, "-m", "pip", "install", "--no-index", "--find-links", str(self.bundle)]
        return self.command([*pip, "wikipretrain[test]"], "install-deps", limit) and self.command(
            [*pip, "--no-deps", "-e", str(REPO)], "install-project", max(1.0, self.left())
        )

    def do_versions(self, step: Step, limit: float) -> bool:
        probe = (
            "import platform, torch, deepspeed, transformers\n"
            "gpu = torch.cuda.is_available()\n"
            "print('device', torch.cuda.get_device_name() if gpu else platform.processor() or 'cpu')\n"
            "print('torch', torch.__version__, 'cuda', torch.version.cuda, 'deepspeed', deepspeed.__version__,"
            " 'transformers', transformers.__version__, 'python', platform.python_version())\n"
        )
        res = subprocess.run(
            [self.py, "-c", probe], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=limit
        )
        found = [line for line in res.stdout.splitlines() if line.startswith(("device ", "torch "))]
        lines = ["\n".join(found) if res.returncode == 0 else f"versions: exit {res.returncode}: {res.stderr[-500:]}"]
        lines.append(f"{MEMORY_CAP_ENV}={self.env.get(MEMORY_CAP_ENV, '')}")
        smi = shutil.which("nvidia-smi")
        lines.append(
            subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout if smi else "no nvidia-smi"
        )
        (self.out / "versions.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        self.say("   " + lines[0].replace("\n", "; "))
        return res.returncode == 0

    def bench_args(self, row: str) -> list[str]:
        """benchmarks/bench_train.py's arguments for ``row`` on this call's device and data."""
        args = [str(REPO / "benchmarks" / "bench_train.py"), "--rows", row, "--work", str(self.bench)]
        if self.cpu:
            return [*args, "--tiny", "--threads", "1"]
        args += ["--steps", str(ROW_STEPS), "--warmup", str(ROW_WARMUP), "--threads", "4"]
        shared = self.bundle / "shared-data"
        for flag, name in (("--vocab", "bert-base-uncased-vocab.txt"), ("--tokenizer", "gpt-neox-20b-tokenizer.json")):
            if (shared / name).is_file():
                args += [flag, str(shared / name)]
        return args + (["--largest"] if os.environ.get("LARGEST") == "1" else [])

    def do_data(self, step: Step, limit: float) -> bool:
        return self.command([self.py, *self.bench_args(str(step.row)), "--data-only"], f"data-{step.row}", limit)

    def do_opcheck(self, step: Step, limit: float) -> bool:
        cmd = [self.py, str(REPO / "scripts" / "check_attention.py"), "--json", str(self.out / "opcheck.json")]
        cmd += ["--device", "cpu", "--size", "bert-debug"] if self.cpu else ["--device", "cuda"]
        return self.command(cmd, "opcheck", limit)

    def do_run(self, step: Step, limit: float) -> bool:
        before = count_lines(self.records)
        cmd = [self.py, *self.bench_args(str(step.row)), "--only", str(step.only), "--records", str(self.records)]
        cmd += ["--port", str(free_port())]  # not bench_train.py's default: another job may use it (CI's benchmarks)
        cmd += ["--timeout", f"{max(1.0, limit - 15):.0f}"]  # the run's own cut leaves its record
        if step.only == "profile":
            cmd += ["--profile-out", str(self.out / "profile.txt")]
        ok = self.command(cmd, f"{step.row}-{str(step.only).replace(':', '-')}", limit)
        new = read_records(self.records)[before:]
        if not new:  # cut before its own limit, or failed before its run: the record bench_train.py did not write
            why = f"cut at its time limit of {limit:.0f} s" if self.cut else "benchmarks/bench_train.py wrote no record"
            self.record(step, "timeout" if self.cut else "failed", f"{why}; see {self.logs}")
            new = read_records(self.records)[before:]
        with open(self.history, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in new)
        for r in new:
            figures = ", ".join(
                f"{k} {r[k]:.4g}" for k in ("sequences_per_sec", "tokens_per_sec", "mfu") if isinstance(r.get(k), float)
            )
            self.say(f"   record: {r['side']} {r['optimizer']} micro {r['micro_batch']}: {r['status']} {figures}")
        self.say(f"   {self.records.name}: {count_lines(self.records)} records")
        return ok and all(r["status"] == "ok" for r in new)

    def skipped_record(self, step: Step, why: str) -> None:
        self.record(step, "skipped", why)
        self.say(f"   {self.records.name}: {count_lines(self.records)} records")

    def record(self, step: Step, status: str, why: str) -> None:
        side, _, optimizer = str(step.only).partition(":")
        rec = {"row": step.row, "side": side, "optimizer": optimizer or None, "status": status, "error": why}
        with open(self.records, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")

    def measured_before(self, step: Step) -> bool:
        side = str(step.only).partition(":")[0]
        return any(
            r.get("row") == step.row and r.get("side") == side and r.get("status") == "ok"
            for r in read_records(self.history)
        )

    def do_tier(self, step: Step, limit: float) -> bool:
        """``pytest -m cuda`` in ``LANES`` concurrent lanes to the deadline, each capped at its share of the
        device's memory (``conftest`` caps the pytest process itself too), the out-of-memory test alone after
        them; ``tier.txt``: each test's outcome, and the tests not reached."""
        tier = self.work / "tier"
        shutil.rmtree(tier, ignore_errors=True)
        tier.mkdir(parents=True)
        ids = self.collect_tier()
        if ids is None:
            return False
        alone = [t for t in ids if OOM_TEST in t]
        rest = sorted((t for t in ids if t not in alone), key=lambda t: any(name in t for name in SEEN_PASSING))
        lanes = [rest[i :: lanes_wanted()] for i in range(lanes_wanted())]
        cap = float(self.env.get(MEMORY_CAP_ENV) or device_gib() or 0)
        procs = []
        for i, lane in enumerate(x for x in lanes if x):
            env = dict(self.env)
            if cap:
                env[MEMORY_CAP_ENV] = f"{cap / len(lanes):.1f}"
            procs.append(self.pytest_lane(tier, f"lane{i}", lane, env))
        for proc in procs:
            wait_or_end(proc, self.left() - 20)
        if alone and self.left() > 60:
            wait_or_end(self.pytest_lane(tier, "alone", alone, dict(self.env)), self.left() - 10)
        return self.tier_report(ids, tier)

    def collect_tier(self) -> list[str] | None:
        cmd = [self.py, "-m", "pytest", "-m", "cuda", "--collect-only", "-q", "-p", "no:cacheprovider"]
        res = subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=120)
        ids = [line.strip() for line in res.stdout.splitlines() if "::" in line]
        if not ids:
            self.say(f"   pytest --collect-only found no cuda tests: {res.stdout.strip()[-300:]}")
            return None
        return ids

    def pytest_lane(self, tier: Path, name: str, ids: list[str], env: dict[str, str]) -> subprocess.Popen:
        cmd = [self.py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "--junitxml", str(tier / f"{name}.xml")]
        log_file = open(self.logs / f"tier-{name}.log", "w", encoding="utf-8")  # noqa: SIM115 (closed with the process)
        self.say(f"   {name}: {len(ids)} tests, memory cap {env.get(MEMORY_CAP_ENV) or 'none'} GiB")
        return subprocess.Popen(
            [*cmd, *ids], cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )

    def tier_report(self, ids: list[str], tier: Path) -> bool:
        outcomes: dict[str, str] = {}
        for xml in sorted(tier.glob("*.xml")):
            try:
                root = ET.parse(xml).getroot()
            except ET.ParseError:
                continue  # a lane cut while writing: its tests count as not reached
            for case in root.iter("testcase"):
                test_id = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
                kids = {child.tag: child for child in case}
                kind = next((k for k in ("failure", "error", "skipped") if k in kids), "passed")
                message = (kids[kind].get("message") or "").splitlines()[0][:200] if kind in kids else ""
                outcomes[test_id] = f"{kind}{': ' + message if message else ''}"
        lines = [f"{t}: {outcomes.get(t, 'not reached before the deadline')}" for t in ids]
        counts: dict[str, int] = {}
        for line in lines:
            word = line.split(": ", 1)[1].split(":")[0]
            counts[word] = counts.get(word, 0) + 1
        summary = ", ".join(f"{n} {word}" for word, n in sorted(counts.items()))
        (self.out / "tier.txt").write_text(f"pytest -m cuda: {summary}\n" + "\n".join(lines) + "\n", encoding="utf-8")
        self.say(f"   tier: {summary}")
        return not any(o.startswith(("failure", "error")) for o in outcomes.values())

    def do_archive(self, step: Step, limit: float) -> bool:
        self.say(f"   archiving {self.logs} and {self.bench / 'logs'}")
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tar:
            tar.add(self.logs, arcname="logs")
            if (self.bench / "logs").is_dir():
                tar.add(self.bench / "logs", arcname="bench-logs")
            if (self.work / "tier").is_dir():
                tar.add(self.work / "tier", arcname="tier")
        return True


def free_port() -> int:
    """A TCP port free on the loopback right now (a run's MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (``/proc``'s parent links), in sessions of their own included: a timed
    run that benchmarks/bench_train.py started in its own session."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s process group, then SIGKILL to what is left once it ended or after 10 s, and to
    every process it started in a session of its own (a cut step leaves nothing on the device)."""
    import signal

    below = descendants(proc.pid)
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    for pid in below:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def wait_or_end(proc: subprocess.Popen, seconds: float) -> None:
    try:
        proc.wait(timeout=max(seconds, 1.0))
    except subprocess.TimeoutExpired:
        end_group(proc)


def read_records(path: Path) -> list[dict]:
    """The records of ``path``; a line that does not parse (a writer killed mid-line) is left out."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def count_lines(path: Path) -> int:
    return len(read_records(path))


def interpreter() -> str:
    """``$PYTHON`` (a path made absolute, not resolved: a venv's python is a link), else this interpreter."""
    py = os.environ.get("PYTHON") or sys.executable
    return os.path.abspath(py) if os.sep in py else py


def has_cuda(py: str) -> bool:
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([py, "-c", probe], capture_output=True).returncode == 0


def device_gib() -> float | None:
    """The first GPU's memory in GiB (``nvidia-smi``), or None."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    res = subprocess.run(
        [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    first = res.stdout.strip().splitlines()[:1]
    return int(first[0]) / 1024 if res.returncode == 0 and first and first[0].strip().isdigit() else None


def memory_cap() -> None:
    """On a card with more memory than an H100 80GB (81,559 MiB), cap every run at ``H100_GIB`` (a value already
    set is kept): what fits the bigger card then fits an H100."""
    gib = device_gib()
    if not os.environ.get(MEMORY_CAP_ENV) and gib is not None and gib * 1024 > 82000:
        os.environ[MEMORY_CAP_ENV] = str(H100_GIB)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bash scripts/gpu.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dry-run", action="store_true", help="print the steps with their expected seconds; run nothing")
    p.add_argument("--cpu", action="store_true", help="run on the CPU at debug sizes (CI; not a measurement)")
    p.add_argument("call", choices=sorted(CALLS))
    p.add_argument("bundle", help="the offline bundle (scripts/gpu_bundle.sh)")
    args = p.parse_args(argv)
    costs = load_costs(Path(os.environ.get("COSTS") or REPO / "scripts" / "gpu_costs.json"))
    try:
        call_s = float(os.environ.get("CALL_S") or CALL_S)
    except ValueError:
        raise CallError(f"CALL_S={os.environ['CALL_S']!r} is not a number of seconds") from None
    for step in CALLS[args.call]:
        expected(step, costs)
    if args.dry_run:
        return dry_run(args.call, costs, call_s)
    bundle = Path(args.bundle)
    if not bundle.is_dir():
        raise CallError(f"{bundle}: no such bundle folder (scripts/gpu_bundle.sh DIR builds one)")
    py = interpreter()
    if not args.cpu and not has_cuda(py):
        raise CallError(f"{py}: import torch sees no CUDA device (torch missing, a CPU build, or no GPU visible)")
    if not args.cpu:
        memory_cap()
    return Call(args.call, bundle.resolve(), args.cpu, costs, call_s).run()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CallError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
