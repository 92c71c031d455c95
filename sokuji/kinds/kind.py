"""The plug-in contract: what a kind of model declares, and what it is given to build one.

A kind is the ``runtime`` a ``[[models]]`` entry names (``onnx``, ``llama``, ``router``, ...,
or one a third-party package registers under the ``sokuji.kinds`` entry-point group). It
declares three things, and the server, the repository and the config core know nothing else
about it:

- **its options schema** (``options``: a ``msgspec.Struct``, or None for a kind without
  options): the model's ``options`` table is converted to it when the config loads, so a wrong
  option stops start-up with a ``ConfigError`` naming ``models[i].options.<key>``
  (``config_errors.convert``). ``check`` then checks what a schema cannot say (files on disk,
  names of other models), also at load, before anything is built.
- **how it is built** (``build``): from the model's config and its checked options, into a
  served model (``core/model.py``'s contract) and, for kinds with versions (an ONNX model's
  variants), the other versions beside it. ``phase`` orders builds: a kind whose models hold
  other models (a router: its targets; a pipeline: its steps) builds after those.
- **what it reports per request**: every handle carries a ``core.model.Report`` (the route
  taken, the steps, a cache hit, who served it), which the HTTP layer reads as it is.

A minimal kind::

    class EchoOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        delay_ms: float = 0.0

    class EchoKind(Kind):
        options = EchoOptions

        def build(self, model, options, env):
            return Built(EchoModel(model, options))

    KIND = EchoKind()       # registered as "echo = 'my_pkg.kind:KIND'" under sokuji.kinds
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from sokuji import config_errors
from sokuji.errors import ConfigError

if TYPE_CHECKING:
    from sokuji.config import ModelConfig, ServerConfig
    from sokuji.core.batcher import BatchInfo
    from sokuji.core.model import ServedModel


@dataclass
class BuildEnv:
    """What a kind is given to build one model."""

    server: ServerConfig
    at: str
    """Where the model sits in the config (``models[2]``): errors name keys under it."""
    models: Mapping[str, ServedModel]
    """The models built in earlier phases, by name (a router's targets, a pipeline's steps)."""
    shared: dict[str, Any] = field(default_factory=dict)
    """This kind's own state, shared by all its models in one repository (a router's breakers:
    one per target, whichever router uses it)."""
    on_batch: Callable[[str], Callable[[BatchInfo], None]] | None = None
    """Batch statistics by metric name, for kinds whose models batch (``observability``)."""


@dataclass
class Built:
    """A built model: the served model, and for a kind with versions the others beside it."""

    served: ServedModel
    variant: str = ""
    """The variant this serves (an ONNX file's: fp32, int8, ...); empty for most kinds."""
    versions: dict[str, ServedModel] = field(default_factory=dict)
    """Other servable variants, by name, answered as V2 versions."""


class Kind:
    """Base of every kind: subclasses set ``options`` and implement ``build``."""

    options: ClassVar[type[Any] | None] = None
    """The options schema (a ``msgspec.Struct``); None: the kind takes no options."""
    phase: ClassVar[int] = 0
    """Build order: 0 for models that stand alone, higher for models that hold others."""
    variants: ClassVar[bool] = False
    """Whether ``variant`` (``sokuji optimize``'s files) means anything to this kind."""
    unbatched: ClassVar[bool] = False
    """Whether ``max_batch_size = 0`` (no batch dimension: Triton's meaning) means anything
    to this kind; the config refuses it for the others."""
    triton_backend: ClassVar[str] = ""
    """Triton's backend for the same engine (``onnxruntime``), as a model's Triton
    configuration names it (``server/triton.py``); empty: the kind's own name."""

    def parse(self, model: ModelConfig, at: str) -> Any:
        """The model's ``options``, checked against the schema (``ConfigError`` naming the
        key under ``at``). A kind whose defaults come from the model's own config (its
        ``intra_op_threads``) overrides this to fill them in where the table leaves them
        out; what it returns is what ``check`` and ``build`` are given."""
        if self.options is None:
            if model.options:
                key = next(iter(model.options))
                raise ConfigError.for_key(f"{at}.options.{key}", model.options[key],
                                          "unknown key (this runtime takes no options)")
            return None
        return config_errors.convert(model.options, self.options, f"{at}.options")

    def check(self, model: ModelConfig, options: Any, at: str, config: ServerConfig) -> None:
        """What the schema cannot say, at config load (files, other models' names)."""
        if model.variant != "fp32" and not self.variants:
            raise ConfigError.for_key(f"{at}.variant", model.variant,
                                      f"runtime {model.runtime} has no variants")

    def build(self, model: ModelConfig, options: Any, env: BuildEnv) -> Built:
        """The served model (blocking: loads weights, warms up; before serving)."""
        raise NotImplementedError
