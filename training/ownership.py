"""One live owner per run directory and checkpoint directory: the owner's mark, its renewal, how a newcomer
judges a mark another job left, and the fence that stops a holder whose mark was taken over.

The mark is a small JSON file, ``DIR/.owner``, inside each directory a job writes (``run.dir`` and
``checkpoint.dir``), so one directory mounted at different paths on two nodes still has one owner. It names its
holder in a way that holds in containers: host name, boot id, PID namespace, pid and the process's start time
(``/proc/PID/stat``), the job id (Slurm's, AWS Batch's, ``launch elastic``'s), when it was taken and a renewal
counter, and a random token that is the holder's identity for every check.

- **Taking it.** A fresh mark is created with ``O_CREAT | O_EXCL``: of two jobs that start together exactly one
  gets it. A mark left by a holder that is gone is replaced by rename, after the breaker claimed that very mark
  with a hard link (``link`` fails for all but one breaker), so two newcomers never both take it.
- **Judging a mark.** Its holder is *provably gone* when it ran under this boot and PID namespace and its pid
  is not alive with the same start time: the next start proceeds at once. Otherwise the newcomer watches the
  mark: a holder renews it every ``renew_s`` (a rewrite by rename, from a background thread), and any change
  of its bytes while the newcomer watches is a sign of life: the newcomer is refused (``RunOwned``, exit 2).
  A mark that does not change for ``run.owner_stale_s`` (and at least its holder's own bound) is stale and may
  be taken over. No clock of another host and no file time is ever compared.
- **Fencing.** The holder's processes check that the mark still holds their token before each checkpoint
  commit, metrics row and event (``fence``); a holder whose mark was taken over stops with one line and exit 4.
- **Releasing.** A job that ends in order (finished, stopped after SIGTERM, a one-line error, a lost peer)
  removes its marks. A job killed outright leaves them, and the table in the README says what the next start
  does.

Under ``train.py`` rank 0 holds the marks (``take``, right after the process group starts); under ``launch
elastic`` the supervisor holds them for the whole job and its ranks carry its token in ``TOKEN_ENV``. The
renewal thread reads and writes only these files: it never touches the accelerator or the process group.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from common.errors import EXIT_PEER_LOST, SUPERVISED_ENV, UserError
from common.log import get_logger

log = get_logger("train")

MARK = ".owner"
TOKEN_ENV = "WIKIPRETRAIN_OWNER_TOKEN"
"""The holder's token, given by ``launch elastic`` to its agent and ranks: they run under their supervisor's
mark, which its restarts never have to take again."""
PAUSE_ENV = "WIKIPRETRAIN_OWNER_PAUSE_FILE"
"""Test hook: while the file this names exists, the holder skips its renewals (a long pause, a partition)."""
HOLD_ENV = "WIKIPRETRAIN_OWNER_HOLD_FILE"
"""Test hook: a ``train.py`` job that took the marks waits, renewing, while the file this names exists, before
anything else: two jobs that start together overlap, however fast the one that wins would finish."""
RENEW_MAX_S = 2.0
RENEWALS_PER_BOUND = 6
POLL_S = 0.1
EXIT_FENCED = EXIT_PEER_LOST


def renew_period(stale_s: float) -> float:
    """How often a holder renews its mark: six times within the staleness bound, at least every 2 s, so that
    a newcomer sees a live holder renew within seconds."""
    return min(RENEW_MAX_S, stale_s / RENEWALS_PER_BOUND)


class RunOwned(UserError):
    """A live job owns the directory: this start is refused, having written nothing (exit 2, no event)."""


# ------------------------------------------------------------------------------------------ identity


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def boot_id() -> str | None:
    return _read("/proc/sys/kernel/random/boot_id")


def pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def start_ticks(pid: int) -> int | None:
    """Process ``pid``'s start time in clock ticks since boot (``/proc/PID/stat`` field 22), None when no
    such process is visible."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    try:  # the command name (field 2) is in parentheses and may hold spaces: count after its last one
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def job_id(elastic: str | None = None) -> str | None:
    """The scheduler's job id where there is one (an AWS Batch node's ``JOB#NODE`` as its job), else
    ``launch elastic``'s; with the scheduler's attempt (``SLURM_RESTART_COUNT``, ``AWS_BATCH_JOB_ATTEMPT``)
    as ``ID.N`` from the second on: a requeued or retried job keeps its id but is another job here, and the
    nodes of ``launch elastic`` that join under their host's mark (``joinable``) must not take the previous
    instance's for theirs."""
    base = elastic
    for name in ("SLURM_JOB_ID", "AWS_BATCH_JOB_ID"):
        v = os.environ.get(name, "").split("#")[0]
        if v:
            base = v
            break
    slurm, aws = os.environ.get("SLURM_RESTART_COUNT", "0"), os.environ.get("AWS_BATCH_JOB_ATTEMPT", "1")
    attempt = slurm if slurm != "0" else aws if aws != "1" else None  # Slurm counts from 0, AWS Batch from 1
    return f"{base}.{attempt}" if base and attempt else base


