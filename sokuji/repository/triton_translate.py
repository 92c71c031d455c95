"""One model of a Triton model repository as a Sokuji ``[[models]]`` table.

A Triton repository is ``<root>/<model>/config.pbtxt`` and ``<root>/<model>/<version>/<file>``
(``model.onnx`` unless ``default_model_filename`` says otherwise). ``config.pbtxt`` is
parsed with Triton's own schema (``tritonclient.grpc.model_config_pb2`` and protobuf's text
format: the ``repository`` extra), completed from the graph where Triton would complete it
(``triton_autocomplete.py``), checked for what Sokuji cannot serve, and translated into the
table a ``[[models]]`` entry of ``runtime = "tensor"`` would spell (``kinds/tensor/kind.py``),
so everything after the config load is Sokuji's ordinary path. The completed configuration
travels in ``options.triton_config`` (the protobuf as JSON, as Triton's
``GET /v2/models/{m}/config`` returns it).

This module imports no ``sokuji.config`` (the config imports it, at load);
``triton_repo.py`` turns its tables into ``ModelConfig``s for code that wants them.
``docs/triton-repository.md`` says what each field maps to and what is refused.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sokuji.errors import ConfigError

log = logging.getLogger(__name__)

CONFIG_FILE = "config.pbtxt"
DEFAULT_MODEL_FILENAME = "model.onnx"
PLATFORM = "onnxruntime_onnx"
BACKEND = "onnxruntime"
ENSEMBLE = "ensemble"
GRAPH_LEVELS = {-1: "basic", 1: "extended", 2: "disable"}
"""``optimization.graph.level`` -> ONNX Runtime's level, as Triton's backend maps it (any
other value, 0 included: all)."""
ACCELERATORS = {("gpu", "tensorrt"): "TensorrtExecutionProvider",
                ("gpu", "cuda"): "CUDAExecutionProvider",
                ("cpu", "openvino"): "OpenVINOExecutionProvider"}
"""``optimization.execution_accelerators`` names -> ONNX Runtime execution providers."""


def names(root: str | Path) -> list[str]:
    """The model directories of the repository, sorted (hidden ones left out)."""
    base = Path(root)
    if not base.is_dir():
        raise ConfigError.for_key("model_repository", str(root), "no such directory")
    return sorted(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))


def tables(root: str | Path) -> list[dict[str, Any]]:
    """Every model of the repository as a ``[[models]]`` table, in name order."""
    found = names(root)
    if not found:
        raise ConfigError.for_key("model_repository", str(root),
                                  "holds no model directory (<model>/config.pbtxt, "
                                  "<model>/<version>/model.onnx)")
    return [table(root, name) for name in found]


def table(root: str | Path, name: str, override: str | dict[str, Any] | None = None
          ) -> dict[str, Any]:
    """Model ``name``'s ``[[models]]`` table. ``override``: a model configuration as JSON
    (a string or its parsed dict), as Triton's load API takes it, in place of config.pbtxt."""
    from tritonclient.grpc import model_config_pb2 as pb

    from sokuji.repository import triton_autocomplete

    home = Path(root) / name
    if not home.is_dir():
        raise ConfigError(f"model repository {root}: no model '{name}' (no directory {home})",
                          param="model_repository")
    where = f"model '{name}' ({home / CONFIG_FILE})" if (home / CONFIG_FILE).is_file() \
        else f"model '{name}' ({home}, no {CONFIG_FILE})"
    config = _parse(home, override, where)
    if config.name and config.name != name:
        raise ConfigError(f"{where}: name '{config.name}' must be the model's directory "
                          f"name, '{name}' (as Triton requires)", param="name")
    config.name = name
    if config.platform == ENSEMBLE:
        return _ensemble(config, home, where, pb)
    _refuse(config, where)
    config.platform, config.backend = PLATFORM, BACKEND
    config.default_model_filename = config.default_model_filename or DEFAULT_MODEL_FILENAME
    files = _versions(home, config, where)
    latest = max(files, key=int)
    if triton_autocomplete.needed(config):
        triton_autocomplete.complete(config, files[latest], where)
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    if not len(config.instance_group):
        config.instance_group.add(kind=pb.ModelInstanceGroup.KIND_CPU, count=1)
    for i, group in enumerate(config.instance_group):
        group.name = group.name or f"{name}_{i}"
        group.count = group.count or 1
    return _table(config, home, files, latest, where, pb)


