"""The cost bound of the kinds of texts (``kinds/encoder/model.py``'s ``text_limits``) and of
a router (``routing/router.py``'s ``route_limits``: its targets' largest, within its own)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from sokuji.config import ModelConfig
from sokuji.core.limits import Limit, LimitExceeded
from sokuji.kinds.encoder.model import text_limits
from sokuji.routing.router import route_limits


def by_key(limits: tuple[Limit, ...]) -> dict[str, float]:
    return {x.key: x.value for x in limits}


def test_a_model_of_texts_states_bytes_texts_and_the_tokens_it_reads() -> None:
    mc = ModelConfig(name="m", max_batch_size=8)
    assert by_key(text_limits(mc, 65536, 256)) == {
        "max_request_bytes": 65536, "max_batch_size": 8, "max_sequence_length": 256}
    own = ModelConfig(name="m", max_request_bytes=4096)
    assert by_key(text_limits(own, 65536)) == {"max_request_bytes": 4096,
                                                "max_batch_size": 32}


def test_past_max_batch_size_is_413_naming_it() -> None:
    items = by_key_limit(text_limits(ModelConfig(name="m", max_batch_size=2), 1024))
    items.check(2)
    with pytest.raises(LimitExceeded, match="the limit is max_batch_size = 2") as caught:
        items.check(3, "input 'text'")
    assert caught.value.status == 413 and caught.value.param == "max_batch_size"


def by_key_limit(limits: tuple[Limit, ...]) -> Limit:
    return next(x for x in limits if x.key == "max_batch_size")


@dataclass
class Target:
    limits: tuple[Limit, ...]


def test_a_router_states_its_targets_largest_within_its_own() -> None:
    small = Target(text_limits(ModelConfig(name="s", max_batch_size=4), 65536, 128))
    large = Target(text_limits(ModelConfig(name="l", max_batch_size=64), 65536, 512))
    router = ModelConfig(name="r", runtime="router", max_batch_size=16)
    assert by_key(route_limits(router, [small, large], batches_texts=True)) == {
        "max_request_bytes": 65536, "max_batch_size": 16, "max_sequence_length": 512}
    own_bytes = ModelConfig(name="r", runtime="router", max_request_bytes=2048)
    assert by_key(route_limits(own_bytes, [small], batches_texts=False)) == {
        "max_request_bytes": 2048, "max_batch_size": 4, "max_sequence_length": 128}
