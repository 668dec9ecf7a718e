"""The workbench off the loopback (issue 33), attacked through its own endpoints: a login is required off the loopback,
the model pickers and method specs load nothing outside the zoo, the presets and the model roots (one message whether
a path exists or not), a checkpoint's own code never runs (even with ``y`` on stdin), pixel bombs and truncated media
get one clear error in the column without the app's memory growing, no server path is shown, and no file of the app is
left in the temp folders after it stops."""
from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path

import pytest

gr = pytest.importorskip("gradio", reason="the app needs the `app` extra: pip install -e '.[app]'")
gradio_client = pytest.importorskip("gradio_client")

from app_serving import launch_local
from mmaccel.apps import workbench
from mmaccel.apps.common import InputError, scrub
from mmaccel.apps.security import ModelGate, check_video, exposure_error, read_auth
from mmaccel.apps.tabs.vlm_qa import SCENE_QA
from mmaccel.apps.vision_encoder import SCENE_SAMPLE
from test_app import save_tiny_vision_encoder, save_tiny_vlm

from mmaccel.models.zoo import assets_dir

pytestmark = pytest.mark.usefixtures("one_thread")
MiB = 2**20


def rss() -> int:
    """This process's resident memory, bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def custom_code_checkpoint(folder: Path, marker: Path) -> Path:
    """micro-lm's weights and tokenizer with an ``auto_map`` and a Python file that writes ``marker`` if imported."""
    shutil.copytree(assets_dir() / "micro-lm", folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                    "from transformers import LlamaConfig as EvilConfig\n"
                                    "from transformers import LlamaForCausalLM as EvilModel\n")
    return folder


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The workbench on micro-lm with a tiny Dinov2 and a tiny LLaVA, one model root holding micro-lm's copy and a
    checkpoint with its own code, and a private folder of its own; launched on a free local port."""
    mp = pytest.MonkeyPatch()
    mp.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    tmp = tmp_path_factory.mktemp("secure")
    root = tmp / "models"
    shutil.copytree(assets_dir() / "micro-lm", root / "my-lm")
    marker = tmp / "marker"
    custom_code_checkpoint(root / "evil", marker)
    (tmp / "private-model").mkdir()  # an existing folder outside the root
    vision_model = save_tiny_vision_encoder(tmp / "tiny-dinov2")
    vlm = save_tiny_vlm(tmp / "tiny-llava")
    demo = workbench.build_app("micro-lm", vision_model=vision_model, vlm_model=vlm, device="cpu", niah_length=256,
                               max_upload_mb=1, model_roots=[root])
    folder = workbench.private_folder(demo)
    launch_local(demo, app_kwargs={"lifespan": workbench.app_lifespan(demo)})
    try:
        yield types.SimpleNamespace(client=gradio_client.Client(demo.local_url, verbose=False), demo=demo, tmp=tmp,
                                    root=root, marker=marker, vision_model=vision_model, vlm=vlm, folder=folder)
    finally:
        demo.close()
        mp.undo()


def longctx(client, model, *specs, upload=None, document="A short document. " * 8, question="What?"):
    padded = [*specs, "", "", ""][:4]
    return client.predict(model, document, upload, question, "", 2, 1, "full input", len(specs), *padded,
                          api_name="/longctx")


def column_errors(result, n=2, offset=1):
    return [result[offset + 2 * i] for i in range(n)]


# ------------------------------------------------------------------------------------------------------- launching
@pytest.mark.parametrize("argv, words", [
    (["--host", "0.0.0.0"], ["--auth", "0.0.0.0"]),
    (["--host", "192.168.1.5"], ["--auth"]),
    (["--share"], ["--auth", "--share"]),
    (["--threads", "-1"], ["--threads", "must be > 0"]),
    (["--max-upload-mb", "-1"], ["--max-upload-mb", "must be > 0"]),
    (["--max-upload-mb", "0"], ["--max-upload-mb", "must be > 0"]),
    (["--max-image-pixels", "nan"], ["--max-image-pixels"]),
    (["--host", "0.0.0.0", "--auth", "user"], ["USER:PASSWORD"]),
    (["--model-root", "/no/such/root"], ["--model-root"]),
])
def test_bad_launches_refuse_with_one_line_before_anything_starts(argv, words, monkeypatch, capsys):
    monkeypatch.setattr(workbench, "build_app", lambda *a, **k: pytest.fail("built despite bad flags"))
    with pytest.raises(SystemExit) as exit_info:
        workbench.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("mmaccel app: error:") and all(w in err for w in words), err


def test_exposure_and_auth_parsing(tmp_path):
    assert exposure_error("127.0.0.1", False, []) is None and exposure_error("localhost", False, []) is None
    assert exposure_error("::1", False, []) is None
    assert "--auth" in exposure_error("0.0.0.0", False, []) and "--auth" in exposure_error("::", False, [])
    assert exposure_error("0.0.0.0", True, [("a", "b")]) is None
    f = tmp_path / "logins"
    f.write_text("# team\nalice:s3cret:with:colons\n\nbob:pw\n")
    assert read_auth(["carol:x"], f) == [("carol", "x"), ("alice", "s3cret:with:colons"), ("bob", "pw")]
    with pytest.raises(ValueError) as err:
        read_auth([":hunter2"])
    assert "hunter2" not in str(err.value)  # the password is never echoed


def test_off_the_loopback_the_app_asks_for_a_login(monkeypatch):
    """``--host 0.0.0.0 --auth`` reaches Gradio's own ``launch(auth=...)``; served (on 127.0.0.1 here) with that auth,
    a client with the login works and one without it is refused."""
    launched = {}
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **kw: launched.update(kw, blocks=self))
    assert workbench.main(["--host", "0.0.0.0", "--auth", "ann:pw1", "--model", "micro-lm"]) == 0
    assert launched["server_name"] == "0.0.0.0" and launched["auth"] == [("ann", "pw1")]
    assert not workbench.private_folder(launched["blocks"]).exists()  # main removed it when launch returned
    monkeypatch.undo()
    demo = workbench.build_app("micro-lm", device="cpu")
    launch_local(demo, auth=launched["auth"])
    try:
        client = gradio_client.Client(demo.local_url, auth=("ann", "pw1"), verbose=False)
        status, table, _ = client.predict("64", "64", "16", ["prefill"], 1, api_name="/kernels")
        assert "speedup" in status and table["data"]
        with pytest.raises(Exception):  # noqa: B017 - gradio_client raises a plain ValueError / httpx error
            gradio_client.Client(demo.local_url, verbose=False).predict("64", "64", "16", ["prefill"], 1,
                                                                        api_name="/kernels")
        with pytest.raises(Exception):  # noqa: B017
            gradio_client.Client(demo.local_url, auth=("ann", "wrong"), verbose=False)
    finally:
        demo.close()


# ---------------------------------------------------------------------------------------------------------- models
def test_model_gate_gives_one_message_whether_a_path_exists_or_not(tmp_path):
    root = tmp_path / "root"
    (root / "lm").mkdir(parents=True)
    secret = tmp_path / "secret"
    secret.mkdir()
    (root / "link").symlink_to(secret)  # a symlink out of the root is outside
    gate = ModelGate(roots=(root,))
    messages = {}
    for name in [str(secret), str(tmp_path / "missing"), "../secret", "link", "/etc", "org/name", "lm/../../secret"]:
        with pytest.raises(InputError) as err:
            gate.check(name)
        messages[name] = str(err.value).replace(repr(name), "NAME")
    assert len(set(messages.values())) == 1, messages
    assert "--model-root" in next(iter(messages.values())) and "--allow-hub" in next(iter(messages.values()))
    assert gate.check("lm") == gate.check(str(root / "lm")) == str((root / "lm").resolve())
    assert gate.check("micro-lm") == "micro-lm"
    assert ModelGate(allow_hub=True).check("org/name") == "org/name"
    for spec in ["draft:model=/etc/passwd", f"draft:model={secret}", "layer_skip:skip_set=../x.json",
                 "draft:model=org/name"]:
        with pytest.raises(InputError, match="unknown model"):
            gate.check_spec(spec)
    gate.check_spec(f"draft:model={root / 'lm'}")
    gate.check_spec("snapkv:budget=64:window=8")


def test_pickers_and_specs_outside_the_roots_are_refused_the_same_way(app):
    client = app.client
    results = [longctx(client, name, "full", "snapkv") for name in
               [str(app.tmp / "private-model"), str(app.tmp / "no-such-dir"), "/etc", "org/name"]]
    texts = [column_errors(r)[0].replace(name, "NAME").replace(Path(name).name, "NAME") for r, name in
             zip(results, [str(app.tmp / "private-model"), str(app.tmp / "no-such-dir"), "/etc", "org/name"])]
    assert all("unknown model" in t for t in texts) and len(set(texts)) == 1, texts
    ok = longctx(client, "my-lm", "full", "streaming:window=16")  # a folder under the root, relative to it
    assert all("mm-output" in h for h in column_errors(ok))
    spec = longctx(client, "micro-lm", "full", "streaming:window=16", document="x")
    assert "mm-output" in column_errors(spec)[0]
    gen = client.predict("micro-lm", "Once", 2, 2, 1, 2, "autoregressive", "draft:model=/etc", "", "",
                         api_name="/generation")
    assert all("unknown model" in gen[1 + 2 * i] for i in range(2))


def test_a_checkpoints_own_code_never_runs_even_with_yes_on_stdin(app, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 20))
    result = longctx(app.client, "evil", "full", "snapkv")
    for html in column_errors(result):
        assert "ships its own Python code" in html and "--allow-remote-code" in html
    assert not app.marker.exists()


def test_remote_code_box_only_with_the_flag_and_honoured_only_then(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 20))
    marker = tmp_path / "marker"
    custom_code_checkpoint(tmp_path / "root" / "evil", marker)
    plain = workbench.build_app("micro-lm", device="cpu", model_roots=[tmp_path / "root"])
    assert '"trust-remote-code"' not in json.dumps(plain.get_config_file())
    allowed = workbench.build_app("micro-lm", device="cpu", model_roots=[tmp_path / "root"], allow_remote_code=True)
    assert '"trust-remote-code"' in json.dumps(allowed.get_config_file())
    from mmaccel.apps.common import AppContext, ModelCache, Request

    calls = []
    monkeypatch.setattr("mmaccel.load", lambda name, **kw: calls.append(kw["trust_remote_code"]) or ("m", "t"))
    for allow, ticked, expected in [(False, True, None), (True, False, None), (True, True, True)]:
        cache = ModelCache("cpu", gate=ModelGate(roots=(tmp_path / "root",), allow_remote_code=allow))
        req = Request(AppContext(cache, MiB, tmp_path / "work"), 2, ["full", "full"])
        model, _ = req.load("evil", lambda *a, **k: None, ticked)
        assert (model is not None) == bool(expected), (allow, ticked)
        if model is None:
            assert "ships its own Python code" in req.results[0].html
    assert calls == [True]
    cache = ModelCache("cpu", gate=ModelGate(allow_remote_code=False))
    cache.get("micro-lm", trust_remote_code=True)  # a client sending True without the flag: False is passed
    assert calls == [True, False] and not marker.exists()


# ----------------------------------------------------------------------------------------------------------- media
@pytest.fixture(scope="module")
def bad_media(tmp_path_factory):
    """Pixel bombs made with Pillow (20k x 20k and 12k x 12k PNGs, a few hundred KB), a truncated PNG and a
    truncated MP4."""
    import numpy as np
    from PIL import Image

    from mmaccel.data.media import write_video

    tmp = tmp_path_factory.mktemp("media")
    files = {}
    for side in (20_000, 12_000):
        path = tmp / f"bomb{side}.png"
        Image.new("1", (side, side)).save(path, optimize=True)  # 1-bit: tiny file, huge RGB decode
        files[f"bomb{side}"] = path
    good = tmp / "good.png"
    Image.fromarray((np.arange(64 * 64 * 3) % 251).astype(np.uint8).reshape(64, 64, 3)).save(good)
    files["truncated_png"] = tmp / "truncated.png"
    files["truncated_png"].write_bytes(good.read_bytes()[:200])
    clip = write_video(np.full((6, 32, 32, 3), 100, np.uint8), tmp / "clip.mp4")
    files["truncated_mp4"] = tmp / "truncated.mp4"
    files["truncated_mp4"].write_bytes(clip.read_bytes()[:300])
    files["clip"] = clip
    return files


MEDIA_ERRORS = {"bomb20000": "megapixels", "bomb12000": "megapixels", "truncated_png": "not a readable image",
                "truncated_mp4": "video"}


def test_pixel_bombs_and_truncated_media_get_one_clear_error_in_every_media_endpoint(app, bad_media):
    handle = gradio_client.handle_file
    client = app.client
    assert max(bad_media[k].stat().st_size for k in ("bomb20000", "bomb12000")) < MiB
    client.predict(app.vision_model, None, SCENE_SAMPLE, 0, 1, 2, "none", "none", "", "", api_name="/vision")  # warm
    before = rss()
    for name, words in MEDIA_ERRORS.items():
        upload = handle(str(bad_media[name]))
        is_video = name.endswith("mp4")
        calls = [] if is_video else [
            ("/vision", (app.vision_model, upload, SCENE_SAMPLE, 0, 1, 2, "none", "none", "", ""), 2)]
        qa_upload = (None, upload) if is_video else (upload, None)
        calls.append(("/vlm_qa", (app.vlm, *qa_upload, SCENE_QA, 0, "", 2, 2, 1, 2,
                                  "none", "", "", "none", "", "", "", "", "", "", "", ""), 2))
        for api, args, offset in calls:
            result = client.predict(*args, api_name=api)
            htmls = column_errors(result, offset=offset)
            assert all("mm-error" in h and words in h for h in htmls), (name, api, htmls[0][:300])
            assert all("/tmp" not in h and tempfile.gettempdir() not in h for h in [*htmls, result[0]]), htmls[0]
    grown = rss() - before
    assert grown < 200 * MiB, f"RSS grew {grown / MiB:.0f} MiB"
    ok = client.predict(app.vision_model, None, SCENE_SAMPLE, 0, 1, 2, "none", "none", "", "", api_name="/vision")
    assert "mm-output" in ok[2] or "mm-error" not in ok[2]


def test_video_caps_on_frame_size_and_frames(bad_media, tmp_path):
    import numpy as np

    from mmaccel.data.media import write_video

    clip = bad_media["clip"]  # 6 frames of 32 x 32
    with pytest.raises(InputError, match="per frame"):
        check_video(clip, 32 * 32 - 1, 100, "the clip")
    with pytest.raises(InputError, match="more than 5 frames"):
        check_video(clip, 10**6, 5, "the clip")
    check_video(clip, 32 * 32, 6, "the clip")
    wide = write_video(np.zeros((1, 64, 2048, 3), np.uint8), tmp_path / "wide.mp4")
    with pytest.raises(InputError, match="64 frames|2048 x 64"):
        check_video(wide, 100_000, 10, "the wide clip")


# ------------------------------------------------------------------------------------------------ paths and files
def test_no_server_path_in_a_status_line_or_an_error(app):
    result = app.client.predict("micro-lm", "256", "0.5", 1, 2, 2, "full", "streaming:window=64", "", "",
                                api_name="/niah_eval")
    assert "mm-output" in result[1] and "/" not in result[0].replace("1 /", ""), result[0]
    bad = app.client.predict("micro-lm", "512 abc", "0.5", 1, 2, 2, "full", "snapkv", "", "", api_name="/niah_eval")
    assert "whole numbers" in bad[1] and "invalid literal" not in bad[1]
    assert scrub("no file at /tmp/gradio/ab12/x.png; see ~/.cache/m/y") == "no file at x.png; see y"
    assert scrub("tokens/s 1/2 and http://h/a") == "tokens/s 1/2 and http://h/a"


def test_uploads_are_private_and_nothing_is_left_after_the_app_stops(tmp_path, monkeypatch):
    """Uploads are read from a 0600 copy in the app's 0700 folder; the per-request folders are gone when the request
    ends; after the app stops neither its folder nor Gradio's copy of the upload is left."""
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    seen = {}
    from mmaccel.apps import prompts

    real = prompts.read_upload

    def spy(path, max_bytes):
        if path:
            seen["mode"] = os.stat(path).st_mode & 0o777
            seen["dir_mode"] = os.stat(Path(path).parent.parent).st_mode & 0o777
            seen["path"] = Path(path)
        return real(path, max_bytes)

    monkeypatch.setattr("mmaccel.apps.tabs.longctx.read_upload", spy)
    demo = workbench.build_app("micro-lm", device="cpu")
    folder = workbench.private_folder(demo)
    launch_local(demo, app_kwargs={"lifespan": workbench.app_lifespan(demo)})
    doc = tmp_path / "unique-upload-name-4f1c.txt"
    doc.write_text("The red fox sleeps. " * 20)
    try:
        client = gradio_client.Client(demo.local_url, verbose=False)
        result = longctx(client, "micro-lm", "full", "snapkv", upload=gradio_client.handle_file(str(doc)))
        assert all("mm-output" in h for h in column_errors(result)), result[1][:300]
        assert seen["mode"] == 0o600 and seen["dir_mode"] == 0o700
        assert seen["path"].is_relative_to(folder) and not seen["path"].exists()
        assert folder.exists() and not any(folder.iterdir())  # the per-request folder went with its request
        client.predict("64", "64", "16", ["prefill"], 1, api_name="/kernels")
        client.predict("micro-lm", "256", "0.5", 1, 2, 2, "full", "snapkv", "", "", api_name="/niah_eval")
        assert not any(folder.iterdir())
    finally:
        demo.close()
    assert not folder.exists()
    gradio_dir = Path(tempfile.gettempdir()) / "gradio"
    assert not list(gradio_dir.rglob(doc.name)), "Gradio's copy of the upload is left"
