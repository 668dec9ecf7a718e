"""mmaccel.Pipeline: vision + KV + speculative composed on one model, exact where every piece is lossless; the
record's split timings and telemetry (mmaccel.eval.measure_pipeline / compare_pieces); the refusals;
Comparison.plot (the app's charts)."""
import json

import pytest
import torch
from test_vision_tokens_vlm import N_IMG, _images, llava, qwen2vl  # noqa: F401 - the tiny VLM fixtures
from tiny_models import random_prompt, tiny_llama

import mmaccel
from mmaccel.eval import Comparison, RunRecord, compare, compare_pieces, measure_pipeline
from mmaccel.longctx import build_method as build_kv
from mmaccel.speculative import PromptLookup, speculative_generate
from mmaccel.vision_tokens import UnsupportedModelError
from mmaccel.vision_tokens import build_method as build_vision

pytestmark = pytest.mark.usefixtures("one_thread")

N = 12


@pytest.fixture(scope="module")
def llava1(llava):  # noqa: F811 - the imported fixture
    """The tiny LLaVA, its processor and one unpadded image prompt that ends with text."""
    model, processor, _ = llava
    inputs = processor(images=_images(1), text=["<image>\nwhat is in the image? a red square"], return_tensors="pt")
    return model, processor, inputs


@pytest.fixture(scope="module")
def qwen1(qwen2vl):  # noqa: F811 - the imported fixture
    """The tiny Qwen2-VL and one unpadded image prompt (row 1 of the fixture's batch)."""
    model, inputs = qwen2vl
    grid = inputs["image_grid_thw"]
    n0 = int(grid[0].prod())
    return model, {"input_ids": inputs["input_ids"][1:], "attention_mask": inputs["attention_mask"][1:],
                   "pixel_values": inputs["pixel_values"][n0:], "image_grid_thw": grid[1:],
                   "mm_token_type_ids": inputs["mm_token_type_ids"][1:]}


@pytest.fixture(scope="module")
def micro():
    model, tok = mmaccel.load("micro-lm", device="cpu")
    draft, _ = mmaccel.load("micro-draft", device="cpu")
    return model, tok, draft


