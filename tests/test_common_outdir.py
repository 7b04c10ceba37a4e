"""common.outdir: the one --overwrite rule of the data commands, on real directories."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.atomic import atomic_path, atomic_write_text
from common.errors import UserError
from common.outdir import prepare_out_dir, remove_stale
from tests.conftest import run_python

SHARD = re.compile(r"^shard-\d{5}\.txt$").match


def test_new_directory_is_created_and_reported(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b"
    assert prepare_out_dir(out, overwrite=False) is True and out.is_dir()
    assert prepare_out_dir(out, overwrite=False) is False  # exists, empty: fine without --overwrite


def test_a_file_in_the_way_is_a_user_error(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("x")
    with pytest.raises(UserError, match="exists and is not a directory"):
        prepare_out_dir(tmp_path / "out", overwrite=True)


def test_leftover_temporaries_of_a_killed_writer_are_removed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    # what common.atomic leaves when its writer dies inside the block: create it for real, then "crash"
    code = (
        "import os, sys\nfrom common.atomic import atomic_path\n"
        f"with atomic_path({str(out / 'shard-00000.txt')!r}) as tmp:\n"
        "    tmp.write_text('half')\n    os._exit(1)\n"
    )
    run_python(["-c", code])  # exits 1 on purpose
    (out / ".shard-00001.txt.k3.tmp").mkdir()  # a directory temporary (h5py / checkpoint writers)
    leftovers = [p.name for p in out.iterdir()]
    assert len(leftovers) == 2 and all(n.startswith(".") and n.endswith(".tmp") for n in leftovers)
    assert prepare_out_dir(out, overwrite=False) is False  # only temporaries: no --overwrite needed
    assert list(out.iterdir()) == []


def test_non_empty_needs_overwrite_and_overwrite_deletes_nothing_up_front(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for i in range(3):
        atomic_write_text(out / f"shard-{i:05d}.txt", f"old {i}")
    (out / "README").write_text("mine")
    with pytest.raises(UserError, match=r"not empty \(4 entries\); pass --overwrite") as e:
        prepare_out_dir(out, overwrite=False)
    assert str(out) in str(e.value) and "\n" not in str(e.value)
    assert prepare_out_dir(out, overwrite=True) is False
    # a failed rerun would find the previous output intact
    assert sorted(p.name for p in out.iterdir()) == [
        "README",
        "shard-00000.txt",
        "shard-00001.txt",
        "shard-00002.txt",
    ]
    # the rerun writes 2 shards, then removes the third, stale one; the user's file stays
    written = []
    for i in range(2):
        with atomic_path(out / f"shard-{i:05d}.txt") as tmp:
            tmp.write_text(f"new {i}")
        written.append(f"shard-{i:05d}.txt")
    assert remove_stale(out, written, SHARD) == ["shard-00002.txt"]
    assert sorted(p.name for p in out.iterdir()) == ["README", "shard-00000.txt", "shard-00001.txt"]
    assert (out / "shard-00001.txt").read_text() == "new 1" and (out / "README").read_text() == "mine"
