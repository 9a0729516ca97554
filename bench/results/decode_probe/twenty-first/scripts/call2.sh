# Twenty-first session, call 2, run on the device from the repository root:
#   bash bench/results/decode_probe/twenty-first/scripts/call2.sh
# (.whl/ as in call1.sh.) Parts: (1) hit_vs_fp32.py, the bf16 prefix hit's first token against a bf16 and an fp32
# cold prefill; (2) the decode part of the bench with the final kernel (the clamped gather), into a copy of
# bench/results/vs_transformers_decode.json whose decode part is then taken into the tree's.
. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
timeout 220 python3 bench/results/decode_probe/twenty-first/scripts/hit_vs_fp32.py --device cuda \
  --out $OUT/hit_vs_fp32.json > $OUT/hit_vs_fp32.log 2>&1; echo "probe rc=$? t=$SECONDS"
grep -E "^conversation|Error" $OUT/hit_vs_fp32.log
cp bench/results/vs_transformers_decode.json $OUT/vs_transformers_decode.json
timeout $((585 - SECONDS)) python3 bench/vs_transformers_decode.py --device cuda --parts decode --prefill-chunk 32768 \
  --out $OUT/vs_transformers_decode.json > $OUT/decode_bench.log 2>&1; echo "bench rc=$? t=$SECONDS"
grep -E "^\||batch|tokens/s" $OUT/decode_bench.log | tail -12