@dataclass(frozen=True)
class Mark:
    """What ``DIR/.owner`` holds."""

    token: str
    host: str
    boot_id: str | None
    pid_ns: str | None
    pid: int
    start_ticks: int | None
    role: str
    """What holds it: ``train.py rank 0`` or ``launch elastic``."""
    job: str | None
    rendezvous: str | None
    """``launch elastic``'s rendezvous endpoint: the other nodes of its job join under it."""
    acquired: float
    """When it was taken, by the holder's clock (reported, never compared)."""
    renewals: int
    renewed: float
    renew_s: float
    stale_s: float

    def to_json(self) -> bytes:
        return (json.dumps({"format": 1, **asdict(self)}, sort_keys=True) + "\n").encode()

    @staticmethod
    def from_json(raw: bytes) -> Mark | None:
        try:
            d = json.loads(raw)
            return Mark(**{f.name: d[f.name] for f in fields(Mark)})
        except (ValueError, TypeError, KeyError):
            return None

    def describe(self) -> str:
        job = f", job {self.job}" if self.job else ""
        return (
            f"host {self.host}, pid {self.pid} ({self.role}{job}), since {when(self.acquired)}, last renewal "
            f"#{self.renewals} at {when(self.renewed)} by its clock"
        )


def when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def new_mark(token: str, role: str, stale_s: float, job: str | None, rendezvous: str | None = None) -> Mark:
    now, pid = time.time(), os.getpid()
    return Mark(
        token=token,
        host=socket.gethostname(),
        boot_id=boot_id(),
        pid_ns=pid_namespace(),
        pid=pid,
        start_ticks=start_ticks(pid),
        role=role,
        job=job,
        rendezvous=rendezvous,
        acquired=now,
        renewals=0,
        renewed=now,
        renew_s=renew_period(stale_s),
        stale_s=stale_s,
    )


@dataclass(frozen=True)
class Seen:
    """A mark as read: its bytes (None: no mark) and what they say (None: unreadable, e.g. being written)."""

    raw: bytes | None
    mark: Mark | None


def read_mark(directory: Path) -> Seen:
    try:
        raw = (directory / MARK).read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return Seen(None, None)
    return Seen(raw, Mark.from_json(raw))


def provably_gone(mark: Mark) -> bool:
    """The holder ran under this boot and in this PID namespace, and no process with its pid and start time
    is alive."""
    if mark.boot_id is None or mark.boot_id != boot_id() or mark.pid_ns != pid_namespace():
        return False
    return start_ticks(mark.pid) != mark.start_ticks


# ------------------------------------------------------------------------------------------ judging


@dataclass
class Verdict:
    directory: Path
    seen: Seen
    state: str  # free | gone | stale | forced
    waited_s: float = 0.0


def _bound(stale_s: float, seen: Seen) -> float:
    """How long a newcomer watches a mark for a renewal: ``stale_s``, or its holder's own bound if longer."""
    return max(stale_s, seen.mark.stale_s if seen.mark else 0.0)


def refusal(v_dir: Path, seen: Seen, stale_s: float, waited_s: float) -> str:
    m = seen.mark
    who = m.describe() if m else "a holder whose mark is being written"
    ends = f"pid {m.pid} on {m.host} ends" if m else "that job ends"
    return (
        f"{v_dir} is owned by a live job: {who}; it renewed its mark {waited_s:.1f} s into this start's watch. "
        f"This job is refused and wrote nothing. A start proceeds at once when {ends}, or after its mark has "
        f"gone unrenewed for {_bound(stale_s, seen):g} s (run.owner_stale_s); run.takeover=true breaks it"
    )


