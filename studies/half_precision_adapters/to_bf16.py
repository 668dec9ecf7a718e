"""Rewrite a safetensors file with its floating-point tensors in bfloat16; other tensors and the metadata unchanged.

    python studies/half_precision_adapters/to_bf16.py SRC.safetensors DST.safetensors
"""
import argparse

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst", help="may be SRC itself (the file is read whole first)")
    args = ap.parse_args(argv)
    with safe_open(args.src, "pt") as f:
        meta = f.metadata()
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    save_file(state, args.dst, metadata=meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
