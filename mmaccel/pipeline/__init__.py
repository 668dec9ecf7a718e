"""mmaccel.pipeline: the composition layer -- specs resolved once into typed methods, the composition rules, the
runners, and :class:`Pipeline`.

- :func:`compose` -- ``vision=``, ``kv=``, ``speculative=`` (specs or objects) -> one :class:`Composition`;
- :func:`check_composition` -- the pairs that cannot run exactly together, refused before any run;
- :func:`resolve_method`, :func:`resolve_methods`, :func:`resolve_vision`, :func:`resolve_kv`,
  :func:`resolve_speculative` -- the three registries (:data:`mmaccel.vision_tokens.METHODS`,
  :data:`mmaccel.longctx.METHODS`, :data:`mmaccel.speculative.METHODS` and ``PEERS``);
- :class:`KVCacheRun`, :func:`runner_for`, :func:`generation_kwargs` -- how one generation runs;
- :class:`Pipeline` -- a composition on one model: ``Pipeline(model, processor, vision=..., kv=...,
  speculative=...).generate(...)``.

Measurement is above this layer (:mod:`mmaccel.eval`): it times what a :class:`Composition` runs.
"""
from .compose import Composition, check_composition, compose, compose_run, engine_cache, visual_token_counts
from .core import Generation, Pipeline
from .inputs import as_input_ids, check_vision_inputs, model_inputs_for, split_inputs, to_model
from .resolve import resolve_kv, resolve_method, resolve_methods, resolve_speculative, resolve_vision
from .runners import KVCacheRun, StepProbe, check_temperature, generation_kwargs, runner_for

__all__ = [
    "Composition",
    "Generation",
    "KVCacheRun",
    "Pipeline",
    "StepProbe",
    "as_input_ids",
    "check_composition",
    "check_temperature",
    "check_vision_inputs",
    "compose",
    "compose_run",
    "engine_cache",
    "generation_kwargs",
    "model_inputs_for",
    "resolve_kv",
    "resolve_method",
    "resolve_methods",
    "resolve_speculative",
    "resolve_vision",
    "runner_for",
    "split_inputs",
    "to_model",
    "visual_token_counts",
]
