"""One logger for the application; on multi-rank runs only rank 0 logs at INFO unless asked otherwise."""

from __future__ import annotations

import logging
import os
import sys

_CONFIGURED = False


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def get_logger(name: str = "wikipretrain") -> logging.Logger:
    global _CONFIGURED
    if not _CONFIGURED:
        handler = logging.StreamHandler(sys.stderr)
        r = rank()
        prefix = f"[rank{r}] " if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%H:%M:%S"))
        root = logging.getLogger("wikipretrain")
        root.addHandler(handler)
        root.setLevel(logging.INFO if r == 0 else logging.WARNING)
        root.propagate = False
        _CONFIGURED = True
    return logging.getLogger(name if name.startswith("wikipretrain") else f"wikipretrain.{name}")
