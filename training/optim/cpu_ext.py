"""The C++ CPU kernels of LANS and LAMB (``csrc/lans_cpu.cpp``, impl ``"cpu"``): built on first use with torch's
extension builder (cached on disk), loaded once per process. ``training.optim.backends.CppKernels`` calls them;
``scripts/setup.sh`` builds them ahead of the first run."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import platform
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common.errors import UserError

_CPU_EXT: list = []  # [module or None] once tried


SOURCE = Path(__file__).with_name("csrc") / "lans_cpu.cpp"


def extension_name() -> str:
    """The kernels' name in torch's extension cache: a hash of this CPU's model and flags (``-march=native``),
    of this copy of the source and of this environment (two checkouts or venvs sharing the cache would
    otherwise rebuild one directory in turn: ninja sees another command line each time)."""
    cpu_id = platform.machine()
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu_id += "".join(ln for ln in info.splitlines() if ln.startswith(("model name", "flags")))[:4096]
    except OSError:
        pass
    where = f"{SOURCE.resolve()}:{sys.prefix}"
    return "lans_cpu_" + hashlib.sha256((cpu_id + where).encode()).hexdigest()[:10]


TORCH_LOCK = "lock"
"""The file torch's extension builder makes in the build directory while one process builds or checks the
build (``torch.utils.file_baton``), waited on by every other: one left by a process killed there (a rank killed
-9 as it started) would hold every later start forever."""


NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


@contextlib.contextmanager
def build_lock(name: str) -> Iterator[Path]:
    """Hold the extension ``name``'s build directory (torch's own, under ~/.cache/torch_extensions) under a lock
    the kernel releases when its process dies (``flock``). Every process takes it before torch's builder, so a
    ``TORCH_LOCK`` found while holding it was left by a process that died holding it, and is removed."""
    from torch.utils import cpp_extension  # deferred, as in cpu_kernels: it imports setuptools

    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    with open(build_dir / "wikipretrain.flock", "a") as held:
        locked = True
        try:
            fcntl.flock(held, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in NO_FLOCK:
                raise
            locked = False  # a filesystem without flock (Lustre's noflock, NFS without its lock daemon)
        if locked:
            (build_dir / TORCH_LOCK).unlink(missing_ok=True)
        yield build_dir  # unlocked: torch's lock file alone, as before, a stale one included


def cpu_kernels(required: bool = False) -> Any:
    """The C++ CPU kernels (``training/optim/csrc/lans_cpu.cpp``), built on first use with torch's extension
    builder and cached under ~/.cache/torch_extensions (a file lock keeps concurrent ranks from building
    twice). ``-march=native``: the cache name carries a hash of this CPU's model and flags, so a home
    directory shared by different machines does not hand one machine another's binary (and of the source's
    path and the Python environment, so that two checkouts do not rebuild one cache directory in turn). None if
    the build fails (with a warning), or UserError when ``required`` (impl="cpu" asked for explicitly)."""
    if not _CPU_EXT:
        from torch.utils import cpp_extension  # deferred: it imports setuptools; only the CPU path builds

        src, name = SOURCE, extension_name()
        # One ninja for every process: the environment's own (pip's ninja, beside this interpreter) ahead of a
        # system one. Two ninja versions (1.11 and 1.13 write different .ninja_log formats) each discard the
        # other's log and rebuild: a venv activated by scripts/setup.sh and a test run without it did, 25 s.
        here = str(Path(sys.executable).parent)
        path = os.environ.get("PATH", "")
        pinned = (Path(here) / "ninja").is_file() and path.split(os.pathsep)[0] != here
        if pinned:
            os.environ["PATH"] = here + os.pathsep + path
        try:
            with build_lock(name) as build_dir:
                ext = cpp_extension.load(
                    name,
                    sources=[str(src)],
                    extra_cflags=[
                        "-O3",
                        "-march=native",
                        "-mprefer-vector-width=512",
                        "-fno-math-errno",
                        "-fopenmp",
                    ],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir),
                    verbose=False,
                )
        except Exception as e:  # no compiler / ninja / headers: use the other paths
            warnings.warn(
                f"building the LANS/LAMB CPU kernels failed ({type(e).__name__}: {str(e)[:300]}); "
                "using the torch.compile or foreach implementation",
                RuntimeWarning,
                stacklevel=3,
            )
            ext = None
        finally:
            if pinned:
                os.environ["PATH"] = path
        _CPU_EXT.append(ext)
    if _CPU_EXT[0] is None and required:
        raise UserError("optimizer impl 'cpu': the C++ kernels could not be built (see the warning above)")
    return _CPU_EXT[0]