def judge(dirs: Sequence[Path], stale_s: float, force: bool = False) -> list[Verdict]:
    """Each directory's mark judged: free, gone (provably), stale (watched for its bound without a change) or
    forced (``run.takeover``). Raises ``RunOwned`` as soon as a watched mark changes: its holder lives."""
    verdicts = []
    for d in dirs:
        seen = read_mark(d)
        state = "free" if seen.raw is None else "gone" if seen.mark and provably_gone(seen.mark) else "watch"
        if state == "watch" and force:
            state = "forced"
        verdicts.append(Verdict(d, seen, state))
    watched = [v for v in verdicts if v.state == "watch"]
    t0 = time.monotonic()
    said = False
    while watched:
        time.sleep(POLL_S)
        waited = time.monotonic() - t0
        for v in list(watched):
            now = read_mark(v.directory)
            if now.raw is None:  # released while watched: free (the create below settles a race)
                v.seen, v.state = now, "free"
            elif now.raw != v.seen.raw:
                raise RunOwned(refusal(v.directory, now, stale_s, waited))
            elif v.seen.mark and provably_gone(v.seen.mark):
                v.state = "gone"
            elif waited >= _bound(stale_s, v.seen):
                v.state = "stale"
            else:
                continue
            v.waited_s = waited
            watched.remove(v)
        if watched and not said and waited > 3 * max(v.seen.mark.renew_s if v.seen.mark else 0 for v in watched):
            said = True  # not renewed within three of its periods: say why this start waits
            v = watched[0]
            who = v.seen.mark.describe() if v.seen.mark else "an unreadable mark"
            log.warning(
                f"{v.directory}: held by {who}, which has not renewed it for {waited:.0f} s: waiting up to "
                f"{_bound(stale_s, v.seen):g} s (run.owner_stale_s) for a renewal before taking it over"
            )
    return verdicts


# ------------------------------------------------------------------------------------------ writing marks


def _create(directory: Path, mark: Mark) -> bool:
    """A fresh mark, atomically: False when one appeared since it was judged (another job won)."""
    directory.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(directory / MARK, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, mark.to_json())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _replace(directory: Path, mark: Mark) -> None:
    """Write ``mark`` over the mark, atomically (a temporary file of this holder's, then rename)."""
    tmp = directory / f"{MARK}.{mark.token}.tmp"
    tmp.write_bytes(mark.to_json())
    os.replace(tmp, directory / MARK)


def _claim(directory: Path, seen: Seen) -> Path:
    """The name that claims the mark judged (``seen``) for one writer: a newcomer breaking it or its holder
    renewing it. Each claims that very file with a hard link of this name, which only one can make."""
    assert seen.raw is not None
    return directory / f"{MARK}.claim-{hashlib.sha256(seen.raw).hexdigest()[:16]}"


NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS)
"""``link(2)`` refused by the filesystem (object-store mounts, SMB, exFAT): the mark is written without a claim."""
DEAD_CLAIM_S = 5.0
"""A claim held this long is a writer's that died holding it (a claim is held for milliseconds)."""


def _link(directory: Path, claim: Path) -> str:
    """Make ``claim``: ``made``; ``held`` by another writer; ``gone``, no mark to claim; or ``no links`` where
    the filesystem makes none (``NO_LINKS``). Every writer of a mark claims it through this."""
    try:
        os.link(directory / MARK, claim)
        return "made"
    except FileExistsError:
        return "held"
    except FileNotFoundError:
        return "gone"
    except OSError as e:
        if e.errno not in NO_LINKS:
            raise
        return "no links"


def _write_claimed(directory: Path, claim: Path, seen: Seen, mark: Mark | None) -> bool:
    """Once ``claim`` is made: ``mark`` over the mark (None: the mark removed), unless the mark claimed is no
    longer the one judged, or the claim was taken from this writer as a dead one's (``DEAD_CLAIM_S``)."""
    try:
        if claim.read_bytes() != seen.raw:
            return False
        _put(directory, mark)
        return True
    except FileNotFoundError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            claim.unlink()


