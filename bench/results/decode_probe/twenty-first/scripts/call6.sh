# Twenty-first session, call 6, run on the device from the repository root:
#   bash bench/results/decode_probe/twenty-first/scripts/call6.sh
# (.whl/ as in call1.sh.) (1) Which test call 5 counted as skipped: tests/serve/test_harness.py skips at collection
# without lm_eval (it has no gpu test); (2) hit_vs_fp32.py with --fp32-hit: the bf16 comparison of call 2 plus an
# fp32 hit against an fp32 cold prefill at 32K, 4 conversations.
. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
timeout 60 python3 -m pytest -p no:cacheprovider -m gpu -rs -q tests/serve/test_harness.py > $OUT/harness_skip.txt 2>&1
tail -3 $OUT/harness_skip.txt
timeout 480 python3 bench/results/decode_probe/twenty-first/scripts/hit_vs_fp32.py --device cuda --conversations 4 \
  --fp32-hit --out $OUT/hit_vs_fp32_with_fp32_hit.json > $OUT/hit_vs_fp32_with_fp32_hit.log 2>&1
echo "probe rc=$? t=$SECONDS"; grep -E "^conversation|Error" $OUT/hit_vs_fp32_with_fp32_hit.log