def _plain(model, inputs, n=N, vision=None, kv=None):
    """``model.generate`` greedy new ids (optionally under a vision method and with a KV method's cache)."""
    kwargs = dict(inputs)
    if kv is not None:
        kwargs["past_key_values"] = build_kv(kv).make_cache(model)
    with torch.no_grad():
        if vision is None:
            out = model.generate(**kwargs, max_new_tokens=n, do_sample=False)
        else:
            with build_vision(vision).apply(model):
                out = model.generate(**kwargs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _no_hooks_left(model):
    inner = model.model
    for module in (inner.language_model, inner.vision_tower if hasattr(inner, "vision_tower") else inner.visual,
                   inner):
        assert not module._forward_hooks and not module._forward_pre_hooks


# ------------------------------------------------------------------------------------------------ (a) exactness
@pytest.mark.parametrize("vision,kv,speculative", [
    ("pooling:keep_ratio=1.0", "full", "prompt_lookup"),
    ("tome:keep_ratio=1.0", "full", "jacobi"),
    ("visionzip:keep_ratio=1.0", "snapkv:budget=100000:window=8", None),
    ("fastv:keep_ratio=1.0", "snapkv:budget=100000:window=8", None),
])
def test_lossless_composition_equals_generate_on_llava(llava1, vision, kv, speculative):
    model, processor, inputs = llava1
    ref = _plain(model, inputs)
    pipe = mmaccel.Pipeline(model, processor, vision=vision, kv=kv, speculative=speculative)
    rec = measure_pipeline(pipe, inputs, max_new_tokens=N)
    assert rec.ok and rec.output_ids == ref
    gen = pipe.generate(inputs, max_new_tokens=N)  # unmeasured: the same tokens and counts
    assert isinstance(gen, mmaccel.pipeline.Generation) and not isinstance(gen, RunRecord)
    assert (gen.output_ids, gen.output_text, gen.visual_tokens_kept) == (ref, rec.output_text, N_IMG)
    assert rec.output_text == processor.tokenizer.decode(ref, skip_special_tokens=True)
    assert (rec.visual_tokens, rec.visual_tokens_kept) == (N_IMG, N_IMG)
    assert rec.method == pipe.label == " + ".join(
        f"{k}={v}" for k, v in (("vision", vision), ("kv", kv), ("speculative", speculative)) if v)
    if speculative == "prompt_lookup":  # drafts were really verified several tokens at a time
        assert rec.telemetry["mean_accepted_length"] > 1.2
        assert rec.telemetry["kv"]["method"] == "full"
    _no_hooks_left(model)


def test_text_prompt_with_images_goes_through_the_processor(llava1):
    model, processor, inputs = llava1
    pipe = mmaccel.Pipeline(model, processor, vision="pooling:keep_ratio=1.0", speculative="prompt_lookup")
    rec = pipe.generate("<image>\nwhat is in the image? a red square", images=_images(1), max_new_tokens=N)
    assert rec.output_ids == _plain(model, inputs)


def test_lossless_composition_equals_generate_on_qwen2vl_with_mrope_positions(qwen1):
    model, inputs = qwen1
    ref = _plain(model, inputs)
    seen = []
    rotary = model.model.language_model.rotary_emb
    handle = rotary.register_forward_hook(
        lambda module, args, kwargs, out: seen.append((args[1] if len(args) > 1 else kwargs["position_ids"]).clone()),
        with_kwargs=True)
    try:
        _plain(model, inputs)
        plain_pos = torch.cat(seen, dim=-1)  # [3, 1, L + N - 1]
        seen.clear()
        pipe = mmaccel.Pipeline(model, None, vision="pooling:keep_ratio=1.0", kv="full", speculative="jacobi")
        rec = pipe.generate(inputs, max_new_tokens=N)
    finally:
        handle.remove()
    assert rec.output_ids == ref
    # the positions of every committed token equal generate's: the prompt's 3-D M-RoPE ids at prefill, then text
    # positions + rope deltas (not the plain 1-D positions, which differ after an image)
    prefill, steps = seen[0], seen[1:]
    committed = [prefill] + [s[..., : 1 + m] for s, m in zip(steps, rec.telemetry["accepted"])]
    spec_pos = torch.cat(committed, dim=-1)
    n = min(spec_pos.shape[-1], plain_pos.shape[-1])
    assert torch.equal(spec_pos[..., :n], plain_pos[..., :n])
    L = inputs["input_ids"].shape[1]
    assert int(plain_pos[0, 0, L]) != L  # the M-RoPE ids really differ from 1-D positions here


def test_lossless_composition_equals_generate_on_micro_lm(micro):
    model, tok, draft = micro
    ids = tok(" ".join(json.__doc__.split()), return_tensors="pt").input_ids[:, :48]
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    ref = ref[0, ids.shape[1]:].tolist()
    spec = measure_pipeline(mmaccel.Pipeline(model, tok, kv="full", speculative="draft", draft=draft), ids,
                            max_new_tokens=40)
    assert spec.output_ids == ref
    assert spec.telemetry["mean_accepted_length"] > 1.2 and spec.telemetry["draft_forwards"] > 0
    assert spec.vision_encoder_s is None and spec.prefill_s == spec.ttft_s and spec.visual_tokens is None
    unbounded = mmaccel.Pipeline(model, tok, kv="snapkv:budget=100000:window=8").generate(ids, max_new_tokens=40)
    assert unbounded.output_ids == ref
    assert unbounded.telemetry["evicted_tokens"] == 0


# ------------------------------------------------------------------------------------------------ (b) lossy runs
def _prefill_then_greedy(model, ids, kv, n, **model_inputs):
    """By hand: the engine's prefill (the prompt minus its last token) into ``kv``'s speculative cache, then greedy
    one-token decoding; the new ids (stopping after EOS)."""
    cache = build_kv(kv).make_cache(model, speculative=True)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out, tok, pos = [], ids[:, -1:], ids.shape[1] - 1
    with torch.no_grad():
        model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True, **model_inputs)
        while len(out) < n and not (out and out[-1] in eos):
            logits = model(input_ids=tok, position_ids=torch.tensor([[pos]]), past_key_values=cache,
                           use_cache=True).logits
            tok = logits[:, -1:].argmax(-1)
            out.append(int(tok))
            pos += 1
    assert cache.layers[0].held < ids.shape[1] - 1 + len(out)  # the prefill really was compressed
    cache.close()
    return out


