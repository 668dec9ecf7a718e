"""mmaccel: a measured workbench for cheaper vision-language and long-context inference.

Subpackages
-----------
kernels        one attention-kernel layer (reference, Triton, FlexAttention, flash-attn when installed)
longctx        KV-cache policies and sparse long-context attention (StreamingLLM, SnapKV, ...)
vision_tokens  visual-token pruning and merging
speculative    draft-and-verify decoding
models         model loading and the offline micro-model zoo
pipeline       composition: specs resolved once, composition rules, runners, Pipeline
eval           measured generation, NIAH, comparisons
"""

__version__ = "0.1.0"


def load(*args, **kwargs):
    """Load a model and its tokenizer; see :func:`mmaccel.models.load`."""
    from .models import load as _load

    return _load(*args, **kwargs)


def compare(*args, **kwargs):
    """Run several methods on the same inputs; see :func:`mmaccel.eval.compare.compare`."""
    from .eval.compare import compare as _compare

    return _compare(*args, **kwargs)


def __getattr__(name):
    """``mmaccel.Pipeline`` and ``mmaccel.compose`` (:mod:`mmaccel.pipeline`), imported on first use so
    ``import mmaccel`` stays light (no torch) for the CLI."""
    if name in ("Pipeline", "compose"):
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'mmaccel' has no attribute {name!r}")


__all__ = ["Pipeline", "__version__", "compare", "compose", "load"]
