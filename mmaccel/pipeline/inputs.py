"""One prompt as the model takes it: ``input_ids`` [1, L] and a vision-language model's other inputs."""
from __future__ import annotations

from collections.abc import Mapping

import torch


def as_input_ids(inputs, tokenizer=None) -> torch.Tensor:
    """Normalise a prompt to a [1, L] long tensor.

    Parameters
    ----------
    inputs : str, list of int, torch.Tensor [L] or [1, L], or an object with ``input_ids`` (e.g. NIAHSample)
        A string is tokenised with ``tokenizer`` (special tokens added, as the tokenizer does by default).
    tokenizer : tokenizer, optional

    Returns
    -------
    torch.LongTensor
        [1, L].

    Raises
    ------
    ValueError
        For an empty prompt, a batch of more than one row, or a string without a tokenizer.
    """
    if hasattr(inputs, "input_ids") and not isinstance(inputs, (str, torch.Tensor)):
        inputs = inputs.input_ids
    if isinstance(inputs, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer")
        inputs = tokenizer(inputs, return_tensors="pt")["input_ids"]
    ids = torch.as_tensor(inputs, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"expected one prompt ([L] or [1, L] token ids), got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty")
    return ids


def split_inputs(inputs, tokenizer=None) -> tuple[torch.Tensor, dict]:
    """A prompt as ``(input_ids, model_inputs)``: the token ids and a vision-language model's other inputs.

    Parameters
    ----------
    inputs : str, list of int, torch.Tensor, an object with ``input_ids``, or a mapping
        A mapping (a processor's ``BatchFeature`` or a dict) holds ``input_ids`` [1, L] and any of
        ``attention_mask`` (all ones), ``pixel_values``, ``image_sizes``, ``image_grid_thw``,
        ``mm_token_type_ids``, ...; the other forms are text prompts (see :func:`as_input_ids`).
    tokenizer : tokenizer, optional

    Returns
    -------
    input_ids : torch.LongTensor
        [1, L].
    model_inputs : dict
        The mapping's entries other than ``input_ids`` and ``attention_mask`` (empty for a text prompt).

    Raises
    ------
    ValueError
        A mapping without ``input_ids``, an attention mask with padding (one unpadded prompt is run), or any
        error of :func:`as_input_ids`.
    """
    if not isinstance(inputs, Mapping):
        return as_input_ids(inputs, tokenizer), {}
    if "input_ids" not in inputs:
        raise ValueError(f"the inputs mapping has no input_ids (keys: {', '.join(map(str, inputs))}); pass the "
                         "processor's output, e.g. processor(images=..., text=..., return_tensors='pt')")
    ids = as_input_ids(inputs["input_ids"], tokenizer)
    mask = inputs.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ValueError("the attention mask has padding; measured generation takes one unpadded prompt")
    return ids, {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}


def to_model(model_inputs: dict, device: torch.device, dtype: torch.dtype | None) -> dict:
    """``model_inputs``' tensors moved to ``device``; floating-point ones (pixel values) also cast to ``dtype``."""
    out = {}
    for k, v in model_inputs.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device=device, dtype=dtype) if v.is_floating_point() and dtype is not None else v.to(device)
        out[k] = v
    return out


def model_inputs_for(model, inputs, tokenizer=None) -> tuple[torch.Tensor, dict]:
    """:func:`split_inputs` placed on ``model``'s device (pixel values in its dtype).

    Returns
    -------
    (torch.LongTensor [1, L], dict)

    Raises
    ------
    ValueError
        As :func:`split_inputs`.
    """
    device = getattr(model, "device", torch.device("cpu"))
    dtype = next(model.parameters()).dtype if hasattr(model, "parameters") else None
    ids, extra = split_inputs(inputs, tokenizer)
    return ids.to(device), to_model(extra, device, dtype)


def check_vision_inputs(vision_label: str | None, model_inputs: dict) -> None:
    """Refuse a visual-token method without media.

    Raises
    ------
    ValueError
        ``vision_label`` is set and ``model_inputs`` holds neither ``pixel_values`` nor ``pixel_values_videos``.
    """
    if vision_label is not None and not any(k in model_inputs for k in ("pixel_values", "pixel_values_videos")):
        raise ValueError(f"vision={vision_label!r} needs image or video inputs; pass the processor's output (with "
                         "pixel_values), e.g. processor(images=image, text=prompt, return_tensors='pt')")