def test_prefill_eviction_under_speculative_decoding_equals_the_kv_method_alone(micro):
    model, tok, draft = micro
    ids = tok(" ".join(json.__doc__.split()), return_tensors="pt").input_ids[:, :48]
    kv = "snapkv:budget=24:window=8"
    ref = _prefill_then_greedy(model, ids, kv, 40)
    for spec in ("prompt_lookup", "draft"):
        rec = mmaccel.Pipeline(model, tok, kv=kv, speculative=spec, draft=draft).generate(ids, max_new_tokens=40)
        assert rec.output_ids == ref, spec  # the speculative method is lossless over the compressed cache
        assert rec.telemetry["kv"]["kept_tokens_per_layer"][0] == 24 + len(ref)  # no decode slot lost or kept twice
        assert rec.telemetry["accepted"] and max(rec.telemetry["accepted"]) >= 1
    plain = mmaccel.Pipeline(model, tok, kv=kv).generate(ids, max_new_tokens=40)
    assert plain.telemetry["kept_tokens_per_layer"][0] == 24 + len(ref) - 1


def test_pooling_snapkv_and_prompt_lookup_together_on_llava(llava1):
    model, processor, inputs = llava1
    kv = "snapkv:budget=24:window=8"
    with build_vision("pooling:keep_ratio=0.25").apply(model):
        ref = _prefill_then_greedy(model, inputs["input_ids"], kv, N, pixel_values=inputs["pixel_values"])
    pipe = mmaccel.Pipeline(model, processor, vision="pooling:keep_ratio=0.25", kv=kv, speculative="prompt_lookup")
    rec = pipe.generate(inputs, max_new_tokens=N)
    assert rec.output_ids == ref and rec.visual_tokens_kept == 16
    assert rec.telemetry["kv"]["evicted_tokens"] > 0
    _no_hooks_left(model)


def test_lossy_composition_records_every_piece(llava1):
    model, processor, inputs = llava1
    plain = measure_pipeline(mmaccel.Pipeline(model, processor), inputs, max_new_tokens=N)
    pipe = mmaccel.Pipeline(model, processor, vision="pooling:keep_ratio=0.25", kv="full", speculative="prompt_lookup")
    rec = measure_pipeline(pipe, inputs, max_new_tokens=N, repeats=2)
    # speculative decoding is lossless over the reduced model: the output is the vision method's alone
    assert rec.output_ids == _plain(model, inputs, vision="pooling:keep_ratio=0.25")
    assert (rec.visual_tokens, rec.visual_tokens_kept) == (N_IMG, 16)
    assert rec.telemetry["vision"]["tokens_after"] == [16]
    assert rec.vision_encoder_s > 0 and rec.prefill_s > 0 and rec.decode_s > 0
    for s in rec.samples:  # per run: TTFT = vision encoder + the rest of the prefill
        assert s["vision_encoder_s"] + s["prefill_s"] == pytest.approx(s["ttft_s"])
    assert rec.telemetry["mean_accepted_length"] >= 1.0 and rec.telemetry["kv"]["method"] == "full"
    # 48 fewer visual tokens in every layer's K/V
    assert 0 < rec.kv_cache_bytes_final < plain.kv_cache_bytes_final
    assert plain.kv_cache_bytes_final - rec.kv_cache_bytes_final == 48 * plain.kv_cache_bytes_final // (
        plain.prompt_tokens + plain.new_tokens - 1)
    _no_hooks_left(model)


def test_lossy_kv_under_in_llm_pruning_equals_the_two_applied_by_hand(llava1):
    model, processor, inputs = llava1
    vision, kv = "fastv:keep_ratio=0.25:layer=2", "snapkv:budget=24:window=8"
    rec = measure_pipeline(mmaccel.Pipeline(model, processor, vision=vision, kv=kv), inputs, max_new_tokens=N)
    assert rec.output_ids == _plain(model, inputs, vision=vision, kv=kv)
    assert rec.visual_tokens_kept == 16 and rec.telemetry["evicted_tokens"] > 0
    assert rec.kv_cache_bytes_prefill is not None and rec.vision_encoder_s > 0


