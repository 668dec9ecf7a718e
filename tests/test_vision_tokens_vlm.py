"""Visual-token methods on tiny random LLaVA and Qwen2-VL models (built here, offline, in a few seconds)."""
import numpy as np
import pytest
import torch
from PIL import Image

from mmaccel.vision_tokens import (
    METHODS,
    FastV,
    Pooling,
    PruMerge,
    TemporalToMe,
    ToMe,
    UnsupportedModelError,
    VisionZip,
    build_method,
)

pytestmark = pytest.mark.usefixtures("one_thread")

SIDE = 112  # 8 x 8 = 64 image tokens per image at patch 14
N_IMG = (SIDE // 14) ** 2


def _images(n, seed=0):
    rng = np.random.RandomState(seed)
    return [Image.fromarray((rng.rand(SIDE, SIDE, 3) * 255).astype("uint8")) for _ in range(n)]


@pytest.fixture(scope="module")
def llava():
    """A tiny LlavaForConditionalGeneration (CLIP tower + Llama), its processor and a padded batch of 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<image>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["what is in the image? a red square sits on a blue mat. describe the picture."] * 4,
                            trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        extra_special_tokens={"image_token": "<image>"}, padding_side="left")
    image_processor = CLIPImageProcessor(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=SIDE, patch_size=14, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    inputs = processor(images=_images(2), text=["<image>\nwhat is in the image?", "<image> describe"],
                       return_tensors="pt", padding=True)
    return model, processor, inputs


@pytest.fixture(scope="module")
def qwen2vl():
    """A tiny Qwen2VLForConditionalGeneration and a batch of 2 images of 4 x 4 merged tokens each."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = Qwen2VLConfig(
        text_config={"vocab_size": 200, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                         "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
                         "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 4, "mlp_ratio": 2, "patch_size": 14,
                           "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3},
        image_token_id=150, video_token_id=151, vision_start_token_id=152, vision_end_token_id=153,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=SIDE * SIDE, patch_size=14, merge_size=2,
                                         temporal_patch_size=2)
    pixels = processor(images=_images(2, seed=1), return_tensors="pt")
    n = int(pixels["image_grid_thw"][0].prod()) // 4
    ids = torch.tensor([[0, 0, 1, 152] + [150] * n + [153, 7, 8, 9],
                        [1, 5, 6, 152] + [150] * n + [153, 7, 8, 9]])
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding in row 0
    inputs = {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels["pixel_values"],
                  "image_grid_thw": pixels["image_grid_thw"], "mm_token_type_ids": (ids == 150).int()}
    return model, inputs


def _generate(model, inputs, n=6):
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[:, inputs["input_ids"].shape[1]:]


def _rope_positions(model):
    """Capture the position ids the language model's rotary embedding gets at each forward."""
    seen = []
    handle = model.model.language_model.rotary_emb.register_forward_hook(
        lambda module, args, kwargs, output: seen.append((args[1] if len(args) > 1 else kwargs["position_ids"]).clone()),
        with_kwargs=True)
    return seen, handle


# specs (a name, or a name with the settings the tiny 4-layer models need); ATP's budget is adaptive: its identity
# is keep_ratio=1.0 *and* mass=1.0
LLAVA_METHODS = ["pooling", "visionzip", "prumerge", "fastv", "temporal-tome", "tome", "aim", "aim:layers=1,3",
                 "atp:mass=1.0", "progressive:layers=1,3"]
QWEN_METHODS = ["pooling", "fastv", "temporal-tome", "aim", "atp:mass=1.0", "progressive:layers=1,3", "visionzip",
                "prumerge", "tome"]


def _video_inputs(batch=2):
    """A Qwen2-VL video prompt: 4 frames (2 temporal patches) of 8 x 8 patches -> 2 x 4 x 4 = 32 video tokens; the
    second temporal patch repeats the first on the left half of the frame (a static region)."""
    torch.manual_seed(0)
    patches = torch.randn(2, 8, 8, 1176)
    patches[1, :, :4] = patches[0, :, :4]
    # Qwen2-VL orders patches by 2 x 2 merge windows: (t, h/2, w/2, 2, 2)
    pixels = patches.view(2, 4, 2, 4, 2, 1176).permute(0, 1, 3, 2, 4, 5).reshape(128, 1176)
    ids = torch.tensor([[1, 5, 152] + [151] * 32 + [153, 7, 8, 9]] * batch)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values_videos": pixels.repeat(batch, 1),
                "video_grid_thw": torch.tensor([[2, 8, 8]] * batch), "mm_token_type_ids": (ids == 151).int() * 2}


