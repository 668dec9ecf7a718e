"""The architecture matrix: every KV-cache method and every drafter on tiny random models of eleven architectures.

Per cell: at an unbounded setting the method's greedy logits match plain ``generate`` (max |Δ| <= 1e-4; drafters:
token-identical sequences, which is what the speculative engine promises), or the method refuses with one clear
``ValueError``/``NotImplementedError`` naming the reason. At a lossy setting it runs (or refuses the same way). Any
other exception, or an output that leaves plain decoding, fails the cell. ``python tests/test_arch_matrix.py`` prints
the table.
"""
from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from arch_configs import ARCHS, HEADS, KV_HEADS, VOCAB, tiny_arch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from mmaccel.kernels import register_attention
from mmaccel.longctx import METHODS as KV_METHODS
from mmaccel.longctx import build_method
from mmaccel.longctx.base import window_queries
from mmaccel.longctx.head_finder import copy_scores
from mmaccel.longctx.head_pattern import HeadPattern, config_fingerprint
from mmaccel.speculative import METHODS as DRAFTERS
from mmaccel.speculative import (
    Cascade,
    DraftModel,
    DraftTree,
    DynamicDraftTree,
    Eagle,
    EagleHead,
    EagleHeadConfig,
    EagleTree,
    Jacobi,
    LayerSkip,
    PromptLookup,
    speculative_generate,
)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, NEW, TOL = 40, 6, 1e-4
#: the matrix's rows: the eleven architectures, plus Llama under eager attention (per-layer lengths vs one mask)
ROWS = [*ARCHS, "llama-eager"]

# KV-cache methods: (unbounded spec, lossy spec); "{pattern}" / "{half}" are head-pattern files written per model
KV_SPECS = {
    "full": ("full", "full"),
    "streaming": ("streaming:window=1000", "streaming:window=6:sink=2"),
    "snapkv": ("snapkv:budget=1000", "snapkv:budget=12:window=4"),
    "pyramidkv": ("pyramidkv:budget=1000:window=8", "pyramidkv:budget=12:window=4"),
    "h2o": ("h2o:budget=1000", "h2o:budget=12:recent=4"),
    "tova": ("tova:budget=1000", "tova:budget=12"),
    "knorm": ("knorm:budget=1000", "knorm:budget=12"),
    "chunked": ("chunked:chunk=7:method=snapkv,budget=1000", "chunked:chunk=12:method=snapkv,budget=12,window=4"),
    "chunked_ffn": ("chunked_ffn:chunk=8", "chunked_ffn:chunk=8:method=snapkv,budget=12,window=4"),
    "retrieval_heads": ("retrieval_heads:pattern={pattern}:sink=2:window=8",
                        "retrieval_heads:pattern={half}:sink=2:window=8"),
    "razor": ("razor:pattern={pattern}:sink=2:window=8", "razor:pattern={half}:sink=2:window=8"),
    "quest": ("quest:budget=1000", "quest:budget=16:page_size=4:dense_layers=0"),
    "adakv": ("adakv:method=snapkv,budget=1000", "adakv:method=snapkv,budget=12,window=4"),
    "chunkkv": ("chunkkv:method=snapkv,budget=1000", "chunkkv:chunk=4:method=snapkv,budget=12,window=4"),
    "kvquant": ("kvquant:bits=16", "kvquant:bits=4:group=16:residual=8"),
    "bilevel": ("bilevel:chunk=8:dense_chunks=100:sparse_tokens=2", "bilevel:chunk=8:dense_chunks=1:sparse_tokens=2:sink=2"),
    "longheads": ("longheads:chunk=8:window=128", "longheads:chunk=8:window=24"),
    # methods other helpers added in parallel (their own files); the matrix covers them as they land
    "expected_attention": ("expected_attention:budget=1000", "expected_attention:budget=12:future=8:sink=2"),
    "kvzip": ("kvzip:budget=1000", "kvzip:budget=12:chunk=16:sink=2"),
    "keydiff": ("keydiff:budget=1000", "keydiff:budget=12"),
    "minference": ("minference:vertical=1:block=8:last_q=8:min_length=8",
                   "minference:vertical=0.05:slash=0.05:block=8:last_q=8:min_length=8:method=snapkv,budget=12,window=4"),
}
KV_ALIASES = {"streamingllm": "streaming", "duo": "retrieval_heads"}  # same classes, one column each
DRAFTER_NAMES = ["draft", "prompt_lookup", "jacobi", "layer_skip", "tree", "dytree", "eagle", "eagle_tree", "cascade"]
DRAFTER_ALIASES = {"pld": "prompt_lookup"}


