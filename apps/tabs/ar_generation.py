"""The Image & video generation tab (endpoint ``/ar_generation``): ``micro-ar`` paints one prompt, image or clip, in
each column with the autoregressive baseline or a speculative method, and the pictures are shown side by side.

``micro-ar`` (:mod:`mmaccel.zoo.train.micro_ar`) is a tiny LlamaGen-style autoregressive model over palette tokens:
a prompt of words from :data:`mmaccel.data.palette.WORDS` (``"red circle at top-left on white"``), then one token
per pixel in raster order with a row token before each row, a ``16 x 16`` image (272 tokens) or 8 frames of ``8 x 8``
(576 tokens). The columns' methods:

- ``autoregressive``: ``model.generate``, one target forward per token;
- ``sjd``: Speculative Jacobi Decoding (Teng et al., "Accelerating Auto-regressive Text-to-Image Generation with
  Training-free Speculative Jacobi Decoding", 2024, arXiv 2410.01699), ``init=random|neighbour|previous_frame``;
- ``lantern``: LANTERN's relaxed acceptance over latent neighbourhoods around SJD (Jang et al., "LANTERN:
  Accelerating Visual Autoregressive Models with Relaxed Speculative Decoding", 2024, arXiv 2410.03355; lossy);
- the model-free text drafters of :data:`mmaccel.speculative.METHODS` that run on any target (``jacobi``,
  ``prompt_lookup``).

Every number comes from :func:`mmaccel.eval.generate_measured` (one warm-up, medians of ``repeats`` runs) through the
shared speculative engine (:func:`mmaccel.speculative.speculative_generate`); palette accuracy scores the picture
against the prompt's rendering (:func:`mmaccel.data.palette.render_prompt`).
"""
from __future__ import annotations

import base64
import html
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import numpy as np

from .. import forms
from ..columns import column_outputs, column_row, run_buttons
from ..common import (
    AUTOREGRESSIVE,
    LOAD_FAILED,
    MAX_COLUMNS,
    MEASURED,
    TEXT_STYLE,
    ColumnResult,
    InputError,
    Request,
    Tab,
    error_text,
    ratio_figure,
    rounded,
)

AR_MODEL = "micro-ar"
"""The model preselected in the tab."""
DEFAULT_PROMPTS = {"image": "red circle at top-left and blue square at bottom-right on white",
                   "video": "yellow circle at center moving down on navy"}
"""The prompt shown at start (image) and after switching the kind."""
DEFAULTS = [(AUTOREGRESSIVE, None), ("sjd", {"init": "neighbour"}), ("lantern", None),
            ("sjd", {"init": "previous_frame"})]
"""The method and starting field values of each column."""
DEFAULT_WINDOW = 32
"""Draft tokens per verification step (the Jacobi window) unless a spec sets ``window=``."""
MODEL_FREE = ("jacobi", "prompt_lookup", "pld")
"""Drafters of :data:`mmaccel.speculative.METHODS` that need no draft model or skip set, so they run on ``micro-ar``."""
ARGEN_RATIO_METRICS = ("seconds", "target forwards", "tokens/s")
"""Metrics of the tab's ratio plot."""
SCALE = {"image": 16, "video": 24}
"""Upscaling factor of the shown pictures (nearest neighbour): a 256 px image, 192 px clip frames."""
STRIP_SCALE = 6
"""Upscaling factor of a clip's frame strip in the column text."""


def ar_methods() -> dict[str, type]:
    """The methods a column can pick: SJD and LANTERN (:mod:`mmaccel.speculative.sjd`, :mod:`.lantern`) and the
    model-free drafters of :data:`mmaccel.speculative.METHODS` (:data:`MODEL_FREE`); registry entries that are SJD or
    LANTERN classes are taken too, so registering them there changes nothing here.

    Returns
    -------
    dict
        Name -> drafter class (aliases such as ``pld`` kept; the column dropdown lists each class once).
    """
    from mmaccel.speculative import METHODS
    from mmaccel.speculative.lantern import Lantern
    from mmaccel.speculative.sjd import SpeculativeJacobi

    registry: dict[str, type] = {"sjd": SpeculativeJacobi, "lantern": Lantern}
    for name, cls in METHODS.items():
        if name in MODEL_FREE or (isinstance(cls, type) and issubclass(cls, (SpeculativeJacobi, Lantern))):
            registry.setdefault(name, cls)
    return registry