# ------------------------------------------------------------------------------------------------ 100% budget
@pytest.mark.parametrize("spec", LLAVA_METHODS)
def test_llava_full_budget_equals_unmodified(llava, spec):
    model, _, inputs = llava
    ref = _generate(model, inputs)
    method = build_method(f"{spec}:keep_ratio=1.0")
    with method.apply(model):
        out = _generate(model, inputs)
    assert torch.equal(out, ref)
    assert method.telemetry["sequence_after"] == method.telemetry["sequence_before"]


@pytest.mark.parametrize("spec", QWEN_METHODS)
def test_qwen2vl_full_budget_equals_unmodified(qwen2vl, spec):
    model, inputs = qwen2vl
    ref = _generate(model, inputs)
    with build_method(f"{spec}:keep_ratio=1.0").apply(model):
        out = _generate(model, inputs)
    assert torch.equal(out, ref)


def test_every_registered_method_is_in_the_full_budget_tests():
    def names(specs):
        return {spec.split(":")[0] for spec in specs}

    assert set(METHODS) == names(LLAVA_METHODS)
    assert set(METHODS) == names(QWEN_METHODS)  # VisionZip, PruMerge and ToMe included: CLS-free on Qwen2-VL


# ------------------------------------------------------------------------------------------------ reductions
@pytest.mark.parametrize("spec", ["pooling:keep_ratio=0.25", "visionzip:keep_ratio=0.25",
                                  "prumerge:keep_ratio=0.25"])
def test_llava_pre_llm_keeps_original_positions_batch2(llava, spec):
    model, _, inputs = llava
    method = build_method(spec)
    seen, handle = _rope_positions(model)
    try:
        with method.apply(model):
            out = _generate(model, inputs, n=3)
    finally:
        handle.remove()
    assert out.shape == (2, 3)
    t = method.telemetry
    assert t["tokens_before"] == [N_IMG, N_IMG] and t["tokens_after"] == [16, 16]
    L = inputs["input_ids"].shape[1]
    assert t["sequence_after"] == L - N_IMG + 16
    kept = torch.tensor(t["kept_positions"])  # [2, K]
    # generate's position ids are mask cumsums (left padding); the LLM must see them at the kept positions
    mask = inputs["attention_mask"]
    full_pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    assert torch.equal(seen[0], full_pos.gather(1, kept))
    # decode steps continue from the original length, not the reduced one
    assert torch.equal(seen[1][:, -1], full_pos[:, -1] + 1)
    # text tokens are all kept; image tokens are a subset
    image = inputs["input_ids"] == model.config.image_token_id
    assert int((~image).sum()) == 2 * (L - N_IMG)
    assert bool(image.gather(1, kept).sum(1).eq(16).all())


