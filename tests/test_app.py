"""The Gradio workbench (apps/) through gradio_client: every tab's endpoint on micro-lm (the Image & video tab on a tiny
random Dinov2, the Vision sweep tab on a tiny random LLaVA, both saved to a temp folder), the generated forms, token
streaming, and errors that stay in their column while the app keeps serving."""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import types
from pathlib import Path

import pytest

gr = pytest.importorskip("gradio", reason="the app needs the `app` extra: pip install -e '.[app]'")
gradio_client = pytest.importorskip("gradio_client")

from app_serving import launch_local
from mmaccel.apps import forms
from mmaccel.apps.tabs import TABS
from mmaccel.apps.workbench import build_app

from mmaccel.longctx import METHODS as KV_METHODS
from mmaccel.longctx import build_method
from mmaccel.specs import accepted_keys
from mmaccel.speculative import METHODS as DRAFTERS
from mmaccel.vision_tokens import METHODS as VISION_METHODS

pytestmark = pytest.mark.usefixtures("one_thread")


def small_haystack(path: Path) -> Path:
    """A small NIAH haystack (building the default stdlib prose takes ~10-20 s): module docstrings, digits removed."""
    text = " ".join(m.__doc__ for m in (argparse, json, inspect, re))
    path.write_text(re.sub(r"\d", "", " ".join(text.split())), encoding="utf-8")
    return path


def save_tiny_vision_encoder(path: Path, image_size: int = 56, patch_size: int = 7) -> str:
    """A tiny random Dinov2 (hidden 32, 4 blocks; by default 56 px at patch 7: [CLS] + 8 x 8 patches) and its image
    processor (resize, centre crop to ``image_size``), saved as a local checkpoint folder that ``mmaccel.load`` reads
    (CI has no fetched ``dinov2-small``)."""
    import torch
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    config = Dinov2Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                          image_size=image_size, patch_size=patch_size)
    Dinov2Model(config).eval().save_pretrained(path)
    side = {"height": image_size, "width": image_size}
    BitImageProcessor(size={"shortest_edge": image_size * 8 // 7}, crop_size=side,
                      image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]).save_pretrained(path)
    return str(path)