def check_palette_tokenizer(tokenizer, model_name: str) -> None:
    """Refuse a model that does not speak ``micro-ar``'s token layout.

    Raises
    ------
    InputError
        If the tokenizer lacks ``<image>`` / ``<video>``, its row tokens ``<r00>`` .. ``<r15>`` are not at
        :data:`~mmaccel.zoo.train.micro_ar.ROW_TOKEN_OFFSET` onwards, or it does not know every prompt word.
    """
    from mmaccel.data.palette import WORDS
    from mmaccel.zoo.train.micro_ar import LAYOUT, ROW_TOKEN_OFFSET, ROW_TOKENS

    vocab = tokenizer.get_vocab()
    starts = [LAYOUT[k][0] for k in LAYOUT]
    rows_ok = [vocab.get(t) for t in ROW_TOKENS] == list(range(ROW_TOKEN_OFFSET, ROW_TOKEN_OFFSET + len(ROW_TOKENS)))
    if not rows_ok or any(t not in vocab for t in (*starts, *WORDS)):
        raise InputError(f"{model_name!r} is not a palette-token image/video model like {AR_MODEL}: its tokenizer "
                         f"needs {' and '.join(starts)}, the row tokens {ROW_TOKENS[0]} .. {ROW_TOKENS[-1]} at ids "
                         f"{ROW_TOKEN_OFFSET}.. and the prompt words (mmaccel.zoo.train.micro_ar)")


def palette_prompt(tokenizer, prompt: str, kind: str) -> tuple[list[int], str, np.ndarray | None, str]:
    """The prompt's token ids and, when the prompt follows the grammar for ``kind``, its target picture.

    Parameters
    ----------
    prompt : str
        Words of :data:`mmaccel.data.palette.WORDS` (case and extra spaces are ignored).
    kind : {"image", "video"}

    Returns
    -------
    ids : list of int
        ``<s> words <image>`` (or ``<video>``), :func:`mmaccel.zoo.train.micro_ar.prompt_ids`.
    prompt : str
        The normalised prompt.
    target : numpy.ndarray or None
        uint8 palette indices, ``[16, 16]`` (image) or ``[8, 8, 8]`` (clip): :func:`mmaccel.data.palette.render_prompt`;
        ``None`` when the prompt does not follow the grammar or describes the other kind (no accuracy then).
    note : str
        Why there is no target (``""`` when there is one).

    Raises
    ------
    InputError
        An unknown kind, an empty prompt, or words outside the vocabulary (the message lists the allowed words).
    """
    from mmaccel.data.palette import KINDS, WORDS, render_prompt
    from mmaccel.zoo.train.micro_ar import LAYOUT, prompt_ids

    if kind not in KINDS:
        raise InputError(f"unknown kind {kind!r}; use one of {', '.join(KINDS)}")
    prompt = " ".join(str(prompt or "").lower().split())
    if not prompt:
        raise InputError(f"the prompt is empty; e.g. {DEFAULT_PROMPTS[kind]!r}")
    unknown = [w for w in prompt.split() if w not in WORDS]
    if unknown:
        raise InputError(f"{', '.join(map(repr, unknown))} not in {AR_MODEL}'s vocabulary; the allowed words are: "
                         f"{', '.join(WORDS)}")
    ids = prompt_ids(tokenizer, prompt, kind)
    try:
        target = render_prompt(prompt)
    except ValueError as exc:
        return ids, prompt, None, f"no target picture, so no palette accuracy: {exc}"
    if target.shape != LAYOUT[kind][2]:
        other = "a clip" if target.ndim == 3 else "an image"
        return ids, prompt, None, (f"the prompt describes {other}, not {'an image' if kind == 'image' else 'a clip'}: "
                                   "no target picture, so no palette accuracy")
    return ids, prompt, target, ""


