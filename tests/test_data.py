"""mmaccel.data: seeded scenes and clips (determinism, answers that match the pixels, fixed splits) and media input."""
import io
import re

import av
import numpy as np
import pytest
from PIL import Image

from mmaccel.data import haystack
from mmaccel.data.clips import CLIP_KINDS, DIRECTIONS, PANEL_RGB, SEVEN_SEGMENTS, make_clip, segment_boxes
from mmaccel.data.media import load_image, load_video, write_video
from mmaccel.data.scenes import ANSWERS, PALETTE, QUESTION_KINDS, SHAPES, make_scene, make_scene_qa
from mmaccel.data.splits import MAX_ITEMS, split_of, split_seed


def nearest_colour(rgb) -> str:
    """The palette name closest to an RGB triple (tolerates video compression)."""
    rgb = np.asarray(rgb, dtype=float)
    return min(PALETTE, key=lambda name: np.abs(rgb - PALETTE[name]).sum())


def read_number(frame: np.ndarray, clip, tolerance: float = 90.0) -> tuple[str, str]:
    """Read the needle's digits and colour off a frame's pixels: a segment is lit when its centre is a palette colour."""
    digits, colours = "", set()
    for box in clip.digit_boxes:
        lit = ""
        for name, (x0, y0, x1, y1) in segment_boxes(box).items():
            rgb = frame[(y0 + y1) // 2, (x0 + x1) // 2].astype(float)
            colour = nearest_colour(rgb)
            if np.abs(rgb - PALETTE[colour]).sum() < tolerance:
                lit += name
                colours.add(colour)
        digits += next((d for d, segs in SEVEN_SEGMENTS.items() if sorted(segs) == sorted(lit)), "?")
    return digits, (colours.pop() if len(colours) == 1 else "?")


# --- scenes ----------------------------------------------------------------------------------------------------------


def test_scene_is_a_pure_function_of_its_seed():
    a, b, other = make_scene(11), make_scene(11), make_scene(12)
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image))
    assert a.objects == b.objects
    assert not np.array_equal(np.asarray(a.image), np.asarray(other.image))
    assert a.image.mode == "RGB" and a.image.size == (168, 168)

    qa1, qa2 = make_scene_qa(30, seed=3, per_scene=3), make_scene_qa(30, seed=3, per_scene=3)
    assert [(q.question, q.answer, q.seed) for q in qa1] == [(q.question, q.answer, q.seed) for q in qa2]
    assert all(x.image.tobytes() == y.image.tobytes() for x, y in zip(qa1, qa2))


def test_scene_objects_sit_in_their_own_cells_and_their_centre_pixel_has_their_colour():
    for seed in range(40):
        scene = make_scene(seed, num_objects=(2, 6))
        pixels = np.asarray(scene.image)
        assert len({o.cell for o in scene.objects}) == len(scene.objects)
        assert len({o.name for o in scene.objects}) == len(scene.objects)
        for o in scene.objects:
            x, y = o.center
            assert tuple(pixels[y, x]) == PALETTE[o.colour]
            row, col = o.cell
            assert col * 42 <= x - o.radius and x + o.radius < (col + 1) * 42  # inside its cell: no overlaps
            assert row * 42 <= y - o.radius and y + o.radius < (row + 1) * 42


def _answer_from_metadata(qa) -> str:
    objs, q = qa.objects, qa.question
    by_name = {o.name: o for o in objs}
    if m := re.fullmatch(r"What color is the (\w+)\?", q):
        (o,) = [o for o in objs if o.shape == m[1]]
        return o.colour
    if m := re.fullmatch(r"What shape is the (\w+) object\?", q):
        (o,) = [o for o in objs if o.colour == m[1]]
        return o.shape
    if m := re.fullmatch(r"How many (\w+)s are there\?", q):
        return str(sum(o.shape == m[1] for o in objs))
    if m := re.fullmatch(r"Is the (\w+ \w+) left or right of the (\w+ \w+)\?", q):
        a, b = by_name[m[1]], by_name[m[2]]
        assert a.cell[1] != b.cell[1]
        return "left" if a.center[0] < b.center[0] else "right"
    if m := re.fullmatch(r"Is the (\w+ \w+) small or large\?", q):
        return by_name[m[1]].size
    raise AssertionError(f"unexpected question {q!r}")