def save_tiny_vlm(path: Path) -> str:
    """A tiny random LLaVA composed by smol-llava's own build (:func:`mmaccel.models.smol_llava.build_llava`) from a
    tiny Dinov2 tower (:func:`save_tiny_vision_encoder`; 56 px at patch 7: 8 x 8 = 64 visual tokens) and a tiny random
    Llama (4 layers, hidden 32) with a word-level ChatML tokenizer over the scene-QA words, saved (model and processor)
    as a local checkpoint folder that ``mmaccel.load`` reads. Its answers are random: the tests check the sweep's
    mechanics (token counts, speed and FLOPs ratios, agreement), not its accuracy."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from mmaccel.data.scenes import ANSWERS, make_scene_qa
    from mmaccel.models import smol_llava
    from mmaccel.zoo.train.smol_llava import INSTRUCTION

    tower = save_tiny_vision_encoder(path / "vision")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    split = pre_tokenizers.Whitespace()
    texts = [q.question for q in make_scene_qa(40, seed=0)] + [INSTRUCTION, "user assistant", *ANSWERS]
    words = sorted({w for t in texts for w, _ in split.pre_tokenize_str(t)})
    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate([*specials, *words])}, unk_token=specials[0]))
    word_level.pre_tokenizer = split
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token=specials[0], bos_token=specials[1],
                                        eos_token=specials[2], pad_token=specials[2])
    tokenizer.save_pretrained(path / "language")
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
                                      eos_token_id=2, pad_token_id=2))
    lm.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    lm.save_pretrained(path / "language")
    model, processor = smol_llava.build_llava(tower, path / "language", recipe=smol_llava.BuildRecipe(image_size=56))
    model.save_pretrained(path / "vlm")
    processor.save_pretrained(path / "vlm")
    return str(path / "vlm")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The workbench on micro-lm (a tiny Dinov2 in the Image & video tab, a tiny LLaVA in the Vision sweep tab)
    launched on a free local port: ``.demo``, ``.client`` (gradio_client), ``.tmp``, ``.vision_model`` (the tiny
    Dinov2's folder), ``.vlm`` (the tiny LLaVA's folder)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    tmp = tmp_path_factory.mktemp("app")
    vision_model = save_tiny_vision_encoder(tmp / "tiny-dinov2")
    vlm = save_tiny_vlm(tmp / "tiny-llava")
    demo = build_app("micro-lm", vision_model=vision_model, vlm_model=vlm, device="cpu", niah_length=384,
                     haystack=small_haystack(tmp / "hay.txt"), work_dir=tmp / "work", max_upload_mb=0.05)
    launch_local(demo)
    try:
        yield types.SimpleNamespace(client=gradio_client.Client(demo.local_url, verbose=False), tmp=tmp, demo=demo,
                                    vision_model=vision_model, vlm=vlm)
    finally:
        demo.close()
        mp.undo()


def columns(result):
    """``[(html, metrics dict), ...]`` of an endpoint result ``[status, html, table, ..., extra]``."""
    body = result[1:1 + 8]
    return [(body[2 * i], {row[0]: row[1] for row in body[2 * i + 1]["data"]}) for i in range(4)]


def assert_numeric(metrics, keys=("TTFT (s)", "decode time (s)", "tokens/s", "peak memory (MiB)", "KV at end (MiB)")):
    for key in keys:
        assert isinstance(metrics[key], (int, float)), (key, metrics)
        assert metrics[key] >= 0, (key, metrics)


# ------------------------------------------------------------------------------------------------ generated forms
@pytest.mark.parametrize("registry", [KV_METHODS, DRAFTERS, VISION_METHODS], ids=["longctx", "speculative", "vision"])
def test_forms_come_from_the_registry(registry):
    for name in forms.unique_names(registry):
        cls = registry[name]
        fields = forms.method_fields(cls)
        assert {f.name for f in fields} <= set(accepted_keys(cls) or [])
        # every field's default composes back to the bare name, which the registry builds
        assert forms.compose_spec(name, fields, [f.default for f in fields]) == name
    snap = {f.name: f for f in forms.method_fields(KV_METHODS["snapkv"])}
    assert snap["budget"].kind == "int" and snap["budget"].optional
    assert snap["window"].minimum == 1 and snap["window"].help
    assert snap["pooling"].kind == "choice" and snap["pooling"].choices == ["avg", "max"]
    values = [256 if f.name == "budget" else "max" if f.name == "pooling" else f.default for f in snap.values()]
    spec = forms.compose_spec("snapkv", list(snap.values()), values)
    assert spec == "snapkv:budget=256:pooling=max"
    assert build_method(spec).budget == 256


def test_a_new_method_gets_a_form_with_no_app_edit():
    @dataclasses.dataclass
    class NewPolicy:
        """A made-up method.

        Parameters
        ----------
        keep : int
            Tokens kept, >= 2 (default 64).
        mode : {"fast", "slow"}
            How.
        """

        keep: int = 64
        mode: str = "fast"

    fields = forms.method_fields(NewPolicy)
    assert [(f.name, f.kind, f.minimum) for f in fields] == [("keep", "int", 2.0), ("mode", "choice", None)]
    with gr.Blocks():
        from mmaccel.apps.workbench import method_column

        col = method_column("t", 0, {"new": NewPolicy}, "new")
    assert len(col.inputs["new"][1]) == 2


def longctx(client, *specs, model="micro-lm", document="", upload=None, question="", expected="", max_new=6,
            warmup="full input"):
    """Call ``/longctx`` with ``len(specs)`` columns."""
    padded = [*specs, "", "", ""][:4]
    return client.predict(model, document, upload, question, expected, max_new, 1, warmup, len(specs), *padded,
                          api_name="/longctx")


def generation(client, *specs, model="micro-lm", prompt="Once upon a time", max_new=12, draft_tokens=4):
    """Call ``/generation`` with ``len(specs)`` columns."""
    padded = [*specs, "", "", ""][:4]
    return client.predict(model, prompt, max_new, draft_tokens, 1, len(specs), *padded, api_name="/generation")


# ------------------------------------------------------------------------------------------------------ endpoints
def test_longctx_niah_document_and_two_columns(app):
    client = app.client
    document, question, expected = client.predict("micro-lm", 384, 0.5, 0, api_name="/niah_document")
    assert len(document) > 200 and expected.isdigit() and expected not in question
    result = longctx(client, "full", "snapkv:budget=96", document=document, question=question, expected=expected,
                     max_new=8, warmup="short prompt (last 64 tokens)")
    status, cols, plot = result[0], columns(result), result[-1]
    assert "one after another" in status and "warm-up" in status
    for html_out, metrics in cols[:2]:
        assert "mm-output" in html_out and "error" not in html_out
        assert_numeric(metrics)
    assert cols[1][1]["KV at end (MiB)"] < cols[0][1]["KV at end (MiB)"]  # snapkv holds less than full
    assert cols[2] == ("", {"-": None}) and cols[3] == ("", {"-": None})  # hidden columns stay empty
    assert plot is not None and plot.get("type") == "matplotlib"


def test_generation_colours_accepted_draft_tokens(app):
    client = app.client
    prompt = "The secret number of the cat is 12345. The secret number of the dog is"
    result = generation(client, "autoregressive", "draft:model=micro-draft", prompt=prompt)
    (base_html, base), (spec_html, spec) = columns(result)[:2]
    assert_numeric(base)
    assert_numeric(spec)
    assert base["mean accepted length"] == 1.0 and spec["mean accepted length"] >= 1.0
    assert "mm-accepted" not in base_html and "mm-target" in base_html
    assert "mm-accepted" in spec_html  # micro-draft gets some tokens accepted on this prompt
    assert strip_tags(base_html) == strip_tags(spec_html)  # greedy speculative decoding is lossless
    assert "identical" in result[0]
    assert result[-1] is not None  # the ratio plot


def strip_tags(html: str) -> str:
    return re.sub(r"<[^>]+>", "", html)


def test_evaluations_niah_heatmaps(app):
    client = app.client
    result = client.predict("micro-lm", "256", "0.5", 1, 6, 2, "full", "streaming:window=64", "", "",
                            api_name="/niah_eval")
    cols = columns(result)
    images = result[9:13]
    for (_, metrics), image in zip(cols[:2], images[:2]):
        assert isinstance(metrics["accuracy (strict)"], (int, float))
        assert image and Path(image).exists()
    assert cols[1][1]["KV ratio vs full @ 256"] < 1  # the window holds less than full on the same prompts
    assert images[2] is None


def test_kernels_benchmark_ratios(app):
    client = app.client
    status, table, plot = client.predict("128", "256", "32", ["prefill", "decode"], 1, api_name="/kernels")
    assert "speedup" in status
    rows = table["data"]
    assert rows and all(isinstance(r[5], (int, float)) and r[5] > 0 for r in rows)
    assert {r[0] for r in rows} >= {"prefill", "decode"}
    assert plot is not None


# --------------------------------------------------------------------------------------------------------- errors
def test_errors_stay_in_the_column_and_the_app_keeps_serving(app):
    client, tmp = app.client, app.tmp
    handle = gradio_client.handle_file
    binary = tmp / "bad.txt"
    binary.write_bytes(b"\x00\x01\x02 not text" * 10)
    result = longctx(client, "full", "snapkv", upload=handle(str(binary)), question="What?")
    assert all("mm-error" in h and "not a text file" in h for h, _ in columns(result)[:2])

    big = tmp / "big.txt"
    big.write_text("word " * 20_000)  # 100 kB > the 0.05 MiB limit of this app
    result = longctx(client, "full", "snapkv", upload=handle(str(big)), question="What?")
    assert all("mm-error" in h and "limit" in h for h, _ in columns(result)[:2])

    result = longctx(client, "full", "snapkv", model="no-such-model", document="some text", question="What?")
    assert all("mm-error" in h and "unknown model" in h for h, _ in columns(result)[:2])
    result = generation(client, "autoregressive", "jacobi", model="no-such-model")
    assert all("mm-error" in h and "unknown model" in h for h, _ in columns(result)[:2])

    # one bad column: the other still runs
    result = longctx(client, "full", "snapkv:bogus=1", document="A short document. " * 20, question="What is it?",
                     max_new=4)
    (ok_html, ok), (bad_html, _) = columns(result)[:2]
    assert "mm-output" in ok_html and "mm-error" in bad_html and "bogus" in bad_html
    assert_numeric(ok)

    # and a good upload after all that still succeeds
    good = tmp / "good.txt"
    good.write_text("The secret number of the red fox is 48213. " + "Some filler prose here. " * 30)
    result = longctx(client, "full", "streaming:window=32", upload=handle(str(good)),
                     question="What is the secret number of the red fox? The secret number of the red fox is")
    assert "good.txt" in result[0]
    for html_out, metrics in columns(result)[:2]:
        assert "mm-error" not in html_out
        assert_numeric(metrics)


def test_out_of_memory_is_an_error_in_its_column(app, monkeypatch):
    import torch

    import mmaccel.eval.generation as generation_mod

    real = generation_mod._one_run

    def fake(model, method, *args, **kwargs):
        if method.method_name == "snapkv":  # the Composition the measured path runs
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, method, *args, **kwargs)

    monkeypatch.setattr(generation_mod, "_one_run", fake)
    client = app.client
    result = longctx(client, "full", "snapkv", document="A short document. " * 20, question="What is it?", max_new=4)
    (ok_html, ok), (bad_html, _) = columns(result)[:2]
    assert "mm-output" in ok_html and "mm-error" in bad_html and "OutOfMemoryError" in bad_html
    assert_numeric(ok)


ENDPOINTS = ("longctx", "niah_document", "generation", "vlm_qa", "ar_generation", "niah_eval", "vision_sweep",
             "spec_bench", "kernels", "vision")


def test_measured_endpoints_share_one_queue_slot(app):
    fns = {fn.api_name: fn for fn in app.demo.fns.values() if fn.api_name}
    for name in ENDPOINTS:
        assert fns[name].concurrency_limit == 1 and fns[name].concurrency_id == "measured", name
    # every endpoint is measured, and every tab is on the page
    public = {name for name, fn in fns.items() if getattr(fn, "api_visibility", "public") != "private"}
    assert public <= set(ENDPOINTS), public - set(ENDPOINTS)
    config = json.dumps(app.demo.get_config_file())
    for cls in TABS:
        assert f'"tab-{cls.key}"' in config, cls.title


# --------------------------------------------------------------------------------------------------- image & video
VISION_KEYS = ("visual tokens", "visual tokens kept", "vision encoder (s)", "images/s", "throughput ratio to column 1",
               "cosine [CLS]/pooled vs unmodified", "cosine patch mean vs unmodified", "merged patches")
PATCH_PX = 448 // 8  # the tiny Dinov2's 8 x 8 patches in the 448-px overlay


def vision(client, *specs, model, upload=None, sample="astronaut", seed=0, repeats=2):
    """Call ``/vision`` with ``len(specs)`` columns: ``(status, input image, [(html, metrics)] * 4, overlays, plot)``."""
    padded = [*specs, "", "", ""][:4]
    result = client.predict(model, upload, sample, seed, repeats, len(specs), *padded, api_name="/vision")
    status, preview, body, overlays, plot = result[0], result[1], result[2:10], result[10:14], result[14]
    cols = [(body[2 * i], {row[0]: row[1] for row in body[2 * i + 1]["data"]}) for i in range(4)]
    return status, preview, cols, overlays, plot


def patch_changes(a_path, b_path):
    """[8, 8] bool: the patches whose interior (2 px in from the edges, where outlines go) differs between images."""
    import numpy as np
    from PIL import Image

    a = np.asarray(Image.open(a_path).convert("RGB"), dtype=np.int16)
    b = np.asarray(Image.open(b_path).convert("RGB"), dtype=np.int16)
    assert a.shape == b.shape == (448, 448, 3)
    diff = np.abs(a - b).sum(-1).reshape(8, PATCH_PX, 8, PATCH_PX)[:, 2:-2, :, 2:-2]
    return diff.max(axis=(1, 3)) > 0


def test_vision_overlay_and_metrics(app):
    status, preview, cols, overlays, plot = vision(app.client, "none", "tome:keep_ratio=0.5", model=app.vision_model)
    assert "one after another" in status and "warm-up" in status and "8 x 8 patches" in status
    base, tome = cols[0][1], cols[1][1]
    for html_out, metrics in cols[:2]:
        assert "mm-output" in html_out and "mm-error" not in html_out
        for key in VISION_KEYS:
            assert isinstance(metrics[key], (int, float)) and metrics[key] >= 0, (key, metrics)
    assert base["visual tokens"] == base["visual tokens kept"] == 65 and base["merged patches"] == 0
    assert base["throughput ratio to column 1"] == 1.0 and base["cosine [CLS]/pooled vs unmodified"] == 1.0
    assert tome["visual tokens"] == 65 and tome["visual tokens kept"] == 33  # 1 + round(0.5 * 64)
    assert 0.5 < tome["cosine [CLS]/pooled vs unmodified"] <= 1.0 + 1e-6
    assert tome["merged patches"] >= 64 - 32 + 1  # 32 merges leave at least one group of two
    assert cols[2] == ("", {"-": None}) and overlays[2] is None  # hidden columns stay empty
    # the overlays are lossless PNGs of the input as the encoder saw it: unchanged where nothing merged, coloured
    # exactly on the merged patches (the interior of every patch kept alone is untouched)
    assert Path(preview).suffix == Path(overlays[0]).suffix == ".png"
    assert not patch_changes(preview, overlays[0]).any()
    assert int(patch_changes(preview, overlays[1]).sum()) == tome["merged patches"]
    assert plot is not None and plot.get("type") == "matplotlib"


def test_vision_overlay_colours_merged_greys_pruned_and_keeps_the_rest():
    import numpy as np
    from mmaccel.apps.workbench import scaled_view, token_overlay
    from PIL import Image

    rng = np.random.default_rng(0)
    view = Image.fromarray(rng.integers(0, 256, (28, 28, 3), dtype=np.uint8))  # 4 x 4 patches of 7 px
    slots = np.arange(16).reshape(4, 4)
    assert np.array_equal(np.asarray(token_overlay(view, slots)), np.asarray(scaled_view(view)))
    slots[0, 1] = 0  # patches (0, 0) and (0, 1) merged into token 0
    slots[3, 3] = -1  # pruned
    base = np.asarray(scaled_view(view), dtype=np.int16)
    out = np.asarray(token_overlay(view, slots), dtype=np.int16)
    step = base.shape[0] // 4
    assert step * 4 == 448

    def inner(a, r, c):
        return a[r * step + 2: (r + 1) * step - 2, c * step + 2: (c + 1) * step - 2]

    assert (inner(out, 0, 0) != inner(base, 0, 0)).any() and (inner(out, 0, 1) != inner(base, 0, 1)).any()
    grey = inner(out, 3, 3)
    assert (grey[..., 0] == grey[..., 1]).all() and (grey[..., 1] == grey[..., 2]).all()  # no colour left
    assert np.array_equal(inner(out, 2, 2), inner(base, 2, 2))  # kept alone, away from any outline


def test_vision_errors_stay_in_the_column_then_a_good_request(app):
    client, tmp, model = app.client, app.tmp, app.vision_model
    handle = gradio_client.handle_file
    corrupt = tmp / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 20)
    status, _, cols, overlays, plot = vision(client, "none", "tome:r=4", model=model, upload=handle(str(corrupt)))
    assert "error" in status and plot is None and list(overlays[:2]) == [None, None]
    assert all("mm-error" in h and "not a readable image" in h and "corrupt.png" in h for h, _ in cols[:2])

    status, _, cols, _, _ = vision(client, "none", "tome:r=4", model="no-such-model")
    assert all("mm-error" in h and "unknown model" in h for h, _ in cols[:2])
    status, _, cols, _, _ = vision(client, "none", "tome:r=4", model="micro-lm")  # a text model
    assert all("mm-error" in h and "takes no images" in h for h, _ in cols[:2])

    # a pre-LLM method on a plain encoder: an error in its column only, saying where it works
    status, _, cols, overlays, _ = vision(client, "none", "pooling:keep_ratio=0.25", "tome:bogus=1", model=model)
    (ok_html, ok), (bad_html, _), (bogus_html, _) = cols[:3]
    assert "mm-output" in ok_html and overlays[0] is not None and ok["visual tokens kept"] == 65
    assert "mm-error" in bad_html and "does not support Dinov2Model" in bad_html and "projector" in bad_html
    assert "mm-error" in bogus_html and "bogus" in bogus_html and overlays[1] is None

    # and a good upload after all that still succeeds
    import numpy as np
    from PIL import Image

    good = tmp / "good.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 80, 3), dtype=np.uint8)).save(good)
    status, _, cols, overlays, plot = vision(client, "none", "tome:r=4", model=model, upload=handle(str(good)))
    assert "good.png" in status and plot is not None
    for html_out, metrics in cols[:2]:
        assert "mm-error" not in html_out
        assert all(isinstance(metrics[key], (int, float)) for key in VISION_KEYS)
    assert cols[1][1]["visual tokens kept"] == 65 - 4 * 4 and overlays[1] is not None


# ------------------------------------------------------------------------------------------------------ streaming
def without_note(html: str) -> str:
    """The text of a column's output without the streaming note under it."""
    return strip_tags(html.split('<div class="mm-note"')[0])


