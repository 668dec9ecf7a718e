"""KVzip: query-agnostic eviction scored by how much each K/V pair is attended while the model repeats its context.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", 2025, arXiv 2505.23416.
"""
from __future__ import annotations

import copy
import functools
import logging
import os
import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..kernels import attention_column_scores
from ..kernels.hf import attention_modules, cache_kwarg, hooked_cache
from .adakv import RaggedLayer, chosen_keep_indices, ragged_telemetry
from .base import EvictingLayer, KVMethodCache, KVScorer, LayerStep, _check_int, query_group_scores, window_queries
from .owned import OwnedAttentionCache

logger = logging.getLogger(__name__)

#: What the model is asked before it repeats the first chunk of its context, and before every later chunk (which
#: then starts from the last ``overlap`` tokens of the chunk before it).
FIRST_INSTRUCTION = "\n\nRepeat the previous context:"
NEXT_INSTRUCTION = "\n\nRepeat the previous context, continuing from:"
_STATE = "kvzip"


@functools.lru_cache(maxsize=8)
def _prompt_ids(path: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """(first instruction, next instruction, chat suffix) token ids with the tokenizer saved in the local checkpoint
    directory ``path``, or None when there is none (no download is attempted)."""
    from transformers import AutoTokenizer

    if not path or not os.path.isdir(path):
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError):
        return None
    return _encode_prompts(tokenizer)


