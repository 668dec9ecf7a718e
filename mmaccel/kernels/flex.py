"""FlexAttention backend: a ``BlockMask`` built from the shared :class:`~mmaccel.kernels.patterns.BlockPlan`.

FlexAttention (Dong et al., 2024, "Flex Attention: A Programming Model for Generating Optimized Attention
Kernels", arXiv 2412.05496) skips the tiles a ``BlockMask`` leaves out and applies ``mask_mod`` only on partial tiles.
It is compiled on CUDA. On the CPU it runs eagerly under ``torch.no_grad()``, which is correct but computes the full
score matrix, so it is only selected explicitly (tests), never by ``backend="auto"``.
"""
from __future__ import annotations

import functools
import warnings

import torch

from .patterns import BlockPlan

FLEX_BLOCK = 128


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex_fn(device: torch.device):
    from torch.nn.attention.flex_attention import flex_attention

    return _compiled_flex() if device.type == "cuda" else flex_attention


def rule_tensors(plan: BlockPlan, device: torch.device) -> dict[str, torch.Tensor]:
    """Per-head rule parameters as tensors: sink/window/gran [Hq] int64, table bool [Hq, R, C], has_table [Hq]."""
    rules = plan.rules
    rows = max([r.table.shape[0] for r in rules if r.table is not None], default=1)
    cols = max([r.table.shape[1] for r in rules if r.table is not None], default=1)
    table = torch.zeros(len(rules), rows, cols, dtype=torch.bool, device=device)
    for h, r in enumerate(rules):
        if r.table is not None:
            table[h, : r.table.shape[0], : r.table.shape[1]] = r.table.to(device)

    def vec(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    return {
        "sink": vec([r.sink for r in rules]), "window": vec([r.window for r in rules]),
        "gran": vec([r.gran for r in rules]),
        "has_table": torch.tensor([r.table is not None for r in rules], device=device), "table": table,
    }


def plan_mask_mod(plan: BlockPlan, device: torch.device, kv_lens: torch.Tensor | None):
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` evaluating the plan's per-head token rule."""
    t = rule_tensors(plan, device)
    off = plan.k_len - plan.q_len
    rows, cols = t["table"].shape[1] - 1, t["table"].shape[2] - 1

    def mask_mod(b, h, q_idx, kv_idx):
        qa = q_idx + off
        gran = t["gran"][h]
        in_table = t["table"][h, (qa // gran).clamp(max=rows), (kv_idx // gran).clamp(max=cols)] & t["has_table"][h]
        ok = (kv_idx < t["sink"][h]) | ((qa - kv_idx) < t["window"][h]) | in_table
        ok = ok & (kv_idx <= qa)
        if kv_lens is not None:
            ok = ok & (kv_idx < kv_lens[b])
        return ok

    return mask_mod


def plan_block_mask(plan: BlockPlan, batch: int, device: torch.device, kv_lens: torch.Tensor | None):
    """``BlockMask`` whose partial/full key-tile lists come from ``plan`` (tile size ``plan.block_q``)."""
    from torch.nn.attention.flex_attention import BlockMask

    num, idx = plan.kv_lists(full_only=False)
    fnum, fidx = plan.kv_lists(full_only=True)
    if kv_lens is not None:  # padded keys: every tile needs the mask
        num, idx = plan.kv_lists()
        fnum = fidx = None

    def batched(x):
        return None if x is None else x.to(device)[None].expand(batch, *x.shape).contiguous()

    return BlockMask.from_kv_blocks(
        batched(num), batched(idx), batched(fnum), batched(fidx),
        BLOCK_SIZE=(plan.block_q, plan.block_k), mask_mod=plan_mask_mod(plan, device, kv_lens),
        seq_lengths=(plan.q_len, plan.k_len),
    )


def flex_attention_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, scale: float
) -> torch.Tensor:
    """Run FlexAttention (GQA enabled); eager under ``no_grad`` on the CPU, compiled on CUDA."""
    fn = _flex_fn(q.device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        if q.device.type != "cuda":
            with torch.no_grad():
                return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