def test_scene_answers_agree_with_the_metadata_and_the_pixels():
    qa = make_scene_qa(200, seed=1, split="test", per_scene=2)
    assert len(qa) == 200
    assert {q.kind for q in qa} == set(QUESTION_KINDS)
    for q in qa:
        assert q.answer in ANSWERS
        assert _answer_from_metadata(q) == q.answer, q.question
        if q.kind == "colour":  # read the answer off the pixels too
            shape = q.question.split()[-1].rstrip("?")
            (o,) = [o for o in q.objects if o.shape == shape]
            assert nearest_colour(q.image.getpixel(o.center)) == q.answer


def test_scene_question_kinds_can_be_chosen_and_counts_cover_absent_shapes():
    qa = make_scene_qa(60, seed=0, kinds=("count",))
    assert {q.kind for q in qa} == {"count"}
    assert "0" in {q.answer for q in qa}
    assert {q.question.split()[2][:-1] for q in qa} == set(SHAPES)


def test_train_and_test_splits_are_disjoint_and_fixed():
    train = make_scene_qa(40, seed=0, split="train")
    test = make_scene_qa(40, seed=0, split="test")
    assert {q.seed for q in train}.isdisjoint({q.seed for q in test})
    assert {q.image.tobytes() for q in train}.isdisjoint({q.image.tobytes() for q in test})
    assert {split_of(q.seed) for q in train} == {"train"} and {split_of(q.seed) for q in test} == {"test"}
    # a test draw with another seed stays in the test range
    assert split_of(split_seed("test", 7, MAX_ITEMS - 1)) == "test"
    with pytest.raises(ValueError, match="unknown split"):
        split_seed("validation", 0, 0)
    with pytest.raises(ValueError, match="at most"):
        split_seed("train", 0, MAX_ITEMS)


def test_scene_arguments_are_checked():
    with pytest.raises(ValueError, match="num_objects"):
        make_scene(0, num_objects=(3, 17))
    with pytest.raises(ValueError, match="too small"):
        make_scene(0, size=40, grid=4)
    with pytest.raises(ValueError, match="kinds"):
        make_scene_qa(2, kinds=("weather",))


# --- clips -----------------------------------------------------------------------------------------------------------


def test_clip_is_deterministic_and_depth_moves_only_the_needle():
    a, b = make_clip(24, seed=5, depth=0.5), make_clip(24, seed=5, depth=0.5)
    assert np.array_equal(a.frames(), b.frames())
    assert (a.question, a.answer, a.needle_frame) == (b.question, b.answer, b.needle_frame) == (
        "What number appeared in the video?", a.number, 12)
    assert np.array_equal(a.frames([3, 7]), np.stack([a.frame(3), a.frame(7)]))
    late = make_clip(24, seed=5, depth=1.0)
    assert late.needle_frame == 23 and late.number == a.number
    assert np.array_equal(late.frame(0), a.frame(0))
    assert not np.array_equal(late.frame(12), a.frame(12))  # the needle left frame 12
    assert np.array_equal(late.frame(5), a.frame(5))  # the rest of the clip is the same


@pytest.mark.parametrize("digits", [1, 3])
def test_needle_frame_stands_out_and_carries_the_answer(digits):
    clip = make_clip(64, seed=digits, needle_frame=40, digits=digits)
    frames = clip.frames([38, 39, 40, 41])
    step = np.abs(frames[1].astype(int) - frames[0]).mean()
    jump = np.abs(frames[2].astype(int) - frames[1]).mean()
    assert jump > 10 * max(step, 1.0), (step, jump)
    assert read_number(frames[2], clip) == (clip.number, clip.number_colour)
    assert clip.answer == clip.number and len(clip.number) == digits
    assert read_number(frames[1], clip)[0] != clip.number  # not on the neighbours
    x0, y0 = clip.digit_boxes[0][:2]
    assert tuple(frames[2][y0 - 2, x0 - 2]) == PANEL_RGB


def test_clip_question_kinds():
    colour = make_clip(16, seed=2, kind="colour")
    assert colour.answer == colour.number_colour and "color" in colour.question
    for seed in range(8):
        clip = make_clip(16, seed=seed, kind="motion", needle_frame=15)
        assert clip.answer in DIRECTIONS and clip.mover["shape"] in clip.question
        (x0, y0), (x1, y1) = clip.mover_center(0), clip.mover_center(14)
        moved = {"right": x1 > x0, "left": x1 < x0, "down": y1 > y0, "up": y1 < y0}
        assert moved[clip.answer]
        assert tuple(clip.frame(0)[y0, x0]) == PALETTE[clip.mover["colour"]]
    assert set(CLIP_KINDS) == {"number", "colour", "motion"}