def test_llava_tome_merges_in_the_tower_and_the_llm_sees_one_token_per_group(llava):
    model, _, inputs = llava
    method = ToMe(r=8)  # 3 CLIP blocks, LLaVA projects block 1's output: 65 -> 57 -> 49 tokens ([CLS] + 48)
    seen, handle = _rope_positions(model)
    try:
        with method.apply(model):
            out = _generate(model, inputs, n=3)
    finally:
        handle.remove()
    assert out.shape == (2, 3)
    t = method.telemetry
    assert t["schedule"] == [8, 8] and t["tokens_per_layer"] == [57, 49]
    assert t["tokens_before"] == [N_IMG, N_IMG] and t["tokens_after"] == [48, 48]
    kept = torch.tensor(t["kept_positions"])
    mask = inputs["attention_mask"]
    full_pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    assert torch.equal(seen[0], full_pos.gather(1, kept))
    from mmaccel.vision_tokens import vit_layers
    assert type(vit_layers(model.model.vision_tower)[0]).__name__ == "CLIPEncoderLayer"  # restored on exit


def test_llava_pooling_merges_2x2_cells(llava):
    model, _, inputs = llava
    captured = []
    lm = model.model.language_model

    def grab(module, args, kwargs):
        captured.append(kwargs["inputs_embeds"])

    handle = lm.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    first = captured.pop()
    with Pooling(keep_ratio=0.25).apply(model):
        handle = lm.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with torch.no_grad():
                model(**inputs)
        finally:
            handle.remove()
    # our hook runs after the method's, so it sees the reduced embeddings
    reduced = captured.pop()
    row = 1  # no padding
    pos = (inputs["input_ids"][row] == model.config.image_token_id).nonzero().squeeze(1)
    grid = first[row, pos].view(8, 8, -1)
    expected = grid.view(4, 2, 4, 2, -1).mean(dim=(1, 3)).reshape(16, -1)
    start = int(pos[0])
    assert torch.allclose(reduced[row, start: start + 16], expected, atol=1e-6)


def test_fastv_prunes_in_llm_under_sdpa_without_eager(llava, monkeypatch):
    import transformers.models.clip.modeling_clip as clip_mod
    import transformers.models.llama.modeling_llama as llama_mod

    def no_eager(*args, **kwargs):
        raise AssertionError("eager attention was called")

    monkeypatch.setattr(llama_mod, "eager_attention_forward", no_eager)
    monkeypatch.setattr(clip_mod, "eager_attention_forward", no_eager)
    model, _, inputs = llava
    assert model.config.text_config._attn_implementation == "sdpa"
    assert model.config.vision_config._attn_implementation == "sdpa"
    method = FastV(layer=2, keep_ratio=0.25)
    lengths = {}

    def length_of(i):
        def hook(module, args, output):  # output length of layer i at prefill
            lengths.setdefault(i, output.shape[1])
        return hook

    hooks = [layer.register_forward_hook(length_of(i)) for i, layer in enumerate(model.model.language_model.layers)]
    try:
        with method.apply(model):
            out = _generate(model, inputs, n=4)
    finally:
        for h in hooks:
            h.remove()
    L = inputs["input_ids"].shape[1]
    assert out.shape == (2, 4)
    assert lengths[0] == lengths[1] == L
    assert lengths[2] == lengths[3] == L - N_IMG + 16
    assert method.telemetry["image_tokens_after"] == 16


@pytest.mark.parametrize("pooling_first", [True, False])
def test_pooling_then_fastv_compose(llava, pooling_first):
    model, _, inputs = llava
    ref = _generate(model, inputs, n=3)
    with Pooling(keep_ratio=1.0).apply(model), FastV(layer=2, keep_ratio=1.0).apply(model):
        assert torch.equal(_generate(model, inputs, n=3), ref)
    pooling, fastv = Pooling(keep_ratio=0.5), FastV(layer=2, keep_ratio=0.5)
    first, second = (pooling, fastv) if pooling_first else (fastv, pooling)
    with first.apply(model), second.apply(model):
        out = _generate(model, inputs, n=3)
    assert out.shape == (2, 3)
    L = inputs["input_ids"].shape[1]
    assert pooling.telemetry["tokens_after"] == [30, 30]  # 8 x 8 -> 6 x 5
    assert fastv.telemetry["image_tokens_before"] == 30 and fastv.telemetry["image_tokens_after"] == 15
    assert fastv.telemetry["sequence_before"] == L - N_IMG + 30
    assert not hasattr(model.model.language_model, "_mmaccel_visual_mask")


