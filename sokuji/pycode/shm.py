"""The hand-off between the server and a Python model's worker process (``pool.py``,
``worker.py``): one message is a small pickled header and a pickled body, over the worker's
pipe; the body's large numpy buffers travel through shared memory instead of the pipe.

The body is pickled with protocol 5: a contiguous numpy array of at least ``MIN_BYTES``
gives its buffer out of band (``buffer_callback``), which is copied once into the sender's
segment (``Outbox``) at an aligned offset; the header says where. The receiver copies each
buffer out of the segment (``Inbox``) into memory of its own and unpickles around it, so
no array it is given is a view of a segment that the next message overwrites (a model may
keep its inputs; the server encodes results after the worker has moved on). Everything
smaller, and what is not a contiguous array (object arrays of strings, typed records,
scalars), stays in the pickle.

Why ``MIN_BYTES`` (``benchmarks/python_handoff.py``: the median round trip of one
request's float32 ``x`` through an echo model's one worker, every buffer through shared
memory against plain pickling over the pipe; 2 cores, load ~0.6): 1 KB 0.20 / 0.12 ms
(shared memory loses: its table and copies cost more than the bytes), 64 KB 0.22 / 0.21,
128 KB 0.24 / 0.24 (even), 256 KB 0.33 / 0.85 (2.6x), 1 MB 0.71 / 2.87 (4x), 16 MB 8.1 /
60 ms (7x): a pickled buffer is copied four times and crosses the pipe in pieces, each a
wake-up of the other side, where shared memory costs two copies and no wake-up. So a buffer
of 128 KB or more goes through shared memory, a smaller one in the pickle. (The call in a
thread of the server costs 0.01 ms at 1 KB: a process hop adds ~0.1 ms at 1 KB, ~0.3 ms at
256 KB, ~7 ms at 16 MB.)

Each side owns the segments it creates (the server: its requests'; a worker: its
results'), grows its one segment as a message needs (a power of two, at least
``FIRST_BYTES``: a segment is reused, never one per message) and unlinks it when it grows
or closes. A segment is allocated when created (``posix_fallocate``), so a full
``/dev/shm`` is an ``OSError`` at once, and that message is pickled whole, instead of a
``SIGBUS`` when a page is first written. Segment names start with the owner's ``prefix``
(``sokuji-<server pid>-<pool>-<worker>-``), so the server can unlink what a worker that
crashed left behind (``unlink_prefix``); the resource tracker, which every process of the
pool shares, unlinks what is left if the server itself is killed.

Linux names segments under ``/dev/shm``; elsewhere ``unlink_prefix`` finds nothing and
only the resource tracker is left to clean up after a crash.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

MIN_BYTES = 128 * 1024
"""The smallest buffer sent through shared memory (see the module's docstring)."""
NEVER = 1 << 62
"""A ``min_bytes`` that sends nothing through shared memory (plain pickling)."""
FIRST_BYTES = 1 << 20
ALIGN = 64
SHM_DIR = "/dev/shm"

Table = list[tuple[int, int]]
"""(offset, length) of each out-of-band buffer, in the body's order."""


class Outbox:
    """The sender's segment: buffers are written into it, growing it as a message needs."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._seq = 0
        self._shm: shared_memory.SharedMemory | None = None

    @property
    def name(self) -> str | None:
        return self._shm.name.lstrip("/") if self._shm is not None else None

    def place(self, buffers: list[pickle.PickleBuffer]) -> Table | None:
        """Copy ``buffers`` into the segment; where each lies, or None when no segment of
        the size needed can be had (``/dev/shm`` full): then the caller pickles in band."""
        table: Table = []
        end = 0
        raws = [b.raw() for b in buffers]
        try:
            for raw in raws:
                start = -(-end // ALIGN) * ALIGN
                table.append((start, raw.nbytes))
                end = start + raw.nbytes
            if (self._shm is None or self._shm.size < end) and not self._grow(end):
                return None
            assert self._shm is not None
            view = self._shm.buf
            assert view is not None
            for (start, n), raw in zip(table, raws, strict=True):
                view[start:start + n] = raw
            return table
        finally:
            for raw in raws:
                raw.release()

    def _grow(self, need: int) -> bool:
        size = max(FIRST_BYTES, 1 << max(0, need - 1).bit_length())
        self._seq += 1
        name = f"{self.prefix}{self._seq}"
        try:
            shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        except OSError:
            return False
        fd = getattr(shm, "_fd", -1)
        if fd >= 0 and hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError:
                _drop(shm, unlink=True)
                return False
        if self._shm is not None:
            _drop(self._shm, unlink=True)
        self._shm = shm
        return True

    def close(self) -> None:
        """Unlink the segment (the receiver's mapping, if any, stays valid until it
        closes)."""
        if self._shm is not None:
            _drop(self._shm, unlink=True)
            self._shm = None


class Inbox:
    """The receiver's view of the sender's segment: attached by name, again when the name
    changes (the sender grew it)."""

    def __init__(self) -> None:
        self._shm: shared_memory.SharedMemory | None = None

    def take(self, name: str, table: Table) -> list[np.ndarray]:
        """Each buffer of ``table``, copied out of the segment ``name``."""
        if self._shm is None or self._shm.name.lstrip("/") != name:
            self.close()
            self._shm = shared_memory.SharedMemory(name=name)
        out = []
        for start, n in table:
            dst = np.empty(n, np.uint8)
            assert self._shm.buf is not None
            src = np.frombuffer(self._shm.buf, np.uint8, count=n, offset=start)
            dst[:] = src
            del src  # releases the segment's buffer, so the segment can be closed
            out.append(dst)
        return out

    def close(self) -> None:
        if self._shm is not None:
            _drop(self._shm, unlink=False)
            self._shm = None


def _drop(shm: shared_memory.SharedMemory, unlink: bool) -> None:
    try:
        shm.close()
    finally:
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()  # also tells the resource tracker it is gone


def send(conn: Connection, op: str, obj: Any, outbox: Outbox | None,
         min_bytes: int = MIN_BYTES, extra: Any = None) -> None:
    """One message: ``(op, segment, table, extra)`` then ``obj``'s pickle. ``obj`` is
    pickled before anything is written, so a value that cannot be pickled raises here and
    the pipe carries no half message."""
    buffers: list[pickle.PickleBuffer] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        with buffer.raw() as raw:
            if raw.nbytes < min_bytes:
                return True  # in band
        buffers.append(buffer)
        return False

    use_shm = outbox is not None and min_bytes < NEVER
    body = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band if use_shm else None)
    name: str | None = None
    table: Table = []
    if buffers:
        assert outbox is not None
        placed = outbox.place(buffers)
        if placed is None:  # no shared memory to be had: the whole of it through the pipe
            body = pickle.dumps(obj, protocol=5)
        else:
            name, table = outbox.name, placed
    conn.send_bytes(pickle.dumps((op, name, table, extra), protocol=5))
    conn.send_bytes(body)


class Unreadable(Exception):
    """A message read whole whose body does not unpickle here (a class this process cannot
    import): the pipe is still in step, and ``op`` says what the message was."""

    def __init__(self, op: str, error: BaseException) -> None:
        super().__init__(f"{op}: {type(error).__name__}: {error}")
        self.op = op
        self.error = error


def recv(conn: Connection, inbox: Inbox) -> tuple[str, Any, Any]:
    """The next message: ``(op, obj, extra)``. ``EOFError`` when the other side is gone;
    ``Unreadable`` when its body does not unpickle."""
    op, name, table, extra = pickle.loads(conn.recv_bytes())
    body = conn.recv_bytes()
    buffers = inbox.take(name, table) if table else ()
    try:
        return op, pickle.loads(body, buffers=buffers), extra
    except Exception as exc:
        raise Unreadable(op, exc) from exc


def unlink_prefix(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with ``prefix`` (what a worker that died left
    behind); the names unlinked."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return []
    gone = []
    for name in names:
        try:
            shm = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            continue
        except (OSError, ValueError):  # created, never sized (empty): not tracked either
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                continue
        else:
            _drop(shm, unlink=True)
        gone.append(name)
    return gone
