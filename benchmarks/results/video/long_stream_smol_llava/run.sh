# issue 37 line 2 on smol-llava: frames vs exact peak, streamed, StreamingLLM window 2,048 (one clip per frame count)
F=$1; OUT=$2
HF_HUB_OFFLINE=1 nice -n 5 mmaccel video-niah --model smol-llava --threads 1 --stream --frames $F --depths 0.5 \
  --trials 1 --warmup 0 --memory-meter allocator --resume --no-progress --out $OUT \
  --methods "pooling:keep_ratio=0.0625:positions=contiguous+chunked:chunk=1024:method=streaming,window=2048"
