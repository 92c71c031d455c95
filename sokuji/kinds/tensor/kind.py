"""Kind ``tensor``: any ONNX graph, its named tensors in and out (``TensorModel`` over a
``TensorRuntime``), dynamically batched along the batch dimension.

The graph says its inputs and outputs; ``inputs`` / ``outputs`` (a Triton model
configuration's, ``repository/triton_repo.py``) may declare them too: each declared tensor
must be the graph's (same datatype; its dims the graph's, or a ``reshape`` to them), and a
declared one serves with its declared dims. ``max_batch_size`` > 0 batches along the first
dimension, which every input must have dynamic; 0 (Triton's meaning) runs each request
alone, as the graph takes it. A graph with no dynamic first dimension is served unbatched
whatever ``max_batch_size`` says (Triton's auto-complete does the same).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from sokuji.config import ModelConfig, ServerConfig
from sokuji.core.batcher import DynamicBatcher
from sokuji.core.limits import Limit
from sokuji.core.model import ModelMetadata, TensorSpec
from sokuji.core.tensor import BYTES, DATATYPES, DTYPES
from sokuji.errors import ConfigError
from sokuji.kinds.encoder.model import batcher_config
from sokuji.kinds.kind import BuildEnv, Built, Kind
from sokuji.kinds.tensor.model import Shapes, TensorModel

log = logging.getLogger(__name__)

Dims = tuple[Annotated[int, msgspec.Meta(ge=-1)], ...]


class Declared(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An input or output as a Triton configuration declares it."""

    name: str
    datatype: str
    """A KServe V2 datatype (FP32, INT64, BYTES, ...)."""
    dims: Dims
    """Past the batch dimension when batched; -1: any size."""
    reshape: Dims | None = None
    """The graph's own shape (past the batch dimension), where ``dims`` is not it."""
    optional: bool = False


class WarmupInput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    datatype: str
    dims: Dims
    fill: Literal["zero", "random", "file"] = "zero"
    file: str = ""
    """``fill = "file"``: the raw little-endian bytes of the tensor (Triton's
    ``input_data_file``)."""