def build_ar_method(spec: str, kind: str, *, window: int = DEFAULT_WINDOW, vocab_size: int | None = None,
                    registry: dict | None = None):
    """The measured-generation method of a column spec, its raster arguments filled in for ``kind``.

    Parameters
    ----------
    spec : str
        ``"autoregressive"``, or a method of :func:`ar_methods` with its arguments (``"sjd:init=neighbour"``,
        ``"lantern:k=3:delta=0.3"``) and optionally ``window=N`` (draft tokens per step).
    kind : {"image", "video"}
        Sets what the spec leaves out: SJD's (and LANTERN's inner SJD's) ``width`` / ``frame`` from
        :data:`~mmaccel.zoo.train.micro_ar.RASTER` (17 / 272 tokens for an image, 9 / 72 for a clip) and
        ``init_tokens`` (the 16 palette tokens); LANTERN's ``init`` (``neighbour`` for an image, ``previous_frame``
        for a clip, as in ``benchmarks/sjd_micro_ar.py``) and its ``neighbours``, nearest palette colours by RGB
        distance (:func:`~mmaccel.speculative.lantern.latent_neighbours`).
    window : int
        Draft tokens per step when the spec sets no ``window``, ``>= 1``.
    vocab_size : int, optional
        The model's vocabulary (rows of LANTERN's neighbour table); default ``micro-ar``'s 71.
    registry : dict, optional
        Default :func:`ar_methods`.

    Returns
    -------
    mmaccel.speculative.SpeculativeMethod or None
        ``None`` for the autoregressive baseline.

    Raises
    ------
    ValueError
        An unknown method (the message lists the choices), an argument the method does not take, a bad value (e.g.
        ``init=spiral``, ``window=0``).
    """
    import torch

    from mmaccel.data.palette import PALETTE16
    from mmaccel.specs import MethodSpec, build_from_registry, parse_method_spec
    from mmaccel.speculative import SpeculativeMethod
    from mmaccel.speculative.lantern import Lantern, latent_neighbours
    from mmaccel.speculative.sjd import SpeculativeJacobi
    from mmaccel.zoo.train.micro_ar import RASTER

    parsed = parse_method_spec(spec)
    if parsed.name == AUTOREGRESSIVE:
        return None
    registry = ar_methods() if registry is None else registry
    if parsed.name not in registry:
        raise ValueError(f"unknown method {parsed.name!r} for {AR_MODEL}; choose one of: {AUTOREGRESSIVE}, "
                         f"{', '.join(forms.unique_names(registry))} (syntax: name:key=value, e.g. sjd:init=neighbour)")
    kwargs = dict(parsed.kwargs)
    window = kwargs.pop("window", window)
    cls = registry[parsed.name]
    width, frame = RASTER[kind]
    palette = range(len(PALETTE16))
    filled: dict = {}
    if issubclass(cls, SpeculativeJacobi):
        filled = {"width": width, "frame": frame, "init_tokens": palette}
    elif issubclass(cls, Lantern):
        k = kwargs.get("k", 4)
        rgb = torch.tensor(list(PALETTE16.values()), dtype=torch.float32)
        table = latent_neighbours(rgb, max(len(PALETTE16), k if isinstance(k, int) and k > 0 else 1),
                                  vocab_size=vocab_size or 71, token_ids=palette)
        filled = {"init": "previous_frame" if kind == "video" else "neighbour", "width": width, "frame": frame,
                  "init_tokens": palette, "neighbours": table}
    drafter = build_from_registry(MethodSpec(parsed.name, {**filled, **kwargs}, parsed.text), registry, "method")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window (draft tokens per step) must be an int >= 1, got {window!r}")
    return SpeculativeMethod(drafter, window)


def picture_of(tokens, kind: str) -> np.ndarray:
    """Generated tokens as palette indices (:func:`~mmaccel.zoo.train.micro_ar.tokens_to_picture`): ``[16, 16]``
    or ``[8, 8, 8]`` uint8, 255 where the token is not a palette colour (a row token out of place, or a picture cut
    short by an early ``</s>``, padded)."""
    from mmaccel.zoo.train.micro_ar import LAYOUT, tokens_to_picture

    n = LAYOUT[kind][1]
    tokens = list(tokens)[:n]
    return tokens_to_picture(tokens + [-1] * (n - len(tokens)), kind)


def save_column_picture(indices: np.ndarray, folder: Path, stem: str, kind: str) -> Path:
    """Write a picture for display with :func:`mmaccel.data.palette.save_picture`, each pixel a block of
    :data:`SCALE` pixels (nearest neighbour): an image as PNG, a clip as a looping animated GIF (4 frames/s).
    Non-palette pixels (255) are drawn black, as in ``benchmarks/sjd_micro_ar.py``."""
    from mmaccel.data.palette import save_picture

    path = Path(folder) / f"{stem}{'.png' if kind == 'image' else '.gif'}"
    return save_picture(np.where(indices == 255, 0, indices), path, scale=SCALE[kind])