def test_generation_streams_an_untimed_pass_then_shows_the_measured_run(app):
    prompt = "The secret number of the cat is 12345. The secret number of the dog is"
    job = app.client.submit("micro-lm", prompt, 24, 4, 1, 2, "autoregressive", "draft:model=micro-draft", "", "",
                            api_name="/generation")
    final = job.result()
    streamed = [columns(out)[1] for out in job.outputs() if "untimed pass" in columns(out)[1][0]]
    assert streamed, "column 2 never showed streamed text"
    for html_out, metrics in streamed:
        assert metrics == {"-": None}  # no number comes from the untimed pass
    (base_html, base), (spec_html, spec) = columns(final)[:2]
    assert "untimed pass" not in spec_html and "mm-accepted" in spec_html
    assert without_note(streamed[-1][0]) == strip_tags(spec_html) == strip_tags(base_html)  # greedy: the same text
    assert_numeric(base)
    assert_numeric(spec)
    assert "untimed pass" in final[0] and "identical" in final[0]


def test_token_stream_yields_growing_text_and_stops_its_thread_when_closed():
    import threading

    from mmaccel.apps.streaming import TokenStream

    import mmaccel
    from mmaccel.pipeline import resolve_method

    model, tok = mmaccel.load("micro-lm", device="cpu")
    ids = tok.encode("The secret number of the cat is 12345. The secret number of the cat is")
    method, _ = resolve_method("prompt_lookup:k=4")
    states = list(TokenStream(model, tok, ids, method, max_new_tokens=12, interval=0.0))
    lengths = [len(s.ids) for s in states]
    assert lengths == sorted(lengths) and states[-1].done and states[-1].error is None and lengths[-1] == 12
    assert sum(states[-1].accepted) > 0  # prompt lookup copies the repeated sentence
    stream = iter(TokenStream(model, tok, ids, method, max_new_tokens=12, interval=0.0))
    next(stream)
    stream.close()  # what an abandoned request does: the pass is cancelled and its thread joined
    assert not [t for t in threading.enumerate() if t.name == "mmaccel-token-stream"]