def test_fastv_matches_manual_pruning_of_scores(llava):
    """FastV's kept image tokens are the top-k of the last query's attention at layer K-1 (eager reference)."""
    model, _, inputs = llava
    method = FastV(layer=1, keep_ratio=0.25)
    with method.apply(model), torch.no_grad():
        model(**inputs)
    kept = torch.tensor(method.telemetry["kept_positions"])
    # reference: layer-0 attention weights of the last query, from an eager copy of the language model's layer 0
    captured = {}
    lm = model.model.language_model
    attn0 = lm.layers[0].self_attn
    h = attn0.register_forward_pre_hook(lambda m, a, k: captured.update(k), with_kwargs=True)
    with torch.no_grad():
        model(**inputs)
    h.remove()
    hidden, (cos, sin) = captured["hidden_states"], captured["position_embeddings"]
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv
    B, L, _ = hidden.shape
    d = attn0.head_dim
    q = attn0.q_proj(hidden).view(B, L, -1, d).transpose(1, 2)
    k = attn0.k_proj(hidden).view(B, L, -1, d).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k = repeat_kv(k, attn0.num_key_value_groups)
    logits = (q[:, :, -1:] @ k.transpose(-1, -2)) * attn0.scaling
    probs = logits.softmax(-1)[:, :, 0].mean(1)  # [B, L]
    image = inputs["input_ids"] == model.config.image_token_id
    top = probs.masked_fill(~image, -1).topk(16, dim=1).indices.sort(dim=1).values
    kept_image = torch.stack([row[image[b, row]] for b, row in enumerate(kept)])
    assert torch.equal(kept_image, top)


# ------------------------------------------------------------------------------------------------ Qwen2-VL M-RoPE
@pytest.mark.parametrize("method", [Pooling(keep_ratio=0.25), FastV(layer=2, keep_ratio=0.25)])
def test_qwen2vl_kept_tokens_keep_their_mrope_positions(qwen2vl, method):
    model, inputs = qwen2vl
    # reference: the unmodified model's 3-D positions
    ref_pos, handle = _rope_positions(model)
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    full = ref_pos[0]  # [3, B, L]
    assert full.shape[0] == 3
    assert not torch.equal(full[1], full[2])  # real 2-D image positions, not text positions
    seen, handle = _rope_positions(model)
    layer_pos = {}
    layers = model.model.language_model.layers

    def grab_cos(module, args, kwargs):
        layer_pos.setdefault("cos", kwargs["position_embeddings"][0])

    hooks = []
    try:
        with method.apply(model):  # registered after the method's hooks, so it sees the reduced inputs
            hooks.append(layers[-1].register_forward_pre_hook(grab_cos, with_kwargs=True))
            out = _generate(model, inputs, n=3)
    finally:
        handle.remove()
        for h in hooks:
            h.remove()
    assert out.shape == (2, 3)
    kept = torch.tensor(method.telemetry["kept_positions"])
    L = inputs["input_ids"].shape[1]
    assert kept.shape == (2, L - 16 + 4)
    expected = full.gather(2, kept[None].expand(3, -1, -1))
    if isinstance(method, Pooling):
        assert torch.equal(seen[0], expected)  # the LLM sees the reduced 3-D ids
    else:
        assert seen[0].shape[-1] == L  # FastV: early layers see everything ...
        # ... and layer >= K gets the rotary table of the kept tokens' original 3-D positions
        cos_full = model.model.language_model.rotary_emb(torch.zeros(1), full)[0]
        assert torch.allclose(layer_pos["cos"], cos_full.gather(1, kept[..., None].expand(-1, -1, cos_full.shape[-1])))
    # decode steps keep their original M-RoPE ids (text position + rope delta), not the reduced cache length
    ref_decode, handle = _rope_positions(model)
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=3, do_sample=False)
    handle.remove()
    assert torch.equal(seen[1], ref_decode[1])


