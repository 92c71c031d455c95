"""Triton's model configuration and statistics extensions, as JSON bodies from plain data.

- ``GET /v2/models/{m}[/versions/{v}]/config``: the model's configuration the way Triton's
  HTTP server returns it: the ``ModelConfig`` protobuf as JSON with proto field names, scalar
  fields present even at their defaults, 64-bit integers as numbers. With ``max_batch_size``
  > 0, ``dims`` leave out the batch dimension. A text input that is one string per batch item
  (the runtime's shape ``[-1]``) becomes ``dims: [1]`` with ``reshape: {shape: []}``,
  Triton's spelling of it, and the V2 metadata shows it as Triton would: ``[-1, 1]``.
  perf_analyzer builds its requests from that shape minus the batch dimension (an empty
  remainder is an error there: "unable to set shape for the input"), so it sends
  ``[batch, 1]``. ``[N]`` stays accepted too.
- ``GET /v2/models[/{m}[/versions/{v}]]/stats``: Triton's statistics (``stats.py`` says how
  Sokuji's stages map onto them). Versions are named as perf_analyzer expects: the model's
  configured version (``"1"``) for the variant served by default, which perf_analyzer parses
  as an integer; other variants by their names.
- A model served from a Triton repository (``repository/triton_translate.py``) answers its
  own completed configuration (``TensorModel.triton_config``), with Sokuji's parameters and
  its ``limit.*`` parameters added.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from sokuji.core.model import Api
from sokuji.observability.stats import Duration, StatsSnapshot
from sokuji.repository import registry
from sokuji.repository.models import Model
from sokuji.runtimes.base import ModelMetadata, TensorSpec

DATA_TYPES = {"BOOL": "TYPE_BOOL", "UINT8": "TYPE_UINT8", "UINT16": "TYPE_UINT16",
              "UINT32": "TYPE_UINT32", "UINT64": "TYPE_UINT64", "INT8": "TYPE_INT8",
              "INT16": "TYPE_INT16", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64",
              "FP16": "TYPE_FP16", "FP32": "TYPE_FP32", "FP64": "TYPE_FP64",
              "BF16": "TYPE_BF16", "BYTES": "TYPE_STRING"}
STAT_FIELDS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
               "cache_hit", "cache_miss")


def versions(primary: Model) -> list[str]:
    """Every version name a model answers to: its configured version, then, when it serves
    several variants, the served variant's name (the same runtime: responses name it) and
    every other variant's."""
    names = [primary.version]
    if primary.variants:
        names += [n for n in (primary.variant, *sorted(primary.variants)) if n not in names]
    return names


def stats_version(model: Model) -> str:
    return model.version if model.primary else model.variant


def batched(model: Model) -> bool:
    """Whether the model batches in Triton's sense (``max_batch_size`` > 0): it batches its
    requests (``batches``) and every input leads with the batch dimension."""
    return model.served.batches and all(t.shape[:1] == (-1,) for t in model.metadata.inputs)


def decoupled(model: Model) -> bool:
    """Whether its answers are streams of events (Triton's decoupled transaction policy):
    it generates, and answers no one-response V2 infer."""
    return Api.GENERATE in model.apis and Api.INFER not in model.apis


def _dims(spec: TensorSpec, batching: bool) -> list[int]:
    """Triton's ``dims``: without the batch dimension when batched; never empty (one item
    per batch entry is ``[1]``, reshaped to ``[]``)."""
    return list(spec.shape[1:] if batching else spec.shape) or [1]


def metadata(model: Model) -> ModelMetadata:
    """The V2 metadata's view of the model: shapes as Triton derives them from the config
    (``[-1, *dims]`` when batched). An open model's (a Python model's that declares none)
    is what it has seen so far, read from the served model."""
    if model.metadata.open:
        return model.served.metadata
    if not batched(model):
        return model.metadata

    def shown(t: TensorSpec) -> TensorSpec:
        return replace(t, shape=(-1, *_dims(t, True)))

    meta = model.metadata
    return replace(meta, inputs=tuple(map(shown, meta.inputs)),
                   outputs=tuple(map(shown, meta.outputs)))


