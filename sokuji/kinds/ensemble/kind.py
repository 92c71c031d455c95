"""Kind ``ensemble``: a Triton repository's ensemble (``ensemble_scheduling``), built after
the models its steps name (``phase`` 1), served by an ``EnsembleModel`` (``model.py``).

The options are what ``repository/triton_translate.py`` makes of the ensemble's
configuration: its declared inputs and outputs, and its steps in order, each a model, the
version (-1: the one served by default) and its ``input_map`` (the step model's input ->
an ensemble tensor) and ``output_map`` (the step model's output -> an ensemble tensor).
At start every step's model must be served and answer V2 tensors, every mapped name must be
the model's and every ensemble tensor a step reads must have been made before it (an input,
or an earlier step's output), with the datatype the step expects; each output of the
ensemble must be made by a step.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sokuji.config import ModelConfig, ServerConfig
from sokuji.core.model import Api
from sokuji.errors import ConfigError
from sokuji.kinds.kind import BuildEnv, Built, Kind
from sokuji.kinds.tensor.kind import Declared


class EnsembleStep(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str
    version: int = -1
    input_map: dict[str, str] = {}
    """The step model's input -> the ensemble tensor it is given."""
    output_map: dict[str, str] = {}
    """The step model's output -> the ensemble tensor it becomes."""


class EnsembleOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    steps: tuple[EnsembleStep, ...]
    inputs: tuple[Declared, ...] = ()
    outputs: tuple[Declared, ...] = ()
    triton_config: dict[str, Any] = {}
    """The ensemble's Triton model configuration, as ``GET .../config`` returns it."""


class EnsembleKind(Kind):
    options = EnsembleOptions
    phase = 1  # after the models its steps call
    unbatched = True
    triton_backend = "ensemble"

    def check(self, model: ModelConfig, options: EnsembleOptions, at: str,
              config: ServerConfig) -> None:
        super().check(model, options, at, config)
        if not options.steps:
            raise ConfigError.for_key(f"{at}.options.steps", [], "an ensemble needs steps")
        names = {m.name for m in config.models}
        for i, step in enumerate(options.steps):
            if step.model not in names:
                raise ConfigError.for_key(f"{at}.options.steps[{i}].model", step.model,
                                          "no such model (a step's model must be served)")

    def build(self, model: ModelConfig, options: EnsembleOptions, env: BuildEnv) -> Built:
        from sokuji.kinds.ensemble.model import EnsembleModel

        steps = []
        for i, step in enumerate(options.steps):
            where = f"{env.at} ({model.name}).options.steps[{i}]"
            served = env.models.get(step.model)
            if served is None or Api.INFER not in served.apis:
                raise ConfigError(f"{where}: model '{step.model}' is not served or answers "
                                  "no V2 tensors")
            if step.version != -1 and str(step.version) != _version(served):
                raise ConfigError(f"{where}: version {step.version} of '{step.model}': an "
                                  "ensemble step calls the version served by default only "
                                  "(-1) in Sokuji")
            steps.append((step, served))
        return Built(EnsembleModel(model, options, steps, env.at))


def _version(served: Any) -> str:
    config = getattr(served, "config", None)
    return str(getattr(config, "version", "") or "")


KIND = EnsembleKind()