# ----------------------------------------------------------------------------------------------------- spec bench
def spec_bench(client, *specs, model="micro-lm", sets=("free",), prompts=1, max_new=12):
    """Call ``/spec_bench`` with ``len(specs)`` columns: ``(status, [(html, metrics)] * 4, table, plot)``."""
    padded = [*specs, "", "", ""][:4]
    result = client.predict(model, list(sets), prompts, max_new, 1, len(specs), *padded, api_name="/spec_bench")
    return result[0], columns(result), result[9], result[10]


def test_spec_bench_columns_table_and_ratio_plot(app):
    status, cols, table, plot = spec_bench(app.client, "autoregressive", "draft:model=micro-draft", "prompt_lookup")
    assert "autoregressive baseline" in status
    (base_html, base), (draft_html, draft), (_, pld) = cols[:3]
    assert base["speedup vs autoregressive (free)"] == 1.0 and base["tokens per target forward (free)"] == 1.0
    for metrics in (draft, pld):
        for key in ("speedup vs autoregressive (free)", "tokens/s (free)", "tokens per target forward (free)",
                    "mean accepted length (free)", "acceptance rate (free)"):
            assert isinstance(metrics[key], (int, float)) and metrics[key] >= 0, (key, metrics)
        assert metrics["identical to greedy (free)"] == 1.0  # lossless
    assert draft["tokens per target forward (free)"] > 1  # micro-draft's drafts are accepted
    assert "mm-accepted" in draft_html and "mm-accepted" not in base_html
    assert strip_tags(draft_html.split("first prompt:")[1]) == strip_tags(base_html.split("first prompt:")[1])
    assert "| full (autoregressive) | (baseline) |" in table and "| draft:model=micro-draft | yes 1/1 |" in table
    assert plot is not None and plot.get("type") == "matplotlib"