# ---------------------------------------------------------------------------------------------------------- models
@functools.cache
def model_of(row: str) -> torch.nn.Module:
    """One tiny model per row, reused by every method (``llama-eager``: Llama under eager attention)."""
    return tiny_arch("llama", attn="eager") if row == "llama-eager" else tiny_arch(row)


@functools.cache
def draft_of(row: str) -> torch.nn.Module:
    """A draft for the row's model: its weights plus small seeded noise (same architecture and vocabulary)."""
    model = model_of(row)
    draft = tiny_arch("llama", attn="eager") if row == "llama-eager" else tiny_arch(row)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p_draft, p in zip(draft.parameters(), model.parameters()):
            p_draft.copy_(p + 0.01 * torch.randn(p.shape, generator=gen))
    return draft


def prompt(seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(seed))


@functools.cache
def plain(row: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain greedy ``generate``: (sequences [1, PROMPT + NEW], logits [NEW, 1, V])."""
    out = model_of(row).generate(prompt(), max_new_tokens=NEW, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, eos_token_id=None)
    return out.sequences, torch.stack(out.logits)


_PATTERN_DIR = Path(tempfile.mkdtemp(prefix="mmaccel-arch-matrix-"))


def pattern_file(row: str, fraction: float) -> str:
    """A head-pattern file for the row's model: every head retrieval (``fraction=1``), or half of them."""
    model = model_of(row)
    layers = model.config.num_hidden_layers
    heads = [(layer, head) for layer in range(layers) for head in range(KV_HEADS)]
    chosen = heads if fraction >= 1 else heads[::2]
    path = _PATTERN_DIR / f"{row}-{fraction}.json"
    if not path.exists():
        scores = [[1.0] * KV_HEADS for _ in range(layers)]
        HeadPattern(layers, KV_HEADS, HEADS, scores, chosen, config_fingerprint(model.config), row).save(path)
    return str(path)


# ------------------------------------------------------------------------------------------------------------ cells
class Refused(Exception):
    """A cell refused with a clear error; ``args[0]`` is the reason."""


def _clear(exc: BaseException) -> str:
    """The refusal's message if ``exc`` is a clear refusal (ValueError / NotImplementedError with a reason)."""
    message = str(exc).strip()
    if isinstance(exc, (ValueError, NotImplementedError)) and len(message) > 20:
        return message
    raise exc


def _kv_run(row: str, spec: str) -> torch.Tensor:
    model = model_of(row)
    spec = spec.format(pattern=pattern_file(row, 1.0), half=pattern_file(row, 0.5))
    cache = build_method(spec).make_cache(model)
    try:
        out = model.generate(prompt(), past_key_values=cache, max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None)
    finally:
        getattr(cache, "close", lambda: None)()  # "full" is a plain DynamicCache
    return torch.stack(out.logits)


def kv_cell(row: str, name: str) -> str:
    """"ok" (unbounded exact within TOL, lossy runs) or "refused: <reason>"; raises on a wrong output or a crash."""
    unbounded, lossy = KV_SPECS[name]
    try:
        logits = _kv_run(row, unbounded)
    except (ValueError, NotImplementedError) as exc:
        return "refused: " + _clear(exc)
    delta = float((logits - plain(row)[1]).abs().max())
    if delta > TOL:
        raise AssertionError(f"{row} x {name}: unbounded logits leave plain generate by {delta:.3g} (silently wrong)")
    try:
        lossy_logits = _kv_run(row, lossy)
    except (ValueError, NotImplementedError) as exc:
        return "lossy refused: " + _clear(exc)
    assert lossy_logits.shape == logits.shape and torch.isfinite(lossy_logits).all(), (row, name)
    return "ok"


def _eagle_head(model, seed: int = 11) -> EagleHead:
    torch.manual_seed(seed)
    config = EagleHeadConfig.from_target(model, list(range(model.config.vocab_size)), "tiny")
    return EagleHead(config).eval()


def drafter_of(name: str, row: str):
    """The drafter ``name`` for the row's model (draft models are a perturbed copy, EAGLE heads random)."""
    model, draft = model_of(row), draft_of(row)
    return {
        "draft": lambda: DraftModel(draft),
        "prompt_lookup": lambda: PromptLookup(verify_cost=0.0),
        "jacobi": lambda: Jacobi(),
        "layer_skip": lambda: LayerSkip(skip=[1]),
        "tree": lambda: DraftTree(draft, shape="2,2"),
        "dytree": lambda: DynamicDraftTree(draft, width=2, depth=3),
        "eagle": lambda: Eagle(_eagle_head(model)),
        "eagle_tree": lambda: EagleTree(_eagle_head(model), width=2, depth=3),
        "cascade": lambda: Cascade(PromptLookup(verify_cost=0.0), Eagle(_eagle_head(model)), then_k=3),
    }[name]()


def drafter_cell(row: str, name: str) -> str:
    """"ok" (greedy sequences token-identical to plain ``generate``) or "refused: <reason>"; raises otherwise."""
    model = model_of(row)
    ids = torch.cat([prompt()[:, :20], prompt()[:, :20]], dim=1)  # a repeat, so prompt lookup drafts
    ref = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    try:
        out = speculative_generate(model, ids, drafter_of(name, row), max_new_tokens=NEW, num_draft_tokens=3,
                                   eos_token_id=None)
    except (ValueError, NotImplementedError) as exc:
        return "refused: " + _clear(exc)
    assert torch.equal(out.sequences, ref), f"{row} x {name}: output leaves plain greedy decoding (silently wrong)"
    return "ok"


def mmaccel_attention_cell(row: str) -> str:
    """The row's model under ``attn_implementation="mmaccel"`` (the same weights): logits within TOL of plain."""
    name = register_attention()
    try:
        model = tiny_arch("llama" if row == "llama-eager" else row, attn=name)
    except (ValueError, NotImplementedError) as exc:
        return "refused: " + _clear(exc)
    model.load_state_dict(model_of(row).state_dict())
    try:
        out = model.generate(prompt(), max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None)
    except (ValueError, NotImplementedError) as exc:
        return "refused: " + _clear(exc)
    delta = float((torch.stack(out.logits) - plain(row)[1]).abs().max())
    if delta > TOL:
        raise AssertionError(f"{row} x attn=mmaccel: logits leave plain generate by {delta:.3g} (silently wrong)")
    return "ok"


def row_cells(row: str) -> dict[str, str]:
    """Every column of one row: {method: "ok" | "refused: ..."} (KV methods not registered yet are left out)."""
    cells = {"attn:mmaccel": mmaccel_attention_cell(row)}
    cells.update({name: kv_cell(row, name) for name in KV_SPECS if name in KV_METHODS})
    cells.update({f"spec:{name}": drafter_cell(row, name) for name in DRAFTER_NAMES})
    return cells


# ------------------------------------------------------------------------------------------------------------ tests
def test_the_matrix_covers_every_registered_method():
    assert set(KV_METHODS) <= set(KV_SPECS) | set(KV_ALIASES), "add the new method's specs to KV_SPECS"
    assert set(DRAFTERS) == set(DRAFTER_NAMES) | set(DRAFTER_ALIASES)


def test_the_softcap_bites():
    """Gemma 2's attention softcap changes the plain output of the tiny model (else the matrix could not see it
    dropped)."""
    model = tiny_arch("gemma2")
    capped = model(prompt()).logits
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert float((model(prompt()).logits - capped).abs().max()) > 0.1


@pytest.mark.parametrize("row", ROWS)
def test_every_method_is_exact_or_refuses_clearly(row):
    cells = row_cells(row)
    assert set(cells) == {"attn:mmaccel", *(set(KV_SPECS) & set(KV_METHODS)), *(f"spec:{n}" for n in DRAFTER_NAMES)}
    for name, cell in cells.items():
        assert cell == "ok" or cell.startswith(("refused: ", "lossy refused: ")), (row, name, cell)


def _capture(module, query, key, value, attention_mask, **kwargs):
    """Plain attention that records the query the model computed (for the recomputation check)."""
    module._test_query = query.detach()
    kwargs.pop("softcap", None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_recomputed_queries_are_the_models_own(arch):
    """The query recomputation of the query-scored methods gives the very queries the model computed: fused
    qkv_proj (Phi-3), a q_norm over the whole projection (OLMo2), no RoPE on SmolLM3's second layer, q_norm per head
    (Qwen3, Gemma 3)."""
    AttentionInterface.register("mmaccel_test_capture", _capture)
    AttentionMaskInterface.register("mmaccel_test_capture", sdpa_mask)
    model = tiny_arch(arch, attn="mmaccel_test_capture")
    inputs = {}

    def grab(module, args, kwargs):
        inputs[module.layer_idx] = (kwargs["hidden_states"], kwargs["position_embeddings"])

    handles = [layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(prompt())
    finally:
        for handle in handles:
            handle.remove()
    for layer in model.model.layers:
        module = layer.self_attn
        hidden, rope = inputs[module.layer_idx]
        with torch.no_grad():
            recomputed = window_queries(module, hidden, rope, 8)
        torch.testing.assert_close(recomputed, module._test_query[:, :, -8:], rtol=1e-5, atol=1e-5)


def test_an_unknown_query_layout_is_refused_not_scored_wrong():
    """A layout the recomputation does not reproduce (here: a Llama layer told it has no RoPE, which it has) is
    caught by the key check at the first prefill and refused by name."""
    model = tiny_arch("llama")
    model.model.layers[1].self_attn.use_rope = False
    try:
        with pytest.raises(ValueError, match="cannot recompute layer 1's queries"):
            with build_method("snapkv:budget=12:window=4").make_cache(model) as cache:
                model.generate(prompt(), past_key_values=cache, max_new_tokens=2, do_sample=False)
    finally:
        del model.model.layers[1].self_attn.use_rope


class _Tokenizer:
    all_special_ids, bos_token_id = [0, 1, 2], 1

    def __len__(self):
        return VOCAB


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "mistral-sw", "olmo2", "phi3"])
def test_the_head_finder_runs_and_leaves_sliding_layers_out(arch):
    model = model_of(arch)
    scores = copy_scores(model, _Tokenizer(), length=24)
    assert scores.shape == (2, KV_HEADS) and torch.isfinite(scores).all()
    sliding = [i for i, kind in enumerate(getattr(model.config, "layer_types", None) or []) if kind != "full_attention"]
    if getattr(model.config, "sliding_window", None) and not getattr(model.config, "layer_types", None):
        sliding = [0, 1]  # Mistral: every layer slides
    assert all(float(scores[i].abs().sum()) == 0 for i in sliding)
    assert all(float(scores[i].sum()) > 0 for i in range(2) if i not in sliding)


@pytest.mark.parametrize("spec", ["adakv:ratio=0.25", "chunkkv:ratio=0.25", "adakv:budget=64"])
def test_wrapper_budgets_reach_the_wrapped_method(spec):
    method = build_method(spec)
    key, value = spec.split(":")[1].split("=")
    assert getattr(method.method, key) == type(getattr(method.method, key))(value)
    assert build_method(method.spec) == method


def table(rows=ROWS) -> str:
    """The matrix as Markdown: ✔, or ✘ with the refusal's reason in a footnote."""
    reasons: dict[str, int] = {}
    lines = []
    columns = ["attn:mmaccel", *(n for n in KV_SPECS if n in KV_METHODS), *(f"spec:{n}" for n in DRAFTER_NAMES)]
    lines.append("| arch | " + " | ".join(columns) + " |")
    lines.append("|---" * (len(columns) + 1) + "|")
    for row in rows:
        marks = []
        for name in columns:
            try:
                if name == "attn:mmaccel":
                    cell = mmaccel_attention_cell(row)
                else:
                    cell = kv_cell(row, name) if name in KV_SPECS else drafter_cell(row, name[5:])
            except Exception as exc:  # noqa: BLE001 - the table shows failures too
                cell = f"FAIL: {type(exc).__name__}: {str(exc)[:160]}"
            if cell == "ok":
                marks.append("✔")
            else:
                n = reasons.setdefault(cell, len(reasons) + 1)
                marks.append(f"✘{n}" if not cell.startswith("FAIL") else f"FAIL{n}")
        lines.append(f"| {row} | " + " | ".join(marks) + " |")
    lines.append("")
    lines.extend(f"{n}. {reason}" for reason, n in reasons.items())
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(table(sys.argv[1:] or ROWS))