def frame_strip_uri(indices: np.ndarray, folder: Path, stem: str) -> str:
    """A clip's frames side by side as a ``data:image/png`` URI (each pixel :data:`STRIP_SCALE` pixels wide)."""
    from mmaccel.data.palette import save_picture

    path = save_picture(np.where(indices == 255, 0, indices), Path(folder) / f"{stem}-strip.png", scale=STRIP_SCALE)
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


@dataclass
class ARRun:
    """One column's measured generation.

    Attributes
    ----------
    spec : str
        The column's spec.
    record : mmaccel.eval.generation.RunRecord
        What :func:`~mmaccel.eval.generate_measured` returned (``ok``).
    picture : numpy.ndarray
        ``[16, 16]`` or ``[8, 8, 8]`` uint8 palette indices of the last measured run, 255 = not a palette token.
    seconds : float
        Median wall seconds of one picture over the measured runs (prefill and every forward included).
    target_forwards : int
        Target forward passes of the last run (autoregressive: one per token, the prompt's included).
    mean_accepted_length : float
        Tokens committed per verification forward (1.0 for the autoregressive baseline).
    lossless : bool
        Whether the method keeps the target's distribution (LANTERN does not).
    """

    spec: str
    record: object
    picture: np.ndarray
    seconds: float
    target_forwards: int
    mean_accepted_length: float
    lossless: bool

    @property
    def new_tokens(self) -> int:
        """Generated tokens (272 for an image, 576 for a clip unless ``</s>`` came early)."""
        return int(self.record.new_tokens)


def measured_run(model, tokenizer, ids: list[int], spec: str, method, kind: str, *, temperature: float, seed: int,
                 repeats: int) -> ARRun:
    """One column: :func:`mmaccel.eval.generate_measured` (one warm-up, ``repeats`` measured runs) after
    ``torch.manual_seed(seed)``, so sampled columns are reproducible.

    Parameters
    ----------
    ids : list of int
        The prompt (:func:`palette_prompt`).
    method : SpeculativeMethod or None
        From :func:`build_ar_method` (``None``: ``model.generate``).
    temperature : float
        ``0`` = greedy; ``> 0`` = sampling (the engine's lossless speculative sampling for SJD).

    Raises
    ------
    RuntimeError
        When a run failed (the message holds the record's error, e.g. ``OutOfMemoryError: ...``).
    ValueError
        Configuration errors from :func:`~mmaccel.eval.generate_measured`.
    """
    import torch

    from mmaccel.eval.generation import generate_measured
    from mmaccel.zoo.train.micro_ar import LAYOUT

    torch.manual_seed(int(seed))
    rec = generate_measured(model, tokenizer, ids, method=method, label=AUTOREGRESSIVE if method is None else spec,
                            max_new_tokens=LAYOUT[kind][1], repeats=repeats, warmup=1, temperature=temperature)
    if not rec.ok:
        raise RuntimeError(f"the measured run failed: {rec.error}")
    tel = rec.telemetry or {}
    if method is None:
        rec.method_name = AUTOREGRESSIVE
    seconds = statistics.median((s["ttft_s"] or 0.0) + (s["decode_s"] or 0.0) for s in rec.samples)
    return ARRun(spec=spec, record=rec, picture=picture_of(rec.output_ids, kind), seconds=float(seconds),
                 target_forwards=int(tel.get("target_forwards", rec.new_tokens)),
                 mean_accepted_length=float(tel.get("mean_accepted_length") or 1.0),
                 lossless=bool(tel.get("lossless", True)))