def _unclaimed(directory: Path, seen: Seen, mark: Mark | None) -> bool:
    """On a filesystem without hard links: ``mark`` over the mark (None: removed) if it is still the one
    judged, without the claim's exclusion (a takeover in the same instant can be written over)."""
    if read_mark(directory).raw != seen.raw:
        return False
    _put(directory, mark)
    return True


def _put(directory: Path, mark: Mark | None) -> None:
    """``mark`` over the mark, or (None) the mark removed."""
    if mark is None:
        (directory / MARK).unlink(missing_ok=True)
    else:
        _replace(directory, mark)


def _break(directory: Path, seen: Seen, mark: Mark) -> bool:
    """Replace the mark judged (``seen``) by ``mark``, unless another newcomer breaks it first, its holder
    renews it meanwhile, or it changed since (``_claim``)."""
    claim = _claim(directory, seen)
    for _ in range(2):
        got = _link(directory, claim)
        if got == "made":
            return _write_claimed(directory, claim, seen, mark)
        if got == "gone":
            return False  # released meanwhile: judge again
        if got == "no links":
            return _unclaimed(directory, seen, mark)
        # held: another breaker, a renewal or a release (done in milliseconds), or one that died holding it
        time.sleep(1.0)
        if read_mark(directory).raw != seen.raw:
            return False
        claim.unlink(missing_ok=True)
    return False


def _remove_if(directory: Path, token: str) -> None:
    """Remove the mark if it holds ``token``, claimed (``_claim``): never a newcomer's that replaced it since it
    was read (a claim held by a newcomer breaking it: its mark replaces this one)."""
    seen = read_mark(directory)
    if seen.mark is None or seen.mark.token != token:
        return
    claim = _claim(directory, seen)
    got = _link(directory, claim)
    if got == "made":
        _write_claimed(directory, claim, seen, None)
    elif got == "no links":
        _unclaimed(directory, seen, None)


# ------------------------------------------------------------------------------------------ holding


