# Twenty-first session, call 3, run on the device from the repository root:
#   bash bench/results/decode_probe/twenty-first/scripts/call3.sh
# (.whl/ as in call1.sh.) The bench's prefill (with transformers), prefix-hit and memory parts with the final code,
# into call 2's JSON (call2_vs_transformers_decode.json, which holds call 2's decode part).
. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
cp bench/results/decode_probe/twenty-first/call2_vs_transformers_decode.json $OUT/vs_transformers_decode.json
timeout 580 python3 bench/vs_transformers_decode.py --device cuda --parts prefill,prefix_hit_ttft,memory \
  --out $OUT/vs_transformers_decode.json > $OUT/prefill_bench.log 2>&1; echo "bench rc=$? t=$SECONDS"
grep -E "^\||prefill |token turn|MiB" $OUT/prefill_bench.log | tail -14
