"""Screenshots of the workbench on real checkpoints, for the README: ``python -m mmaccel.apps.screenshots``.

Launches the app (:func:`mmaccel.apps.workbench.build_app`) on the given models, drives it with Playwright and Debian's
chromium (never ``playwright install``), runs a two- or three-column comparison in the Generation, Long context and
Image & video QA tabs, and saves one PNG per tab. It checks the same things as ``tests/test_app_browser.py`` (outputs
and metrics tables appear) and fails loudly otherwise, so a screenshot never shows an empty or failed run.

Usage::

    python -m mmaccel.apps.screenshots --model smollm2-135m --vlm-model smol-llava --threads 2 --out assets/app

On 2 CPU cores the three tabs take a few minutes (the real models run every column after a warm-up).
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
from pathlib import Path

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
"""Flags for a headless chromium on a machine without a display, GPU or network."""


def _fill(page, elem_id: str, text: str) -> None:
    """Type ``text`` into the textbox or number field ``#elem_id`` and commit it (Gradio fires ``.change``)."""
    box = page.locator(f"#{elem_id} textarea, #{elem_id} input").first
    box.fill(text)
    box.press("Tab")


def _numeric_metrics(page, elem_id: str) -> None:
    """Raise ``RuntimeError`` unless ``#elem_id`` (a metrics table) holds a decimal number."""
    text = page.locator(f"#{elem_id}").inner_text()
    if not re.search(r"\d+\.\d+", text):
        raise RuntimeError(f"#{elem_id} shows no numbers: {text[:200]!r}")


def _run_and_shoot(page, expect, prefix: str, columns: int, path: Path) -> Path:
    """Press ``#{prefix}-run``, wait for the status and every column's output and numeric metrics, scroll to the
    ratio plot and save a full-page PNG at ``path``; returns ``path``."""
    page.locator(f"#{prefix}-run").click()
    expect(page.locator(f"#{prefix}-status")).to_contain_text("one after another")
    for i in range(columns):
        expect(page.locator(f"#{prefix}-col{i}-output .mm-output")).to_be_visible()
        _numeric_metrics(page, f"{prefix}-col{i}-metrics")
    page.locator(f"#{prefix}-plot").scroll_into_view_if_needed()
    page.screenshot(path=str(path), full_page=True)
    return path


def generation(page, expect, out: Path, prompt: str) -> Path:
    """Generation tab: the autoregressive baseline and prompt lookup on ``prompt``; returns the PNG's path."""
    page.get_by_role("tab", name="Generation", exact=True).click()
    _fill(page, "gen-prompt", prompt)
    _fill(page, "gen-max-new", "48")
    path = _run_and_shoot(page, expect, "gen", 2, out / "generation.png")
    expect(page.locator("#gen-col1-output .mm-accepted").first).to_be_visible()
    return path


def longctx(page, expect, out: Path) -> Path:
    """Long context tab: a generated NIAH document, full attention vs SnapKV; returns the PNG's path."""
    page.get_by_role("tab", name="Long context", exact=True).click()
    page.locator("#lc-gen-doc").click()
    expect(page.locator("#lc-expected input, #lc-expected textarea").first).to_have_value(re.compile(r"^\d{5}$"))
    _fill(page, "lc-max-new", "20")
    return _run_and_shoot(page, expect, "lc", 2, out / "longctx.png")


def vlm_qa(page, expect, out: Path, columns: int = 3) -> Path:
    """Image & video QA tab: a generated scene, ``columns`` composed configurations; returns the PNG's path."""
    page.get_by_role("tab", name="Image & video QA", exact=True).click()
    page.locator("#vqa-ncols").get_by_label(str(columns)).check()
    if columns >= 3:  # the composed column: pooling + SnapKV + prompt lookup (the tab's default, at a milder KV ratio)
        _fill(page, "vqa-col2-kv", "snapkv:ratio=0.75")
    return _run_and_shoot(page, expect, "vqa", columns, out / "vlm_qa.png")


TABS = {"generation": generation, "longctx": longctx, "vlm_qa": vlm_qa}
"""The tabs this script can photograph, by name."""


def main(argv=None) -> int:
    """Launch the app on real models, photograph the chosen tabs, print the paths; returns the exit status.

    Raises
    ------
    SystemExit
        Without playwright or chromium (with the install command), or when a tab's run shows no output.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="text model (zoo name or local checkpoint)")
    p.add_argument("--vlm-model", default="smol-llava", help="vision-language model of the Image & video QA tab")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tabs", nargs="+", default=list(TABS), choices=list(TABS))
    p.add_argument("--niah-length", type=int, default=1024, help="tokens of the generated NIAH document")
    p.add_argument("--prompt", default="Repeat this sentence exactly: The quick brown fox jumps over the lazy dog "
                                       "near the quiet river bank.", help="the Generation tab's prompt")
    p.add_argument("--out", type=Path, default=Path("assets/app"))
    p.add_argument("--timeout-s", type=float, default=600.0, help="how long one tab's run may take")
    args = p.parse_args(argv)
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        raise SystemExit("needs playwright: pip install playwright (then apt-get install -y chromium; never "
                         "`playwright install`)") from None
    if not Path(chromium).exists():
        raise SystemExit("needs Debian's chromium: apt-get install -y chromium")
    import torch

    from .workbench import build_app

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    demo = build_app(args.model, vlm_model=args.vlm_model, device=args.device, niah_length=args.niah_length)
    demo.launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True, quiet=True)
    expect.set_options(timeout=args.timeout_s * 1000)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(args.timeout_s * 1000)
            page.goto(demo.local_url)
            for name in args.tabs:
                t0 = time.perf_counter()
                kwargs = {"prompt": args.prompt} if name == "generation" else {}
                try:
                    path = TABS[name](page, expect, args.out, **kwargs)
                except Exception:
                    page.screenshot(path=str(args.out / f"{name}_failed.png"), full_page=True)
                    raise
                print(f"{name}: {path} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
            browser.close()
    finally:
        demo.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
