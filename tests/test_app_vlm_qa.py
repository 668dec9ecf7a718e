"""The Image & video QA tab (``/vlm_qa``) through gradio_client, on a tiny random LLaVA built by smol-llava's own build
(:func:`test_app.save_tiny_vlm`: 8 x 8 = 64 visual tokens per image): composed ``mmaccel.Pipeline`` columns, video
frames, the kept-token overlays, and errors that stay in their columns while the app keeps serving."""
from __future__ import annotations

import re
import types

import pytest

gr = pytest.importorskip("gradio", reason="the app needs the `app` extra: pip install -e '.[app]'")
gradio_client = pytest.importorskip("gradio_client")

from app_serving import launch_local
from mmaccel.apps import workbench
from mmaccel.apps.tabs.vlm_qa import CLIP_QA, SCENE_QA, kept_slots
from test_app import save_tiny_vlm  # tests/ is on sys.path (rootdir conftest)

pytestmark = pytest.mark.usefixtures("one_thread")

VISUAL = 64  # the tiny LLaVA's visual tokens per image
QA_KEYS = ("TTFT (s)", "vision encoder (s)", "prefill (s)", "decode time (s)", "tokens/s", "visual tokens",
           "visual tokens kept", "KV at end (bytes)", "mean accepted length")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The workbench with the tiny LLaVA as its VLM, launched on a free local port: ``.client``, ``.tmp``, ``.vlm``."""
    mp = pytest.MonkeyPatch()
    mp.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    tmp = tmp_path_factory.mktemp("vlm-qa")
    vlm = save_tiny_vlm(tmp / "tiny-llava")
    demo = workbench.build_app("micro-lm", vlm_model=vlm, device="cpu", work_dir=tmp / "work", max_upload_mb=0.5)
    launch_local(demo)
    try:
        yield types.SimpleNamespace(client=gradio_client.Client(demo.local_url, verbose=False), tmp=tmp, vlm=vlm)
    finally:
        demo.close()
        mp.undo()


def vlm_qa(client, *columns, model, image=None, video=None, sample=SCENE_QA, seed=0, question="", frames=2,
           max_new=4, repeats=1):
    """Call ``/vlm_qa`` with one ``(vision, kv, speculative)`` per column: ``(status, preview, [(html, metrics)] * 4,
    overlays, plot)``."""
    cols = [*columns, *[("", "", "")] * 4][:4]
    result = client.predict(model, image, video, sample, seed, question, frames, max_new, repeats, len(columns),
                            *[x for c in cols for x in c], api_name="/vlm_qa")
    status, preview, body, overlays, plot = result[0], result[1], result[2:10], result[10:14], result[14]
    out = [(body[2 * i], {row[0]: row[1] for row in body[2 * i + 1]["data"]}) for i in range(4)]
    return status, preview, out, overlays, plot


def text(html: str) -> str:
    """The answer without its markup (and without the found / expected note)."""
    html = html.split('<div class="mm-note"')[0]
    return re.sub(r"<[^>]+>", "", html)


def assert_answered(col, speculative=False):
    html_out, metrics = col
    assert "mm-output" in html_out and "mm-error" not in html_out, html_out
    for key in QA_KEYS:
        assert isinstance(metrics[key], (int, float)) and metrics[key] >= 0, (key, metrics)
    assert ("mm-accepted" in html_out or metrics["mean accepted length"] >= 1) if speculative else \
        metrics["mean accepted length"] == 1.0


def test_image_qa_pooling_keeps_fewer_tokens(app):
    status, preview, cols, overlays, plot = vlm_qa(app.client, ("none", "", ""), ("pooling:keep_ratio=0.25", "", ""),
                                                   model=app.vlm)
    assert "one after another" in status and "warm-up" in status and "Expected answer" in status
    base, pooled = cols[0][1], cols[1][1]
    for col in cols[:2]:
        assert_answered(col)
    assert base["visual tokens"] == base["visual tokens kept"] == pooled["visual tokens"] == VISUAL
    assert pooled["visual tokens kept"] == VISUAL // 4 < base["visual tokens kept"]
    assert pooled["KV at end (bytes)"] < base["KV at end (bytes)"]  # 48 fewer positions in the cache
    assert cols[2] == ("", {"-": None}) and overlays[2] is None  # hidden columns stay empty
    # the overlays are PNGs of the input as the tower saw it: untouched without a method, 2 x 2 groups when pooled
    import numpy as np
    from PIL import Image

    shown, plain, pooled_overlay = (np.asarray(Image.open(f).convert("RGB")) for f in (preview, *overlays[:2]))
    assert np.array_equal(plain, shown) and not np.array_equal(pooled_overlay, shown)
    assert plot is not None and plot.get("type") == "matplotlib"


def test_composed_column_is_lossless_at_full_settings(app):
    lossless = ("pooling:keep_ratio=1.0", "snapkv:ratio=1.0", "prompt_lookup")
    composed = ("pooling:keep_ratio=0.25", "snapkv:ratio=0.5", "prompt_lookup")
    without_kv = ("pooling:keep_ratio=0.25", "", "prompt_lookup")
    _, _, cols, _, _ = vlm_qa(app.client, ("none", "", ""), lossless, composed, without_kv, model=app.vlm, max_new=6)
    assert_answered(cols[0])
    for col in cols[1:]:
        assert_answered(col, speculative=True)
    assert text(cols[1][0]) == text(cols[0][0])  # every piece lossless: the baseline's greedy answer
    assert cols[1][1]["visual tokens kept"] == VISUAL and cols[2][1]["visual tokens kept"] == VISUAL // 4
    assert cols[2][1]["KV at end (bytes)"] < cols[3][1]["KV at end (bytes)"]  # SnapKV compressed the prefill
    assert cols[2][1]["mean accepted length"] > 1  # the repetitive answer: prompt lookup's drafts are accepted


def test_video_frames_and_uploaded_video(app):
    from mmaccel.data.clips import make_clip
    from mmaccel.data.media import write_video

    status, preview, cols, overlays, _ = vlm_qa(app.client, ("none", "", ""), ("temporal-tome:keep_ratio=0.5", "", ""),
                                                model=app.vlm, sample=CLIP_QA, frames=2)
    assert "2 frames fed as 2 images" in status
    from PIL import Image

    strip = Image.open(preview)
    assert strip.width > 2 * strip.height - 10  # the two frames side by side
    assert_answered(cols[0])
    assert_answered(cols[1])
    assert cols[0][1]["visual tokens"] == 2 * VISUAL and cols[1][1]["visual tokens kept"] == VISUAL
    assert overlays[1] is not None  # merged across the two frames: one strip of two overlays

    clip = make_clip(6, seed=1, size=64)
    path = write_video(clip.frames(), app.tmp / "clip.mp4", fps=4)
    status, _, cols, _, _ = vlm_qa(app.client, ("pooling:keep_ratio=0.25", "", ""), ("none", "", ""), model=app.vlm,
                                   video=gradio_client.handle_file(str(path)), frames=2)
    assert "uploaded video clip.mp4 (2 frames)" in status
    assert cols[0][1]["visual tokens"] == 2 * VISUAL and cols[0][1]["visual tokens kept"] == 2 * VISUAL // 4


@pytest.mark.slow  # 30-60 s on 2 cores; covered in part by faster tests; CI stays inside 25 minutes
def test_errors_stay_in_their_column_then_a_good_request(app):
    client, tmp, vlm = app.client, app.tmp, app.vlm
    baseline = ("none", "", "")
    handle = gradio_client.handle_file

    def good_request():
        """After every error: a good request still succeeds (a photo, a question of our own, a composed column)."""
        status, _, cols, _, plot = vlm_qa(client, baseline, ("pooling:keep_ratio=0.25", "", "prompt_lookup"),
                                          model=vlm, sample="astronaut", question="What color is the square?",
                                          max_new=3)
        assert_answered(cols[0])
        assert_answered(cols[1], speculative=True)
        assert "Expected answer" not in status and plot is not None

    corrupt = tmp / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 20)
    status, _, cols, overlays, plot = vlm_qa(client, baseline, baseline, model=vlm, image=handle(str(corrupt)))
    assert "error" in status and plot is None and list(overlays[:2]) == [None, None]
    assert all("mm-error" in h and "not a readable image" in h and "corrupt.png" in h for h, _ in cols[:2])
    good_request()

    bad_video = tmp / "bad.mp4"
    bad_video.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 50)
    _, _, cols, _, _ = vlm_qa(client, baseline, baseline, model=vlm, video=handle(str(bad_video)))
    assert all("mm-error" in h and "bad.mp4" in h and "video" in h for h, _ in cols[:2])
    _, _, cols, _, _ = vlm_qa(client, baseline, baseline, model=vlm, image=handle(str(corrupt)),
                              video=handle(str(bad_video)))
    assert all("mm-error" in h and "clear one of them" in h for h, _ in cols[:2])
    good_request()

    _, _, cols, _, _ = vlm_qa(client, baseline, baseline, model="no-such-model")
    assert all("mm-error" in h and "unknown model" in h for h, _ in cols[:2])
    good_request()

    # a conflicting composition and a bad spec: errors in their own columns; the baseline still answers
    _, _, cols, overlays, _ = vlm_qa(client, baseline, ("none", "h2o:budget=64", "prompt_lookup"),
                                     ("pooling:bogus=1", "", ""), model=vlm)
    assert_answered(cols[0])
    assert "mm-error" in cols[1][0] and "h2o" in cols[1][0] and "conflicts with speculative" in cols[1][0]
    assert "mm-error" in cols[2][0] and "bogus" in cols[2][0] and overlays[1] is None
    good_request()


def test_kept_slots_from_the_methods_token_maps():
    """Pooling's 2 x 2 groups, FastV's kept positions, and no method: the [h, w] patch -> token maps of the overlay."""
    import numpy as np
    import torch

    from mmaccel.vision_tokens import build_method
    from mmaccel.vision_tokens.plan import TokenPlan

    ids = torch.tensor([[5, *[9] * 16, 6, 7]])  # 16 image placeholders (id 9) on a 4 x 4 grid, then text
    plain = kept_slots(None, {}, ids, 9, (4, 4), 1)
    assert np.array_equal(plain[0], np.arange(16).reshape(4, 4))

    pooling = build_method("pooling:keep_ratio=0.25")
    pooling._image_plans = [TokenPlan(index=torch.tensor([[0, 2, 8, 10]]), length=16,
                                      assign=torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]]))]
    (slots,) = kept_slots(pooling, {}, ids, 9, (4, 4), 1)
    assert np.array_equal(slots, np.array([[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 3, 3]]))

    fastv = build_method("fastv:keep_ratio=0.5")
    kept = [0, *range(1, 17, 2), 17, 18]  # every other image token and the text
    (slots,) = kept_slots(fastv, {"kept_positions": [kept]}, ids, 9, (4, 4), 1)
    assert (slots[:, 1::2] == -1).all() and (slots[:, ::2] >= 0).all()
    assert "no token map" in kept_slots(fastv, {}, ids, 9, (4, 4), 1)
