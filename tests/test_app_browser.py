"""The workbench in a real browser: Debian's chromium driven by Playwright (never `playwright install`).

Loads the page, runs a two-column comparison in every tab -- Long context, Generation, Image & video QA (a tiny
random LLaVA, one column composed with SnapKV and prompt lookup), Image & video generation (micro-ar), Evaluations,
Vision sweep (on a tiny random LLaVA), Spec bench, Kernels and Vision encoder (on a tiny random Dinov2 at 224 px,
16 x 16 patches) --,
checks that outputs, metrics tables, accepted-token colouring, overlays, tables and plots appear, and saves screenshots
under runs/screenshots/.
"""
from __future__ import annotations

import argparse
import inspect
import re
import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytest.importorskip("gradio", reason="the app needs the `app` extra: pip install -e '.[app]'")
pytest.importorskip("playwright", reason="the browser test needs `pip install playwright` (no `playwright install`)")
if not Path(CHROMIUM).exists():
    pytest.skip("the browser test needs Debian's chromium: apt-get install -y chromium", allow_module_level=True)

from playwright.sync_api import expect, sync_playwright

ROOT = Path(__file__).resolve().parents[1]

from app_serving import launch_local
from mmaccel.apps.workbench import build_app
from test_app import save_tiny_vision_encoder, save_tiny_vlm