def ar_rows(run: ARRun, target: np.ndarray | None, reference: ARRun | None, greedy: bool) -> list[list]:
    """Metric rows ``[name, number]`` of one column.

    ``seconds`` (median wall seconds per picture), ``tokens/s``, ``target forwards``, ``mean accepted length``
    (tokens per verification forward), ``forward ratio vs AR`` (autoregressive decoding's forwards for the same
    tokens, one per token, over this run's), ``palette accuracy`` (fraction of pixels equal to ``target``; ``None``
    without one), ``identical to AR (greedy)`` (1 / 0 against ``reference``, the autoregressive column; ``None`` when
    sampling or without one), ``new tokens`` and ``non-palette pixels``.
    """
    from mmaccel.data.palette import palette_accuracy

    n = run.new_tokens
    identical = None
    if greedy and reference is not None:
        identical = int(run.record.output_ids == reference.record.output_ids)
    return [
        ["seconds", rounded(run.seconds)],
        ["tokens/s", rounded(n / run.seconds, 1) if run.seconds > 0 else None],
        ["target forwards", run.target_forwards],
        ["mean accepted length", rounded(run.mean_accepted_length, 3)],
        ["forward ratio vs AR", rounded(n / run.target_forwards, 3) if run.target_forwards else None],
        ["palette accuracy", None if target is None else rounded(palette_accuracy(run.picture, target), 4)],
        ["identical to AR (greedy)", identical],
        ["new tokens", n],
        ["non-palette pixels", int((run.picture == 255).sum())],
    ]


def run_html(run: ARRun, window: int | None, strip: str = "") -> str:
    """A column's text: the method, whether it is lossless, its window, and a clip's frames side by side."""
    what = ("one target forward per token (model.generate)" if run.record.method_name == AUTOREGRESSIVE else
            f"{run.mean_accepted_length:.2f} tokens per verification forward, window {window}; "
            + ("lossless" if run.lossless else "<b>lossy</b> (relaxed acceptance)"))
    frames = (f'<div style="margin-top:6px"><small>frames 1 to {run.picture.shape[0]}:</small><br><img '
              f'class="mm-frames" alt="frames" src="{strip}" style="width:100%;image-rendering:pixelated"></div>'
              if strip else "")
    return (f'<div class="mm-output" style="{TEXT_STYLE}"><b>{html.escape(run.spec)}</b>: {run.new_tokens} tokens '
            f"in {run.target_forwards} target forwards<br><small>{what}</small>{frames}</div>")


def argen_intro() -> str:
    """The tab's text: what runs, the prompt grammar and the allowed words (:mod:`mmaccel.data.palette`)."""
    from mmaccel.data.palette import BACKGROUNDS, DIRECTIONS, OBJECT_COLOURS, POSITIONS, SHAPES

    def words(xs):
        return ", ".join(f"`{w}`" for w in xs)

    return (f"**Autoregressive image and video generation with `{AR_MODEL}`**, a tiny LlamaGen-style model that "
            "paints one palette token per pixel (16 x 16 images: 272 tokens; 8 frames of 8 x 8: 576 tokens). Each "
            "column paints the same prompt: `autoregressive` (`model.generate`), "
            "[SJD](https://arxiv.org/abs/2410.01699) (speculative Jacobi decoding; `init=random`, `neighbour`: the "
            "pixel above, `previous_frame`: the same pixel one frame back), "
            "[LANTERN](https://arxiv.org/abs/2410.03355) (relaxed acceptance over nearby palette colours around SJD; "
            "lossy), or a model-free text drafter (`jacobi`, `prompt_lookup`). Leave SJD's `width`, `frame` and "
            "`init_tokens` empty: the tab fills them from the model's raster and palette. A spec may set "
            "`window=N` (draft tokens per step) instead of the window below. Greedy SJD paints exactly the "
            "autoregressive picture in fewer target forwards.\n\n"
            "**Prompt grammar.** Image: `<colour> <shape> at <position> [and <colour> <shape> at <position>] on "
            "<background>`. Clip: `<colour> <shape> at <lane> moving <direction> on <background>` (lanes: "
            "`top`/`center`/`bottom` for left/right, `left`/`center`/`right` for up/down).\n"
            f"- colours: {words(OBJECT_COLOURS)}\n- backgrounds: {words(BACKGROUNDS)}\n- shapes: {words(SHAPES)}\n"
            f"- positions: {words(POSITIONS)}\n- directions: {words(DIRECTIONS)}\n"
            "- and: `at`, `on`, `and`, `moving`")


def sample_prompt(kind: str) -> str:
    """A random held-out prompt of ``kind`` (the test split of :func:`mmaccel.data.palette.make_palette_sample`)."""
    from mmaccel.data.palette import make_palette_sample
    from mmaccel.data.splits import split_seed

    kind = kind if kind in DEFAULT_PROMPTS else "image"
    return make_palette_sample(split_seed("test", 0, random.randrange(1000)), kind).prompt


