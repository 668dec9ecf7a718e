"""micro-ar: palette data, quality metric, PNG/GIF/MP4 output, tokenizer, trainer, and SJD on the committed model."""
import itertools

import numpy as np
import pytest
import torch
from PIL import Image

from mmaccel.data.media import load_video
from mmaccel.data.palette import (
    COLOURS,
    IMAGE_SIZE,
    VIDEO_FRAMES,
    VIDEO_SIZE,
    make_palette_sample,
    palette_accuracy,
    palette_samples,
    palette_to_rgb,
    render_prompt,
    save_picture,
)
from mmaccel.models.zoo import zoo_path
from mmaccel.zoo.train.micro_ar import RASTER, build_tokenizer, picture_to_tokens, prompt_ids, tokens_to_picture

pytestmark = pytest.mark.usefixtures("one_thread")

RED, WHITE, BLUE, BLACK = (COLOURS.index(c) for c in ("red", "white", "blue", "black"))


def test_palette_accuracy_on_a_hand_made_image():
    target = np.zeros((4, 4), dtype=np.uint8)
    generated = target.copy()
    generated[0, 0], generated[2, 3], generated[3, 3] = 5, 1, 255  # 255: a non-image token
    assert palette_accuracy(generated, target) == pytest.approx(13 / 16)
    assert palette_accuracy(target, target) == 1.0
    with pytest.raises(ValueError, match="same shape"):
        palette_accuracy(target, target[:3])


def test_render_prompt_draws_the_named_shapes_where_the_prompt_says():
    img = render_prompt("red square at center and blue circle at top-left on white")
    assert img.shape == (IMAGE_SIZE, IMAGE_SIZE)
    assert (img == RED).sum() == 25 and img[8, 8] == RED  # a 5 x 5 square around the centre cell's centre
    assert img[2, 2] == BLUE and img[0, 0] == WHITE  # the circle's centre is blue, the corner of its box is not
    assert set(np.unique(img)) == {RED, BLUE, WHITE}
    clip = render_prompt("red circle at top moving right on black")
    assert clip.shape == (VIDEO_FRAMES, VIDEO_SIZE, VIDEO_SIZE)
    xs = [np.nonzero(frame == RED)[1].mean() for frame in clip]
    assert xs[0] < xs[-1] and all(a <= b for a, b in itertools.pairwise(xs))  # it moves right, never back


@pytest.mark.parametrize("prompt", ["red square at middle on white", "red square at center on magenta",
                                    "red square at center", "red square at top and red circle at top on black",
                                    "red square at top moving right on black extra"])
def test_bad_prompts_raise_one_clear_error(prompt):
    with pytest.raises(ValueError, match="cannot parse prompt"):
        render_prompt(prompt)


def test_samples_are_seeded_and_the_splits_disjoint():
    a, b = make_palette_sample(7), make_palette_sample(7)
    assert a.prompt == b.prompt and np.array_equal(a.indices, b.indices)
    assert np.array_equal(a.indices, render_prompt(a.prompt))
    train = {s.seed for s in palette_samples(20)}
    test = {s.seed for s in palette_samples(20, split="test")}
    assert not train & test
    with pytest.raises(ValueError, match="unknown kind"):
        make_palette_sample(0, kind="audio")


def test_decoding_writes_readable_png_gif_and_mp4(tmp_path):
    image = render_prompt("red square at center on white")
    png = save_picture(image, tmp_path / "x.png", scale=4)
    back = np.asarray(Image.open(png).convert("RGB"))
    assert back.shape == (64, 64, 3) and np.array_equal(back[::4, ::4], palette_to_rgb(image))
    clip = np.zeros((VIDEO_FRAMES, VIDEO_SIZE, VIDEO_SIZE), dtype=np.uint8)
    for t in range(VIDEO_FRAMES):
        clip[t, :, t] = RED  # a red column sweeping right: every frame differs
    gif = Image.open(save_picture(clip, tmp_path / "x.gif", scale=2))
    assert gif.n_frames == VIDEO_FRAMES
    gif.seek(3)
    assert np.array_equal(np.asarray(gif.convert("RGB"))[::2, ::2], palette_to_rgb(clip[3]))
    frames = load_video(save_picture(clip, tmp_path / "x.mp4", scale=8, fps=4))
    assert frames.shape == (VIDEO_FRAMES, 64, 64, 3)
    assert np.abs(frames.astype(int) - palette_to_rgb(clip).repeat(8, 1).repeat(8, 2)).mean() < 12
    with pytest.raises(ValueError, match="use a .png, .gif or .mp4"):
        save_picture(image, tmp_path / "x.bmp")
    with pytest.raises(ValueError, match="palette indices must be in"):
        save_picture(np.full((2, 2), 16), tmp_path / "y.png")


