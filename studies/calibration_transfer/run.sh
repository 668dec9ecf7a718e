#!/usr/bin/env bash
# The calibration-transfer study (README.md beside this file). Resumable: rerun the same line after an interruption.
#   bash studies/calibration_transfer/run.sh [OUT] [THREADS]   (default OUT=runs/calibration_transfer, THREADS=2)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/calibration_transfer}
THREADS=${2:-2}
mkdir -p "$OUT"
S=studies/calibration_transfer
export HF_HUB_OFFLINE=1
[ -f "$S/smollm2-135m-gates-mix.json" ] || python "$S/fit.py" --out "$S" --prose "$OUT/fit_prose.txt" --threads 2
[ -f "$OUT/fit_prose.txt" ] || python -c "from mmaccel.data.haystack import stdlib_paragraphs as s; open('$OUT/fit_prose.txt','w').write(' '.join(s('train')))"
R="retrieval_heads:fraction=0.2:window=192:pattern"
M="full $R=smollm2-135m $R=$S/smollm2-135m-mix.json $R=smollm2-135m-gates $R=$S/smollm2-135m-gates-mix.json"
COMMON="--model smollm2-135m --threads $THREADS --lengths 4096 --n 10 --mode aware --methods $M --resume"
# essay-haystack tasks on the train-split prose (the new patterns' fitting source; held out for the old ones)
mmaccel ruler $COMMON --tasks niah_single_2 niah_multikey_1 niah_multivalue --haystack "$OUT/fit_prose.txt" --out "$OUT/train_prose"
# the same tasks on the eval split (the old patterns' fitting source; held out for the new ones) and the noise haystack
mmaccel ruler $COMMON --tasks niah_single_2 niah_multikey_1 niah_multivalue niah_single_1 --out "$OUT/eval_prose"
