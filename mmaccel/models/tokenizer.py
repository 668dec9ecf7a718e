"""Byte-level BPE tokenizer for the micro-model zoo, trained offline with the `tokenizers` library."""
from __future__ import annotations

from collections.abc import Iterable

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<image>", "<video>")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 2048):
    """Train a byte-level BPE with single-digit splitting and wrap it for transformers.

    Digits are split one per token (as in Llama/PaLM), so numbers such as NIAH needle values are spelled digit by
    digit and exact-match scoring is well defined.

    Parameters
    ----------
    texts : iterable of str
        Training text.
    vocab_size : int
        Target vocabulary size, special tokens included.

    Returns
    -------
    transformers.PreTrainedTokenizerFast
        With ``<pad>`` (id 0), ``<s>`` (BOS, id 1), ``</s>`` (EOS, id 2), ``<image>`` and ``<video>`` placeholders.

    Raises
    ------
    ValueError
        If ``vocab_size`` is too small to hold the 256 bytes and the special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>", "video_token": "<video>"},
        model_max_length=1 << 20,
    )