# --------------------------------------------------------------------------------------------------- vision sweep
def vision_sweep(client, *specs, model, budgets="0.5", questions=1, seed=0):
    """Call ``/vision_sweep`` with ``len(specs)`` columns: ``(status, [(html, metrics)] * 4, table, plot)``."""
    padded = [*specs, "", "", ""][:4]
    result = client.predict(model, budgets, questions, seed, len(specs), *padded, api_name="/vision_sweep")
    return result[0], columns(result), result[9], result[10]


def test_vision_sweep_accuracy_and_speed_vs_budget(app):
    status, cols, table, plot = vision_sweep(app.client, "none", "fastv", model=app.vlm, budgets="0.5 0.25")
    assert "1 held-out scene question(s)" in status
    (base_html, base), (fastv_html, fastv) = cols[:2]
    assert "mm-error" not in base_html + fastv_html
    assert base["visual tokens"] == 64 and base["runs ok"] == 1 and 0 <= base["accuracy"] <= 1
    assert fastv["visual tokens kept @ 0.5"] == 32 and fastv["visual tokens kept @ 0.25"] == 16
    for b in ("0.5", "0.25"):
        assert 0 <= fastv[f"accuracy @ {b}"] <= 1 and fastv[f"prefill speedup @ {b}"] > 0
        assert 0 < fastv[f"FLOPs ratio @ {b}"] < 1  # fewer tokens after FastV's layer
        assert 0 <= fastv[f"same as all tokens @ {b}"] <= 1
    assert fastv["FLOPs ratio @ 0.25"] < fastv["FLOPs ratio @ 0.5"]
    assert "| baseline | 1 |" in table and "| pooling | 0.5 |" in table and "| fastv | 0.25 |" in table
    assert Path(plot).suffix == ".png" and Path(plot).stat().st_size > 0


