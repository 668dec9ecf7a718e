"""Visual-token methods on AnyRes models: tiny random LLaVA-OneVision (SigLIP + Qwen2) and LLaVA-NeXT (CLIP + Llama),
built here, offline, in a few seconds.

Layout of the tiny OneVision: 16 x 16 crops of 4 x 4 patches, so a base image is 4 x 4 = 16 tokens; the grid
pinpoints allow at most 2 x 2 crops (an 8 x 8 crop grid before unpadding). A 20 x 30 (h x w) image picks 32 x 32
(2 x 2 crops); unpadding keeps round(20 * 8 / 30) = 5 rows plus the odd padding row: 6 x 8 crop tokens + 6 newlines
= 70 tokens with the base. A 30 x 14 image picks 32 x 16 (2 x 1 crops): 8 x 4 + 8 newlines = 56 tokens. An image of
a multi-image prompt is 16 + 1 newline; a 4-frame video 4 x 2 x 2 (pooled) + 1 newline.
"""
import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from mmaccel.vision_tokens import (
    METHODS,
    FastV,
    ImageGrid,
    Pooling,
    TemporalToMe,
    TokenPlan,
    ToMe,
    UnsupportedModelError,
    VLMParts,
    lift_to_sequence,
)

pytestmark = pytest.mark.usefixtures("one_thread")

SIDE, PATCH = 16, 4
PINPOINTS = [[16, 32], [32, 16], [32, 32]]
WORDS = ["<pad>", "<s>", "</s>", "<image>", "<video>", "what", "is", "in", "the", "image", "?", "describe", "compare",
         "these", "a", "video"]
IMAGE, VIDEO = WORDS.index("<image>"), WORDS.index("<video>")
UNEVEN_GRIDS = [ImageGrid(1, 4, 4), ImageGrid(1, 6, 8, newline=True, part=1),
                ImageGrid(1, 4, 4), ImageGrid(1, 8, 4, newline=True, part=1)]


def _image(h, w, rng):
    return Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8"))


