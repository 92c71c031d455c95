"""API keys (``server/auth.py``) against the mutants mutmut left alive there
(docs/mutation.md): each test names the mutant(s) it kills, by mutmut's name."""

from __future__ import annotations

import pytest

from sokuji.config import ApiKey
from sokuji.errors import Forbidden, Unauthorized
from sokuji.server.auth import Authenticator, key_id

ACME = ApiKey(key="key-of-acme-0001", tenant="acme", models=("minilm",))
BOLT = ApiKey(key="key-of-bolt-0002", tenant="bolt", admin=True)


def test_a_keys_identity_is_stable_across_releases() -> None:
    """Jobs store ``key_id`` and run later with the rights of the key that has it, so its
    value is a stored format: this literal is SHA-256 over "sokuji-key:key-of-acme-0001",
    16 hex digits. Kills ``x_key_id__mutmut_3`` / ``_4`` (another prefix: every stored job's
    key "gone") and ``_5`` (17 digits)."""
    assert key_id(ACME.key) == "2e57cc39fbc7357b"


def test_a_key_id_finds_that_keys_rights_and_nothing_else() -> None:
    """Kills ``xǁAuthenticatorǁ__init____mutmut_7`` / ``_13`` (tenants built without their
    key's identity), ``_17`` (no index by identity) and ``xǁAuthenticatorǁby_key_id__mutmut_1``
    (the lookup ignoring the identity asked for)."""
    auth = Authenticator((ACME, BOLT))
    acme = auth.by_key_id(key_id(ACME.key))
    assert acme is not None and acme.name == "acme" and acme.key_id == key_id(ACME.key)
    bolt = auth.by_key_id(key_id(BOLT.key))
    assert bolt is not None and bolt.name == "bolt"
    assert auth.by_key_id(key_id("a-key-never-configured")) is None


def test_a_bearer_key_after_several_spaces_is_still_read() -> None:
    """``Authorization: Bearer   <key>``: the scheme is the first word, the rest (stripped)
    the key. Kills ``xǁAuthenticatorǁauthenticate__mutmut_15`` (split at the last space:
    the scheme would read "Bearer  " and the key be refused)."""
    auth = Authenticator((ACME,))
    assert auth.authenticate({"authorization": f"Bearer   {ACME.key}"}).name == "acme"


def test_a_missing_key_is_told_both_ways_to_send_one() -> None:
    """The 401's reason is the instruction a client needs, exactly. Kills
    ``xǁAuthenticatorǁauthenticate__mutmut_24``, ``_27``, ``_28`` and ``_29`` (the message
    changed or its header names' case)."""
    with pytest.raises(Unauthorized) as e:
        Authenticator((ACME,)).authenticate({})
    assert e.value.message == ("missing API key: send 'Authorization: Bearer <key>' or "
                               "'X-API-Key: <key>'")


def test_a_model_outside_the_tenants_list_is_a_403_on_the_model_parameter() -> None:
    """The error names the parameter at fault (OpenAI's ``param``). Kills
    ``xǁTenantǁcheck_model__mutmut_4``, ``_6``, ``_7`` and ``_8``."""
    acme = Authenticator((ACME,)).authenticate({"x-api-key": ACME.key})
    acme.check_model("minilm")
    with pytest.raises(Forbidden) as e:
        acme.check_model("other")
    assert e.value.param == "model"