def _parse(home: Path, override: str | dict[str, Any] | None, where: str) -> Any:
    """The model's configuration proto: the override, else config.pbtxt, else empty (to be
    auto-completed)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2 as pb

    config = pb.ModelConfig()
    if override is not None:
        try:
            if isinstance(override, str):
                json_format.Parse(override, config)
            else:
                json_format.ParseDict(override, config)
        except (json_format.ParseError, TypeError, ValueError) as exc:
            raise ConfigError(f"model '{home.name}': the configuration given is not a Triton "
                              f"model configuration: {exc}", param="config") from None
        return config
    path = home / CONFIG_FILE
    if not path.is_file():
        return config
    try:
        text_format.Parse(path.read_text(encoding="utf-8"), config)
    except (text_format.ParseError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not a valid Triton model configuration: {exc}",
                          param="model_repository") from None
    return config


def _refuse(config: Any, where: str) -> None:
    """Stop at start, naming the model, on what Sokuji does not serve."""
    platform, backend = config.platform, config.backend
    if platform not in ("", PLATFORM) or backend not in ("", BACKEND):
        raise ConfigError(
            f"{where}: platform '{platform}' / backend '{backend}' is not supported: Sokuji "
            f"serves Triton repositories' ONNX models (platform {PLATFORM}, backend "
            f"{BACKEND}) and ensembles of them (platform {ENSEMBLE}); not tensorrt_plan, "
            "pytorch_libtorch, tensorflow_*, openvino, python or custom backends",
            param="platform")
    unsupported = [
        ("sequence_batching", config.HasField("sequence_batching")),
        ("batch_input", bool(len(config.batch_input))),
        ("batch_output", bool(len(config.batch_output))),
        ("model_transaction_policy.decoupled", config.model_transaction_policy.decoupled),
        ("input.is_shape_tensor", any(i.is_shape_tensor for i in config.input)),
        ("output.is_shape_tensor", any(o.is_shape_tensor for o in config.output)),
        ("input.allow_ragged_batch", any(i.allow_ragged_batch for i in config.input)),
    ]
    for field, present in unsupported:
        if present:
            raise ConfigError(f"{where}: {field} is not supported by Sokuji yet",
                              param=field)


def _ensemble(config: Any, home: Path, where: str, pb: Any) -> dict[str, Any]:
    """An ensemble's table (kind ``ensemble``): its steps in order, its tensors."""
    if not len(config.ensemble_scheduling.step):
        raise ConfigError(f"{where}: an ensemble needs ensemble_scheduling with steps",
                          param="ensemble_scheduling")
    for field in ("sequence_batching", "dynamic_batching"):
        if config.HasField(field):
            raise ConfigError(f"{where}: {field} on an ensemble is not supported",
                              param=field)
    versions = sorted(int(p.name) for p in home.iterdir() if p.is_dir() and p.name.isdigit())
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    steps = [{"model": s.model_name, "version": s.model_version,
              "input_map": dict(s.input_map), "output_map": dict(s.output_map)}
             for s in config.ensemble_scheduling.step]
    return {"name": config.name, "runtime": "ensemble",
            "version": str(versions[-1]) if versions else "1",
            "max_batch_size": config.max_batch_size, "cache": False,
            "options": {"steps": steps,
                        "inputs": [_declared(i, pb, where) for i in config.input],
                        "outputs": [_declared(o, pb, where) for o in config.output],
                        "triton_config": to_json(config)}}