def _word_tokenizer():
    """A word-level tokenizer over ``WORDS`` (ids = list positions), left padding."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   extra_special_tokens={"image_token": "<image>", "video_token": "<video>"},
                                   padding_side="left")


@pytest.fixture(scope="module")
def onevision():
    """A tiny LlavaOnevisionForConditionalGeneration, its processor and four prompts: ``uneven`` (a batch of two
    images of different sizes, 70 and 56 tokens, left-padded), ``even`` (a batch of two 20 x 30 images), ``multi``
    (two images in one prompt) and ``video`` (one 4-frame video)."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, LlavaOnevisionProcessor
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )
    from transformers.models.llava_onevision.video_processing_llava_onevision import LlavaOnevisionVideoProcessor

    tokenizer = _word_tokenizer()
    processor = LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessorPil(size={"height": SIDE, "width": SIDE},
                                                        image_grid_pinpoints=PINPOINTS),
        video_processor=LlavaOnevisionVideoProcessor(size={"height": SIDE, "width": SIDE}),
        tokenizer=tokenizer, num_image_tokens=(SIDE // PATCH) ** 2, vision_feature_select_strategy="full")
    config = LlavaOnevisionConfig(
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": SIDE, "patch_size": PATCH},
        text_config={"model_type": "qwen2", "vocab_size": len(WORDS), "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 10, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
        image_token_id=IMAGE, video_token_id=VIDEO, image_grid_pinpoints=PINPOINTS, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlavaOnevisionForConditionalGeneration(config).eval()
    rng = np.random.RandomState(0)
    prompts = {
        "uneven": processor(images=[_image(20, 30, rng), _image(30, 14, rng)],
                            text=["<image> what is in the image ?", "<image> describe"], return_tensors="pt",
                            padding=True),
        "even": processor(images=[_image(20, 30, rng), _image(20, 30, rng)],
                          text=["<image> what is in the image ?", "<image> describe"], return_tensors="pt",
                          padding=True),
        "multi": processor(images=[[_image(20, 30, rng), _image(30, 14, rng)]], text=["<image> <image> compare these"],
                           return_tensors="pt"),
        "video": processor(videos=[(rng.rand(4, SIDE, SIDE, 3) * 255).astype("uint8")],
                           text=["<video> describe a video"], return_tensors="pt"),
    }
    return model, processor, prompts


@pytest.fixture(scope="module")
def llava_next():
    """A tiny LlavaNextForConditionalGeneration (CLIP tower with [CLS], "default" strategy) and a batch of the two
    differently sized images of ``onevision``'s ``uneven`` prompt (the same AnyRes layout)."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    processor = LlavaNextProcessor(
        image_processor=LlavaNextImageProcessorPil(size={"shortest_edge": SIDE},
                                                   crop_size={"height": SIDE, "width": SIDE},
                                                   image_grid_pinpoints=PINPOINTS),
        tokenizer=_word_tokenizer(), patch_size=PATCH, vision_feature_select_strategy="default",
        num_additional_image_tokens=1)
    config = LlavaNextConfig(
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": SIDE, "patch_size": PATCH,
                       "projection_dim": 32},
        text_config={"model_type": "llama", "vocab_size": len(WORDS), "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 10, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
        image_token_id=IMAGE, image_grid_pinpoints=PINPOINTS, attn_implementation="sdpa")
    torch.manual_seed(1)
    model = LlavaNextForConditionalGeneration(config).eval()
    rng = np.random.RandomState(0)
    inputs = processor(images=[_image(20, 30, rng), _image(30, 14, rng)],
                       text=["<image> what is in the image ?", "<image> describe"], return_tensors="pt", padding=True)
    return model, inputs


def _generate(model, inputs, n=4):
    """Greedy tokens [B, n] and the logits of every step [n, B, V]."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                             output_scores=True)
    return out.sequences[:, inputs["input_ids"].shape[1]:], torch.stack(out.scores)


@pytest.fixture(scope="module")
def references():
    """The unmodified model's greedy tokens and logits per prompt, computed once."""
    return {}


def _full_budget(name):
    """The method at a budget of 100%. ATP's budget is adaptive: it keeps everything with all of the mass too."""
    cls = METHODS[name]
    kwargs = {"keep_ratio": 1.0}
    if "mass" in {f.name for f in dataclasses.fields(cls)}:
        kwargs["mass"] = 1.0
    return cls(**kwargs)


def _rope_positions(model):
    """Capture the position ids the language model's rotary embedding gets at each forward."""
    seen = []
    handle = model.model.language_model.rotary_emb.register_forward_hook(
        lambda module, args, kwargs, output: seen.append(
            (args[1] if len(args) > 1 else kwargs["position_ids"]).clone()),
        with_kwargs=True)
    return seen, handle


def _capture_lm_inputs(model, store):
    """Record the keyword arguments of every language-model forward in ``store`` (register it after a method's own
    hook to see what the method hands on)."""
    return model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: store.append(kwargs), with_kwargs=True)


def _generate_seeing_lm_inputs(model, method, inputs, n):
    """Greedy tokens and logits under ``method``, and the keyword arguments the language model got at each forward
    (recorded by a hook registered after the method's own)."""
    captured = []
    with method.apply(model):
        grab = _capture_lm_inputs(model, captured)
        try:
            out, scores = _generate(model, inputs, n=n)
        finally:
            grab.remove()
    return out, scores, captured


def _full_positions(inputs):
    """generate's position ids of the unreduced prompt (left padding: the mask's cumsum)."""
    mask = inputs["attention_mask"]
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


# ------------------------------------------------------------------------------------------------ the layout
def test_find_reads_the_anyres_layout_from_the_packed_features(onevision, llava_next):
    model, _, prompts = onevision
    parts = VLMParts.find(model)
    assert parts.kind == "anyres" and parts.video_token_id == VIDEO
    inner = model.model

    def grids(name, media="image"):
        inputs = prompts[name]
        with torch.no_grad():
            if media == "image":
                features = inner.get_image_features(inputs["pixel_values"], inputs["image_sizes"],
                                                    batch_num_images=inputs.get("batch_num_images")).pooler_output
            else:
                features = inner.get_video_features(inputs["pixel_values_videos"]).pooler_output
        token = IMAGE if media == "image" else VIDEO
        return parts.grids(int((inputs["input_ids"] == token).sum()), features=features, media=media)

    assert grids("uneven") == UNEVEN_GRIDS
    assert [g.tokens for g in UNEVEN_GRIDS] == [16, 54, 16, 40]
    assert grids("multi") == [ImageGrid(1, 4, 4, suffix=1)] * 2  # a multi-image prompt: base image + one newline
    assert grids("video", "video") == [ImageGrid(4, 2, 2, suffix=1)]
    # LLaVA-NeXT packs the same way (CLIP's [CLS] is dropped by the "default" strategy)
    next_model, next_inputs = llava_next
    next_parts = VLMParts.find(next_model)
    with torch.no_grad():
        features = next_model.model.get_image_features(next_inputs["pixel_values"],
                                                       next_inputs["image_sizes"]).pooler_output
    assert next_parts.kind == "anyres" and next_parts.grids(126, features=features) == UNEVEN_GRIDS


def test_grid_offsets_of_raster_and_newline_tokens():
    grid = ImageGrid(1, 2, 3, newline=True, suffix=1)
    assert grid.tokens == 2 * 4 + 1
    assert grid.raster_index().tolist() == [0, 1, 2, 4, 5, 6]
    assert grid.newline_index().tolist() == [3, 7]
    assert ImageGrid(2, 1, 2, prefix=1).raster_index().tolist() == [1, 2, 3, 4]


def test_a_layout_that_is_not_anyres_is_refused(onevision):
    model, _, _ = onevision
    parts = VLMParts.find(model)
    newline = model.model.image_newline.detach()
    with pytest.raises(ValueError, match="read from the packed features"):
        parts.grids(17)
    with pytest.raises(ValueError, match="not rows of crop tokens closed by image_newline"):
        crops = torch.randn(16 + 7, 32)
        crops[16 + 3] = newline  # a newline after 3 tokens, then 3 tokens and none
        parts.grids(23, features=[crops])
    with pytest.raises(ValueError, match="do not start with a 4x4 base image"):
        parts.grids(10, features=[torch.randn(10, 32)])
    with pytest.raises(ValueError, match="the LLaVA-OneVision video layout"):
        parts.grids(16, features=torch.randn(1, 16, 32), media="video")


def test_rows_of_different_lengths_are_evened_out_by_padding_or_spare_newlines():
    image_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    drop_half = [TokenPlan.from_keep(torch.tensor([[True, False] * (n // 2)])) for n in (4, 6)]
    grids = [ImageGrid(1, 1, 4), ImageGrid(1, 1, 6)]
    padded = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    plan = lift_to_sequence(image_mask, grids, drop_half, padded)  # row 0 keeps 5, row 1 keeps 4: drop a pad
    assert plan.index.tolist() == [[1, 2, 4, 6], [0, 2, 4, 6]]
    with pytest.raises(ValueError, match="row 1 cannot get to 5 .too few padding tokens to drop"):
        lift_to_sequence(image_mask, grids, drop_half, torch.ones(2, 7))
    with pytest.raises(ValueError, match="every row must keep the same number of tokens"):
        lift_to_sequence(image_mask, grids, drop_half)  # without a mask, as before
    # same-size images whose kept tokens fill different numbers of crop rows: the shorter row takes a newline back
    grid = ImageGrid(1, 2, 2, newline=True)  # offsets: raster 0 1 | 3 4, newlines 2 | 5
    two_rows = TokenPlan.from_keep(torch.tensor([[True, False, True, True, False, True]]))
    one_row = TokenPlan.from_keep(torch.tensor([[True, True, True, False, False, False]]))
    image_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]] * 2, dtype=torch.bool)
    plan = lift_to_sequence(image_mask, [grid, grid], [two_rows, one_row], torch.ones(2, 7))
    assert plan.index.tolist() == [[0, 2, 3, 5, 6], [0, 1, 2, 5, 6]]


# ------------------------------------------------------------------------------------------------ 100% budget
def _budget_cases():
    for case in ("uneven", "even", "multi", "video", "next"):
        for name in sorted(METHODS):
            marks = []
            if name == "atp" and case in ("uneven", "next"):
                marks = [pytest.mark.xfail(raises=ValueError, strict=True,
                                           reason="ATP refuses rows with different numbers of visual tokens")]
            yield pytest.param(case, name, marks=marks, id=f"{case}-{name}")


@pytest.mark.parametrize("case,name", list(_budget_cases()))
def test_full_budget_equals_unmodified(onevision, llava_next, references, case, name):
    """Every registered method at 100%: the same logits at every step (bit for bit), so the same greedy tokens; or,
    if it declares the model unsupported, one UnsupportedModelError naming the model and what is supported (only
    methods that need the tower's [CLS] attention or a fixed tower grid may)."""
    if case == "next":
        model, inputs = llava_next
    else:
        model, _, prompts = onevision
        inputs = prompts[case]
    method = _full_budget(name)
    reason = method.supports(model)
    if reason is not None:
        assert type(method).stage == "vision" or getattr(type(method), "needs_tower_scores", False), reason
        with pytest.raises(UnsupportedModelError,
                           match=f"{type(method).__name__} does not support {type(model).__name__}: .*LLaVA"), \
                method.apply(model):
            pass
        assert not model.model.language_model._forward_pre_hooks  # nothing was left attached
        return
    if case not in references:
        references[case] = _generate(model, inputs)
    ref, ref_scores = references[case]
    with method.apply(model):
        out, scores = _generate(model, inputs)
    assert torch.equal(out, ref) and torch.equal(scores, ref_scores)
    assert method.telemetry["sequence_after"] == method.telemetry["sequence_before"] == inputs["input_ids"].shape[1]
    assert not model.model.language_model._forward_pre_hooks


def test_a_plain_forward_with_pixels_is_encoded_first_and_gives_the_same_logits(onevision):
    model, _, prompts = onevision
    inputs = prompts["uneven"]  # pixel_values, image_sizes, batch_num_images: no generate() to encode them first
    method = Pooling(keep_ratio=0.25)
    with torch.no_grad():
        ref = model(**inputs).logits
        with Pooling(keep_ratio=1.0).apply(model):
            same = model(**inputs).logits
        with method.apply(model):
            reduced = model(**inputs).logits
    assert torch.equal(same, ref)
    assert method.telemetry["tokens_after"] == [4, 15, 4, 12]
    assert reduced.shape[:2] == torch.tensor(method.telemetry["kept_positions"]).shape


def test_tome_runs_inside_onevisions_siglip_tower(onevision):
    """ToMe declares the AnyRes VLM unsupported (its crops are unpadded after the tower), but merges inside the SigLIP
    tower itself: no [CLS], so every token is mergeable."""
    model, _, prompts = onevision
    tower = model.model.vision_tower
    crops = prompts["uneven"]["pixel_values"][0]  # [5, 3, 16, 16]: base image + 4 crops
    with torch.no_grad():
        ref = tower(crops).last_hidden_state
        with ToMe(keep_ratio=1.0).apply(tower):
            same = tower(crops).last_hidden_state
        method = ToMe(r=4)
        with method.apply(tower):
            merged = tower(crops).last_hidden_state
    assert torch.equal(same, ref)
    assert method.telemetry["tokens_per_layer"] == [12, 8] and merged.shape == (5, 8, 32)
    assert [plan.num_kept for plan in method.source_map()] == [8] * 5


def test_the_main_methods_support_onevision(onevision):
    model, _, _ = onevision
    for name in ("pooling", "fastv", "temporal-tome", "visionzip", "prumerge", "tome"):  # the last three CLS-free
        assert METHODS[name]().supports(model) is None


# ------------------------------------------------------------------------------------------------ reductions
def test_pooling_keeps_original_positions_and_one_newline_per_kept_row_batch2(onevision):
    model, _, prompts = onevision
    inputs = prompts["uneven"]
    method = Pooling(keep_ratio=0.25)
    seen, handle = _rope_positions(model)
    try:
        out, scores, captured = _generate_seeing_lm_inputs(model, method, inputs, n=3)
    finally:
        handle.remove()
    assert out.shape == (2, 3)
    t = method.telemetry
    # base 4x4 -> 2x2; crops 6x8 -> 3x4 + 3 newlines; base 4x4 -> 2x2; crops 8x4 -> 4x2 + 4 newlines
    assert t["tokens_before"] == [16, 54, 16, 40] and t["tokens_after"] == [4, 15, 4, 12]
    kept = torch.tensor(t["kept_positions"])  # [2, K]
    full_pos = _full_positions(inputs)
    assert torch.equal(seen[0], full_pos.gather(1, kept))  # kept tokens keep their original positions
    assert torch.equal(seen[1][:, -1], full_pos[:, -1] + 1)  # decoding continues from the original length
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    image = ids == IMAGE
    # row 0 keeps L - 70 + 19 tokens; row 1 would keep L - 56 + 16, 11 more, so it drops 11 of its padding tokens
    L = ids.shape[1]
    assert kept.shape == (2, L - 70 + 19)
    for b, padding_dropped in enumerate([0, 11]):
        dropped = torch.tensor(sorted(set(range(ids.shape[1])) - set(kept[b].tolist())))
        assert int((mask[b, dropped] == 0).sum()) == padding_dropped
        assert bool((image[b, dropped] | (mask[b, dropped] == 0)).all())  # only image and padding tokens go
        assert int(image[b, kept[b]].sum()) == sum(t["tokens_after"][2 * b: 2 * b + 2])
    # the reduced crop grid reads like the model's own downsampled layout: rows of pooled tokens closed by a newline
    embeds, newline = captured[0]["inputs_embeds"], model.model.image_newline
    is_newline = (embeds == newline).all(-1)  # [2, K]
    for b, (rows, cols) in enumerate([(3, 4), (4, 2)]):
        start = int(image[b, kept[b]].nonzero()[0]) + 4  # after the pooled base image
        span = is_newline[b, start: start + rows * (cols + 1)].view(rows, cols + 1)
        assert bool(span[:, -1].all()) and not bool(span[:, :-1].any())
        assert int(is_newline[b].sum()) == rows
    assert torch.equal(captured[0]["attention_mask"], mask.gather(1, kept))
    # the source map: one plan per grid over all its tokens; lifted with the mask it gives the LLM's sequence
    maps = method.source_map()
    assert [p.length for p in maps] == t["tokens_before"] and [p.num_kept for p in maps] == t["tokens_after"]
    assert lift_to_sequence(image, UNEVEN_GRIDS, maps, mask).index.tolist() == t["kept_positions"]
    # rows are reduced independently: each row alone gives the same logits
    for b in range(2):
        with method.apply(model):
            _, row_scores = _generate(model, _row(inputs, b), n=3)
        assert torch.allclose(row_scores[:, 0], scores[:, b], atol=1e-4)


def _row(inputs, b):
    """Row ``b`` of a processed AnyRes batch as a batch-1 prompt without its padding."""
    keep = inputs["attention_mask"][b] == 1
    row = {"input_ids": inputs["input_ids"][b: b + 1, keep], "attention_mask": inputs["attention_mask"][b: b + 1, keep]}
    for key in ("pixel_values", "image_sizes", "batch_num_images"):
        if key in inputs:
            row[key] = inputs[key][b: b + 1]
    return row


def test_fastv_prunes_rows_with_different_image_counts_and_keeps_positions(onevision):
    model, _, prompts = onevision
    inputs = prompts["uneven"]
    method = FastV(layer=2, keep_ratio=0.25)
    seen = {}  # layer -> (input length, rotary cos) at prefill, as the layer gets them after the method's hooks

    def record(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.setdefault(module.self_attn.layer_idx, (hidden.shape[1], kwargs["position_embeddings"][0]))

    layers = model.model.language_model.layers
    with method.apply(model):
        hooks = [layers[i].register_forward_pre_hook(record, with_kwargs=True) for i in (1, 2)]
        try:
            out, scores = _generate(model, inputs, n=3)
        finally:
            for h in hooks:
                h.remove()
    assert out.shape == (2, 3)
    t = method.telemetry
    # each row keeps a quarter of its own image tokens (newline tokens count as image tokens): round(17.5), 14
    assert t["rows_image_tokens_before"] == [70, 56] and t["rows_image_tokens_after"] == [18, 14]
    L = inputs["input_ids"].shape[1]
    assert seen[1][0] == L and seen[2][0] == L - 70 + 18  # row 1 would keep L - 56 + 14: it drops 10 padding tokens
    kept = torch.tensor(t["kept_positions"])
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    for b, n_image in enumerate([18, 14]):
        text = ((ids[b] != IMAGE) & (mask[b] == 1)).nonzero().squeeze(1)
        assert set(text.tolist()) <= set(kept[b].tolist())  # every text token is kept
        assert int((ids[b, kept[b]] == IMAGE).sum()) == n_image
    rotary = model.model.language_model.rotary_emb
    expected = rotary(torch.zeros(1), _full_positions(inputs).gather(1, kept))[0]
    assert torch.allclose(seen[2][1], expected)  # kept tokens keep their original positions
    # rows are pruned independently: each row alone keeps the same image tokens and gives the same logits
    for b in range(2):
        alone = FastV(layer=2, keep_ratio=0.25)
        with alone.apply(model):
            _, row_scores = _generate(model, _row(inputs, b), n=3)
        row_kept, row_ids = torch.tensor(alone.telemetry["kept_positions"][0]), _row(inputs, b)["input_ids"][0]
        assert _image_offsets(row_kept, row_ids) == _image_offsets(kept[b], ids[b])
        assert torch.allclose(row_scores[:, 0], scores[:, b], atol=1e-4)


def _image_offsets(kept, ids):
    """The kept image tokens of one row, as offsets from the row's first image token."""
    return (kept[ids[kept] == IMAGE] - int((ids == IMAGE).nonzero()[0])).tolist()


@pytest.mark.parametrize("pooling_first", [True, False])
def test_pooling_and_fastv_compose_on_rows_of_different_sizes(onevision, pooling_first):
    model, _, prompts = onevision
    inputs = prompts["uneven"]
    pooling, fastv = Pooling(keep_ratio=0.25), FastV(layer=2, keep_ratio=0.5)
    first, second = (pooling, fastv) if pooling_first else (fastv, pooling)
    with first.apply(model), second.apply(model):
        out, _ = _generate(model, inputs, n=3)
    assert out.shape == (2, 3)
    # FastV prunes among the 19 / 16 tokens pooling kept (newlines included): round(9.5) = 10 and 8
    assert fastv.telemetry["rows_image_tokens_before"] == [19, 16]
    assert fastv.telemetry["rows_image_tokens_after"] == [10, 8]
    L = inputs["input_ids"].shape[1]
    assert fastv.telemetry["sequence_before"] == L - 70 + 19 and fastv.telemetry["sequence_after"] == L - 70 + 10
    lm = model.model.language_model
    assert not hasattr(lm, "_mmaccel_visual_mask") and not hasattr(lm, "_mmaccel_attention_mask")


def test_multi_image_prompt_and_video_keep_their_trailing_newline(onevision):
    model, _, prompts = onevision
    newline = model.model.image_newline
    for name, method, before, after in [("multi", Pooling(keep_ratio=0.25), [17, 17], [5, 5]),
                                        ("video", Pooling(keep_ratio=0.25), [17], [5]),  # 1 of 2 x 2 per frame
                                        ("video", TemporalToMe(keep_ratio=0.5), [17], [9])]:  # 8 of 16 across frames
        inputs = prompts[name]
        out, _, captured = _generate_seeing_lm_inputs(model, method, inputs, n=2)
        t = method.telemetry
        assert out.shape == (1, 2) and t["tokens_before"] == before and t["tokens_after"] == after
        assert t["media"] == ("video" if name == "video" else "image")
        kept = torch.tensor(t["kept_positions"][0])
        token = VIDEO if name == "video" else IMAGE
        visual = (inputs["input_ids"][0, kept] == token).nonzero().squeeze(1)
        is_newline = (captured[0]["inputs_embeds"][0, visual] == newline).all(-1)
        ends = torch.tensor(after).cumsum(0) - 1  # the last kept token of every item is its newline
        assert is_newline.nonzero().squeeze(1).tolist() == ends.tolist()
