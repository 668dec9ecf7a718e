"""Tiny random decoders of eleven architectures, built from their transformers config classes (no weights download).

Every model has 2 layers, hidden size 64, 4 query / 2 key-value heads of 16 dims, vocabulary 128, fp32, eval mode,
seeded. What makes each architecture itself is kept: Mistral's sliding window (16 tokens, so a 40-token prompt
slides), Gemma 2/3's sliding + global layer pattern, Gemma 2's attention softcap (made to bite by scaling q/k so that
attention logits reach realistic sizes), Phi-3's fused ``qkv_proj``, OLMo2's ``q_norm`` over the whole projection,
SmolLM3's no-RoPE layer, and the two mixture-of-experts MLPs.
"""
from __future__ import annotations

import torch
import transformers as tf

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, WINDOW = 128, 64, 4, 2, 16, 16
COMMON = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "max_position_embeddings": 256,
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

#: name -> (model class, config class, config overrides)
ARCHS = {
    "llama": (tf.LlamaForCausalLM, tf.LlamaConfig, {}),
    "mistral-sw": (tf.MistralForCausalLM, tf.MistralConfig, {"sliding_window": WINDOW, "head_dim": HEAD_DIM}),
    "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config, {}),
    "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config, {"head_dim": HEAD_DIM}),
    "gemma2": (tf.Gemma2ForCausalLM, tf.Gemma2Config,
               {"head_dim": HEAD_DIM, "sliding_window": WINDOW, "attn_logit_softcapping": 50.0,
                    "final_logit_softcapping": 30.0, "query_pre_attn_scalar": HEAD_DIM,
                    "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma3": (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig,
               {"head_dim": HEAD_DIM, "sliding_window": WINDOW, "query_pre_attn_scalar": HEAD_DIM,
                    "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": (tf.Phi3ForCausalLM, tf.Phi3Config, {}),
    "olmo2": (tf.Olmo2ForCausalLM, tf.Olmo2Config, {}),
    "smollm3": (tf.SmolLM3ForCausalLM, tf.SmolLM3Config, {"no_rope_layers": [1, 0]}),
    "qwen2-moe": (tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig,
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                       "shared_expert_intermediate_size": 32}),
    "mixtral": (tf.MixtralForCausalLM, tf.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}),
}

#: attention logits of this size make Gemma 2's softcap (50) change the output (a realistic size for trained models)
QK_SCALE = 30.0


def tiny_arch(name: str, *, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    """A random ``*ForCausalLM`` of architecture ``name`` (a key of :data:`ARCHS`) in eval mode, fp32, seeded.

    Architectures that transformers runs eager only (Gemma 2) get ``attn="eager"`` in place of ``"sdpa"``. For an architecture with ``attn_logit_softcapping`` the q and k projections are scaled by :data:`QK_SCALE`, so
    that the softcap changes the logits (checked by the matrix test).
    """
    model_cls, config_cls, overrides = ARCHS[name]
    if attn == "sdpa" and not getattr(model_cls, "_supports_sdpa", True):
        attn = "eager"  # Gemma 2 runs eager only (its softcap)
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **overrides}, attn_implementation=attn)
    model = model_cls(config).eval()
    if getattr(config, "attn_logit_softcapping", None):
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(QK_SCALE)
                layer.self_attn.k_proj.weight.mul_(QK_SCALE)
    return model
