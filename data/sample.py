"""Where the real English Wikipedia sample dump lives: inside the installed ``gensim`` wheel."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from common.errors import UserError

SAMPLE_RELPATH = Path("test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
# What the sample holds (checked by the tests against our own extraction).
SAMPLE_PAGES = 206
SAMPLE_REDIRECTS = 100
SAMPLE_ARTICLES = 106  # main namespace, not redirects


def sample_dump_path() -> Path:
    """Path of gensim's 206-page enwiki sample (1.7 MB bz2), found without importing gensim (slow).

    ``WIKIPRETRAIN_SAMPLE_DUMP`` names a copy instead (an offline bundle carries the .bz2, not gensim).
    """
    override = os.environ.get("WIKIPRETRAIN_SAMPLE_DUMP")
    if override:
        if not Path(override).is_file():
            raise UserError(f"WIKIPRETRAIN_SAMPLE_DUMP={override}: no such file")
        return Path(override)
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("gensim is not installed, so its Wikipedia sample dump is absent (pip install gensim)")
    for root in spec.submodule_search_locations:
        p = Path(root) / SAMPLE_RELPATH
        if p.is_file():
            return p
    raise UserError(
        f"gensim is installed but {SAMPLE_RELPATH.name} is missing from it (pip install --force-reinstall gensim)"
    )
