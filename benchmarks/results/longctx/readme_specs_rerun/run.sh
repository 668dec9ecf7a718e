# Issue 35 line 4: the README's verdict specs run exactly as printed (CPU, 1 thread, 2026-11-29). Usage: bash run.sh OUT
OUT=${1:?usage: bash run.sh OUT}
export HF_HUB_OFFLINE=1
NIAH="mmaccel niah --model smollm2-135m --device cpu --threads 1 --depths 0.1 0.3 0.5 0.7 0.9 --trials 2 --warmup 0"
# trial t uses sample seed SEED+t: seeds 0, 1 and 3 give sample seeds 0-4 (seed 0 and 1 share sample seed 1)
for S in 0 1; do $NIAH --lengths 4096 --seed $S --methods "quest:ratio=0.19" --out "$OUT/quest_s$S" --resume; done
$NIAH --lengths 4096 --seed 3 --methods full "quest:ratio=0.19" --out "$OUT/quest_s3" --resume
$NIAH --lengths 8192 --out "$OUT/rh8k" --resume \
  --methods "chunked:chunk=512:method=retrieval_heads,pattern=smollm2-135m-gates,fraction=0.2,window=192"
