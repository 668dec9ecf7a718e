"""The tiny random Llama the tests build (no weights are downloaded): one builder, shared by the test modules."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(
    *,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    vocab_size: int = 128,
    max_positions: int = 512,
    attn: str = "sdpa",
    tokenizer=None,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A random ``LlamaForCausalLM`` in eval mode, fp32, seeded.

    GQA with ``heads`` query and ``kv_heads`` key/value heads of ``head_dim``; MLP width 128. With ``tokenizer``,
    the vocabulary size and the BOS/EOS/PAD ids are taken from it.
    """
    torch.manual_seed(seed)
    special = {}
    if tokenizer is not None:
        vocab_size = len(tokenizer)
        special = {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=heads * head_dim,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        attn_implementation=attn,
        **special,
    )
    return LlamaForCausalLM(config).eval()


def random_prompt(length: int, seed: int = 1, batch: int = 1, vocab_size: int = 128) -> torch.Tensor:
    """Seeded random token ids [batch, length] for the tiny Llama."""
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))
