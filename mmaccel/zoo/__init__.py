"""The zoo's workshop: the trainers of the committed micro-models and adapters, and the card writer.

Nothing in the library (kernels, data, models, longctx, vision_tokens, speculative, pipeline, eval) imports this
package; the CLI's ``mmaccel zoo train`` and ``zoo list`` do. Loading a zoo model at run time (the registry, the
fetch from the package index, the converters) lives in :mod:`mmaccel.models`.

- :mod:`mmaccel.zoo.train` -- ``lm`` (micro-lm, micro-draft), ``micro_ar``, ``smol_llava`` (smol-llava and
  micro-llava projectors and LoRA adapters), ``clips`` (video-clip conversations for smol-llava), ``eagle`` (the
  EAGLE head of smollm2-135m), ``schedule`` (the one learning-rate schedule).
- :mod:`mmaccel.zoo.card` -- model cards: training summaries, measured tables and seed studies.
"""