class WarmupSample(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One warm-up request (Triton's ``model_warmup``): run ``count`` times at load."""

    name: str
    inputs: dict[str, WarmupInput]
    batch_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    count: Annotated[int, msgspec.Meta(ge=1)] = 1


class TensorOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[models.options]`` of a tensor model."""

    inter_op_threads: Annotated[int, msgspec.Meta(ge=1)] = 1
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = "all"
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    """ONNX Runtime execution providers, in order (only those installed are used)."""
    ragged: dict[str, float] = {}
    """Inputs whose dimensions past the batch may differ between the requests of a batch:
    padded to the batch's largest with this value (a transformer's ``input_ids = 0``)."""
    cut: tuple[str, ...] = ()
    """Outputs cut back, on the ragged inputs' axes, to each request's own extent."""
    preferred_batch_sizes: tuple[Annotated[int, msgspec.Meta(ge=1)], ...] = ()
    """Batch sizes (rows) a batch is cut back to; empty: any up to ``max_batch_size``."""
    max_elements: Annotated[int, msgspec.Meta(ge=1)] = 1 << 24
    """The most input elements one request may send (its cost bound beside the body's
    bytes): more are refused (413) before anything runs."""
    max_batch_elements: Annotated[int, msgspec.Meta(ge=1)] = 1 << 24
    """The most input elements of one batch (a request larger still runs, alone); in place
    of ``max_batch_tokens``, which is for texts."""
    inputs: tuple[Declared, ...] = ()
    outputs: tuple[Declared, ...] = ()
    warmup: tuple[WarmupSample, ...] = ()
    platform: str = "onnxruntime_onnx"
    triton_config: dict[str, Any] = {}
    """The Triton model configuration this model was served from (a repository's,
    completed), as ``GET .../config`` returns it; empty: made from this config."""
    versions: dict[str, str] = {}
    """Other versions served beside ``path`` (version -> ONNX file; a Triton repository's
    ``version_policy``), answered as V2 versions; ``version`` names the one ``path`` holds."""


class TensorKind(Kind):
    options = TensorOptions
    unbatched = True
    triton_backend = "onnxruntime"

    def check(self, model: ModelConfig, options: TensorOptions, at: str,
              config: ServerConfig) -> None:
        super().check(model, options, at, config)
        if model.path is None:
            raise ConfigError.for_key(f"{at}.path", None, "a tensor model needs an ONNX file")
        if not Path(model.path).is_file():
            raise ConfigError.for_key(f"{at}.path", model.path, "no such file")
        for version, file in options.versions.items():
            if version == model.version:
                raise ConfigError.for_key(f"{at}.options.versions", version,
                                          f"is the model's own version (path {model.path})")
            if not Path(file).is_file():
                raise ConfigError.for_key(f"{at}.options.versions.{version}", file,
                                          "no such file")
        for key, declared in (("inputs", options.inputs), ("outputs", options.outputs)):
            for i, d in enumerate(declared):
                if d.datatype not in DATATYPES:
                    raise ConfigError.for_key(f"{at}.options.{key}[{i}].datatype", d.datatype,
                                              f"must be one of {', '.join(sorted(DATATYPES))}")
        if sorted(options.preferred_batch_sizes) != list(options.preferred_batch_sizes):
            raise ConfigError.for_key(f"{at}.options.preferred_batch_sizes",
                                      list(options.preferred_batch_sizes), "must be ascending")
        if options.preferred_batch_sizes and \
                options.preferred_batch_sizes[-1] > model.max_batch_size:
            raise ConfigError.for_key(f"{at}.options.preferred_batch_sizes",
                                      list(options.preferred_batch_sizes),
                                      f"must be at most max_batch_size ({model.max_batch_size})")

    def build(self, model: ModelConfig, options: TensorOptions, env: BuildEnv) -> Built:
        if not options.versions:
            return Built(build_model(model, options, env))
        # Each version its own model (session, batcher), the same options but its file.
        versions = {v: build_model(msgspec.structs.replace(model, path=file, version=v),
                                   options, env, metric_name=f"{model.name}@{v}")
                    for v, file in sorted(options.versions.items())}
        return Built(build_model(model, options, env), variant=model.version,
                     versions=dict(versions))


def build_model(model: ModelConfig, options: TensorOptions, env: BuildEnv,
                metric_name: str = "") -> TensorModel:
    """A loaded, warmed ``TensorModel`` for ``model`` (blocking); ``metric_name``: its
    batches' name (another version's: ``name@version``), else the model's."""
    from sokuji.runtimes.onnx import auto_threads
    from sokuji.runtimes.tensor import Options, TensorRuntime

    assert model.path is not None
    runtime = TensorRuntime(model.path, Options(
        intra_op_threads=model.intra_op_threads or auto_threads(),
        inter_op_threads=options.inter_op_threads,
        graph_optimization_level=options.graph_optimization_level,
        providers=_providers(model.name, options.providers), ragged=options.ragged,
        cut=options.cut), batched=None if model.max_batch_size else False)
    try:
        runtime.load()
    except ConfigError as exc:
        raise ConfigError(f"{env.at} ({model.name}): {exc}") from exc
    max_batch = model.max_batch_size if runtime.batched else 0
    if model.max_batch_size and not runtime.batched:
        log.info("model %s: the graph's inputs have no dynamic first dimension: served "
                 "unbatched (max_batch_size 0)", model.name)
    metadata, shapes = _served(model, options, runtime, max_batch, env.at)
    if model.warmup:
        runtime.warmup([s for w in options.warmup
                        for s in [_sample(w, shapes, metadata, env.at)] * w.count])
    bc = dataclasses.replace(batcher_config(model, env.server.slos),
                             max_batch_size=max(1, max_batch),
                             max_batch_tokens=options.max_batch_elements,
                             preferred_batch_sizes=options.preferred_batch_sizes)
    name = metric_name or model.name
    batcher = DynamicBatcher(name, runtime.run_batch, bc,
                             on_batch=env.on_batch(name) if env.on_batch else None)
    limits = (Limit("max_request_bytes", model.max_request_bytes or env.server.max_request_bytes,
                    "bytes", "bytes of one request's body"),
              Limit("options.max_elements", options.max_elements, "elements",
                    "input elements of one request"))
    served = TensorModel(model, runtime, batcher, metadata, shapes, limits)
    if options.triton_config:
        served.triton_config = dict(options.triton_config)
    return served


def _providers(name: str, wanted: tuple[str, ...]) -> tuple[str, ...]:
    """The execution providers asked for that this ONNX Runtime has (CPU last, always)."""
    import onnxruntime as ort

    have = set(ort.get_available_providers())
    kept = [p for p in wanted if p in have]
    for p in wanted:
        if p not in have:
            log.warning("model %s: execution provider %s is not available here (have: %s); "
                        "not used", name, p, ", ".join(sorted(have)))
    if "CPUExecutionProvider" not in kept:
        kept.append("CPUExecutionProvider")
    return tuple(kept)


