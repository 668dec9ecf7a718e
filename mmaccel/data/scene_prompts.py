"""The prompt format of the zoo's LLaVA models (``smol-llava``, ``micro-llava``): how a scene question is asked and
how an answer is read, shared by their trainer (:mod:`mmaccel.zoo.train.smol_llava`) and the evaluations
(:mod:`mmaccel.eval.visual`).

The instruction is LLaVA-1.5's for short-answer VQA (Liu et al., 2023, "Improved Baselines with Visual Instruction
Tuning", arXiv:2310.03744). Further turns are written in SmolLM2's ChatML.
"""
from __future__ import annotations

#: LLaVA-1.5's instruction for short-answer VQA, appended to every question.
INSTRUCTION = "Answer the question using a single word or phrase."
#: The user turn of a caption (``--caption``): the model answers with :func:`mmaccel.data.scenes.describe_scene`.
CAPTION_PROMPT = "List the objects in the image."


def messages(question: str) -> list:
    """The chat of one question: a user turn holding the image, then the question and :data:`INSTRUCTION` (a model
    trained with the question first gets a chat template that writes the image after the text)."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"{question} {INSTRUCTION}"}]}]


def later_turn_ids(tokenizer, question: str, instruction: str | None = INSTRUCTION) -> list:
    """Token ids of a further user turn of a conversation (after an answer's EOS): ``<|im_start|>user``, the question
    and ``instruction`` (none when ``None``), ``<|im_end|>``, then ``<|im_start|>assistant``; the first turn is the
    chat template's."""
    text = question if instruction is None else f"{question} {instruction}"
    return tokenizer.encode(f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def first_word(text: str) -> str:
    """The first word of a generated answer, lower-cased, without surrounding punctuation ('' if none)."""
    words = text.strip().lower().split()
    return words[0].strip(".,;:!?\"'") if words else ""
