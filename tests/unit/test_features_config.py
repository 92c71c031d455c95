"""The feature store's configuration and the built-in repository's data, without Feast."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sokuji.errors import ConfigError
from sokuji.features import rag_repo
from sokuji.features.store_config import FeatureStoreConfig, redis_parts


def test_redis_urls_become_feast_connection_parts() -> None:
    assert redis_parts("redis://127.0.0.1:6399/13") == ("127.0.0.1", 6399, 13, {})
    assert redis_parts("redis://cache") == ("cache", 6379, 0, {})
    assert redis_parts("rediss://bob:p%40ss@h:1/2") == (
        "h", 1, 2, {"ssl": "true", "username": "bob", "password": "p@ss"})


@pytest.mark.parametrize("url", ["http://h:1/0", "redis://h:1/x", "redis://:a,b@h:1/0",
                                 "redis:///0"])
def test_bad_redis_urls_are_config_errors_that_hide_the_password(url: str) -> None:
    with pytest.raises(ConfigError) as err:
        redis_parts(url)
    assert "features.redis_url" in err.value.message
    assert "a,b" not in err.value.message


def test_target_names_the_store_without_secrets(tmp_path: Path) -> None:
    cfg = FeatureStoreConfig(path=tmp_path, redis_url="redis://u:secret@h:7/3")
    assert cfg.target() == "redis:h:7/3"
    assert FeatureStoreConfig(path=tmp_path).target() == f"sqlite:{tmp_path / 'online.db'}"


def test_generated_users_are_a_function_of_count_and_seed() -> None:
    users = rag_repo.generate_users(300, 13)
    assert users == rag_repo.generate_users(300, 13)
    assert users != rag_repo.generate_users(300, 14)
    assert [u["user_id"] for u in users[:2]] == ["user-0000", "user-0001"]
    for name, allowed in (("expertise", rag_repo.EXPERTISE), ("plan", rag_repo.PLANS),
                          ("preferred_length", rag_repo.LENGTHS),
                          ("python_version", rag_repo.PYTHON_VERSIONS)):
        assert {u[name] for u in users} == set(allowed)  # every value occurs in 300 users
    assert set(users[0]) == {"user_id", *rag_repo.FEATURES}


def test_importing_the_store_module_does_not_import_feast() -> None:
    code = ("import sys, sokuji.features.store; "
            "assert 'feast' not in sys.modules and 'pandas' not in sys.modules, "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('feast', 'pandas'))")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_unknown_read_path_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"features\.read_path"):
        FeatureStoreConfig(path=tmp_path, read_path="fastest")