# --------------------------------------------------------------------------------------- errors in every other tab
def test_errors_in_the_other_tabs_stay_in_their_columns(app):
    client, vlm = app.client, app.vlm

    def errors(cols, text, k=2):
        return all("mm-error" in h and text in h for h, _ in cols[:k])

    # an unknown model: every column says so, in every tab that loads one
    assert errors(columns(client.predict("no-such-model", "256", "0.5", 1, 6, 2, "full", "streaming", "", "",
                                         api_name="/niah_eval")), "unknown model")
    assert errors(spec_bench(client, "autoregressive", "prompt_lookup", model="no-such-model")[1], "unknown model")
    assert errors(vision_sweep(client, "none", "fastv", model="no-such-model")[1], "unknown model")
    # bad settings
    assert errors(columns(client.predict("micro-lm", "abc", "0.5", 1, 6, 2, "full", "streaming", "", "",
                                         api_name="/niah_eval")), "bad sweep")
    assert errors(vision_sweep(client, "none", "fastv", model=vlm, budgets="2")[1], "(0, 1]")
    assert errors(vision_sweep(client, "none", "fastv", model="micro-lm")[1], "vision-language model")
    assert errors(spec_bench(client, "autoregressive", "prompt_lookup", sets=())[1], "prompt set")
    status, table, plot = client.predict("-5", "256", "32", ["prefill"], 1, api_name="/kernels")
    assert status.startswith("**error**") and "whole numbers" in status and table["data"] == [] and plot is None
    # a bad column next to good ones: only that column fails
    result = generation(client, "autoregressive", "jacobi:bogus=1", max_new=6)
    (ok_html, ok), (bad_html, _) = columns(result)[:2]
    assert "mm-error" not in ok_html and "mm-error" in bad_html and "bogus" in bad_html
    assert_numeric(ok)
    _, cols, table, _ = spec_bench(client, "prompt_lookup:bogus=1", "jacobi", max_new=8)
    assert "mm-error" in cols[0][0] and "bogus" in cols[0][0] and "mm-error" not in cols[1][0]
    assert isinstance(cols[1][1]["speedup vs autoregressive (free)"], float) and "jacobi" in table
    _, cols, table, plot = vision_sweep(client, "fastv:keep_ratio=0.5", "fastv", model=vlm)
    assert "mm-error" in cols[0][0] and "sets keep_ratio" in cols[0][0]
    assert cols[1][1]["visual tokens kept @ 0.5"] == 32 and plot
    # and the next requests still succeed
    status, table, plot = client.predict("128", "256", "32", ["prefill"], 1, api_name="/kernels")
    assert "speedup" in status and table["data"] and plot is not None


# ---------------------------------------------------------------------------------------------------------- CLI
def test_mmaccel_app_builds_the_workbench_and_launches_it(monkeypatch):
    """``mmaccel app ARGS`` runs ``mmaccel.apps.workbench.main(ARGS)``: the flags reach ``build_app`` and ``launch``."""
    import torch
    from mmaccel.apps import workbench

    from mmaccel.cli import main

    launched = {}
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **kw: launched.update(kw, blocks=self))
    threads = torch.get_num_threads()
    try:
        assert main(["app", "--model", "micro-lm", "--vlm-model", "/no/such/vlm", "--port", "7999",
                     "--max-upload-mb", "1", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert launched["server_port"] == 7999 and launched["server_name"] == "127.0.0.1"
    assert launched["max_file_size"] == 2 * 2**20
    config = json.dumps(launched["blocks"].get_config_file())
    assert "/no/such/vlm" in config and all(f'"tab-{cls.key}"' in config for cls in TABS)
    assert workbench.build_parser().parse_args([]).vlm_model == "smol-llava"
