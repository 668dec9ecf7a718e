"""The composed speedup beside each piece alone: a :class:`mmaccel.Pipeline`'s pieces measured one by one."""
from __future__ import annotations

from ..pipeline import Composition, split_inputs
from .compare import Comparison
from .generation import generate_measured


def compare_pieces(pipeline, inputs, max_new_tokens: int = 32, *, images=None, videos=None, repeats: int = 1,
                   warmup: int = 1, temperature: float = 0.0) -> Comparison:
    """Run the plain model, each piece of ``pipeline`` alone and all pieces together on the same input, in turn.

    ``compare_pieces(pipe, ...).plot()`` draws every metric relative to the plain model, ``.to_markdown()`` tabulates
    them.

    Parameters
    ----------
    pipeline : mmaccel.Pipeline
    inputs, max_new_tokens, images, videos, temperature
        As in :func:`~mmaccel.eval.generation.measure_pipeline`.
    repeats, warmup : int
        Measured and unrecorded runs per configuration (``warmup`` defaults to one).

    Returns
    -------
    Comparison
        Records labelled ``"plain"``, ``"vision=..."``, ``"kv=..."``, ``"speculative=..."`` (the pieces that are
        on) and, with two or more pieces, the pipeline's ``label`` for all of them together. A configuration whose
        run fails gets a ``status="failed"`` record.

    Raises
    ------
    ValueError
        Bad inputs or settings, before any run.
    """
    c = pipeline.composed
    prompt = pipeline.inputs(inputs, images, videos)
    ids, _ = split_inputs(prompt, pipeline.tokenizer)
    configs = [("plain", Composition())]
    if c.vision is not None:
        configs.append((f"vision={c.vision_label}", Composition(vision=c.vision, vision_label=c.vision_label)))
    if c.kv is not None:
        configs.append((f"kv={c.kv_label}", Composition(kv=c.kv, kv_label=c.kv_label)))
    if c.speculative is not None:
        configs.append((f"speculative={c.speculative_label}",
                        Composition(speculative=c.speculative, speculative_label=c.speculative_label)))
    if len(configs) > 2:
        configs.append((c.label, c))
    records = [generate_measured(pipeline.model, pipeline.tokenizer, prompt, method=composed, label=label,
                                 max_new_tokens=max_new_tokens, repeats=repeats, warmup=warmup,
                                 temperature=temperature)
               for label, composed in configs]  # the same inputs (and media) for every configuration
    return Comparison(records=records, inputs={"prompt_tokens": int(ids.shape[1])})
