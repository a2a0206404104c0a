"""Row blocks shared between forks at the page level (Linux).

A fork's prompt must be held once while every fork decodes on. Kernels
read a layer's rows as one array per block (``[nkv, cap, ...]``), so the
sharing lives under the arrays: :class:`Snapshot` copies a storage's row
blocks once into an anonymous shared-memory file (``memfd_create``), and
every holder (the parent and each fork) maps that file privately
(``MAP_PRIVATE``). Reads of rows nobody rewrote come from the one shared
copy of the file's pages; a holder's write (its next row, a truncation's
rewrite) copies just the page it touches into the holder's own memory, as
``fork(2)`` does for a process. The kernels see ordinary arrays at
ordinary addresses, so a fork answers bit for bit as a deep copy would,
on every backend, without a line of kernel code.

The file is sized for more rows than the prompt (holes cost no memory), so
a fork decodes on in its mapping; a holder that outgrows it copies its
rows into ordinary arrays, as any growth does. Where ``memfd_create`` is
missing (not Linux) forks share arrays until their first write instead.
"""

from __future__ import annotations

import mmap
import os
import weakref

import numpy as np

#: Whether this platform shares pages between forks.
AVAILABLE = hasattr(os, "memfd_create") and hasattr(mmap, "MAP_PRIVATE")

#: Below this many bytes of rows a fork copies eagerly: a snapshot costs a
#: file and a page per head and block for each holder's next row.
MIN_BYTES = 1 << 18


def _page(n: int) -> int:
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


class Snapshot:
    """Row blocks frozen in a shared-memory file; :meth:`map` gives a holder
    its private (copy-on-write) arrays over them."""

    def __init__(self, blocks: dict[str, np.ndarray], lens: np.ndarray, cap: int, version: int, nbytes: int):
        """``blocks``: the storage's row blocks ``[nkv, old_cap, ...]``; rows
        ``[0, lens[h])`` of each head are copied into blocks of ``cap`` rows."""
        self.specs = []
        offset = 0
        for name, a in blocks.items():
            shape = (a.shape[0], cap) + a.shape[2:]
            size = int(np.prod(shape)) * a.itemsize
            self.specs.append((name, a.dtype, shape, offset))
            offset += _page(size)
        self.size = max(offset, mmap.PAGESIZE)
        self.lens = lens.copy()
        self.version = version
        #: Bytes of stored rows the file holds (what every holder shares).
        self.nbytes = nbytes
        fd = os.memfd_create("kvreg-rows", os.MFD_CLOEXEC)
        self._fd = fd
        weakref.finalize(self, os.close, fd)
        os.ftruncate(fd, self.size)
        dst = self._arrays(mmap.mmap(fd, self.size))   # shared: writes reach the file
        for name, a in blocks.items():
            for h in np.flatnonzero(lens):
                dst[name][h, : lens[h]] = a[h, : lens[h]]

    def _arrays(self, mm: mmap.mmap) -> dict[str, np.ndarray]:
        return {name: np.frombuffer(mm, dtype, int(np.prod(shape)), offset).reshape(shape)
                for name, dtype, shape, offset in self.specs}

    def map(self) -> dict[str, np.ndarray]:
        """A holder's arrays: private, copy-on-write mappings of the file
        (unmapped when the arrays are garbage collected)."""
        return self._arrays(mmap.mmap(self._fd, self.size, flags=mmap.MAP_PRIVATE,
                                      prot=mmap.PROT_READ | mmap.PROT_WRITE))