def _encode_prompts(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The instructions' ids and, for a chat model, the ids that open the assistant's turn after a user message."""
    suffix = ""
    if getattr(tokenizer, "chat_template", None):
        mark = "\x00KVZIP\x00"
        text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], add_generation_prompt=True,
                                             tokenize=False)
        suffix = text.split(mark, 1)[1] if mark in text else ""

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()

    return ids(FIRST_INSTRUCTION), ids(NEXT_INSTRUCTION), ids(suffix)


class _PrefixLayer(DynamicLayer):
    """A scratch cache layer for one reconstruction forward: it attends over a held layer's K/V (not copied) plus the
    forward's own tokens, keeps the concatenation for the scorer, and stores nothing, so every chunk starts again
    from the held context."""

    def __init__(self, held: EvictingLayer):
        super().__init__()
        self.keys, self.values, self.is_initialized = held.keys, held.values, True
        self.seen, self.held = held.cumulative_length, held.held
        self.attended: torch.Tensor | None = None  # [B, Hkv, held + q, D] the keys of the last forward

    def update(self, key_states, value_states, *args, **kwargs):
        keys = torch.cat([self.keys, key_states], dim=-2)
        self.attended = keys
        return keys, torch.cat([self.values, value_states], dim=-2)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.held + query_length, self.seen - self.held


class KVzipCache(KVMethodCache):
    """The :class:`~mmaccel.longctx.base.KVMethodCache` of :class:`KVzip`: after every prefill forward with it, the
    model repeats the forward's tokens (chunk by chunk) against the held K/V, and then each layer is compressed.

    One more forward hook on ``model`` (removed with the others by :meth:`close`) runs the reconstruction; its
    forwards use a scratch cache (:class:`_PrefixLayer` per layer) and are ignored by this cache's own hooks.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    method : KVzip
    prompt_ids : tuple of tuple of int or None
        (first instruction, next instruction, chat suffix) token ids; ``None`` reconstructs with no instruction.
    """

    def __init__(self, model: torch.nn.Module, method: KVzip, prompt_ids, *, attach: bool = True):
        self.prompt_ids = prompt_ids
        self.unscored = 0  # tokens the prefill steps appended since the last reconstruction
        self._attention: dict[int, torch.nn.Module] = {}
        super().__init__(model, method, attach=attach)
        self._attention = {i: m for i, m in attention_modules(model).items() if
                           i < len(self.layers) and isinstance(self.layers[i], EvictingLayer)}

    def _attach(self, model: torch.nn.Module) -> None:
        super()._attach(model)
        ref = weakref.ref(self)

        def after_model(module, args, kwargs, output):
            cache = ref()
            if cache is not None and output is not None and hooked_cache(kwargs) is cache and cache.unscored:
                ids = kwargs.get("input_ids", args[0] if args else None)
                try:
                    cache.reconstruct(module, ids)
                except BaseException:
                    cache.close()
                    raise

        self._hooks.append(model.register_forward_hook(after_model, with_kwargs=True))

    def note_prefill(self, step: LayerStep) -> None:
        """Count the tokens a prefill step of the first hooked layer appended (they await their reconstruction)."""
        if step.layer_idx == min(self._attention):
            self.unscored += step.query_length

    def reconstruct(self, model: torch.nn.Module, input_ids: torch.Tensor | None) -> None:
        """Score the last ``unscored`` held slots of every layer by a reconstruction of their tokens, then compress.

        Raises
        ------
        ValueError
            If the forward had no ``input_ids`` (``inputs_embeds`` only) or fewer ids than tokens to score.
        """
        n = self.unscored
        if input_ids is None or input_ids.shape[-1] < n:
            raise ValueError("kvzip reconstructs the context from its token ids: call the model with input_ids "
                             "(not inputs_embeds) and the whole prompt in one forward or with its Chunked wrapper")
        method: KVzip = self.method
        context = input_ids[:, -n:]
        scores = {i: None for i in self._attention}
        starts = range(0, n, method.chunk)
        with torch.no_grad():
            for start in starts:
                scratch = DynamicCache(config=model.config)
                for i, layer in enumerate(self.layers):
                    scratch.layers[i] = _PrefixLayer(layer) if i in self._attention else copy.deepcopy(layer)
                end = min(start + method.chunk, n)
                slots = {i: self._chunk_slots(self.layers[i], n, start, end) for i in self._attention}
                columns = self._score_forward(model, scratch, self._repeat_ids(context, start, end), slots)
                for i, part in columns.items():  # [B, Hkv, end - start]
                    scores[i] = part if scores[i] is None else torch.cat([scores[i], part], dim=-1)
        for i in self._attention:
            layer = self.layers[i]
            state = layer.slot_state[_STATE]
            state[..., -n:] = scores[i]
            state.masked_fill_(layer.positions < method.sink, float("inf"))
        if method.budgets == "global":
            self._keep_global()
        else:
            for i, module in self._attention.items():
                layer = self.layers[i]
                if layer.held > layer.target:
                    method.compress(LayerStep(self, layer, i, module, None, None, None, "prefill"), layer.target)
        self.unscored = 0

    def _keep_global(self) -> None:
        """``budgets="global"``: keep the best-scored slots over every layer and KV head at once (per row, as many
        as the layers' budgets add up to), each head holding only its own (:class:`RaggedLayer`)."""
        layers = [self.layers[i] for i in self._attention]
        scores = [l.slot_state[_STATE].float().masked_fill(~l.slot_state["valid"], float("-inf")) for l in layers]
        total = sum(l.target * s.shape[1] for l, s in zip(layers, scores))  # slots per row
        flat = torch.cat([s.flatten(1) for s in scores], dim=1)  # [B, sum of Hkv * S]
        if int((flat != float("-inf")).sum(-1).max()) <= total:
            return  # the budget holds every real slot
        chosen = torch.zeros_like(flat, dtype=torch.bool)
        chosen.scatter_(1, flat.topk(total, dim=-1).indices, True)
        start = 0
        for layer, s in zip(layers, scores):
            mine = chosen[:, start:start + s[0].numel()].view_as(s)
            start += s[0].numel()
            indices, valid = chosen_keep_indices(mine)
            layer.keep(indices)
            layer.slot_state["valid"] = valid
            layer.pack()

    def _repeat_ids(self, context: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """[B, q] the reconstruction input for context tokens ``start:end``: instruction (+ overlap), suffix, tokens."""
        first, following, suffix = self.prompt_ids or ((), (), ())
        head = list(first if start == 0 else following)
        pieces = [context.new_tensor(head).expand(context.shape[0], -1)]
        if start:
            pieces.append(context[:, max(0, start - self.method.overlap): start])
        pieces += [context.new_tensor(list(suffix)).expand(context.shape[0], -1), context[:, start:end]]
        return torch.cat(pieces, dim=-1)

    def _chunk_slots(self, layer: EvictingLayer, n: int, start: int, end: int) -> tuple[int, int, int]:
        """(sinks, first, last): held slots ``first:last`` are context tokens ``start:end`` of the last ``n``; the
        first ``sinks`` held slots are sink positions before them."""
        first = layer.held - n + start
        sinks = int((layer.positions[0, 0] < self.method.sink).sum()) if layer.positions.numel() else 0
        return min(sinks, first), first, layer.held - n + end

    def _score_forward(self, model, scratch, ids, slots: dict[int, tuple[int, int, int]]) -> dict[int, torch.Tensor]:
        """One reconstruction forward; per hooked layer, [B, Hkv, last - first] the most attention each slot of the
        chunk gets from any reconstruction query of its KV head's GQA group. The softmax runs over the sinks, the
        chunk's own slots and the causal part of the reconstruction (as kvpress's), so that chunks, and the slots
        scored by an earlier prefill forward, are scored on one scale whatever else is held."""
        out: dict[int, torch.Tensor] = {}

        def score(module, args, kwargs, output):
            if hooked_cache(kwargs) is not scratch:
                return
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            layer = scratch.layers[module.layer_idx]
            sinks, first, last = slots[module.layer_idx]
            keys = layer.attended
            keys = torch.cat([keys[:, :, :sinks], keys[:, :, first:last], keys[:, :, layer.held:]], dim=2)
            queries = window_queries(module, hidden, kwargs.get("position_embeddings"), hidden.shape[1])
            column = attention_column_scores(queries, keys, causal=True, reduce="max",
                                             scaling=getattr(module, "scaling", None))
            out[module.layer_idx] = query_group_scores(column[..., sinks: sinks + last - first], keys.shape[1], "max")
            layer.attended = None

        handles = [m.register_forward_hook(score, with_kwargs=True) for m in self._attention.values()]
        try:
            model(input_ids=ids, **cache_kwarg(model, scratch), use_cache=True, logits_to_keep=1)
        finally:
            for handle in handles:
                handle.remove()
        return out


@dataclass
class KVzip(KVScorer):
    """KVzip (Kim et al., 2025, arXiv 2505.23416): keep the K/V pairs the model needs to repeat its own context.

    After a prefill forward (full attention, nothing evicted yet), the model is fed, on a scratch cache that attends
    over the held K/V, "Repeat the previous context:" (and, for a chat model, the opening of the assistant's turn)
    followed by the forward's tokens again, ``chunk`` tokens at a time (a later chunk's instruction ends with the
    last ``overlap`` tokens of the chunk before). Each held slot scores the largest attention probability any
    reconstruction query of its KV head's GQA group pays it in the reconstruction of the chunk that holds it (the
    softmax normalised over the sinks, that chunk's slots and the reconstruction, as kvpress does, so that every
    chunk and every prefill forward is scored on one scale); the first ``sink`` positions are always kept. Then the
    cache keeps, per row, the best ``budget x Hkv x layers`` slots over every layer and KV head at once (``budgets=
    "global"``, the paper's non-uniform head and layer budgets and kvpress's default), or each layer and KV head its
    own ``budget`` best (``budgets="uniform"``). The evicted K/V are freed: under global budgets each KV head holds
    only its own slots (:class:`~mmaccel.longctx.adakv.RaggedLayer`, its decode attention computed per head), so
    ``kv_cache_bytes`` is the ratio asked either way (kvpress masks instead of evicting and holds every byte).
    Query-agnostic: the scores never see a question, so a compressed context serves any later one. Decode tokens are
    appended.

    Costs: one reconstruction forward per chunk, about the prefill's compute again (the reconstruction is as long as
    the context), and transiently one layer's [B, Hkv, held + chunk, D] keys and the scores of one chunk.

    Parameters
    ----------
    budget, ratio
        Slots kept per layer and KV head (default 256) or a kept fraction of the prompt (``kvzip:ratio=0.25``).
    chunk : int
        Context tokens reconstructed per forward, >= 1 (default 2048, kvpress's).
    overlap : int
        Tokens of the previous chunk a later chunk's instruction repeats, >= 0 (default 8).
    sink : int
        First positions always kept, >= 0 (default 4).
    budgets : str
        ``"global"`` (default): one ranking over every layer and KV head, as the paper; ``"uniform"``: ``budget``
        per layer and KV head. Scores are attention probabilities, comparable across heads and layers.

    Notes
    -----
    The instruction's token ids come from the tokenizer saved beside the model's weights
    (``model.config.name_or_path``, a local directory: no download), or ``make_cache(model, tokenizer=tok)``;
    without one the context is repeated right after itself, with a warning in the telemetry. Needs ``input_ids``
    (not ``inputs_embeds``: a VLM's image tokens cannot be re-fed). Served by the shared prefill
    (:mod:`mmaccel.longctx.shared_prefill`): its prefill forward is full attention, and the reconstruction runs on the
    filled holder after that forward (:meth:`finish_shared_prefill`), as it does after its own. Not wrappable by ``chunkkv``/``adakv`` (they score at each layer's prefill step, before any
    reconstruction: the first prefill raises) nor by ``kvquant`` (refused when built). A second prefill forward (a
    later chunk or turn) reconstructs its own tokens, earlier slots keeping their scores, under ``budgets=uniform``;
    under global budgets it raises (the layers then hold different lengths). Global budgets own the attention, so a
    model with an attention softcap or sinks (Gemma 2) is refused; ``budgets=uniform`` serves it.

    Raises
    ------
    ValueError
        On a bad hyper-parameter; during prefill, for a padded batch, a forward without ``input_ids``, or (global
        budgets) a second multi-token forward.
    """

    chunk: int = 2048
    overlap: int = 8
    sink: int = 4
    budgets: str = "global"

    method_name = "kvzip"
    prefill_is_full = True  # full-attention prefill; the reconstruction and eviction come after the forward

    def __post_init__(self):
        super().__post_init__()
        _check_int(self.method_name, "chunk", self.chunk, 1, "e.g. kvzip:chunk=2048")
        _check_int(self.method_name, "overlap", self.overlap, 0, "e.g. kvzip:overlap=8")
        _check_int(self.method_name, "sink", self.sink, 0, "e.g. kvzip:sink=4")
        if self.budgets not in ("global", "uniform"):
            raise ValueError(f"kvzip: budgets must be 'global' or 'uniform', got {self.budgets!r}; e.g. "
                             "kvzip:budgets=uniform")

    def make_layer(self, layer_idx: int) -> EvictingLayer:
        return _RaggedKVzipLayer() if self.budgets == "global" else _KVzipLayer()

    def make_cache(self, model: torch.nn.Module, *, speculative: bool = False, tokenizer=None) -> KVzipCache:
        """A fresh :class:`KVzipCache` for one ``generate`` run of ``model`` (close it, or use ``with``, when done).

        ``tokenizer`` gives the instruction's ids; by default the tokenizer saved in ``model.config.name_or_path``.
        Raises ``ValueError`` with ``speculative=True`` (its reconstruction forwards would count as drafts).
        """
        if speculative:
            raise ValueError("kvzip runs its own reconstruction forwards after the prefill, which the speculative "
                             "engine would take for drafts; use snapkv, knorm, keydiff or expected_attention there")
        return self._cache(model, tokenizer, attach=True)

    def _cache(self, model: torch.nn.Module, tokenizer, *, attach: bool) -> KVzipCache:
        prompts = _encode_prompts(tokenizer) if tokenizer is not None else _prompt_ids(
            str(getattr(model.config, "name_or_path", "") or ""))
        kind = _OwnedKVzipCache if self.budgets == "global" else KVzipCache
        cache = kind(model, self, prompts, attach=attach)
        if prompts is None:
            cache.warn("no tokenizer beside the model: the context is reconstructed without an instruction")
        return cache

    def prefill_holder(self, model: torch.nn.Module) -> KVzipCache:
        """A :class:`KVzipCache` without hooks for a shared prefill to fill (the instruction from the tokenizer
        saved beside the model, as :meth:`make_cache`)."""
        return self._cache(model, None, attach=False)

    def finish_shared_prefill(self, holder: KVzipCache, model: torch.nn.Module, input_ids: torch.Tensor) -> None:
        """Reconstruct the shared prefill's tokens against ``holder``'s K/V and evict, as the after-forward hook of
        this method's own cache does."""
        if holder.unscored:
            holder.reconstruct(model, input_ids)

    def on_step(self, step: LayerStep) -> None:
        """At a prefill step: fix the layer's budget and count its tokens; the cache evicts after the forward."""
        if step.phase != "prefill":
            return
        if not isinstance(step.cache, KVzipCache):
            raise ValueError(  # noqa: TRY004 - a misuse reported like the other run-time refusals
                "kvzip needs its own cache (KVzip.make_cache); it cannot be run by another method's")
        if self.budgets == "global" and step.layer.cumulative_length > step.query_length:
            raise ValueError(
                "kvzip:budgets=global ranks the slots of one prefill forward over every layer, so its layers hold "
                "different lengths, which a later multi-token forward (a chunked prefill, a new turn) cannot mask: "
                "prefill the context in one forward, or use kvzip:budgets=uniform")
        step.layer.add_slot_state(_STATE, fill=float("inf"))
        step.layer.target = self.layer_budget(step)
        step.layer.prefill_length = step.layer.cumulative_length
        step.cache.note_prefill(step)

    def score(self, step: LayerStep) -> torch.Tensor:
        """The reconstruction scores of the held slots, [B, Hkv, S] (``inf`` for sinks and unscored slots).

        Raises
        ------
        ValueError
            When called before any reconstruction (e.g. by a wrapper such as chunkkv or adakv).
        """
        state = step.layer.slot_state.get(_STATE)
        if state is None:
            raise ValueError("kvzip scores come from its reconstruction after the prefill; it cannot be wrapped by "
                             "chunkkv or adakv: run kvzip:ratio=... on its own")
        return state

    def telemetry(self, cache) -> dict:
        """The base telemetry; with ``budgets="global"``, the slot counts of the ragged layers (mean real slots per
        KV head in ``kept_tokens_per_layer``, ``valid_tokens_per_head``, ``padding_fraction``)."""
        out = super().telemetry(cache)
        if self.budgets == "global":
            out.update(ragged_telemetry(cache))
        return out


class _OwnedKVzipCache(KVzipCache, OwnedAttentionCache):
    """:class:`KVzipCache` for ``budgets="global"``: its :class:`RaggedLayer` s compute the decode attention per KV
    head (:class:`~mmaccel.longctx.owned.OwnedAttentionCache`)."""


class _RaggedKVzipLayer(RaggedLayer):
    """KVzip's cache layer under ``budgets="global"``: a :class:`RaggedLayer` (each KV head keeps its own slots)."""


class _KVzipLayer(EvictingLayer):
    """KVzip's cache layer: an :class:`EvictingLayer` (its own type, so ``kvquant``, which would quantize before the
    reconstruction, refuses to wrap KVzip when built)."""