def _tensor(spec: TensorSpec, batching: bool, output: bool) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": spec.name, "data_type": DATA_TYPES[spec.datatype],
                           "dims": _dims(spec, batching)}
    if len(spec.shape) == int(batching):
        doc["reshape"] = {"shape": []}
    if output:
        doc["label_filename"] = ""
    else:
        doc.update(format="FORMAT_NONE", allow_ragged_batch=False, optional=spec.optional)
    doc.update(is_shape_tensor=False, is_non_linear_format_io=False)
    return doc


def model_config(model: Model, primary: Model, response_cache: bool) -> dict[str, Any]:
    """Triton's model configuration of ``model`` (``primary``: the version served by
    default, which knows the others); ``response_cache``: the server's cache is on."""
    mc, meta, batching = model.config, model.metadata, batched(model)
    params = {"sokuji_runtime": mc.runtime, "max_queue_depth": mc.max_queue_depth,
              "default_timeout_ms": mc.default_timeout_ms,
              "priority_aging_ms": mc.priority_aging_ms}
    if model.variant:
        params["variant"] = model.variant
    doc: dict[str, Any] = {
        "name": model.name, "platform": meta.platform,
        "backend": registry.get(mc.runtime).triton_backend or mc.runtime, "runtime": "",
        "version_policy": {"all": {}} if primary.variants else {"latest": {"num_versions": 1}},
        "max_batch_size": mc.max_batch_size if batching else 0,
        "input": [_tensor(t, batching, output=False) for t in meta.inputs],
        "output": [_tensor(t, batching, output=True) for t in meta.outputs],
        "batch_input": [], "batch_output": [],
        "instance_group": [{
            "name": f"{model.name}_0", "kind": "KIND_CPU",
            "count": mc.instances if model.served.batches else 1, "gpus": [],
            "secondary_devices": [], "profile": [], "passive": False, "host_policy": ""}],
        "default_model_filename": "", "cc_model_filenames": {}, "metric_tags": {},
        "model_warmup": [],
        "model_transaction_policy": {"decoupled": decoupled(model)},
        "response_cache": {"enable": response_cache and mc.cache and batching},
    }
    if model.served.batches:
        # Sokuji's batcher is work-conserving: max_queue_delay only applies while another
        # instance of the model is busy (Triton's always does). Priority level 1 is
        # interactive, 2 and above batch.
        doc["dynamic_batching"] = {
            "preferred_batch_size": [],
            "max_queue_delay_microseconds": round(mc.max_queue_delay_ms * 1000),
            "preserve_ordering": False, "priority_levels": 2, "default_priority_level": 1,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": round(mc.default_timeout_ms * 1000),
                "allow_timeout_override": True, "max_queue_size": mc.max_queue_depth},
            "priority_queue_policy": {}}
        params.update(max_batch_tokens=mc.max_batch_tokens, batching=str(mc.batching),
                      max_concurrency=mc.max_concurrency, work_conserving="true")
    served_from = getattr(model.served, "triton_config", None)
    if served_from:
        # A Triton repository's model: its own completed configuration, Sokuji's parameters
        # added to its own.
        doc = copy.deepcopy(served_from)
        doc["parameters"] = {**doc.get("parameters", {}),
                             **{k: {"string_value": str(v)} for k, v in params.items()}}
    else:
        doc["parameters"] = {k: {"string_value": str(v)} for k, v in params.items()}
    # The cost bound (core/limits.py), as Triton's clients read parameters: one string each.
    for limit in model.served.limits:
        doc["parameters"][f"limit.{limit.key}"] = {
            "string_value": f"{limit.value:g} {limit.unit}: {limit.what}"}
    return doc


def model_stats(model: Model, snap: StatsSnapshot) -> dict[str, Any]:
    """One ``$model_stat`` object. ``batch_stats`` counts executions by batch size; their
    durations are not kept by size (0): the per-request compute totals are exact."""
    def duration(d: Duration) -> dict[str, int]:
        return {"count": d.count, "ns": d.ns}

    return {
        "name": model.name, "version": stats_version(model),
        "last_inference": snap.last_inference_ms,
        "inference_count": snap.inference_count, "execution_count": snap.execution_count,
        "inference_stats": {f: duration(getattr(snap, f)) for f in STAT_FIELDS},
        "batch_stats": [{"batch_size": size, **{part: {"count": n, "ns": 0} for part in
                                                ("compute_input", "compute_infer",
                                                 "compute_output")}}
                        for size, n in sorted(snap.batch_counts.items())],
    }