def test_temporal_tome_on_qwen2vl_video_merges_across_frames_and_keeps_mrope(qwen2vl):
    model, _ = qwen2vl
    inputs = _video_inputs()
    ref = _generate(model, inputs, n=3)
    with TemporalToMe(keep_ratio=1.0).apply(model):
        assert torch.equal(_generate(model, inputs, n=3), ref)
    ref_pos, handle = _rope_positions(model)
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    full = ref_pos[0]
    method = TemporalToMe(keep_ratio=0.75)  # 32 -> 24 video tokens: 8 second-frame tokens merge into the first
    seen, handle = _rope_positions(model)
    try:
        with method.apply(model):
            out = _generate(model, inputs, n=3)
    finally:
        handle.remove()
    assert out.shape == (2, 3)
    t = method.telemetry
    assert t["media"] == "video" and t["tokens_before"] == [32, 32] and t["tokens_after"] == [24, 24]
    kept = torch.tensor(t["kept_positions"])
    assert torch.equal(seen[0], full.gather(2, kept[None].expand(3, -1, -1)))
    # the merged (static) tokens are the left half of the second temporal patch: video tokens 16 + {0,1,4,5,...}
    first = 3  # video tokens start after [bos, 5, vision_start]
    dropped = sorted(set(range(first, first + 32)) - set(kept[0].tolist()))
    assert dropped == [first + 16 + r * 4 + c for r in range(4) for c in range(2)]


# ------------------------------------------------------------------------------------------------ errors
def test_unsupported_models_get_one_clear_error(llava, qwen2vl):
    llava_model = llava[0]
    qwen = qwen2vl[0]
    assert VisionZip(keep_ratio=0.5).supports(qwen) is None  # CLS-free score (tests/test_vision_tokens_cls_free.py)
    with pytest.raises(UnsupportedModelError, match="ToMe does not support Qwen2VLForConditionalGeneration.*give "
                                                    "keep_ratio, not r"), ToMe(r=2).apply(qwen):
        pass
    with pytest.raises(UnsupportedModelError, match=r"layer must be an int in \[1, 3\]"), FastV(layer=4).apply(llava_model):
        pass
    tower = llava_model.model.vision_tower
    with pytest.raises(UnsupportedModelError, match="PruMerge does not support CLIPVisionModel.*supported: LLaVA"), PruMerge().apply(tower):
        pass
    # nothing was left attached by the refusals
    assert not llava_model.model.language_model._forward_pre_hooks


# ------------------------------------------------------------------------------------------------ reduce before the merge
def _lm_inputs(model, method, inputs, before_merge, monkeypatch):
    """Run ``generate`` and a plain forward under ``method`` with the reduction before LlavaModel's merge (or at the
    language model's entry); return the ids' lengths the embedding table saw, the language model's prefill inputs
    (as it receives them) and the forward's logits."""
    monkeypatch.setattr(type(method), "reduce_before_merge", before_merge)
    embedded, seen = [], []
    with method.apply(model):
        h1 = model.get_input_embeddings().register_forward_hook(lambda m, a, o: embedded.append(a[0].shape[1]))
        h2 = model.model.language_model.register_forward_pre_hook(
            lambda m, a, k: seen.append({n: k.get(n) for n in ("inputs_embeds", "position_ids", "attention_mask")}),
            with_kwargs=True)
        try:
            out = _generate(model, inputs, n=3)
            with torch.no_grad():
                logits = model(**inputs).logits
        finally:
            h1.remove()
            h2.remove()
    return embedded, seen, out, logits