class Holding:
    """This process's part in a job's ownership: the token and directories. ``owned``: this process holds the
    marks (renews them from a thread and releases them); else it runs under them (another rank, a rank under
    ``launch elastic``) and only checks them."""

    def __init__(self, token: str, dirs: Sequence[Path], owned: bool, renew_s: float = RENEW_MAX_S) -> None:
        self.token, self.dirs, self.owned, self.renew_s = token, list(dirs), owned, renew_s
        self.lost: str | None = None  # the line, once the mark is found taken over
        self.on_lost: Callable[[str], None] = stop_fenced
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._marks: dict[Path, Mark] = {}
        self._blocked: dict[Path, tuple[bytes, float]] = {}  # a mark whose claim another writer holds, since
        self._links = True  # False on a filesystem without hard links: renewals write without a claim

    def start_renewing(self, marks: dict[Path, Mark]) -> None:
        self._marks = dict(marks)
        self._thread = threading.Thread(target=self._renew, name="owner-renewal", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        pause = os.environ.get(PAUSE_ENV)
        while not self._stop.wait(self.renew_s):
            if pause and os.path.exists(pause):
                continue
            for d, mark in list(self._marks.items()):
                try:
                    seen = read_mark(d)
                    if seen.mark is None or seen.mark.token != self.token:
                        self.lost = self._line(d, seen)
                        return
                    mark = replace(mark, renewals=mark.renewals + 1, renewed=time.time())
                    if self._renew_one(d, seen, mark):
                        self._marks[d] = mark
                except OSError as e:  # the next period tries again; a newcomer waits out the bound first
                    log.warning(f"{d}: could not renew the owner's mark ({e.strerror or e})")

    def _renew_one(self, d: Path, seen: Seen, mark: Mark) -> bool:
        """Write the renewed ``mark`` over the one read (``seen``), claimed as a newcomer claims it to break it
        (``_claim``): a renewal does not write over a newcomer's mark that replaced this one since it was read.
        A claim another writer holds skips this period (a newcomer breaking the mark: the next period finds its
        token), unless held for ``DEAD_CLAIM_S``: a writer that died holding it, whose claim is removed."""
        if not self._links:
            return _unclaimed(d, seen, mark)
        claim = _claim(d, seen)
        for _ in range(2):
            got = _link(d, claim)
            if got == "made":
                self._blocked.pop(d, None)
                return _write_claimed(d, claim, seen, mark)
            if got == "gone":
                return False  # removed meanwhile: the next period finds it gone
            if got == "no links":
                log.warning(f"{d}: the filesystem makes no hard links: the owner's mark is renewed without a claim")
                self._links = False
                return _unclaimed(d, seen, mark)
            raw = seen.raw or b""  # held
            first = self._blocked.setdefault(d, (raw, time.monotonic()))
            if first[0] != raw:
                self._blocked[d] = (raw, time.monotonic())
                return False
            if time.monotonic() - first[1] < DEAD_CLAIM_S:
                return False
            claim.unlink(missing_ok=True)
        return False

    def _line(self, d: Path, seen: Seen) -> str:
        gone = "(its mark was removed)" if seen.raw is None else "(its mark is unreadable)"
        who = f"by another job ({seen.mark.describe()})" if seen.mark else gone
        return f"{d} was taken over {who}: this job stops here, before its next write (exit {EXIT_FENCED})"

    def check(self, released_ok: bool = False) -> bool:
        """The fence: True while every mark still holds this job's token; else ``on_lost`` with the line
        (a rank: one line, exit 4) and False. A mark gone from under a process that does not own it (its
        holder released it as the job ends): False, nothing more written, no line; with ``released_ok`` (an
        event: no other job holds the run, and this rank's own ending is worth its line) True."""
        if self.lost is None:
            for d in self.dirs:
                try:
                    seen = read_mark(d)
                except OSError:  # the storage failed the read: no sign of another job (the write will say)
                    continue
                if seen.raw is None and not self.owned:
                    # its holder (rank 0, the supervisor) released it as the job ends: this rank ends on its own
                    # error, not as taken over, and writes no more commits or rows (its events yet)
                    if released_ok:
                        continue
                    return False
                if seen.mark is None or seen.mark.token != self.token:
                    self.lost = self._line(d, seen)
                    break
        if self.lost is not None:
            self.on_lost(self.lost)
            return False
        return True

    def release(self, run_dir: Path | None) -> None:
        """Stop renewing; when this process holds the marks and they are still its own: the release event,
        then the marks removed."""
        global _current
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.owned and self.lost is None and all(_ours(d, self.token) for d in self.dirs):
            if run_dir is not None:
                from training import events  # on call: training.events imports this module (its fence)

                events.record(run_dir, "owner_release", token=self.token, pid=os.getpid())
            for d in self.dirs:
                _remove_if(d, self.token)
        if _current is self:
            _current = None


def _ours(d: Path, token: str) -> bool:
    seen = read_mark(d)
    return seen.mark is not None and seen.mark.token == token


def stop_fenced(line: str) -> None:
    """A rank whose job's mark was taken over: one line, exit 4, nothing more written."""
    print(f"error: rank {os.environ.get('RANK', '0')}: {line}", file=sys.stderr, flush=True)
    os._exit(EXIT_FENCED)


_current: Holding | None = None
"""This process's holding (one per process, as its signal handlers): what ``fence`` checks."""


def install(holding: Holding | None) -> None:
    global _current
    _current = holding


def current() -> Holding | None:
    return _current


def fence(released_ok: bool = False) -> bool:
    """Before a commit, a metrics row or an event: True when this process may write (no holding, or its mark
    still holds; ``released_ok``: or its holder released it, ``Holding.check``); a rank whose mark was taken
    over ends here (``stop_fenced``)."""
    return _current is None or _current.check(released_ok)


def release(run_dir: Path | None = None) -> None:
    """Release this process's holding, if any (idempotent)."""
    if _current is not None:
        with contextlib.suppress(OSError):  # a mark that cannot be removed is judged by the next start
            _current.release(run_dir)


def unique_dirs(dirs: Sequence[Path]) -> list[Path]:
    """``dirs`` less those that reach a directory named before (a ``checkpoint.dir`` that is ``run.dir``, by
    another spelling, through a symbolic link or another mount of it): one mark each."""
    out: list[Path] = []
    seen: set[Any] = set()
    for d in dirs:
        key: Any = Path(os.path.realpath(d))  # a directory not made yet: by its path, links resolved
        with contextlib.suppress(OSError):
            st = os.stat(key)
            key = (st.st_dev, st.st_ino)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def acquire(
    dirs: Sequence[Path],
    *,
    stale_s: float,
    takeover: bool,
    role: str,
    job: str | None = None,
    rendezvous: str | None = None,
    run_dir: Path | None = None,
) -> Holding:
    """Take every directory's mark (judged by ``judge``), or raise ``RunOwned`` having written nothing. A
    mark of a previous start in this process is released first. The acquisition is recorded in
    ``run_dir``'s events: ``owner_acquire`` for fresh marks, ``owner_takeover`` with what was replaced."""
    if _current is not None:  # an earlier start in this process (training.start.prepare called twice)
        _current.release(None)
    dirs = unique_dirs(dirs)
    t0 = time.monotonic()
    for _ in range(5):  # another job that takes or releases a mark between judging and writing: judge again
        verdicts = judge(dirs, stale_s, takeover)
        token = secrets.token_hex(8)
        marks = {d: new_mark(token, role, stale_s, job, rendezvous) for d in dirs}
        taken: list[Path] = []
        try:
            for v in verdicts:
                ok = (
                    _create(v.directory, marks[v.directory])
                    if v.state == "free"
                    else _break(v.directory, v.seen, marks[v.directory])
                )
                if not ok:
                    break
                taken.append(v.directory)
        except OSError:  # a directory that cannot be written: none of this job's marks is left behind
            for d in taken:
                _remove_if(d, token)
            raise
        if len(taken) == len(dirs):
            break
        for d in taken:
            _remove_if(d, token)
    else:
        raise UserError(f"{', '.join(map(str, dirs))}: other jobs kept taking the owner's mark; start again")
    holding = Holding(token, dirs, owned=True, renew_s=renew_period(stale_s))
    install(holding)
    holding.start_renewing(marks)
    waited = round(time.monotonic() - t0, 3)
    replaced = [v for v in verdicts if v.state != "free"]
    for v in replaced:
        who = v.seen.mark.describe() if v.seen.mark else "an unreadable mark"
        how = {"gone": "its holder is gone", "stale": f"unrenewed for {v.waited_s:.1f} s", "forced": "run.takeover"}
        text = f"{v.directory}: took over the owner's mark of {who} ({how[v.state]})"
        (log.warning if v.state == "forced" else log.info)(text)
    if run_dir is not None:
        from training import events  # on call: training.events imports this module (its fence)

        mark = marks[dirs[0]]
        fields_: dict[str, Any] = {
            "token": token,
            "host": mark.host,
            "pid": mark.pid,
            "role": role,
            "job": job,
            "dirs": [str(d) for d in dirs],
            "waited_s": waited,
        }
        if replaced:
            previous = [
                {"dir": str(v.directory), "reason": v.state, **(_brief(v.seen.mark) if v.seen.mark else {})}
                for v in replaced
            ]
            events.record(run_dir, "owner_takeover", **fields_, previous=previous)
        else:
            events.record(run_dir, "owner_acquire", **fields_)
    return holding


def _brief(m: Mark) -> dict[str, Any]:
    return {k: getattr(m, k) for k in ("token", "host", "pid", "job", "acquired", "renewals")}


def under(token: str, dirs: Sequence[Path]) -> Holding:
    """A process that runs under a holder's ``token`` (another rank of the job; a rank of ``launch elastic``):
    it checks the marks, it neither renews nor releases them."""
    holding = Holding(token, unique_dirs(dirs), owned=False)
    install(holding)
    return holding


def joinable(dirs: Sequence[Path], stale_s: float, job: str | None, rendezvous: str) -> None:
    """A ``launch elastic`` that does not host the rendezvous (the host's takes the marks): refused when a live
    job of another rendezvous or job id holds a directory; else it joins."""

    def ours(m: Mark | None) -> bool:
        return m is not None and m.role == "launch elastic" and m.rendezvous == rendezvous and m.job == job

    for d in unique_dirs(dirs):
        if ours(read_mark(d).mark):
            continue
        try:
            judge([d], stale_s)
        except RunOwned:  # the change it saw may be its own host taking the mark over (a requeue): then it joins
            if not ours(read_mark(d).mark):
                raise


def describe_owner(directory: Path, watch_s: float | None = None) -> str:
    """Who owns a run, for ``launch report`` and ``launch curve``: ``none``, the holder, or ``stale since T``.
    A holder on this host is judged by its process; one elsewhere by a renewal within ``watch_s`` (default:
    three of its renewal periods)."""
    seen = read_mark(directory)
    if seen.raw is None:
        return "none"
    m = seen.mark
    if m is not None and provably_gone(m):
        return f"stale since {when(m.renewed)} (its holder, pid {m.pid} on {m.host}, is gone)"
    if m is not None and m.boot_id == boot_id() and m.pid_ns == pid_namespace():
        return m.describe()
    limit = watch_s if watch_s is not None else 3 * (m.renew_s if m else RENEW_MAX_S)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(POLL_S)
        now = read_mark(directory)
        if now.raw != seen.raw:
            return now.mark.describe() if now.mark else "none"
    if m is None:
        return f"stale since before {when(time.time() - limit)} (an unreadable mark)"
    return f"stale since {when(m.renewed)} by its holder's clock ({m.describe()}; no renewal in {limit:g} s)"


HEARTBEAT_S = 1.0
"""While rank 0 judges a mark (up to the staleness bound), it tells the other ranks to wait this often: each a
short collective, so a long judgment never runs into ``deepspeed.timeout_s``."""


def take(dirs: Sequence[Path], stale_s: float, takeover: bool) -> Holding | None:
    """``train.py``, on every rank right after the process group starts: rank 0 takes the marks of ``dirs``
    (the run directory first, where the events go), or finds that it runs under its ``launch elastic``
    supervisor's (every rank's ``TOKEN_ENV``, any rank's under a multi-node supervisor), and every rank learns
    the outcome from it. Raises ``RunOwned`` on every rank, with the same line, when a live job holds one; a
    rank under a supervisor whose mark was taken over ends with the fence's line. None: the marks could not be
    written (the run-directory probes that follow say why)."""
    from training import collectives  # on call: it imports torch, which launch elastic's supervisor never needs

    dirs = unique_dirs(dirs)
    token = os.environ.get(TOKEN_ENV) or None
    if os.environ.get(SUPERVISED_ENV) and collectives.world_size() > 1:  # only the rendezvous host's node has it
        token = next((t for t in collectives.all_gather_object(token) if t), None)
    result: list[tuple[str, str | None]] = []
    worker = None
    if collectives.rank() == 0:
        worker = threading.Thread(target=lambda: result.append(_decide(dirs, stale_s, takeover, token)), daemon=True)
        worker.start()
    while True:
        msg: tuple[str, str | None] | None = None
        if worker is not None:
            worker.join(timeout=HEARTBEAT_S)
            msg = result[0] if result else ("wait", None) if worker.is_alive() else ("error", _DIED)
        msg = collectives.broadcast_object(msg)
        assert msg is not None
        if msg[0] != "wait":
            break
    kind, value = msg
    if kind == "refused":
        raise RunOwned(str(value))
    if kind == "error":
        raise UserError(str(value))
    if kind == "fenced":
        stop_fenced(str(value))
    if kind == "unowned" or value is None:
        return None
    if kind == "held" and collectives.rank() == 0:
        return current()
    return under(value, dirs)


_DIED = "the owner's check ended without an outcome (see the traceback above); nothing was written"
"""What every rank says when rank 0's check raised what it does not expect (a mark of the right shape with
values of the wrong types): one line on every rank, never a wait without end."""


def _decide(dirs: list[Path], stale_s: float, takeover: bool, token: str | None) -> tuple[str, str | None]:
    """Rank 0's part of ``take``: the outcome every rank acts on."""
    try:
        if token is not None:
            for d in dirs:
                if not _ours(d, token):
                    return "fenced", Holding(token, dirs, owned=False)._line(d, read_mark(d))
            return "under", token
        role = "train.py rank 0"
        holding = acquire(dirs, stale_s=stale_s, takeover=takeover, role=role, job=job_id(), run_dir=dirs[0])
        hold = os.environ.get(HOLD_ENV)
        while hold and os.path.exists(hold):
            time.sleep(POLL_S)
        return "held", holding.token
    except RunOwned as e:
        return "refused", str(e)
    except UserError as e:
        return "error", str(e)
    except OSError as e:
        log.warning(f"cannot write the owner's mark in {e.filename or dirs[0]} ({e.strerror or e})")
        return "unowned", None
