"""The Gradio workbench (apps/workbench.py) through gradio_client: every tab's endpoint on micro-lm, the generated
forms, and errors that stay in their column while the app keeps serving."""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
import types
from pathlib import Path

import pytest

gr = pytest.importorskip("gradio", reason="the app needs the `app` extra: pip install -e '.[app]'")
gradio_client = pytest.importorskip("gradio_client")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` without `python -m` does not put the repo root on sys.path
    sys.path.insert(0, str(ROOT))

from apps import forms
from apps.workbench import build_app
from mmaccel.longctx import METHODS as KV_METHODS
from mmaccel.longctx import build_method
from mmaccel.specs import accepted_keys
from mmaccel.speculative import METHODS as DRAFTERS

pytestmark = pytest.mark.usefixtures("one_thread")


def small_haystack(path: Path) -> Path:
    """A small NIAH haystack (building the default stdlib prose takes ~10-20 s): module docstrings, digits removed."""
    text = " ".join(m.__doc__ for m in (argparse, json, inspect, re))
    path.write_text(re.sub(r"\d", "", " ".join(text.split())), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The workbench on micro-lm launched on a free local port: ``.demo``, ``.client`` (gradio_client), ``.tmp``."""
    mp = pytest.MonkeyPatch()
    mp.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    tmp = tmp_path_factory.mktemp("app")
    demo = build_app("micro-lm", device="cpu", niah_length=384, haystack=small_haystack(tmp / "hay.txt"),
                     work_dir=tmp / "work", max_upload_mb=0.05)
    demo.launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True, quiet=True)
    try:
        yield types.SimpleNamespace(client=gradio_client.Client(demo.local_url, verbose=False), tmp=tmp, demo=demo)
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
@pytest.mark.parametrize("registry", [KV_METHODS, DRAFTERS], ids=["longctx", "speculative"])
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
        from apps.workbench import method_column

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
        if getattr(method, "name", None) == "snapkv":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, method, *args, **kwargs)

    monkeypatch.setattr(generation_mod, "_one_run", fake)
    client = app.client
    result = longctx(client, "full", "snapkv", document="A short document. " * 20, question="What is it?", max_new=4)
    (ok_html, ok), (bad_html, _) = columns(result)[:2]
    assert "mm-output" in ok_html and "mm-error" in bad_html and "OutOfMemoryError" in bad_html
    assert_numeric(ok)


def test_measured_endpoints_share_one_queue_slot(app):
    fns = {fn.api_name: fn for fn in app.demo.fns.values() if fn.api_name}
    for name in ("longctx", "niah_document", "generation", "niah_eval", "kernels"):
        assert fns[name].concurrency_limit == 1 and fns[name].concurrency_id == "measured", name