def test_tokenizer_and_picture_tokens():
    tok = build_tokenizer()
    assert len(tok) == 71 and tok.convert_tokens_to_ids("<c07>") == 7 and tok.convert_tokens_to_ids("<r00>") == 21
    ids = prompt_ids(tok, "red circle at top on black")
    assert ids[0] == tok.bos_token_id and tok.convert_ids_to_tokens(ids[-1]) == "<image>"
    assert tok.decode(ids[1:-1]) == "red circle at top on black"
    with pytest.raises(ValueError, match="not in micro-ar's vocabulary"):
        prompt_ids(tok, "red dragon at top on black")
    image = render_prompt("red circle at top on black")
    tokens = picture_to_tokens(image)
    assert len(tokens) == 16 * 17 and tok.convert_ids_to_tokens(tokens[17]) == "<r01>"  # each row: its row token
    assert tokens[1:17] == image[0].tolist()
    assert np.array_equal(tokens_to_picture(tokens), image)
    tokens[18] = tok.eos_token_id  # a non-palette token where pixel (1, 0) belongs
    assert tokens_to_picture(tokens)[1, 0] == 255
    clip = render_prompt("red circle at top moving right on black")
    clip_tokens = picture_to_tokens(clip, "video")
    assert len(clip_tokens) == 8 * 8 * 9 and clip_tokens[72] == clip_tokens[0]  # row tokens restart every frame
    assert np.array_equal(tokens_to_picture(clip_tokens, "video"), clip)
    with pytest.raises(ValueError, match="a video is 576 tokens"):
        tokens_to_picture([0] * 272, "video")


def test_trainer_writes_a_loadable_checkpoint_and_card(tmp_path):
    from transformers import AutoModelForCausalLM

    from mmaccel.models.zoo import Phase, Recipe
    from mmaccel.zoo.train.micro_ar import train

    recipe = Recipe(phases=(Phase(steps=3, min_len=256, max_len=512, batch_size=2),), warmup_steps=1)
    summary = train(tmp_path, max_steps=3, recipe=recipe, log_every=1, eval_images=1, eval_clips=0)
    assert summary["steps"] == 3 and len(summary["history"]) == 3
    assert all(np.isfinite(h["loss"]) for h in summary["history"])
    assert 0.0 <= summary["quality"]["image"]["palette_accuracy"] <= 1.0 and set(summary["quality"]) == {"image"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config.vocab_size == 71
    card = (tmp_path / "README.md").read_text()
    assert "palette accuracy" in card and "--max-steps 3" in card


TRAINED = (zoo_path("micro-ar") / "model.safetensors").exists()


@pytest.mark.skipif(not TRAINED, reason="micro-ar is not trained yet (mmaccel zoo train micro-ar)")
def test_sjd_on_micro_ar_paints_the_same_image_in_fewer_forwards():
    from mmaccel.models import load
    from mmaccel.speculative.engine import speculative_generate
    from mmaccel.speculative.sjd import SpeculativeJacobi

    model, tok = load("micro-ar", device="cpu")
    sample = palette_samples(1, split="test")[0]
    ids = torch.tensor([prompt_ids(tok, sample.prompt)])
    n = 16 * 17
    ref = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=tok.pad_token_id)
    drafter = SpeculativeJacobi(init="neighbour", width=RASTER["image"][0], init_tokens=range(16))
    out = speculative_generate(model, ids, drafter, max_new_tokens=n, num_draft_tokens=16, eos_token_id=None)
    assert torch.equal(out.sequences, ref)
    assert out.target_forwards < n / 2
    assert palette_accuracy(tokens_to_picture(out.sequences[0, ids.shape[1]:].tolist()), sample.indices) > 0.5
