"""What is installed here."""

from __future__ import annotations


def installed_version(name: str) -> str | None:
    """The version of the installed distribution ``name`` (as pip names it), or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None