def test_compare_pieces_runs_each_piece_alone_and_all_together(llava1, tmp_path):
    model, processor, inputs = llava1
    pipe = mmaccel.Pipeline(model, processor, vision="pooling:keep_ratio=0.25", kv="full", speculative="prompt_lookup")
    comp = compare_pieces(pipe, inputs, max_new_tokens=N, warmup=0)
    labels = [r.method for r in comp.records]
    assert labels == ["plain", "vision=pooling:keep_ratio=0.25", "kv=full", "speculative=prompt_lookup", pipe.label]
    assert all(r.ok for r in comp.records)
    plain, vision, kv, spec, both = comp.records
    assert plain.output_ids == kv.output_ids == spec.output_ids and vision.output_ids == both.output_ids
    fig = comp.plot(path=tmp_path / "pieces.png")
    names = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert names[:3] == ["TTFT (s)", "vision encoder (s)", "prefill (s)"] and len(fig.axes[0].containers) == 5
    assert (tmp_path / "pieces.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------------ (c) errors
@pytest.mark.parametrize("kwargs,match", [
    ({"vision": "nope"}, r"unknown visual-token method 'nope'; visual-token methods: aim, atp, fastv, pooling"),
    ({"kv": "prompt_lookup"}, r"'prompt_lookup' is a speculative method: pass it as speculative='prompt_lookup'"),
    ({"speculative": "snapkv:budget=64"}, r"'snapkv' is a kv method: pass it as kv='snapkv'"),
    ({"vision": "snapkv"}, r"pass it as kv='snapkv'"),
    ({"vision": "pooling:keep_ratio=2"}, r"keep_ratio must be in \(0, 1\]"),
    ({"vision": 3}, r"vision must be a visual-token spec"),
    ({"kv": "h2o:budget=64", "speculative": "prompt_lookup"},
     r"kv='h2o' conflicts with speculative='prompt_lookup': speculative decoding crops the cache"),
    ({"kv": "quest", "speculative": "jacobi"}, r"kv='quest' conflicts with speculative='jacobi'"),
    ({"vision": "fastv:keep_ratio=0.5", "speculative": "prompt_lookup"},
     r"vision='fastv' conflicts with speculative='prompt_lookup': fastv picks visual tokens"),
    ({"vision": "pooling:keep_ratio=0.5", "speculative": "hf_prompt_lookup"},
     r"vision='pooling' conflicts with speculative='hf_prompt_lookup'.*absolute sequence lengths"),
    ({"kv": "streaming:window=16", "speculative": "hf_prompt_lookup"},
     r"kv='streaming' conflicts with speculative='hf_prompt_lookup'"),
    ({"vision": "fastv:keep_ratio=0.5", "kv": "chunked:chunk=8"},
     r"vision='fastv' conflicts with chunked prefill: fastv prunes visual tokens inside"),
    ({"vision": "progressive:layers=1,3:keep_ratio=0.25", "kv": "chunked:chunk=8"},
     r"vision='progressive' conflicts with chunked prefill"),
])
def test_bad_specs_and_conflicts_are_one_clear_error(llava1, kwargs, match):
    model, processor, _ = llava1
    with pytest.raises(ValueError, match=match):
        mmaccel.Pipeline(model, processor, **kwargs)
    _no_hooks_left(model)


def test_bad_inputs_are_one_clear_error(llava1):
    model, processor, inputs = llava1
    text_llm = tiny_llama(layers=2, vocab_size=128)
    with pytest.raises(UnsupportedModelError, match="Pooling does not support LlamaForCausalLM"):
        mmaccel.Pipeline(text_llm, None, vision="pooling:keep_ratio=0.5")
    pipe = mmaccel.Pipeline(model, processor, vision="pooling:keep_ratio=0.5", speculative="prompt_lookup")
    with pytest.raises(ValueError, match="needs image or video inputs; pass the processor's output"):
        pipe.generate(inputs["input_ids"], max_new_tokens=2)
    ends_on_image = processor(images=_images(1), text=["what is this? <image>"], return_tensors="pt")
    with pytest.raises(ValueError, match="the prompt must end with text after the image"):
        pipe.generate(ends_on_image, max_new_tokens=2)
    with pytest.raises(ValueError, match="images need a processor"):
        mmaccel.Pipeline(text_llm, None).generate("hi", images=_images(1))
    _no_hooks_left(model)


def test_engine_refuses_a_cache_it_cannot_roll_back():
    model = tiny_llama(layers=2, vocab_size=128)
    ids = random_prompt(8)
    with pytest.raises(ValueError, match="cannot be cropped; use a DynamicCache"):
        speculative_generate(model, ids, PromptLookup(), max_new_tokens=2,
                             cache=build_kv("streaming:window=4:sink=1").make_cache(model))
    full = build_kv("full").make_cache(model)
    out = speculative_generate(model, ids, PromptLookup(), max_new_tokens=2, cache=full)
    assert full.get_seq_length() == out.sequences.shape[1] - 1  # the caller's cache is the engine's
    with pytest.raises(ValueError, match="needs an empty cache"):
        speculative_generate(model, ids, PromptLookup(), max_new_tokens=2, cache=full)


# ------------------------------------------------------------------------------------------------ Comparison.plot
def _tiny_comparison():
    model = tiny_llama(layers=2, vocab_size=128)
    return compare(model, None, random_prompt(24), ["full", "streaming:window=8:sink=2"], max_new_tokens=6, warmup=0)


def test_comparison_plot_draws_one_bar_group_per_metric_and_writes_a_png(tmp_path):
    comp = _tiny_comparison()
    fig = comp.plot()
    from matplotlib.figure import Figure

    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    names = [t.get_text() for t in ax.get_xticklabels()]
    assert names == ["TTFT (s)", "decode time (s)", "tokens/s", "peak memory (MiB)", "KV at end (MiB)"] or \
        names == ["TTFT (s)", "decode time (s)", "tokens/s", "KV at end (MiB)"]  # RSS growth can read 0 on the CPU
    assert len(ax.containers) == 2 and all(len(c) == len(names) for c in ax.containers)
    first = [bar.get_height() for bar in ax.containers[0]]
    assert first == pytest.approx([1.0] * len(names))  # the reference column is 1.0 everywhere
    kv = names.index("KV at end (MiB)")
    assert ax.containers[1][kv].get_height() < 0.5  # the window keeps 8 of 29 tokens (MiB rounded to 3 places)
    assert ax.containers[1][kv].get_height() == pytest.approx(comp.kv_ratio(comp.records[1]), rel=0.1)
    path = tmp_path / "sub" / "ratios.png"
    assert comp.plot(path=path) is not None and path.read_bytes()[:4] == b"\x89PNG"


def test_the_app_draws_the_same_ratio_plot():
    pytest.importorskip("gradio")
    from mmaccel.apps.workbench import ColumnResult, ratio_figure, record_rows

    comp = _tiny_comparison()
    results = [ColumnResult(rows=record_rows(r), record=r) for r in comp.records]
    app_ax, api_ax = ratio_figure([r.method for r in comp.records], results).axes[0], comp.plot().axes[0]
    assert [t.get_text() for t in app_ax.get_xticklabels()] == [t.get_text() for t in api_ax.get_xticklabels()]
    assert [[b.get_height() for b in c] for c in app_ax.containers] == \
        [[b.get_height() for b in c] for c in api_ax.containers]


def test_comparison_niah_plot_and_errors(tmp_path):
    records = [RunRecord(method=m, method_name=m.split(":")[0], new_tokens=2, ttft_s=0.1, decode_s=0.1,
                         extra={"length": n, "depth": d, "correct": ok})
               for m, ok in (("full", True), ("streaming:window=8", False)) for n in (64, 128) for d in (0.0, 1.0)]
    comp = Comparison(records=records)
    fig = comp.plot(kind="niah", path=tmp_path / "niah.png")
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert set(panels) == {"NIAH accuracy: full", "NIAH accuracy: streaming:window=8"}
    assert (tmp_path / "niah.png").exists()
    # each panel is the depth x length accuracy grid of its method
    assert panels["NIAH accuracy: full"].images[0].get_array().tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert panels["NIAH accuracy: streaming:window=8"].images[0].get_array().tolist() == [[0.0, 0.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match="unknown plot kind 'pie'; choose 'ratios' or 'niah'"):
        comp.plot(kind="pie")
    with pytest.raises(ValueError, match="NIAH heatmaps need records of NIAH prompts"):
        Comparison(records=[RunRecord(method="full")]).plot(kind="niah")
    with pytest.raises(ValueError, match="a ratio plot needs at least two successful records"):
        Comparison(records=[RunRecord(method="full", ttft_s=1.0), RunRecord(method="x", status="failed")]).plot()