def _versions(home: Path, config: Any, where: str) -> dict[str, Path]:
    """The versions to serve (by ``version_policy``), each with its model file."""
    have = sorted(int(p.name) for p in home.iterdir() if p.is_dir() and p.name.isdigit())
    if not have:
        raise ConfigError(f"{where}: no version directory (a model's file goes in "
                          f"{home}/<version>/{config.default_model_filename})",
                          param="version_policy")
    policy = config.version_policy.WhichOneof("policy_choice")
    if policy == "all":
        chosen = have
    elif policy == "specific":
        chosen = sorted(set(config.version_policy.specific.versions))
        missing = [v for v in chosen if v not in have]
        if missing:
            raise ConfigError(f"{where}: version_policy names version(s) "
                              f"{', '.join(map(str, missing))}, which have no directory "
                              f"(there are: {', '.join(map(str, have))})",
                              param="version_policy")
    else:
        n = config.version_policy.latest.num_versions if policy == "latest" else 1
        chosen = have[-max(1, n):]
    files: dict[str, Path] = {}
    for v in chosen:
        path = home / str(v) / config.default_model_filename
        if path.is_dir():  # Triton's onnxruntime backend takes a directory holding model.onnx
            path = path / DEFAULT_MODEL_FILENAME
        if not path.is_file():
            raise ConfigError(f"{where}: version {v} has no model file {path}",
                              param="default_model_filename")
        files[str(v)] = path
    return files


def _datatype(value: int, pb: Any, where: str) -> str:
    name = pb.DataType.Name(value)
    if name == "TYPE_INVALID":
        raise ConfigError(f"{where}: a data_type is missing (TYPE_INVALID)", param="data_type")
    return "BYTES" if name == "TYPE_STRING" else name.removeprefix("TYPE_")


def _declared(io: Any, pb: Any, where: str) -> dict[str, Any]:
    out: dict[str, Any] = {"name": io.name, "datatype": _datatype(io.data_type, pb, where),
                           "dims": list(io.dims)}
    if io.HasField("reshape"):
        out["reshape"] = list(io.reshape.shape)
    if getattr(io, "optional", False):
        out["optional"] = True
    return out


def _table(config: Any, home: Path, files: dict[str, Path], latest: str, where: str,
           pb: Any) -> dict[str, Any]:
    mbs = config.max_batch_size
    options: dict[str, Any] = {
        "platform": PLATFORM,
        "inputs": [_declared(i, pb, where) for i in config.input],
        "outputs": [_declared(o, pb, where) for o in config.output],
    }
    model: dict[str, Any] = {"name": config.name, "runtime": "tensor",
                             "path": str(files[latest]), "version": latest,
                             "max_batch_size": mbs, "cache": config.response_cache.enable,
                             "max_queue_delay_ms": 0.0}
    if config.HasField("dynamic_batching"):
        db = config.dynamic_batching
        model["max_queue_delay_ms"] = db.max_queue_delay_microseconds / 1000
        preferred = sorted(set(db.preferred_batch_size))
        if preferred and (preferred[0] < 1 or preferred[-1] > mbs):
            raise ConfigError(f"{where}: dynamic_batching.preferred_batch_size "
                              f"{list(db.preferred_batch_size)} must be between 1 and "
                              f"max_batch_size ({mbs})", param="preferred_batch_size")
        options["preferred_batch_sizes"] = preferred
        queue = db.default_queue_policy
        model["default_timeout_ms"] = queue.default_timeout_microseconds / 1000
        if queue.max_queue_size > 0:
            model["max_queue_depth"] = queue.max_queue_size
        if db.default_priority_level > 1 or len(db.priority_queue_policy):
            log.warning("%s: Sokuji has two priority classes (level 1 interactive, 2 and "
                        "above batch; a request without one is interactive): "
                        "default_priority_level and priority_queue_policy are not applied",
                        where)
    model["instances"] = sum(g.count for g in config.instance_group)
    options["providers"] = _providers(config, where)
    if config.optimization.HasField("graph"):
        options["graph_optimization_level"] = GRAPH_LEVELS.get(
            config.optimization.graph.level, "all")
    for key, target, low in (("intra_op_thread_count", "intra_op_threads", 0),
                             ("inter_op_thread_count", "inter_op_threads", 1)):
        if key in config.parameters:
            raw = config.parameters[key].string_value
            if not raw.strip().isdigit():
                raise ConfigError(f"{where}: parameters {key} = {raw!r} is not a whole "
                                  "number", param=key)
            value = int(raw)
            if target == "intra_op_threads":
                model[target] = value
            elif value >= low:
                options[target] = value
    options["warmup"] = [_warmup(w, home, mbs, pb, where) for w in config.model_warmup]
    others = {v: str(p) for v, p in files.items() if v != latest}
    if others:
        options["versions"] = others
    options["triton_config"] = to_json(config)
    model["options"] = options
    return model