def test_long_clip_is_rendered_lazily():
    clip = make_clip(1000, seed=0, depth=0.25)
    assert len(clip) == 1000 and clip.needle_frame == 250
    sampled = clip.frames(np.linspace(0, 999, 9).round())
    assert sampled.shape == (9, 168, 168, 3) and sampled.dtype == np.uint8
    held = sum(v.nbytes for v in vars(clip).values() if isinstance(v, np.ndarray))
    assert held < 2 * 168 * 168 * 3  # one background texture and a sprite, not 1,000 frames


def test_clip_arguments_are_checked():
    for kwargs, match in [
        ({"needle_frame": 10}, "needle_frame"),
        ({"depth": 1.5}, "depth"),
        ({"depth": 0.5, "needle_frame": 1}, "not both"),
        ({"kind": "sound"}, "kind"),
        ({"digits": 4}, "digits"),
    ]:
        with pytest.raises(ValueError, match=match):
            make_clip(10, **kwargs)


# --- media -----------------------------------------------------------------------------------------------------------


def test_load_image_from_path_bytes_and_pil(tmp_path):
    scene = make_scene(4)
    path = tmp_path / "scene.png"
    scene.image.save(path)
    expected = np.asarray(scene.image)
    assert np.array_equal(np.asarray(load_image(path)), expected)
    assert np.array_equal(np.asarray(load_image(str(path))), expected)
    assert np.array_equal(np.asarray(load_image(path.read_bytes())), expected)
    rgba = Image.new("RGBA", (6, 4), (255, 0, 0, 0))  # transparent -> white
    image = load_image(rgba)
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (255, 255, 255)


def test_load_image_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no image file"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(ValueError, match=re.escape("is not a readable image (PIL could not decode it)")):
        load_image(b"definitely not an image")
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 200, 30)).save(buf, "PNG")
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    with pytest.raises(ValueError, match="truncated.png is not a readable image"):
        load_image(truncated)
    with pytest.raises(TypeError):
        load_image(42)


def test_write_video_round_trip_and_sampling(tmp_path):
    clip = make_clip(32, seed=9, needle_frame=20)
    path = write_video(clip, tmp_path / "clip.mp4", fps=8)
    frames = load_video(path)
    assert frames.shape == (32, 168, 168, 3) and frames.dtype == np.uint8
    assert np.abs(frames.astype(int) - clip.frames()).mean() < 8  # lossy, but close
    assert read_number(frames[20], clip) == (clip.number, clip.number_colour)  # the needle survives encoding
    assert len(load_video(path, num_frames=5)) == 5
    assert np.array_equal(load_video(path, num_frames=2), frames[[0, 31]])
    assert np.array_equal(load_video(path, stride=4), frames[::4])
    assert len(load_video(path, fps=2)) == 8  # 4 s at 8 fps
    assert len(load_video(path, stride=2, max_frames=3)) == 3
    with pytest.raises(ValueError, match="not fps and stride"):
        load_video(path, fps=2, stride=2)
    with pytest.raises(ValueError, match="positive"):
        load_video(path, num_frames=0)


def test_load_video_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no video file"):
        load_video(tmp_path / "missing.mp4")
    empty = tmp_path / "empty.mp4"  # a container with a video stream and no frames
    container = av.open(str(empty), mode="w")
    stream = container.add_stream("mpeg4", rate=8)
    stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
    container.start_encoding()
    container.close()
    with pytest.raises(ValueError, match="no decodable video frames"):
        load_video(empty)
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(bytes(range(256)) * 40)
    with pytest.raises(ValueError, match="not a readable video"):
        load_video(garbage)
    text = tmp_path / "notes.txt"
    text.write_text("not a video\n" * 20)
    with pytest.raises(ValueError, match="notes.txt"):
        load_video(text)


def test_write_video_errors_leave_no_file(tmp_path):
    with pytest.raises(ValueError, match="no frames"):
        write_video([], tmp_path / "none.mp4")
    with pytest.raises(ValueError, match="even"):
        write_video(np.zeros((2, 15, 16, 3), np.uint8), tmp_path / "odd.mp4")
    bad = [np.zeros((16, 16, 3), np.uint8), np.zeros((16, 32, 3), np.uint8)]
    with pytest.raises(ValueError, match="frame 1"):
        write_video(bad, tmp_path / "sizes.mp4")
    assert not list(tmp_path.iterdir())


# --- the haystack moved here from mmaccel.eval ---------------------------------------------------------------------


def test_the_eval_haystack_shim_is_gone():
    """The haystack lives in mmaccel.data only; the old mmaccel.eval.haystack re-export was removed."""
    import importlib

    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mmaccel.eval.haystack")
    assert haystack.make_niah_sample.__module__ == "mmaccel.data.haystack"
    assert haystack.score_answer("It is 40,817.", "40817")
