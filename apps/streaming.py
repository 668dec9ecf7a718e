"""Token streaming for the Generation tab: one untimed generation in a background thread, read while it runs.

A column's numbers always come from its measured run (:func:`mmaccel.eval.generate_measured`). A streamer inside
that run would put its own work (copying tokens out, waking the UI thread) into the timed decode loop, so the stream
is a separate, **untimed** pass of the same method on the same prompt, run before the measured one and finished
(its thread joined) before the measured run starts; its numbers are thrown away. Greedy decoding is deterministic and
every drafter is lossless, so the streamed text is the text the measured run then produces.

How each kind of method is streamed:

- plain ``generate`` (the autoregressive baseline, a KV-cache method) and transformers' own speculative paths
  (``hf_assisted``, ``hf_prompt_lookup``, ``hf_early_exit``): a ``transformers`` streamer handed to ``generate``
  through the runner's ``gen_kwargs``;
- the engine's drafters (:func:`mmaccel.speculative.speculative_generate`): the drafter is wrapped
  (:class:`StreamingDrafter`, by composition: the drafter itself is not modified) so that each ``propose`` reports the
  tokens committed so far and each ``observe`` the draft tokens the target accepted; the text then grows one
  verification step at a time, accepted drafts and all.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from mmaccel.speculative import Drafter, SpeculativeMethod

logger = logging.getLogger(__name__)


class Cancelled(RuntimeError):
    """Raised inside the streamed generation when the reader stops reading (Stop button, closed request)."""


@dataclass
class StreamState:
    """What the untimed pass has produced so far.

    Attributes
    ----------
    ids : list of int
        New token ids committed so far.
    accepted : list of int
        Per verification step so far, the draft tokens the target accepted (empty for plain ``generate``).
    done : bool
        Whether the pass has ended (then ``ids`` is its whole output, or ``error`` says why it stopped).
    error : str or None
        ``"Type: message"`` of a pass that raised.
    """

    ids: list = field(default_factory=list)
    accepted: list = field(default_factory=list)
    done: bool = False
    error: str | None = None


class _Shared:
    """The state the generation thread writes and the reader copies, under one lock."""

    def __init__(self):
        self.state = StreamState()
        self.lock = threading.Lock()
        self.changed = threading.Event()
        self.cancel = threading.Event()

    def update(self, ids=None, accepted=None) -> None:
        if self.cancel.is_set():
            raise Cancelled("the stream was closed")
        with self.lock:
            if ids is not None:
                self.state.ids = list(ids)
            if accepted is not None:
                self.state.accepted = list(accepted)
        self.changed.set()

    def snapshot(self) -> StreamState:
        with self.lock:
            s = self.state
            return StreamState(ids=list(s.ids), accepted=list(s.accepted), done=s.done, error=s.error)


class _TokenSink:
    """A ``transformers`` streamer (``put``/``end``): the first ``put`` is the prompt, every later one new tokens."""

    def __init__(self, shared: _Shared):
        self.shared, self.ids, self.seen_prompt = shared, [], False

    def put(self, value) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.ids += [int(t) for t in torch.as_tensor(value).reshape(-1).tolist()]
        self.shared.update(ids=self.ids)

    def end(self) -> None:
        """Nothing to flush: the reader takes the final output from the runner."""


class StreamingDrafter(Drafter):
    """A drafter that reports the engine's progress and otherwise is ``inner``.

    Parameters
    ----------
    inner : Drafter
        The drafter of the column's method (from :data:`mmaccel.speculative.METHODS`); every call goes to it.
    report : callable
        ``report(ids=..., accepted=...)``: the new tokens committed so far (at each :meth:`propose`, whose
        ``sequences`` are the prompt, the committed tokens and the pending one) and the accepted draft tokens per
        step (at each :meth:`observe`). It may raise :class:`Cancelled`, which ends the generation.
    """

    def __init__(self, inner: Drafter, report):
        self.inner, self.report = inner, report
        self.name, self.lossless = inner.name, inner.lossless
        self.prompt_length, self.accepted = 0, []

    def begin(self, target, input_ids, attention_mask, sampler) -> None:
        """Remember the prompt length; then ``inner.begin``."""
        self.prompt_length, self.accepted = int(input_ids.shape[1]), []
        self.inner.begin(target, input_ids, attention_mask, sampler)

    def propose(self, sequences, attention_mask, k, sampler, generator=None):
        """Report ``sequences[0, prompt:]`` (the tokens committed so far); then ``inner.propose``."""
        self.report(ids=sequences[0, self.prompt_length:].tolist())
        return self.inner.propose(sequences, attention_mask, k, sampler, generator)

    def observe(self, target_logits, draft, kept) -> None:
        """Report the accepted count; then ``inner.observe``."""
        self.accepted.append(int(kept))
        self.report(accepted=self.accepted)
        self.inner.observe(target_logits, draft, kept)

    def end(self) -> dict:
        """``inner.end()``."""
        return self.inner.end()


class TokenStream:
    """An untimed greedy generation of ``method`` in a background thread; iterate it for its progress.

    Parameters
    ----------
    model, tokenizer
        The target causal LM and its tokenizer.
    input_ids : list of int or torch.LongTensor
        One prompt ([L] or [1, L]).
    method : object
        A resolved method (:func:`mmaccel.eval.generation.resolve_method`): a KV-cache method (``full`` for the
        baseline), a :class:`~mmaccel.speculative.SpeculativeMethod` or a transformers peer. The column's measured
        run takes the same object, so a draft model is loaded once.
    max_new_tokens : int
        As in the measured run.
    interval : float
        Seconds between two states yielded while the pass runs (the UI is not updated faster).

    Notes
    -----
    Iterating yields :class:`StreamState` copies, the last with ``done=True`` and the pass's whole output (or its
    error). Leaving the loop early (or closing the iterator) cancels the pass at its next token and joins its
    thread, so nothing keeps running into the next measurement.
    """

    def __init__(self, model, tokenizer, input_ids, method, *, max_new_tokens: int, interval: float = 0.1):
        self.model, self.tokenizer, self.method = model, tokenizer, method
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        self.input_ids = (ids[None] if ids.dim() == 1 else ids).to(getattr(model, "device", "cpu"))
        self.max_new_tokens, self.interval = int(max_new_tokens), float(interval)

    def _run(self, shared: _Shared) -> None:
        from mmaccel.pipeline import generation_kwargs, runner_for

        gen_kwargs = generation_kwargs(self.model, self.tokenizer, 0.0)
        method = self.method
        try:
            with torch.inference_mode():
                if isinstance(method, SpeculativeMethod):
                    runner = SpeculativeMethod(StreamingDrafter(method.drafter, shared.update), method.num_draft_tokens)
                else:
                    runner, gen_kwargs = runner_for(method), {**gen_kwargs, "streamer": _TokenSink(shared)}
                out = runner.timed_generate(self.model, self.input_ids, max_new_tokens=self.max_new_tokens,
                                            gen_kwargs=gen_kwargs)
            with shared.lock:
                shared.state.ids = list(out["new_ids"])
                shared.state.accepted = list(out["telemetry"].get("accepted", shared.state.accepted))
        except Cancelled:
            pass
        except Exception as exc:  # noqa: BLE001 - the measured run will report it in the column
            logger.warning("streamed preview failed: %s: %s", type(exc).__name__, exc)
            with shared.lock:
                shared.state.error = f"{type(exc).__name__}: {exc}"
        finally:
            with shared.lock:
                shared.state.done = True
            shared.changed.set()

    def __iter__(self) -> Iterator[StreamState]:
        shared = _Shared()
        thread = threading.Thread(target=self._run, args=(shared,), name="mmaccel-token-stream", daemon=True)
        thread.start()
        try:
            last = -1
            while True:
                shared.changed.wait()
                shared.changed.clear()
                state = shared.snapshot()
                if state.done:
                    yield state
                    return
                if len(state.ids) != last:
                    last = len(state.ids)
                    yield state
                time.sleep(self.interval)  # at most one UI update per interval
        finally:
            shared.cancel.set()
            thread.join()
