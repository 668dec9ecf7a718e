#!/usr/bin/env bash
# Shared prefill on smollm2-135m: the same NIAH sweep (4k, 5 depths x 2 trials = 10 documents, every prefill-only
# KV method) with and without the shared prefill, one after the other, wall time of each command.
set -u
cd "$(git rev-parse --show-toplevel)"
M="full snapkv:ratio=0.25 pyramidkv:ratio=0.25 chunkkv:method=snapkv,ratio=0.25 adakv:method=snapkv,ratio=0.25 knorm:ratio=0.25 tova:ratio=0.25 h2o:ratio=0.25 streaming:window=1024 kvquant:bits=4 quest:ratio=0.19:group=max:page_size=8"
for mode in shared separate; do
  flag=""; [ $mode = separate ] && flag="--no-shared-prefill"
  out=${OUT:-runs}/sp_$mode
  echo "== $mode start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  /usr/bin/time -f "$mode wall %e s" env HF_HUB_OFFLINE=1 mmaccel niah --model smollm2-135m --threads 2 --methods $M \
    --lengths 4096 --depths 0.1 0.3 0.5 0.7 0.9 --trials 2 --max-new-tokens 8 --repeats 1 --warmup 1 \
    --chat-template on --out $out --resume --no-progress $flag
  echo "== $mode end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
done
