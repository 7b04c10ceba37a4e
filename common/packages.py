"""What is installed here, and where a child process imports from."""

from __future__ import annotations

import os


def installed_version(name: str) -> str | None:
    """The version of the installed distribution ``name`` (as pip names it), or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version  # on call (start-up time): python_path needs none

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def python_path(*first: str) -> str:
    """A child's ``PYTHONPATH``: ``first`` ahead of this process's own entries (empty ones left out)."""
    return os.pathsep.join(p for p in (*first, os.environ.get("PYTHONPATH", "")) if p)
