"""Model control without a restart (Triton's model repository extension): load a model, load
it again from what its source says now (a new file at the same path, a new version, a config
override), unload it, and say what the source holds and in which state.

Where models come from is a ``Source`` (``repository/sources.py``: the server's config, a
Triton model repository; ``source_for`` picks a server's); this module is the mechanism over
one.

A (re)load:
1. builds the new model by its kind (``registry.get(mc.runtime)``, ``parse``, ``check``,
   ``build``) in a thread: weights load and warm up off the event loop, and the version
   serving now keeps serving meanwhile (a failure, a broken file, is a ``LoadFailed`` naming
   the reason, 400, and leaves it untouched);
2. on the loop: connects it to the server's observers (``wire``: metrics, the dashboard, a
   semantic cache in front), starts it, then swaps it into ``repo.models`` in one
   assignment. A request looks its model up once and keeps what it found, so from then on
   new requests reach the new model and the ones already holding the old one finish on it;
3. retires the old one: it takes no new requests (nothing finds it any more); once the last
   request holding it has let it go (Triton holds a model by a shared pointer; here the
   ``Model`` entry is watched by weak reference) and its queue and batches are empty, it is
   stopped and closed. Stopping it earlier would fail its queued requests ("stopped"). A
   holder that does not let go within ``drain_s`` is waited for no longer (logged).

Calls for one model are serialised (a lock per name); other models load in parallel and stay
ready throughout. A model that others were built over (a router's targets, a pipeline's
steps: ``Model.uses``) is not swapped or unloaded under them: 400 naming them (an unload may
ask for them to go first, ``unload_dependents``).

``poll`` (``repository_poll_s`` > 0, Triton's ``--model-control-mode=poll``): every interval,
models the source has and the server does not are loaded, those it no longer has unloaded,
and those whose config or model file changed (its modification time and size) loaded again.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from sokuji.config import ModelConfig, ServerConfig
from sokuji.core.batcher import BatchInfo
from sokuji.errors import BadRequest, LoadFailed, ModelNotFound, SokujiError
from sokuji.kinds.kind import BuildEnv
from sokuji.repository import registry
from sokuji.repository.models import Model, ModelRepository, Taken
from sokuji.repository.sources import Override, Source

log = logging.getLogger(__name__)

DRAIN_S = 120.0
"""The longest a retired model waits for the requests holding it before it is stopped."""

READY, UNAVAILABLE, LOADING = "READY", "UNAVAILABLE", "LOADING"


@dataclass
class Record:
    """What the index says of a model that is not serving (unloaded, or its load failed)."""

    state: str
    version: str = ""
    reason: str = ""


@dataclass
class ModelControl:
    """Load, unload and the index over a running ``ModelRepository`` (on its event loop)."""

    config: ServerConfig
    repo: ModelRepository
    source: Source
    wire: Callable[[Model], None] = lambda model: None
    """Connects a model about to serve to the server's observers (``server/app.py``)."""
    follow: Callable[[str, Model | None], None] = lambda name, model: None
    """Told after a swap or an unload: what now serves ``name`` (None: nothing)."""
    on_batch: Callable[[str], Callable[[BatchInfo], None]] | None = None
    drain_s: float = DRAIN_S
    records: dict[str, Record] = field(default_factory=dict)
    loading: set[str] = field(default_factory=set)
    retiring: set[asyncio.Task[None]] = field(default_factory=set)
    """Old versions draining, then stopping."""
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    _shared: dict[int, dict[str, Any]] = field(default_factory=dict)
    _seen: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    """The poll's last look at each model's config and file."""
    _poll: asyncio.Task[None] | None = None

    # --- the index -----------------------------------------------------------------------

    async def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Triton's repository index: every model the source has or the server serves, with
        ``name``, ``version``, ``state`` and ``reason`` (a model never loaded: its name only)."""
        listed = await asyncio.to_thread(self.source.names)  # (a directory, for a repository)
        names = dict.fromkeys([*listed, *self.repo.models, *self.records])
        out: list[dict[str, str]] = []
        for name in sorted(names):
            model = self.repo.models.get(name)
            if model is not None:
                for m in model.all():
                    version = m.version if m.primary else m.variant
                    ready = m.ready
                    out.append({"name": name, "version": version,
                                "state": READY if ready else UNAVAILABLE,
                                "reason": "" if ready else "not ready (a worker stopped)"})
            elif name in self.loading:
                out.append({"name": name, "version": "", "state": LOADING, "reason": ""})
            elif name in self.records:
                r = self.records[name]
                out.append({"name": name, "version": r.version, "state": r.state,
                            "reason": r.reason})
            else:
                out.append({"name": name})
        return [e for e in out if e.get("state") == READY] if ready_only else out

    # --- load ----------------------------------------------------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def load(self, name: str, override: Override = None) -> Model:
        """Build ``name`` from the source now, start it, and swap it in for the version
        serving (retired in the background); ``LoadFailed`` (400, the reason) leaves that
        one serving. Returns the model now serving."""
        lock = self._lock(name)
        try:
            async with lock:
                self.loading.add(name)
                try:
                    return await self._load(name, override)
                finally:
                    self.loading.discard(name)
        finally:  # a name that is nothing here keeps no lock (admins may send any)
            if not lock.locked() and name not in self.repo.models \
                    and name not in self.records:
                self._locks.pop(name, None)

    async def _load(self, name: str, override: Override) -> Model:
        old = self.repo.models.get(name)
        holders = self._holders(name)
        if old is not None and holders:
            raise LoadFailed(f"failed to load '{name}': {_listed(holders)} built over it "
                             "(unload them first, then load them again after it)")
        t0 = time.perf_counter()
        try:
            mc = await asyncio.to_thread(self.source.resolve, name, override)
            look = await asyncio.to_thread(self._look, mc)  # (before: a file replaced while
            new = await asyncio.to_thread(self._build, mc)  # it builds is seen by the poll)
        except ModelNotFound:
            raise ModelNotFound(self._unknown(name), param="model") from None
        except Exception as exc:  # noqa: BLE001 - any failure is the load's reason
            reason = exc.message if isinstance(exc, SokujiError) else f"{type(exc).__name__}: {exc}"
            if old is None:
                self.records[name] = Record(UNAVAILABLE, "", reason)
            log.warning("model %s: load failed (%s serves): %s", name,
                        "the version before" if old is not None else "nothing", reason)
            raise LoadFailed(f"failed to load '{name}': {reason}", param="model") from None
        revision = hashlib.sha256(repr(look).encode()).hexdigest()[:12]
        for m in new.all():
            m.revision = revision
        try:
            self.wire(new)
            for m in new.all():
                m.served.start()
                m.started = True
        except Exception:
            await self._stop(new)
            raise
        self.repo.models[name] = new  # the swap: new lookups find it from here on
        self.records.pop(name, None)
        self.repo.wire_neighbours()
        self.follow(name, new)
        self._seen[name] = look
        log.info("model %s %s (runtime %s, version %s) in %.0f ms", name,
                 "reloaded" if old is not None else "loaded", new.config.runtime,
                 new.version, (time.perf_counter() - t0) * 1e3)
        if old is not None:
            task = asyncio.get_running_loop().create_task(self._retire(old, name),
                                                          name=f"retire-{name}")
            self.retiring.add(task)
            task.add_done_callback(self.retiring.discard)
            del old  # (the retirement watches it by weak reference only)
        return new

    def _build(self, mc: ModelConfig) -> Model:
        """The model, built by its kind (in a thread: loads weights, warms up)."""
        at = f"model '{mc.name}'"
        kind = registry.get(mc.runtime, f"{at}.runtime")
        if mc.max_batch_size == 0 and not kind.unbatched:
            raise LoadFailed(f"max_batch_size 0 is for runtime tensor; runtime {mc.runtime} "
                             "batches", param="max_batch_size")
        options = kind.parse(mc, at)
        kind.check(mc, options, at, self.config)
        models = Taken({n: m.served for n, m in self.repo.models.items() if n != mc.name})
        env = BuildEnv(self.config, at, models, self._shared.setdefault(id(kind), {}),
                       self.on_batch)
        built = kind.build(mc, options, env)
        return Model.of(mc, built, models.taken)

    def _holders(self, name: str) -> list[str]:
        return sorted(n for n, m in self.repo.models.items() if name in m.uses and n != name)

    def _unknown(self, name: str) -> str:
        listed = (f"; available: {', '.join(sorted(self.source.names())) or 'none'}"
                  if self.repo.list_in_errors else "")
        return f"unknown model '{name}'{listed}"

    # --- unload --------------------------------------------------------------------------

    async def unload(self, name: str, dependents: bool = False) -> None:
        """Stop serving ``name``: new requests get 404 at once, those holding it finish, then
        it is stopped and closed (this returns then). ``dependents``: the models built over
        it go first (else 400 naming them)."""
        if name not in self.repo.models and name not in self.records \
                and name not in await asyncio.to_thread(self.source.names):
            raise ModelNotFound(self._unknown(name), param="model")
        holders = self._holders(name)
        if holders and not dependents:
            raise BadRequest(f"cannot unload '{name}': {_listed(holders)} built over it "
                             "(unload them first, or ask for unload_dependents)",
                             param="model")
        for holder in holders:
            await self.unload(holder, dependents=True)
        async with self._lock(name):
            model = self.repo.models.pop(name, None)
            if model is None:
                return  # (not serving: nothing to do, as Triton answers)
            self.records[name] = Record(UNAVAILABLE, model.version, "unloaded")
            self._seen.pop(name, None)
            self.repo.wire_neighbours()
            self.follow(name, None)
            log.info("model %s unloaded: draining", name)
            retire = self._retire(model, name)
            del model  # (watched by weak reference only from here)
            await retire

    # --- retiring ------------------------------------------------------------------------

    async def _retire(self, model: Model, name: str) -> None:
        """Wait until no request holds ``model`` and it has nothing queued or running, then
        stop and close it (also when cancelled: at shutdown)."""
        served = [m.served for m in model.all()]
        refs = [weakref.ref(m) for m in model.all()]
        del model
        try:
            await self._drain(refs, served, name)
        finally:
            await self._stop_served(served)
            log.info("model %s: the version retired is stopped and closed", name)

    async def _drain(self, refs: list[weakref.ref[Model]], served: list[Any], name: str
                     ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_s
        delay, collected = 0.002, loop.time()
        while loop.time() < deadline:
            held = any(r() is not None for r in refs)
            if not held and not any(s.num_waiting or s.capacity().num_running for s in served):
                return
            if held and loop.time() - collected > 1.0:
                gc.collect()  # a request gone, its frame caught in a reference cycle
                collected = loop.time()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        log.warning("model %s: the version retired was still held after %.0f s: stopped "
                    "anyway", name, self.drain_s)

    async def _stop(self, model: Model) -> None:
        await self._stop_served([m.served for m in model.all()])

    @staticmethod
    async def _stop_served(served: list[Any]) -> None:
        await asyncio.gather(*(s.stop() for s in served))
        await asyncio.gather(*(asyncio.to_thread(s.close) for s in served))

    # --- polling -------------------------------------------------------------------------

    def _look(self, mc: ModelConfig) -> tuple[Any, ...]:
        """What the poll compares: the config, and its model file's time and size."""
        stat: tuple[int, int] = (0, 0)
        if mc.path:
            with contextlib.suppress(OSError):
                st = Path(mc.path).stat()
                stat = (st.st_mtime_ns, st.st_size)
        return (msgspec.json.encode(mc), stat)

    async def poll_once(self) -> list[str]:
        """One look at the source: load what is new or changed, unload what is gone; the
        names acted on. A failed load is logged and kept in the index (its reason)."""
        names = await asyncio.to_thread(self.source.names)
        acted: list[str] = []
        for name in [n for n in self.repo.models if n not in names]:
            with contextlib.suppress(SokujiError):
                await self.unload(name, dependents=True)
                acted.append(name)
        for name in names:
            if name in self.loading:
                continue
            try:
                mc = await asyncio.to_thread(self.source.resolve, name, None)
            except Exception as exc:  # noqa: BLE001 - a broken entry: its reason, kept
                if name not in self.repo.models:
                    self.records[name] = Record(UNAVAILABLE, "", str(exc))
                continue
            look = self._look(mc)
            if name in self.repo.models and self._seen.get(name) in (None, look):
                self._seen.setdefault(name, look)
                continue
            if name not in self.repo.models and self._seen.get(name) == look:
                continue  # failed before as it is now: not tried again until it changes
            self._seen[name] = look
            try:
                await self.load(name)
                acted.append(name)
            except SokujiError as exc:
                log.warning("poll: %s", exc.message)
        return acted

    def start(self, interval_s: float) -> None:
        """Poll the source every ``interval_s`` (0: never)."""
        if interval_s <= 0:
            return
        for model in self.repo.models.values():
            self._seen[model.name] = self._look(model.config)

        async def run() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await self.poll_once()
                except Exception:  # a source that cannot be read now: the next look
                    log.exception("poll of %s failed", self.source.what)

        self._poll = asyncio.get_running_loop().create_task(run(), name="repository-poll")

    async def stop(self) -> None:
        """At shutdown: no more polls; retired versions stop now."""
        if self._poll is not None:
            self._poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll
        for task in list(self.retiring):
            task.cancel()  # (a cancelled retirement still stops and closes its model)
        await asyncio.gather(*self.retiring, return_exceptions=True)


def _listed(names: list[str]) -> str:
    return ", ".join(f"'{n}'" for n in names)