@pytest.mark.parametrize("spec,images", [("pooling:keep_ratio=0.25", 1), ("visionzip:keep_ratio=0.25", 1),
                                         ("prumerge:keep_ratio=0.25", 1), ("aim:keep_ratio=0.25", 1),
                                         ("temporal-tome:keep_ratio=0.4", 3)])
def test_llava_reduce_before_merge_gives_the_language_model_the_same_inputs(llava, spec, images, monkeypatch):
    """On LLaVA a pre-LLM method shortens the ids and the projected features before ``LlavaModel`` merges them, so
    the embedding table only ever sees the kept ids; the language model's prefill inputs (embeddings, original
    positions, mask), the generated tokens and a plain forward's logits equal the late path's bit for bit."""
    model, processor, inputs = llava
    if images > 1:  # a 3-frame clip in one row, as a LLaVA-1.5 model is fed a video
        inputs = processor(images=_images(3, seed=1), text=["<image><image><image> describe"], return_tensors="pt")
    L = inputs["input_ids"].shape[1]
    late = _lm_inputs(model, build_method(spec), inputs, False, monkeypatch)
    early = _lm_inputs(model, method := build_method(spec), inputs, True, monkeypatch)
    K = method.telemetry["sequence_after"]
    assert K < L
    assert late[0][0] == L and early[0][0] == K  # the prefill's embedding lookups: full ids against kept ids
    assert len(early[1]) == len(late[1])
    for a, b in zip(early[1], late[1]):
        for name in a:
            assert (a[name] is None and b[name] is None) or torch.equal(a[name], b[name]), name
    assert torch.equal(early[2], late[2])
    assert torch.equal(early[3], late[3]) and early[3].shape[1] == K


def test_placed_features_reads_rows_across_images_and_merges_like_the_sequence_plan():
    """PlacedFeatures indexes a list of per-image features like the [B, L, D] embeddings they fill, and its
    ``reduce`` equals ``plan.merge`` of those embeddings at the kept placeholders, bit for bit."""
    from mmaccel.vision_tokens.plan import TokenPlan
    from mmaccel.vision_tokens.pre_llm import PlacedFeatures

    torch.manual_seed(0)
    images = [torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 3)]
    ids_mask = torch.tensor([[False, True, True, True, True, False, True, True, True, True],
                             [False, False, False, False, False, True, True, True, True, False]])
    placed = PlacedFeatures(ids_mask, images)
    embeds = torch.zeros(2, 10, 3)
    embeds[ids_mask] = torch.cat(images)
    positions = torch.tensor([3, 4, 6])
    assert torch.equal(placed[0, positions], embeds[0, positions])
    assert torch.equal(placed[1, torch.tensor([5, 8])], embeds[1, torch.tensor([5, 8])])
    # row 0: image 1 keeps 1, merges 3 into 2 (weighted), drops 4; image 2 keeps 6 and 7, merges 9 into 8;
    # row 1: image 3 merges 5..8 into 5; text tokens are their own representatives; 7 tokens per row
    rep = torch.tensor([[0, 1, 2, 2, -1, 5, 6, 7, 8, 8], [0, 1, 2, 3, 4, 5, 5, 5, 5, 9]])
    weight = torch.rand(2, 10) + 0.5
    plan = TokenPlan.from_representatives(rep, weight)
    ref = plan.merge(embeds)
    kept_image = plan.take(ids_mask)
    assert torch.equal(placed.reduce(plan), ref[kept_image])
    with pytest.raises(ValueError, match="3 image placeholders but the encoder gave 12 tokens"):
        PlacedFeatures(torch.tensor([[True, False, True, True]]), images)


# ------------------------------------------------------------------------------------------------ contiguous positions
def _captured_lm_prefill(model, method, inputs, n=3):
    """Generate under ``method``; return the tokens and the language model's prefill kwargs (embeddings, positions,
    mask) as it received them."""
    seen = []
    with method.apply(model):
        handle = model.model.language_model.register_forward_pre_hook(
            lambda m, a, k: seen.append({name: k.get(name) for name in ("inputs_embeds", "position_ids",
                                                                         "attention_mask")}), with_kwargs=True)
        try:
            out = _generate(model, inputs, n=n)
        finally:
            handle.remove()
    return out, seen


