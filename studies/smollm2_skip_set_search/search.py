"""The search behind mmaccel/speculative/skip_sets/smollm2-135m.json (and micro-lm.json).

smollm2-135m: calibration = 4 chat requests and 2 copy-heavy prompts (spec-bench copy set, seed 1: none of the
benchmark's prompts) with the model's own greedy answers (../smollm2_pld_replay/greedy_outputs.jsonl.gz, made by
../smollm2_pld_replay/collect.py), chat template, 256 tokens each at most; 1 thread.
micro-lm: the first 8 stdlib_paragraphs("train") longer than 400 characters.

Usage: python search.py OUT_DIR
"""
import gzip
import json
import logging
import sys
import time
from pathlib import Path

import torch

import mmaccel
from mmaccel.data.haystack import stdlib_paragraphs
from mmaccel.speculative.layer_skip import search_skip_layers

HERE = Path(__file__).parent


def main(out: Path) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    model, tok = mmaccel.load("micro-lm", device="cpu")
    texts = [p for p in stdlib_paragraphs("train") if len(p) > 400][:8]
    found = search_skip_layers(model, texts, tokenizer=tok, model_name="micro-lm")
    found.found_by["calibration"] = ("the first 8 stdlib_paragraphs('train') longer than 400 characters, 512 tokens "
                                     "each at most")
    found.save(out / "micro-lm.json")

    model, tok = mmaccel.load("smollm2-135m", device="cpu")
    greedy = HERE.parent / "smollm2_pld_replay" / "greedy_outputs.jsonl.gz"
    recs = [json.loads(line) for line in gzip.decompress(greedy.read_bytes()).splitlines()]
    chosen = [r for r in recs if r["set"] == "tune_free"][:4] + [r for r in recs if r["set"] == "tune_copy"][:2]
    t0 = time.time()
    found = search_skip_layers(model, [torch.tensor([r["prompt"] + r["output"]]) for r in chosen], max_tokens=256,
                               model_name="smollm2-135m")
    found.found_by["calibration"] = (
        "4 chat requests and 2 copy-heavy prompts (spec-bench copy set, seed 1; none of the benchmark's prompts) with "
        "smollm2-135m-instruct's own greedy answers, chat template, 256 tokens each at most")
    found.found_by["search_seconds"] = round(time.time() - t0, 1)
    found.save(out / "smollm2-135m.json")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