def _providers(config: Any, where: str) -> list[str]:
    """ONNX Runtime execution providers from the accelerators and the instance groups."""
    wanted: list[str] = []
    acc = config.optimization.execution_accelerators
    for side, listed in (("gpu", acc.gpu_execution_accelerator),
                         ("cpu", acc.cpu_execution_accelerator)):
        for a in listed:
            provider = ACCELERATORS.get((side, a.name))
            if provider is None:
                known = ", ".join(n for s, n in ACCELERATORS if s == side)
                raise ConfigError(f"{where}: {side}_execution_accelerator '{a.name}' is not "
                                  f"known (known: {known})", param="execution_accelerators")
            wanted.append(provider)
    gpu = config.instance_group and any(
        g.kind == g.KIND_GPU for g in config.instance_group)
    if gpu:
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            log.warning("%s: instance_group kind KIND_GPU, but this ONNX Runtime has no "
                        "CUDAExecutionProvider: served on CPU", where)
        wanted.append("CUDAExecutionProvider")
    wanted.append("CPUExecutionProvider")
    return list(dict.fromkeys(wanted))


def _warmup(w: Any, home: Path, mbs: int, pb: Any, where: str) -> dict[str, Any]:
    batch = max(1, w.batch_size)
    if mbs and batch > mbs:
        raise ConfigError(f"{where}: model_warmup '{w.name}' batch_size {batch} is over "
                          f"max_batch_size ({mbs})", param="model_warmup")
    inputs: dict[str, Any] = {}
    for name, inp in w.inputs.items():
        spec: dict[str, Any] = {"datatype": _datatype(inp.data_type, pb, where),
                                "dims": list(inp.dims)}
        which = inp.WhichOneof("input_data_type")
        if which == "random_data":
            spec["fill"] = "random"
        elif which == "input_data_file":
            path = home / "warmup" / inp.input_data_file
            if not path.is_file():
                raise ConfigError(f"{where}: model_warmup '{w.name}' input '{name}': no file "
                                  f"{path}", param="model_warmup")
            spec.update(fill="file", file=str(path))
        inputs[name] = spec
    return {"name": w.name or "warmup", "inputs": inputs, "batch_size": batch,
            "count": max(1, w.count)}


_INT64 = {3, 4, 6, 16, 18}
"""Protobuf field types held as 64-bit integers (int64, uint64, fixed64, sfixed64, sint64),
which protobuf's JSON writes as strings and Triton's server as numbers."""


def to_json(message: Any) -> dict[str, Any]:
    """A ``ModelConfig`` proto as Triton's HTTP server writes it: proto field names, fields
    at their defaults present, enums by name, 64-bit integers as numbers."""
    from google.protobuf import json_format

    try:
        doc = json_format.MessageToDict(message, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True)
    except TypeError:  # protobuf < 5.26
        doc = json_format.MessageToDict(message, preserving_proto_field_name=True,
                                        including_default_value_fields=True)
    return _numbers(message.DESCRIPTOR, doc)


def _numbers(desc: Any, doc: dict[str, Any]) -> dict[str, Any]:
    for key, value in doc.items():
        field = desc.fields_by_name.get(key)
        if field is None:
            continue
        sub = field.message_type
        if sub is not None and sub.GetOptions().map_entry:
            vfield = sub.fields_by_name["value"]
            for k, v in value.items():
                if vfield.message_type is not None:
                    _numbers(vfield.message_type, v)
                elif vfield.type in _INT64:
                    value[k] = int(v)
        elif sub is not None:
            for item in value if isinstance(value, list) else [value]:
                _numbers(sub, item)
        elif field.type in _INT64:
            doc[key] = [int(v) for v in value] if isinstance(value, list) else int(value)
    return doc