SHOTS = ROOT / "runs" / "screenshots"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 60_000
expect.set_options(timeout=TIMEOUT_MS)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """A chromium page on the workbench (micro-lm, a small NIAH haystack, a tiny Dinov2 in the Image & video tab, a
    tiny LLaVA in the Vision sweep tab)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    tmp = tmp_path_factory.mktemp("browser")
    hay = tmp / "hay.txt"
    hay.write_text(re.sub(r"\d", "", " ".join(" ".join(m.__doc__ for m in (argparse, inspect, re)).split())))
    vision_model = save_tiny_vision_encoder(tmp / "tiny-dinov2", image_size=224, patch_size=14)
    demo = build_app("micro-lm", vision_model=vision_model, vlm_model=save_tiny_vlm(tmp / "tiny-llava"), device="cpu",
                     niah_length=384, haystack=hay, work_dir=tmp / "work")
    launch_local(demo)
    SHOTS.mkdir(parents=True, exist_ok=True)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
            pg = browser.new_page(viewport={"width": 1400, "height": 1000})
            pg.set_default_timeout(TIMEOUT_MS)
            pg.goto(demo.local_url)
            expect(pg.locator("#lc-run")).to_be_visible()
            yield pg
            browser.close()
    finally:
        demo.close()
        mp.undo()


def fill(page, elem_id: str, text: str) -> None:
    box = page.locator(f"#{elem_id} textarea, #{elem_id} input").first
    box.fill(text)
    box.press("Tab")  # commits the value: Gradio fires .change


def expect_column(page, tab: str, i: int) -> None:
    expect(page.locator(f"#{tab}-col{i}-output .mm-output")).to_be_visible()
    table = page.locator(f"#{tab}-col{i}-metrics")
    expect(table).to_contain_text("TTFT (s)")
    expect(table).to_contain_text("tokens/s")
    assert re.search(r"\d+\.\d+", table.inner_text())


def test_long_context_two_columns(page):
    page.get_by_role("tab", name="Long context", exact=True).click()
    expect(page.locator("#fair-timing")).to_contain_text("concurrency 1")
    page.locator("#lc-gen-doc").click()
    expect(page.locator("#lc-expected input, #lc-expected textarea").first).to_have_value(re.compile(r"^\d{5}$"))
    # the generated form: setting column 2's budget recomposes its spec
    fill(page, "lc-max-new", "8")
    fill(page, "lc-col1-snapkv-budget", "96")
    expect(page.locator("#lc-col1-spec textarea, #lc-col1-spec input").first).to_have_value("snapkv:budget=96")
    page.locator("#lc-run").click()
    expect(page.locator("#lc-status")).to_contain_text("one after another")
    for i in range(2):
        expect_column(page, "lc", i)
    expect(page.locator("#lc-plot img, #lc-plot svg, #lc-plot canvas").first).to_be_visible()
    page.locator("#lc-plot").scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / "longctx.png"), full_page=True)


def test_generation_two_columns_coloured(page):
    page.get_by_role("tab", name="Generation", exact=True).click()
    fill(page, "gen-max-new", "24")
    page.locator("#gen-run").click()
    expect(page.locator("#gen-status")).to_contain_text("one after another")
    for i in range(2):
        expect_column(page, "gen", i)
    expect(page.locator("#gen-col1-output .mm-accepted").first).to_be_visible()  # prompt lookup's accepted drafts
    expect(page.locator("#gen-col1-output")).not_to_contain_text("untimed pass")  # the measured run replaced the stream
    expect(page.locator("#gen-plot img, #gen-plot svg, #gen-plot canvas").first).to_be_visible()
    page.screenshot(path=str(SHOTS / "generation.png"), full_page=True)


def test_image_qa_two_columns_composed(page):
    page.get_by_role("tab", name="Image & video QA", exact=True).click()
    fill(page, "vqa-max-new", "6")
    fill(page, "vqa-repeats", "1")
    # column 2: pooling (its default) with a KV policy and speculative decoding composed on it
    fill(page, "vqa-col1-kv", "snapkv:ratio=0.5")
    fill(page, "vqa-col1-speculative", "prompt_lookup")
    page.locator("#vqa-run").click()
    expect(page.locator("#vqa-status")).to_contain_text("one after another")
    expect_image_drawn(page, "vqa-input")
    for i in range(2):
        expect(page.locator(f"#vqa-col{i}-output .mm-output")).to_be_visible()
        expect_image_drawn(page, f"vqa-col{i}-image")  # the kept / merged visual tokens over the image
        table = page.locator(f"#vqa-col{i}-metrics")
        expect(table).to_contain_text("visual tokens kept")
        assert re.search(r"\d+\.\d+", table.inner_text())
    expect(page.locator("#vqa-plot img, #vqa-plot svg, #vqa-plot canvas").first).to_be_visible()
    page.screenshot(path=str(SHOTS / "vlm_qa.png"), full_page=True)


def test_image_generation_two_columns(page):
    page.get_by_role("tab", name="Image & video generation", exact=True).click()
    fill(page, "argen-repeats", "1")
    page.locator("#argen-run").click()
    expect(page.locator("#argen-status")).to_contain_text("one after another")
    for i in range(2):
        expect_image_drawn(page, f"argen-col{i}-image")  # the generated picture
        table = page.locator(f"#argen-col{i}-metrics")
        expect(table).to_contain_text("target forwards")
        assert re.search(r"\d+\.\d+", table.inner_text())
    expect(page.locator("#argen-plot img, #argen-plot svg, #argen-plot canvas").first).to_be_visible()
    page.screenshot(path=str(SHOTS / "ar_generation.png"), full_page=True)


def test_evaluations_two_columns(page):
    page.get_by_role("tab", name="Evaluations", exact=True).click()
    fill(page, "ev-lengths", "256")
    fill(page, "ev-depths", "0 1")
    fill(page, "ev-max-new", "6")
    fill(page, "ev-col1-snapkv-budget", "64")
    page.locator("#ev-run").click()
    expect(page.locator("#ev-status")).to_contain_text("NIAH:")
    for i in range(2):
        expect(page.locator(f"#ev-col{i}-heatmap img")).to_be_visible()
        expect(page.locator(f"#ev-col{i}-metrics")).to_contain_text("accuracy (strict)")
    page.screenshot(path=str(SHOTS / "evaluations.png"), full_page=True)


def test_vision_sweep_two_columns(page):
    page.get_by_role("tab", name="Vision sweep", exact=True).click()
    fill(page, "vs-budgets", "0.5 0.25")
    fill(page, "vs-questions", "1")
    page.locator("#vs-run").click()
    # 10 measured runs and 5 warm-ups of a tiny LLaVA: seconds on a quiet machine, minutes on a loaded one
    expect(page.locator("#vs-status")).to_contain_text("held-out scene question", timeout=4 * TIMEOUT_MS)
    for i in range(2):
        expect(page.locator(f"#vs-col{i}-output .mm-output")).to_be_visible()
        expect(page.locator(f"#vs-col{i}-metrics")).to_contain_text("accuracy")
    expect(page.locator("#vs-col1-metrics")).to_contain_text("FLOPs ratio @ 0.25")
    expect(page.locator("#vs-table")).to_contain_text("pooling")
    expect_image_drawn(page, "vs-plot")
    page.screenshot(path=str(SHOTS / "vision_sweep.png"), full_page=True)


def test_spec_bench_two_columns(page):
    page.get_by_role("tab", name="Spec bench", exact=True).click()
    page.locator("#sb-sets").get_by_label("free").check()  # free prompts: the copy set first parses the stdlib
    page.locator("#sb-sets").get_by_label("copy").uncheck()
    fill(page, "sb-max-new", "24")
    fill(page, "sb-col1-spec", "draft:model=micro-draft")
    page.locator("#sb-run").click()
    expect(page.locator("#sb-status")).to_contain_text("Spec-bench:")
    for i in range(2):
        expect(page.locator(f"#sb-col{i}-output .mm-output").first).to_be_visible()
        table = page.locator(f"#sb-col{i}-metrics")
        expect(table).to_contain_text("speedup vs autoregressive (free)")
        text = table.inner_text()  # measured numbers at 3 significant digits: "1", "249" or "0.87"
        speedup = re.search(r"speedup vs autoregressive \(free\)\s+(\d+(?:\.\d+)?)", text)
        rate = re.search(r"tokens/s \(free\)\s+(\d+(?:\.\d+)?)", text)
        assert speedup and float(speedup.group(1)) > 0 and rate and float(rate.group(1)) > 0, text
    expect(page.locator("#sb-col1-output .mm-accepted").first).to_be_visible()  # micro-draft's accepted drafts
    expect(page.locator("#sb-table")).to_contain_text("identical to greedy")
    expect(page.locator("#sb-plot img, #sb-plot svg, #sb-plot canvas").first).to_be_visible()
    page.locator("#sb-plot").scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / "specbench.png"), full_page=True)


def test_kernels_two_columns(page):
    page.get_by_role("tab", name="Kernels", exact=True).click()
    fill(page, "kb-lengths", "128")
    fill(page, "kb-cache", "256")
    fill(page, "kb-budgets", "32")
    fill(page, "kb-repeats", "1")
    page.locator("#kb-run").click()
    expect(page.locator("#kb-status")).to_contain_text("speedup")
    expect(page.locator("#kb-plot img, #kb-plot svg, #kb-plot canvas").first).to_be_visible()
    page.screenshot(path=str(SHOTS / "kernels.png"), full_page=True)


def expect_image_drawn(page, elem_id: str) -> None:
    """The image in ``#elem_id`` is on screen and decoded (Gradio's images load lazily, off screen)."""
    img = page.locator(f"#{elem_id} img").first
    img.scroll_into_view_if_needed()
    expect(img).to_be_visible()
    page.wait_for_function("id => { const i = document.querySelector(`#${id} img`); "
                           "return i && i.complete && i.naturalWidth > 0; }", arg=elem_id)


