from __future__ import annotations

from pathlib import Path

import pytest

from sokuji import config as cfg
from sokuji.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sokuji.toml"
    path.write_text(text)
    return path


def test_defaults_serve_the_builtin_model() -> None:
    config = cfg.load(env={})
    assert config.port == 8000 and config.host == "127.0.0.1"
    assert [m.name for m in config.models] == ["minilm", "smollm2"]
    assert [m.runtime for m in config.models] == ["onnx", "llama"]
    assert config.models[0].batching is cfg.BatchPolicy.LENGTH


def test_file_then_env_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, """
port = 9000
host = "0.0.0.0"
[[models]]
name = "fake"
runtime = "synthetic"
max_batch_size = 4
max_queue_delay_ms = 5
batching = "fifo"
[models.options]
base_ms = 2.5
""")
    config = cfg.load(path, env={"SOKUJI_PORT": "9100"}, overrides={"host": "127.0.0.2"})
    assert config.port == 9100 and config.host == "127.0.0.2"
    model = config.model("fake")
    assert model is not None
    assert (model.max_batch_size, model.max_queue_delay_ms) == (4, 5.0)
    assert model.batching is cfg.BatchPolicy.FIFO and model.options == {"base_ms": 2.5}


def test_config_file_from_environment(tmp_path: Path) -> None:
    path = write(tmp_path, "port = 9200\n")
    assert cfg.load(env={"SOKUJI_CONFIG": str(path)}).port == 9200


@pytest.mark.parametrize(("text", "key", "value"), [
    ('[[models]]\nname="m"\nruntime="synthetic"\nmax_batch_size=0\n',
     "models[0].max_batch_size", "0"),
    ('[[models]]\nname="m"\nruntime="synthetic"\nmax_batch_size="many"\n',
     "models[0].max_batch_size", "'many'"),
    ('[[models]]\nname="m"\nruntime="tensorflow"\n', "models[0].runtime", "'tensorflow'"),
    ('[[models]]\nname="m"\nruntime="synthetic"\nbatching="random"\n',
     "models[0].batching", "'random'"),
    ('[[models]]\nname="m"\nruntime="synthetic"\nwarmup="perhaps"\n',
     "models[0].warmup", "'perhaps'"),
    ('[[models]]\nname="m"\nruntime="synthetic"\nbatch_size=4\n',
     "models[0].batch_size", "4"),
    ('[[models]]\nname="m"\nruntime="onnx"\n', "models[0].path", "None"),
    ('[[models]]\nname="m"\nruntime="onnx"\npath="/no/such.onnx"\n',
     "models[0].path", "'/no/such.onnx'"),
    ('[[models]]\nname="m"\nruntime="synthetic"\n[[models]]\nname="m"\nruntime="synthetic"\n',
     "models[1].name", "'m'"),
    ("port = 70000\n", "port", "70000"),
    ("log_level = 'loud'\n", "log_level", "'loud'"),
    ("colour = 'blue'\n", "colour", "'blue'"),
    ("[cache]\nbackend = 'memcached'\n", "cache.backend", "'memcached'"),
    ("[cache]\nttl = 5\n", "cache.ttl", "5"),
    ("[jobs]\nconcurrency = 0\n", "jobs.concurrency", "0"),
    ("shutdown_grace_s = -1\n", "shutdown_grace_s", "-1.0"),
    ('[[api_keys]]\nkey = "0123456789"\ntenant = "t"\nmodels = ["nope"]\n',
     "api_keys[0].models", "'nope'"),
    ('[[models]]\nname="m"\nruntime="synthetic"\nmax_queue_depth=0\n',
     "models[0].max_queue_depth", "0"),
    ("[jobs]\ncallback_allow = ['not a host!']\n", "jobs.callback_allow", "'not a host!'"),
    ("[jobs]\ncallback_allow = ['10.0.0.0/33']\n", "jobs.callback_allow", "'10.0.0.0/33'"),
    ("[jobs]\ncallback_allow = '127.0.0.1'\n", "jobs.callback_allow", "'127.0.0.1'"),
    ("[jobs]\nresult_ttl_s = 0\n", "jobs.result_ttl_s", "0.0"),
    ("[jobs]\nmax_pending_per_tenant = 0\n", "jobs.max_pending_per_tenant", "0"),
    ("[cache]\nredis_timeout_s = -1\n", "cache.redis_timeout_s", "-1.0"),
    ("metrics_require_key = 'sometimes'\n", "metrics_require_key", "'sometimes'"),
    ('[[api_keys]]\nkey = "0123456789"\ntenant = "t"\nmax_priority = "urgent"\n',
     "api_keys[0].max_priority", "'urgent'"),
    ('[[api_keys]]\nkey = "0123456789"\ntenant = "t"\nadmin = "maybe"\n',
     "api_keys[0].admin", "'maybe'"),
])
def test_invalid_values_name_the_key_and_value(tmp_path: Path, text: str, key: str,
                                               value: str) -> None:
    with pytest.raises(ConfigError) as err:
        cfg.load(write(tmp_path, text), env={})
    assert f"Config '{key}' has value {value}" in err.value.message


def test_invalid_environment_value_is_named() -> None:
    with pytest.raises(ConfigError, match="SOKUJI_PORT' has value 'eighty'"):
        cfg.load(env={"SOKUJI_PORT": "eighty"})


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        cfg.load(tmp_path / "absent.toml", env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        cfg.load(write(tmp_path, "port = = 1"), env={})


def test_cache_jobs_and_keys_tables(tmp_path: Path) -> None:
    path = write(tmp_path, """
[cache]
backend = "redis"
redis_url = "redis://cache:6379/1"
[jobs]
concurrency = 4
[[api_keys]]
key = "0123456789abcdef"
tenant = "acme"
models = ["minilm"]
priority = "batch"
""")
    config = cfg.load(path, env={})
    assert config.cache.backend == "redis" and config.jobs.concurrency == 4
    assert config.jobs_path.endswith("jobs.sqlite")
    (key,) = config.api_keys
    assert (key.tenant, key.models, key.priority) == ("acme", ("minilm",), "batch")


def test_security_keys(tmp_path: Path) -> None:
    path = write(tmp_path, """
metrics_require_key = true
[jobs]
callback_allow = ["127.0.0.1", "10.0.0.0/8", "hooks.internal", "::1"]
callback_secret = "0123456789abcdef"
max_pending_per_tenant = 7
[[api_keys]]
key = "0123456789"
tenant = "t"
max_priority = "batch"
admin = true
max_pending_jobs = 3
callback_secret = "fedcba9876543210"
""")
    config = cfg.load(path, env={"SOKUJI_MODELS_REQUIRE_KEY": "false"})
    assert config.metrics_require_key and not config.models_require_key
    assert config.jobs.callback_allow == ("127.0.0.1", "10.0.0.0/8", "hooks.internal", "::1")
    key = config.api_keys[0]
    # A batch ceiling pulls the default class down with it.
    assert (key.max_priority, key.priority, key.admin, key.max_pending_jobs) == \
        ("batch", "batch", True, 3)
    assert "fedcba" not in repr(key) and "0123456789" not in repr(key)


def test_short_secrets_are_refused_without_echoing_them(tmp_path: Path) -> None:
    path = write(tmp_path, '[[api_keys]]\nkey = "0123456789"\ntenant = "t"\n'
                           'callback_secret = "short-secret"\n')
    with pytest.raises(ConfigError) as err:
        cfg.load(path, env={})
    assert "api_keys[0].callback_secret" in err.value.message
    assert "short-secret" not in err.value.message
