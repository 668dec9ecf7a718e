"""Load a model and its tokenizer/processor: zoo names, local HF checkpoints, hub ids."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from .built import BUILT, NotTrainedError, load_built, load_built_processor, trained_weights
from .paths import ModelLoadError, resolve_checkpoint

logger = logging.getLogger(__name__)


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} was asked for but no CUDA GPU is available; pass device='cpu'")
    return device


def _resolve_dtype(dtype, device: str):
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if isinstance(dtype, str):
        try:
            return {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
                    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}[dtype]
        except KeyError:
            raise ModelLoadError(f"unknown dtype {dtype!r}; use float32, float16 or bfloat16") from None
    return dtype


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def resolve_model_path(name_or_path: str | os.PathLike, *, cache_dir=None) -> str:
    """Turn a zoo name, a local directory or a hub id into what ``from_pretrained`` takes.

    A fetched zoo model (``smollm2-135m``, ``dinov2-small``) is downloaded and converted on first use
    (:func:`mmaccel.models.fetched.fetch`), and its cached files are checked against their sha256 on every call.

    Raises
    ------
    ModelLoadError
        A trained zoo model whose weights are missing (names the train command), a fetched zoo model that cannot be
        fetched (no network and no cache: names the fetch command) or whose cached files are corrupted (deleted,
        names the fetch command), a path that does not exist, a local directory without ``config.json``, a
        string that is neither a path nor a hub id (the message lists the zoo), or a built zoo model (composed at
        load time: not trained yet names ``mmaccel zoo train NAME``, otherwise the message says to use ``load``).
    """
    name = str(name_or_path)
    if name in BUILT:
        try:
            trained_weights(name)
        except NotTrainedError as exc:
            raise ModelLoadError(str(exc)) from exc
        raise ModelLoadError(f"{name} is composed from other zoo models at load time and has no single checkpoint "
                             f"folder: load it with mmaccel.load({name!r})")
    return resolve_checkpoint(name, cache_dir=cache_dir, known=BUILT)


def load(name_or_path, *, device: str = "auto", dtype=None, attn_implementation: str | None = None, cache_dir=None,
         device_map=None, trust_remote_code: bool = False):
    """Load a causal LM (or vision-language model) and its tokenizer or processor.

    Parameters
    ----------
    name_or_path : str or path
        A zoo name (``micro-lm``, ``micro-draft``, the fetched ``smollm2-135m``, ``dinov2-small``, or the built
        ``smol-llava``, composed from fetched parts and a committed projector; see ``mmaccel zoo list``), a local HF
        checkpoint directory, or a hub id (``org/name``; needs network access and no ``HF_HUB_OFFLINE``).
    device : str
        ``"auto"`` (CUDA when available, else CPU), ``"cpu"`` or ``"cuda[:N]"``. With ``device_map`` it only picks
        the default dtype.
    dtype : torch.dtype or str, optional
        Default: bfloat16 on CUDA, float32 on CPU.
    attn_implementation : str, optional
        ``"sdpa"`` (default), ``"eager"``, ``"flex_attention"``, ``"flash_attention_2"`` or ``"mmaccel"``.
    cache_dir : path, optional
        Where fetched zoo models are cached (default ``$XDG_CACHE_HOME/mmaccel/models``).
    device_map : str or dict, optional
        Passed to ``from_pretrained`` for checkpoints too large for one device: accelerate places the weights as they
        load (``"auto"``, ``"balanced"``, ``"sequential"``, or a ``{module name: device}`` dict; layers that fit
        nowhere are offloaded to CPU memory), and the model is not moved afterwards. Default ``None``: load, then
        move the whole model to ``device``.
    trust_remote_code : bool
        Default ``False``: a checkpoint that ships its own Python code (an ``auto_map`` in its config) is refused with
        :class:`ModelLoadError`, whatever is typed on stdin. ``True`` runs that code (only when the user asked, e.g.
        ``--trust-remote-code``); it is passed explicitly to every transformers load.

    Returns
    -------
    (model, tokenizer)
        The model in eval mode on ``device`` (or where ``device_map`` put it: ``model.hf_device_map`` when that is
        more than one device); the tokenizer, or the processor for multimodal checkpoints, or the image processor for
        a vision encoder (e.g. ``dinov2-small`` -> ``Dinov2Model``).

    Raises
    ------
    ModelLoadError
        A missing path, a checkpoint whose architecture transformers cannot load as a causal LM or VLM
        (unsupported architecture), a hub id while offline (the message says to pass a local path), or a built zoo
        model whose trained piece is missing (the message names ``mmaccel zoo train NAME``; raised before any part
        is fetched) or that is asked for with ``device_map``.
    """
    from transformers import AutoConfig, AutoTokenizer

    if str(name_or_path) in BUILT:
        return _load_built(str(name_or_path), device=device, dtype=dtype, attn_implementation=attn_implementation,
                           cache_dir=cache_dir, device_map=device_map)
    source = resolve_model_path(name_or_path, cache_dir=cache_dir)
    is_local = Path(source).exists()
    if not is_local and _offline():
        raise ModelLoadError(
            f"{source!r} looks like a hub id, but the hub is offline (HF_HUB_OFFLINE is set or there is no network): "
            "download the checkpoint elsewhere and pass its local directory instead"
        )
    device = _resolve_device(device)
    torch_dtype = _resolve_dtype(dtype, device)
    if attn_implementation == "mmaccel":
        from ..kernels.hf import register_attention

        register_attention()
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except OSError as exc:
        if is_local:
            raise ModelLoadError(f"cannot read the config in {source}: {exc}") from exc
        raise ModelLoadError(
            f"cannot reach the hub for {source!r} ({type(exc).__name__}); pass a local checkpoint directory instead"
        ) from exc
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise _remote_code_error(source) from exc
        raise ModelLoadError(f"unsupported architecture in {source}: {exc}") from exc
    kwargs = {"dtype": torch_dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = None
    errors = []
    classes = _auto_classes()
    if _is_encoder_only(config):
        from transformers import AutoModel

        classes = [AutoModel]
    for auto in classes:
        try:
            model = auto.from_pretrained(source, config=config, trust_remote_code=trust_remote_code, **kwargs)
            break
        except ValueError as exc:  # "Unrecognized configuration class ..." for this auto class
            errors.append(str(exc).splitlines()[0])
    if model is None:
        archs = getattr(config, "architectures", None) or [type(config).__name__]
        raise ModelLoadError(
            f"unsupported architecture {archs} (model_type {config.model_type!r}) in {source}: mmaccel loads causal "
            f"LMs and image-text-to-text models ({'; '.join(errors)})"
        )
    if device_map is None:
        model.to(device)
    model.eval()
    tokenizer = _load_tokenizer(source, AutoTokenizer, trust_remote_code)
    return model, tokenizer


def _remote_code_error(source) -> ModelLoadError:
    return ModelLoadError(
        f"{source} ships its own model code (an auto_map in its config), and mmaccel runs a checkpoint's code only "
        "when asked: pass --trust-remote-code (mmaccel.load(..., trust_remote_code=True)) if you trust it, or use a "
        "checkpoint of an architecture transformers implements")


def _load_built(name: str, *, device, dtype, attn_implementation, cache_dir, device_map):
    """:func:`load` for a built zoo model: compose it on the CPU, then move it."""
    if device_map is not None:
        raise ModelLoadError(f"{name} is composed from parts in CPU memory; device_map is not supported for it: "
                             "pass device= instead")
    device = _resolve_device(device)
    if attn_implementation == "mmaccel":
        from ..kernels.hf import register_attention

        register_attention()
    try:
        model, processor = load_built(name, cache_dir=cache_dir, dtype=_resolve_dtype(dtype, device),
                                      attn_implementation=attn_implementation)
    except NotTrainedError as exc:
        raise ModelLoadError(str(exc)) from exc
    return model.to(device).eval(), processor


def load_tokenizer(name_or_path, *, cache_dir=None, trust_remote_code: bool = False):
    """Load only the tokenizer (or processor) of a model, in seconds, e.g. to validate prompts before a slow load.

    Same names, ``trust_remote_code`` and errors as :func:`load` (a fetched zoo model is fetched first).
    """
    from transformers import AutoTokenizer

    if str(name_or_path) in BUILT:
        try:
            return load_built_processor(str(name_or_path), cache_dir=cache_dir)
        except NotTrainedError as exc:
            raise ModelLoadError(str(exc)) from exc
    source = resolve_model_path(name_or_path, cache_dir=cache_dir)
    if not Path(source).exists() and _offline():
        raise ModelLoadError(
            f"{source!r} looks like a hub id, but the hub is offline (HF_HUB_OFFLINE is set or there is no network): "
            "download the checkpoint elsewhere and pass its local directory instead"
        )
    try:
        return _load_tokenizer(source, AutoTokenizer, trust_remote_code)
    except OSError as exc:
        raise ModelLoadError(f"cannot load a tokenizer for {source}: {exc}") from exc


def _auto_classes():
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return [AutoModelForCausalLM, AutoModelForImageTextToText]


def _is_encoder_only(config) -> bool:
    """A vision encoder (e.g. Dinov2) that mmaccel loads as a bare ``AutoModel``."""
    return getattr(config, "model_type", None) in {"dinov2", "clip_vision_model", "siglip_vision_model"}


def _load_tokenizer(source: str, auto_tokenizer, trust_remote_code: bool = False):
    if not Path(source, "tokenizer_config.json").exists() and Path(source, "preprocessor_config.json").exists():
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
    try:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
        if not _is_plain_tokenizer(processor):
            return processor
    except (OSError, ValueError, TypeError, KeyError) as exc:
        logger.debug("no processor in %s (%s); loading a tokenizer", source, exc)
    try:
        return auto_tokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise _remote_code_error(source) from exc
        raise


def _is_plain_tokenizer(obj) -> bool:
    from transformers import PreTrainedTokenizerBase

    return isinstance(obj, PreTrainedTokenizerBase)