def test_image_two_columns_with_the_token_overlay(page):
    page.get_by_role("tab", name="Vision encoder", exact=True).click()
    expect(page.locator("#vis-about")).to_contain_text("Image & video QA tab")
    # the generated ToMe form starts at keep_ratio 0.5; setting it recomposes the spec
    fill(page, "vis-col1-tome-keep_ratio", "0.25")
    expect(page.locator("#vis-col1-spec textarea, #vis-col1-spec input").first).to_have_value("tome:keep_ratio=0.25")
    fill(page, "vis-repeats", "2")
    page.locator("#vis-run").click()
    expect(page.locator("#vis-status")).to_contain_text("one after another")
    expect_image_drawn(page, "vis-input")
    for i in range(2):
        expect(page.locator(f"#vis-col{i}-output .mm-output")).to_be_visible()
        expect_image_drawn(page, f"vis-col{i}-image")
        table = page.locator(f"#vis-col{i}-metrics")
        expect(table).to_contain_text("visual tokens kept")
        expect(table).to_contain_text("cosine [CLS]/pooled vs unmodified")
        assert re.search(r"\d+\.\d+", table.inner_text())
    expect(page.locator("#vis-col1-output")).to_contain_text("257 → 65 tokens")
    expect(page.locator("#vis-plot img, #vis-plot svg, #vis-plot canvas").first).to_be_visible()
    page.screenshot(path=str(SHOTS / "image.png"), full_page=True)