def prompt_for_kind(kind: str, prompt: str) -> str:
    """The prompt after switching to ``kind``: the kind's default when the prompt was the other kind's default or
    does not describe this kind, else unchanged."""
    from mmaccel.data.palette import render_prompt

    try:
        fits = (render_prompt(prompt).ndim == 3) == (kind == "video")
    except ValueError:
        fits = False
    return prompt if fits and prompt not in DEFAULT_PROMPTS.values() else DEFAULT_PROMPTS.get(kind, prompt)


class ARGenerationTab(Tab):
    """Handler and layout of the Image & video generation tab."""

    title, key = "Image & video generation", "argen"

    def ar_generation(self, model_name, prompt, kind, temperature, seed, window, repeats, n_columns, spec1, spec2,
                      spec3, spec4, trust_remote_code=False,
                      progress=gr.Progress()):  # noqa: B008 - how Gradio injects progress
        """Image & video generation: the same prompt painted by each column's method, one column after another.

        Parameters
        ----------
        model_name : str
            ``micro-ar`` or a local checkpoint with its token layout (:func:`check_palette_tokenizer`).
        prompt : str
            Words of :data:`mmaccel.data.palette.WORDS` (:func:`palette_prompt`).
        kind : {"image", "video"}
            A ``16 x 16`` image (272 tokens) or a clip of 8 frames of ``8 x 8`` (576 tokens).
        temperature : float
            ``0`` = greedy (every lossless method paints the autoregressive picture); ``> 0`` = sampling.
        seed : int
            ``torch.manual_seed`` before each column (sampling only).
        window : int
            Draft tokens per step of the speculative columns whose spec sets no ``window=`` (``>= 1``).
        repeats : int
            Measured runs per column (``>= 1``) after one warm-up; seconds are their median.
        n_columns : int
            2 to 4; ``spec1..spec4``: each column's spec (:func:`build_ar_method`).

        Yields
        ------
        list
            ``[status, target picture, (html, metrics) x 4, picture x 4, ratio plot]``: pictures are file paths (PNG
            for an image, animated GIF for a clip; the column text shows a clip's frames side by side), metrics
            :func:`ar_rows`. An unknown model, a model with another token layout, words outside the vocabulary or
            bad settings put an error in every column; a bad spec or a failed run in its own column only.
        """
        ctx = self.ctx
        pictures: list = [None] * MAX_COLUMNS
        target_path = None

        def tail(final):
            return [*pictures, ratio_figure(specs, results, ARGEN_RATIO_METRICS) if final else None]

        req = Request(ctx, n_columns, (spec1, spec2, spec3, spec4), empty=AUTOREGRESSIVE, head=lambda: [target_path],
                      tail=tail)
        n, specs, results, outputs = req.n, req.specs, req.results, req.outputs
        try:
            temperature = float(temperature or 0.0)
            seed, window, repeats = int(seed or 0), int(window or 0), int(repeats or 0)
            if temperature < 0 or repeats < 1 or window < 1:
                raise InputError(f"need temperature >= 0, window >= 1 and repeats >= 1; got {temperature:g}, {window} "
                                 f"and {repeats}")
        except (TypeError, ValueError) as exc:
            yield req.fail_all(str(exc))
            return
        model, tok = req.load(model_name, progress, trust_remote_code)
        if model is None:
            yield outputs(LOAD_FAILED, final=True)
            return
        try:
            check_palette_tokenizer(tok, model_name)
            ids, prompt, target, note = palette_prompt(tok, prompt, kind)
        except ValueError as exc:
            yield req.fail_all(str(exc))
            return
        with self.ctx.request_folder("argen-") as folder:  # pictures are shown from here, then removed
            folder = Path(folder)
            if target is not None:
                target_path = str(save_column_picture(target, folder, "target", kind))
            vocab = int(model.get_output_embeddings().weight.shape[0])
            runs: list = [None] * n
            for i, spec in enumerate(specs):
                progress((i, n), desc=f"column {i + 1}: {spec}")
                yield outputs(f"running column {i + 1} of {n} ({spec}) ...")
                try:
                    method = build_ar_method(spec, kind, window=window, vocab_size=vocab)
                    run = measured_run(model, tok, ids, spec, method, kind, temperature=temperature, seed=seed,
                                       repeats=repeats)
                except Exception as exc:  # noqa: BLE001 - bad spec, bad value, a failed run: this column only
                    results[i] = ColumnResult.failure(error_text(exc))
                    continue
                runs[i] = run
                pictures[i] = str(save_column_picture(run.picture, folder, f"col{i + 1}", kind))
                strip = frame_strip_uri(run.picture, folder, f"col{i + 1}") if kind == "video" else ""
                results[i] = ColumnResult(html=run_html(run, None if method is None else method.num_draft_tokens, strip),
                                          record=run)
            reference = next((r for r in runs if r is not None and r.record.method_name == AUTOREGRESSIVE), None)
            greedy = temperature == 0
            for i, run in enumerate(runs):
                if run is not None:
                    results[i].rows = ar_rows(run, target, reference, greedy)
            done = [r for r in runs if r is not None]
            check = ""
            if greedy and reference is not None:
                same = [r.spec for r in done if r.record.output_ids == reference.record.output_ids]
                check = (f" Greedy: {len(same)} of {len(done)} column(s) painted exactly the autoregressive picture "
                         "(lossless methods must).")
            elif greedy:
                check = " Add an `autoregressive` column to check that greedy SJD paints exactly its picture."
            what = "16 x 16 image" if kind == "image" else "clip of 8 frames of 8 x 8"
            status = (f"Ran {n} configuration(s) one after another on the same prompt ({prompt!r}, a {what}), "
                      f"{'greedy' if greedy else f'sampled at temperature {temperature:g}, seed {seed}'}, each after "
                      f"one warm-up run; seconds are medians of {repeats} run(s) (mmaccel.eval.generate_measured)."
                      + check + (f" Note: {note}." if note else ""))
            yield outputs(status, final=True)

    def build(self, model) -> None:
        """The tab: its own model picker, prompt, kind, temperature, seed, window, repeats, the columns; the target
        picture, each column's picture and metrics, and the ratio plot."""
        gr.Markdown(argen_intro(), elem_id="argen-about")
        with gr.Row():
            with gr.Column(scale=3):
                ar_model = gr.Dropdown(choices=[AR_MODEL], value=AR_MODEL, allow_custom_value=True,
                                       label="model (micro-ar or a local checkpoint with its token layout)",
                                       elem_id="argen-model")
                with gr.Row():
                    prompt = gr.Textbox(DEFAULT_PROMPTS["image"], label="prompt (palette words, see above)",
                                        elem_id="argen-prompt", scale=4)
                    sample = gr.Button("held-out prompt", elem_id="argen-sample", scale=1)
                with gr.Row():
                    kind = gr.Radio(["image", "video"], value="image", label="kind", elem_id="argen-kind")
                    temperature = gr.Number(0.0, label="temperature (0 = greedy)", minimum=0,
                                            elem_id="argen-temperature")
                    seed = gr.Number(0, label="seed", precision=0, minimum=0, elem_id="argen-seed")
                    window = gr.Number(DEFAULT_WINDOW, label="window (draft tokens per step)", precision=0, minimum=1,
                                       elem_id="argen-window")
                    repeats = gr.Number(3, label="repeats (median)", precision=0, minimum=1, elem_id="argen-repeats")
            with gr.Column(scale=2):
                target = gr.Image(label="target: the prompt rendered (what palette accuracy scores against)",
                                  type="filepath", interactive=False, elem_id="argen-target")
        ncols, cols = column_row("argen", ar_methods(), [m for m, _ in DEFAULTS],
                                 extra={AUTOREGRESSIVE: "Plain decoding with model.generate: the baseline."},
                                 initial=[v for _, v in DEFAULTS])
        run, stop = run_buttons("argen")
        status = gr.Markdown(elem_id="argen-status")
        outs, imgs = column_outputs("argen", cols, ncols, image="generated picture (a clip: animated GIF)")
        plot = gr.Plot(label="ratios to column 1", elem_id="argen-plot")
        kind.change(prompt_for_kind, [kind, prompt], prompt, queue=False, api_visibility="private")
        sample.click(sample_prompt, kind, prompt, queue=False, api_visibility="private")
        ev = run.click(self.ar_generation,
                       [ar_model, prompt, kind, temperature, seed, window, repeats, ncols, *[c.spec for c in cols],
                        *self.ctx.extra_inputs],
                       [status, target, *outs, *imgs, plot], api_name="ar_generation", **MEASURED)
        stop.click(None, cancels=[ev], api_visibility="private")
