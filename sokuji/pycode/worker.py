"""A Python model's worker process (``workers = N``, ``pool.py``): it loads the model's entry
itself, sets up one instance, says it is ready, then runs the batches the server sends it,
one at a time, through the same ``invoke`` / ``invoke_stream`` as a thread of the server
(``runner.py``: one calling mechanism), and answers each over its pipe (``shm.py``).

What the server receives for a batch, in order: for a stream, a ``step`` message per step
(pickled in band: the worker goes on to the next step at once, so a step cannot reuse the
one shared memory segment the reader may still be copying out of); then ``done`` with the
results (large buffers through shared memory) and the stages the code reported, or ``error``
with the ``SokujiError`` the batch failed with (``ModelCodeFailed``, ``BadModelOutput``),
pickled whole; the worker stays up for the next batch. A stream the server stops (its
``emit`` failed) gets a ``cancel`` between steps: the generator is closed and the answer is
``cancelled``.

The worker never outlives the server: it exits when its pipe closes (the server is gone or
closed it: its main loop reads end of file, and a watching thread sees the hang-up even
while the model's code runs), and the kernel kills it when its parent dies
(``PR_SET_PDEATHSIG``: its parent is multiprocessing's fork server, which the kernel kills
with the server, ``fork_server.py``), even in the middle of an endless loop. It ignores
SIGINT (a Ctrl-C in the terminal reaches the whole process group; the server decides when
its workers stop) and takes SIGTERM's default (it dies).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from sokuji.errors import BadModelOutput, ConfigError, ModelCodeFailed, SokujiError
from sokuji.pycode import entry as entries
from sokuji.pycode import shm
from sokuji.pycode.inthread import set_up
from sokuji.pycode.runner import invoke, invoke_stream

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Spec:
    """What a worker needs to become the model (pickled to it at start)."""

    entry: str
    """The entry, a file entry's path made absolute (the worker's directory may differ)."""
    key: str
    options: dict[str, Any]
    model: str
    sys_path: list[str]
    cwd: str
    prefix: str
    """Its result segments' name prefix (``shm.Outbox``)."""
    min_bytes: int = shm.MIN_BYTES


class _Cancelled(SokujiError):
    """The server stopped the stream (never leaves the worker)."""


def main(conn: Connection, spec: Spec) -> None:
    """The worker process's body (multiprocessing's target)."""
    die_with_parent()
    _watch(conn)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.path[:] = spec.sys_path
    with contextlib.suppress(OSError):
        os.chdir(spec.cwd)
    _logging()
    outbox = shm.Outbox(spec.prefix)
    inbox = shm.Inbox()
    try:
        try:
            code = entries.load(spec.entry, spec.key, Path(spec.cwd))
            instance = set_up(code, spec.options, spec.model)
        except ConfigError as exc:
            shm.send(conn, "setup_failed", exc, None)
            return
        except BaseException as exc:  # noqa: BLE001 - the import died oddly: a setup failure
            shm.send(conn, "setup_failed", ConfigError(
                f"model '{spec.model}' ({spec.entry}): setup failed: "
                f"{entries.last_line(exc)}"), None)
            return
        try:  # the class's V2 metadata, asked of a set-up instance (the server shows it)
            described = instance.describe() if code.describes else None
        except Exception as exc:  # noqa: BLE001 - the user's code: start-up stops, naming it
            shm.send(conn, "setup_failed", ConfigError(
                f"model '{spec.model}' ({spec.entry}): describe() failed: "
                f"{entries.last_line(exc)}"), None)
            return
        shm.send(conn, "ready", (os.getpid(), described), None)
        _serve(conn, spec, code, instance, inbox, outbox)
        teardown = None if code.function else getattr(instance, "teardown", None)
        if callable(teardown):
            try:
                teardown()
            except Exception:
                log.exception("model %s: teardown failed", spec.model)
    finally:
        outbox.close()
        inbox.close()
        conn.close()


def _serve(conn: Connection, spec: Spec, code: Any, instance: Any, inbox: shm.Inbox,
           outbox: shm.Outbox) -> None:
    while True:
        try:
            op, batch, _ = shm.recv(conn, inbox)
        except (EOFError, ConnectionError):
            return  # the server is gone or closed the pipe
        except Exception as exc:  # noqa: BLE001 - read whole, but does not unpickle here
            _answer_error(conn, spec.model, ModelCodeFailed(
                f"model '{spec.model}': the batch cannot be received in the worker process: "
                f"{entries.last_line(exc)}"))
            continue
        if op == "stop":
            return
        if op == "cancel":  # came after the stream had ended: nothing to stop
            continue
        try:
            if op == "stream":
                ran = invoke_stream(code, instance, batch, spec.model,
                                    lambda step: _step(conn, inbox, step, spec.model))
            else:
                ran = invoke(code, instance, batch, spec.model, spec.options)
        except _Cancelled:
            shm.send(conn, "cancelled", None, None)
            continue
        except SokujiError as exc:
            _answer_error(conn, spec.model, exc)
            continue
        try:
            shm.send(conn, "done", ran.results, outbox, spec.min_bytes, extra=ran.stages)
        except (EOFError, ConnectionError):
            return
        except Exception as exc:  # noqa: BLE001 - a result that cannot be pickled
            _answer_error(conn, spec.model, BadModelOutput(
                f"model '{spec.model}': a result cannot be sent from the worker process: "
                f"{entries.last_line(exc)}"))


def _step(conn: Connection, inbox: shm.Inbox, step: list[Any], model: str) -> None:
    if conn.poll():  # the server sends nothing during a stream but a cancel
        shm.recv(conn, inbox)
        raise _Cancelled("stream cancelled by the server")
    try:
        shm.send(conn, "step", step, None)
    except (EOFError, ConnectionError):
        raise
    except Exception as exc:  # noqa: BLE001 - a partial result that cannot be pickled
        raise BadModelOutput(f"model '{model}': a partial result cannot be sent from the "
                             "worker process: "
                             f"{entries.last_line(exc)}") from None


def _answer_error(conn: Connection, model: str, exc: SokujiError) -> None:
    try:
        try:
            shm.send(conn, "error", exc, None)
        except (EOFError, ConnectionError):
            raise
        except Exception:  # noqa: BLE001 - an error of the model's own that does not pickle
            shm.send(conn, "error", ModelCodeFailed(
                f"model '{model}': predict raised {type(exc).__name__}"), None)
    except (EOFError, ConnectionError):
        pass  # the server is gone: the next read says so


def _watch(conn: Connection) -> None:
    """A thread that ends the process when the server's end of the pipe closes, in case
    the kernel does not (a fork server started by other code than the pool's); it runs
    while the main thread is in the model's Python code (the GIL changes hands every few
    milliseconds), not while C code holds the GIL without end."""
    if not hasattr(select, "POLLRDHUP"):
        return
    fd = conn.fileno()

    def watch() -> None:
        poller = select.poll()
        poller.register(fd, select.POLLRDHUP)
        while True:
            for _, events in poller.poll():
                if events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    os._exit(0)

    threading.Thread(target=watch, name="sokuji-worker-watch", daemon=True).start()


def die_with_parent() -> None:
    """Linux: SIGKILL when the parent thread exits (a worker's: the fork server's one
    thread; the fork server's: the pool's keeper thread)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        log.warning("PR_SET_PDEATHSIG unavailable: a worker outlives a killed server "
                    "until its pipe closes")


def _logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.WARNING, format=(
            "%(asctime)s %(levelname)s sokuji worker %(process)d %(name)s: %(message)s"))
