"""common.process.exit_fast: the exit code, the atexit handlers, logging, Python's and C's stdio, as a normal exit
gives them; a non-daemon thread still running is waited for."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import run_python

SCRIPT = """
import atexit, logging, sys, threading, time
from common.process import exit_fast
out = sys.argv[1]
atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
handler = logging.FileHandler(out + ".log")
logging.getLogger("t").addHandler(handler)
logging.getLogger("t").warning("logged")
if sys.argv[2] == "thread":
    threading.Thread(target=lambda: (time.sleep(0.5), open(out + ".thread", "w").write("done"))).start()
sys.stdout.write("no newline, buffered")
import ctypes
ctypes.CDLL(None).printf(b"[from C]")  # C's own stdout buffer: a pipe's is flushed only by fflush
exit_fast(3)
"""


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    # buffered: stdout as a plain interpreter's, which exit_fast must flush (``-u`` would leave it nothing to do)
    return run_python(["-c", SCRIPT, str(tmp_path / "f"), mode], timeout=60, buffered=True)


def test_exit_fast_keeps_what_a_normal_exit_gives(tmp_path: Path) -> None:
    r = _run(tmp_path, "plain")
    assert r.returncode == 3 and r.stdout == "no newline, buffered[from C]", (r.returncode, r.stdout, r.stderr)
    assert (tmp_path / "f.atexit").read_text() == "ran"
    assert (tmp_path / "f.log").read_text() == "logged\n"


def test_exit_fast_waits_for_a_non_daemon_thread(tmp_path: Path) -> None:
    r = _run(tmp_path, "thread")
    assert r.returncode == 3, r.stderr
    assert (tmp_path / "f.thread").read_text() == "done" and (tmp_path / "f.atexit").read_text() == "ran"
