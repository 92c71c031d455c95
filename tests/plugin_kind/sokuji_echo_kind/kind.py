"""Kind ``echo``: what it declares to Sokuji (``sokuji/kinds/kind.py``): its options schema,
a check the schema cannot make, and how a model of it is built."""

from __future__ import annotations

from typing import Annotated

import msgspec

from sokuji.config import ModelConfig, ServerConfig
from sokuji.core.limits import Limit
from sokuji.errors import ConfigError
from sokuji.kinds.kind import BuildEnv, Built, Kind
from sokuji_echo_kind.model import EchoModel


class EchoOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[models.options]`` of an echo model, converted when the config loads: a wrong type,
    a negative delay or an unknown key stops start-up naming ``models[i].options.<key>``."""

    scale: float = 1.0
    """The answer is the input times this."""
    delay_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """How long each request takes (on the event loop: an ``asyncio.sleep``)."""
    max_elements: Annotated[int, msgspec.Meta(ge=1)] = 1 << 20
    """The most elements of ``x`` one request may send (its cost bound, beside the body's
    bytes): more are refused (413) before the product is computed."""


class EchoKind(Kind):
    options = EchoOptions

    def check(self, model: ModelConfig, options: EchoOptions, at: str,
              config: ServerConfig) -> None:
        super().check(model, options, at, config)  # (no variants: `variant` must stay fp32)
        if model.default_timeout_ms and options.delay_ms >= model.default_timeout_ms:
            raise ConfigError.for_key(f"{at}.options.delay_ms", options.delay_ms,
                                      f"must be under default_timeout_ms "
                                      f"({model.default_timeout_ms:g}): every request "
                                      "would time out")

    def build(self, model: ModelConfig, options: EchoOptions, env: BuildEnv) -> Built:
        limits = (Limit("max_request_bytes",
                        model.max_request_bytes or env.server.max_request_bytes, "bytes",
                        "bytes of one request's body"),
                  Limit("options.max_elements", options.max_elements, "elements",
                        "elements of input x in one request"))
        return Built(EchoModel(model, options.scale, options.delay_ms, limits))


KIND = EchoKind()
"""What the entry point names (``echo = "sokuji_echo_kind.kind:KIND"``)."""