def _served(model: ModelConfig, options: TensorOptions, runtime: Any, max_batch: int,
            at: str) -> tuple[ModelMetadata, Shapes]:
    """The served tensors (the graph's, or as declared) and how they map onto the graph."""
    graph = runtime.describe(options.platform)
    batched = max_batch > 0
    in_reshape: dict[str, tuple[int, ...]] = {}
    out_reshape: dict[str, tuple[int, ...]] = {}

    def served(specs: tuple[TensorSpec, ...], declared: tuple[Declared, ...], key: str,
               reshape: dict[str, tuple[int, ...]]) -> tuple[TensorSpec, ...]:
        by_name = {s.name: s for s in specs}
        for i, d in enumerate(declared):
            where = f"{at}.options.{key}[{i}]"
            spec = by_name.get(d.name)
            if spec is None:
                raise ConfigError.for_key(f"{where}.name", d.name,
                                          f"the graph has no {key[:-1]} of that name (it has "
                                          f"{', '.join(by_name)})")
            if d.datatype != spec.datatype:
                raise ConfigError.for_key(f"{where}.datatype", d.datatype,
                                          f"the graph's {key[:-1]} '{d.name}' is "
                                          f"{spec.datatype}")
            own = spec.shape[1:] if batched else spec.shape
            target = d.reshape if d.reshape is not None else d.dims
            if not _compatible(target, own):
                raise ConfigError.for_key(f"{where}.dims", list(d.dims),
                                          f"the graph's {key[:-1]} '{d.name}' has shape "
                                          f"{list(spec.shape)}"
                                          f"{' (past the batch dimension)' if batched else ''}"
                                          "; declare those dims, or a reshape to them")
            if d.reshape is not None and tuple(d.reshape) != tuple(d.dims):
                if key == "inputs":
                    reshape[d.name] = tuple(d.reshape)
                else:
                    reshape[d.name] = tuple(d.dims)
            if d.optional and not spec.optional:
                raise ConfigError.for_key(f"{where}.optional", True,
                                          f"the graph needs {key[:-1]} '{d.name}' (it has no "
                                          "default for it)")
            shape = ((-1,) if batched else ()) + tuple(d.dims)
            by_name[d.name] = TensorSpec(d.name, d.datatype, shape, optional=spec.optional)
        return tuple(by_name.values())

    inputs = served(graph.inputs, options.inputs, "inputs", in_reshape)
    outputs = served(graph.outputs, options.outputs, "outputs", out_reshape)
    shapes = Shapes(max_batch, frozenset(options.ragged), in_reshape or None,
                    out_reshape or None)
    return ModelMetadata(platform=graph.platform, inputs=inputs, outputs=outputs), shapes


def _compatible(declared: tuple[int, ...], graph: tuple[int, ...]) -> bool:
    """Declared dims fit the graph's: same rank, each equal or either side -1."""
    return len(declared) == len(graph) and all(
        a == b or a == -1 or b == -1 for a, b in zip(declared, graph, strict=True))


def _sample(w: WarmupSample, shapes: Shapes, meta: ModelMetadata, at: str
            ) -> dict[str, np.ndarray]:
    """One warm-up request's graph inputs."""
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {}
    for name, spec in w.inputs.items():
        dims = tuple(1 if d < 0 else d for d in spec.dims)
        shape = ((w.batch_size,) if shapes.max_batch_size else ()) + dims
        if spec.datatype == BYTES:
            array = np.full(shape, "", dtype=object)
        else:
            dtype = DTYPES.get(spec.datatype)
            if dtype is None:
                raise ConfigError.for_key(f"{at}.options.warmup.{w.name}.{name}", spec.datatype,
                                          "not a KServe datatype")
            if spec.fill == "file":
                raw = Path(spec.file).read_bytes()
                array = np.frombuffer(raw, dtype=dtype).reshape(shape)
            elif spec.fill == "random":
                array = (rng.random(shape) * 2).astype(dtype)
            else:
                array = np.zeros(shape, dtype=dtype)
        graph = (shapes.input_reshape or {}).get(name)
        if graph is not None:
            array = array.reshape(((w.batch_size,) if shapes.max_batch_size else ()) + graph)
        feeds[name] = array
    return feeds


KIND = TensorKind()