@pytest.mark.parametrize("before_merge", [True, False])
def test_contiguous_positions_equal_a_prompt_built_short(llava, before_merge, monkeypatch):
    """``positions="contiguous"`` numbers the reduced prompt 0..K-1 over its mask and continues from there while
    decoding: generating under the method equals ``generate`` on the reduced embeddings given as a plain prompt, on a
    left-padded batch of 2, through both the early (before LlavaModel's merge) and the late path."""
    model, _, inputs = llava
    monkeypatch.setattr(Pooling, "reduce_before_merge", before_merge)
    out, seen = _captured_lm_prefill(model, Pooling(keep_ratio=0.25, positions="contiguous"), inputs, n=4)
    prefill = seen[0]
    mask = prefill["attention_mask"]
    assert mask.shape[1] == inputs["input_ids"].shape[1] - N_IMG + 16
    real = mask.bool()
    expected = mask.cumsum(-1) - 1
    assert torch.equal(prefill["position_ids"][real], expected[real])
    with torch.no_grad():
        plain = model.generate(inputs_embeds=prefill["inputs_embeds"], attention_mask=mask, max_new_tokens=4,
                               do_sample=False)
    assert torch.equal(out, plain[:, -4:])
    # decode steps continue from the reduced length: each row's next position is its kept real tokens' count
    assert torch.equal(seen[1]["position_ids"][:, -1], mask.sum(-1))


def test_contiguous_positions_at_full_budget_and_their_errors(llava, qwen2vl):
    model, _, inputs = llava
    assert torch.equal(_generate(model, inputs), _captured_lm_prefill(
        model, Pooling(keep_ratio=1.0, positions="contiguous"), inputs, n=6)[0])
    assert build_method("pooling:keep_ratio=0.5:positions=contiguous").positions == "contiguous"
    with pytest.raises(ValueError, match="positions must be one of"):
        Pooling(keep_ratio=0.5, positions="packed")
    with pytest.raises(UnsupportedModelError, match="M-RoPE"), \
            Pooling(keep_ratio=0.5, positions="contiguous").apply(qwen2vl[0]):
        pass


def test_pooled_clip_embeds_are_what_pooling_gives_the_language_model(llava):
    """The video-NIAH trainer's pooled clip embeddings (``mmaccel.zoo.train.clips``) equal the language model's
    prefill embeddings under ``Pooling`` with contiguous positions on the same 3-frame prompt."""
    from mmaccel.models.smol_llava import image_features
    from mmaccel.zoo.train.clips import pooled_clip_embeds

    model, processor, _ = llava
    inputs = processor(images=_images(3, seed=2), text=["<image>\n<image>\n<image>\ndescribe"], return_tensors="pt")
    _, seen = _captured_lm_prefill(model, Pooling(keep_ratio=0.25, positions="contiguous"), inputs, n=1)
    image_id = model.config.image_token_id
    ids, run = [], 0
    for t in inputs["input_ids"][0].tolist():  # each frame's 64 placeholders -> 16
        run = run + 1 if t == image_id else 0
        if run <= 16:
            ids.append(t)
    with torch.no_grad():
        feats = image_features(model, inputs["pixel_values"])
        mine = pooled_clip_embeds(model, torch.tensor([ids]), [feats], tokens_per_frame=16)
    assert torch.allclose(mine, seen[0]["inputs_embeds"], atol=1e-6)
    short = list(ids)
    short.remove(image_id)  # one placeholder too few for 3 frames of 16
    with pytest.raises(ValueError, match="image tokens"):
        pooled_clip_embeds(model, torch.tensor([short]), [feats], tokens_per_frame=16)
