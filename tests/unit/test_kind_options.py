"""Every kind's options are its schema's, checked when the config loads: a wrong option stops
``config.validate`` (nothing is built: no weights are needed here) with one spelling of the
key (``models[0].options.<key>``, nested tables included; a pipeline step's
``pipelines[0].steps[0].options.<key>``) and ``ConfigError.for_key``'s message form."""

from __future__ import annotations

from typing import Any

import pytest

from sokuji import config as cfg
from sokuji.errors import ConfigError
from sokuji.pipelines.config import PipelineConfig, StepConfig
from tests.conftest import CACHE_DIR

UPSTREAM = {"protocol": "v2", "url": "http://127.0.0.1:9", "upstream_model": "m"}


def validate(*models: cfg.ModelConfig, pipelines: tuple[PipelineConfig, ...] = ()) -> None:
    cfg.validate(cfg.ServerConfig(models=models, pipelines=pipelines, cache_dir=str(CACHE_DIR)))


def one(runtime: str, options: dict[str, Any], name: str = "m") -> None:
    """A config of one model (a router's: and its target, ``t``)."""
    target = (cfg.ModelConfig(name="t", runtime="synthetic"),) if runtime == "router" else ()
    validate(cfg.ModelConfig(name=name, runtime=runtime, options=options), *target)


@pytest.mark.parametrize(("runtime", "name", "options", "key", "reason"), [
    ("synthetic", "m", {"error_rate": 2}, "error_rate", "must be a number from 0 to 1"),
    ("synthetic", "m", {"distribution": "uniform"}, "distribution",
     "must be one of: constant, exponential, lognormal"),
    ("synthetic", "m", {"degrade_after_s": 3}, "degrade_after_s", "needs degrade_error_rate"),
    ("llama", "smollm2", {"slots": 0}, "slots", "must be at least 1"),
    ("llama", "smollm2", {"context_size": "2048"}, "context_size", "not a valid integer"),
    ("llama", "smollm2", {"slots": 16, "n_batch": 8}, "n_batch", "must be at least slots"),
    ("llama", "smollm2", {"draft_model": "/no/such.gguf", "speculative": "draft"},
     "draft_model", "no such file"),
    ("ocr", "m", {"rec_max_batch": 0}, "rec_max_batch", "must be an integer from 1 to 256"),
    ("ocr", "m", {"use_cls": 1}, "use_cls", "not a valid bool"),
    ("vad", "m", {"threshold": 1.0}, "threshold", "must be less than 1"),
    ("vad", "m", {"instances": 65}, "instances", "must be at most 64"),
    ("classifier", "m", {"scheme": "knn"}, "scheme", "must be centroid or nn"),
    ("classifier", "m", {"prototypes": "/no/such.jsonl"}, "prototypes", "no such file"),
    ("upstream", "m", {**UPSTREAM, "url": "http://h:1/v2"}, "url", "without a path"),
    ("upstream", "m", {**UPSTREAM, "max_connections": 0}, "max_connections",
     "must be at least 1"),
    ("upstream", "m", {"protocol": "v2", "url": "http://h:1"}, "upstream_model",
     "required key missing"),
    ("router", "m", {"kind": "rules", "default": "t", "breaker": {"cooldown_s": 0}},
     "breaker.cooldown_s", "must be more than zero"),
    ("router", "m", {"kind": "rules", "rules": [{"target": "t", "when": {"max_chars": -1}}]},
     "rules[0].when.max_chars", "must be zero or more"),
    ("router", "m", {"kind": "canary", "canary": {"stable": "t", "canary": "nope"}},
     "canary.canary", "no such model"),
    ("router", "m", {"kind": "cascade", "targets": ["t", "t"], "threshold": "auto"},
     "threshold", 'must be a number or "calibrated"'),
    ("onnx", "minilm", {"threads": 2}, "threads", "this runtime takes no options"),
])
def test_a_wrong_option_fails_when_the_config_loads(runtime: str, name: str,
                                                    options: dict[str, Any], key: str,
                                                    reason: str) -> None:
    with pytest.raises(ConfigError) as err:
        one(runtime, options, name)
    key = f"models[0].options.{key}"
    assert err.value.param == key
    assert err.value.message.startswith(f"Config '{key}' has value ")
    assert reason in err.value.message


def test_an_unknown_option_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as err:
        one("router", {"kind": "rules", "default": "t", "breaker": {"failure": 1}})
    assert err.value.message == ("Config 'models[0].options.breaker.failure' has value 1: "
                                 "unknown key; known: cooldown_s, failures, max_cooldown_s")


def test_options_keep_the_types_the_file_gave_them() -> None:
    """Options come from the file only: ``"2"`` is not an integer there (the server's own
    keys, which environment variables may set, are converted leniently)."""
    with pytest.raises(ConfigError) as err:
        one("synthetic", {"stall_after_batches": "2"})
    assert err.value.message == ("Config 'models[0].options.stall_after_batches' has value "
                                 "'2': not a valid integer")
    one("synthetic", {"base_ms": 2})  # an integer is a number


def test_a_semantic_cache_table_is_checked_when_the_config_loads() -> None:
    model = cfg.ModelConfig(name="m", runtime="synthetic",
                            semantic_cache={"enabled": True, "threshold": 1.5})
    with pytest.raises(ConfigError) as err:
        validate(model)
    assert err.value.param == "models[0].semantic_cache.threshold"
    assert "must be a cosine similarity (from -1 to 1)" in err.value.message


def _pipeline(kind: str, options: dict[str, Any], **step: Any) -> PipelineConfig:
    return PipelineConfig(name="p", steps=(StepConfig(name="s", kind=kind, options=options,
                                                      **step),))


@pytest.mark.parametrize(("kind", "options", "step", "key", "reason"), [
    ("retrieve", {"k": 0, "encoder": "enc"}, {}, "k", "must be an integer from 1 to 100"),
    ("retrieve", {"mode": "fuzzy"}, {}, "mode", "must be one of: bm25, dense, hybrid"),
    ("retrieve", {"mode": "dense"}, {}, "encoder", "needs the encoder that embeds queries"),
    ("retrieve", {"encoder": "nope"}, {}, "encoder", "no such model"),
    ("retrieve", {"encoder": "enc", "colour": 1}, {}, "colour", "unknown key; known:"),
    ("features", {"features": []}, {}, "features", "must be a non-empty list of feature"),
    ("features", {"store": "users"}, {}, "features", "required key missing"),
    ("model", {"temperature": 3}, {"model": "enc"}, "temperature", "must be from 0 to 2"),
    ("model", {"max_token": 5}, {"model": "enc"}, "max_token", "unknown key"),
])
def test_a_wrong_step_option_fails_when_the_config_loads(kind: str, options: dict[str, Any],
                                                         step: dict[str, Any], key: str,
                                                         reason: str) -> None:
    encoder = cfg.ModelConfig(name="enc", runtime="synthetic")
    with pytest.raises(ConfigError) as err:
        validate(encoder, pipelines=(_pipeline(kind, options, **step),))
    key = f"pipelines[0].steps[0].options.{key}"
    assert err.value.param == key
    assert err.value.message.startswith(f"Config '{key}' has value ")
    assert reason in err.value.message


def test_every_kind_takes_its_defaults() -> None:
    """Without options, every kind's defaults stand (nothing required is left out)."""
    for runtime, name in (("synthetic", "m"), ("llama", "smollm2"), ("ocr", "m"),
                          ("vad", "m"), ("classifier", "m"), ("onnx", "minilm")):
        one(runtime, {}, name)
