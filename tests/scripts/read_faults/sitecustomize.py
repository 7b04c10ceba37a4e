"""Storage faults under a real train.py job, at a chosen point of its data order.

Named by ``WIKIPRETRAIN_TEST_SITECUSTOMIZE`` (tests/conftest.py: on PYTHONPATH for a fresh interpreter, run after
the fork by a forked rank), a train.py rank (and the DataLoader workers it forks) patches the shard reader at
start-up, as ``WIKIPRETRAIN_TEST_READ_FAULT`` says (``MODE:POSITION:MARKER``):

- ``truncate``: the rank's first read of a micro-batch at or after global position POSITION of the epoch truncates
  the shard of a unit that read needs and the rank has not read yet (to that unit's first byte of
  ``input_ids``; never longer than the file already is; not again where another rank truncated it first),
  then reads: the real read of a real truncated file fails. Once per rank (MARKER.<rank>).
- ``vanish``: the rank's first read at or after POSITION moves the shard of the first unit it needs away, to
  MARKER (a shard gone from a shared filesystem), then reads.
- ``fail_once``: the first shard open in a DataLoader worker of any rank raises EIO, once in the job (MARKER,
  created exclusively): the reader's retry then reads the real file.

Python imports ``sitecustomize`` from the path at start-up: the loader itself has no test hook.
"""

import errno
import os
import sys


def _truncate(position: int, marker: str) -> None:
    import h5py
    import numpy as np

    from data import loader

    real_read = loader._Reader.read
    mine = f"{marker}.{os.environ.get('RANK', '0')}"

    def read(self, epoch, positions):
        if epoch == 0 and int(np.min(positions)) >= position and not os.path.exists(mine):
            shard, row = self.order.locate(epoch, positions)
            for s, r in zip(shard.tolist(), row.tolist()):
                k = r // self.order.unit
                if (s, k) in self.units:
                    continue
                path = self.shards.entries[s].path
                open(mine, "w").close()
                try:
                    with h5py.File(path, "r") as f:
                        offset = f["input_ids"].id.get_chunk_info_by_coord((k * self.order.unit, 0)).byte_offset
                except (OSError, RuntimeError):  # another rank truncated it already
                    break
                os.truncate(path, min(offset, os.path.getsize(path)))
                print(f"read_faults: truncated {path} at byte {offset} (rows from {k * self.order.unit})", flush=True)
                break
        return real_read(self, epoch, positions)

    loader._Reader.read = read


def _vanish(position: int, marker: str) -> None:
    import numpy as np

    from data import loader

    real_read = loader._Reader.read

    def read(self, epoch, positions):
        if int(np.min(positions)) >= position and not os.path.exists(marker):
            shard, _ = self.order.locate(epoch, positions)
            os.rename(self.shards.entries[int(shard[0])].path, marker)
            self.handles.clear()  # a handle opened earlier would go on reading the moved file
            self.units.clear()
        return real_read(self, epoch, positions)

    loader._Reader.read = read


def _fail_once(marker: str) -> None:
    import torch.utils.data

    from data import loader

    real_file = loader._Reader._file

    def _file(self, s):
        if torch.utils.data.get_worker_info() is not None and s not in self.handles:
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                raise OSError(errno.EIO, "injected I/O error", str(self.shards.entries[s].path))
        return real_file(self, s)

    loader._Reader._file = _file


_fault = os.environ.get("WIKIPRETRAIN_TEST_READ_FAULT")
if _fault and sys.argv and sys.argv[0].endswith("train.py"):
    _mode, _position, _marker = _fault.split(":", 2)
    if _mode == "truncate":
        _truncate(int(_position), _marker)
    elif _mode == "vanish":
        _vanish(int(_position), _marker)
    elif _mode == "fail_once":
        _fail_once(_marker)
