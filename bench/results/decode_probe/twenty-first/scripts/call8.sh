# Twenty-first session, call 8, run on the device from the repository root:
#   bash bench/results/decode_probe/twenty-first/scripts/call8.sh
# (.whl/ as in call1.sh.) Splitting call 6's fp32 hit difference: besides the fp32 hit (first turn's reply decoded)
# and the chunk control, an fp32 hit whose first turn was prefilled as one prompt (the cache's restore without the
# decode path); fp32 only, the first 2 conversations. The last of this session's device time.
. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
timeout 165 python3 bench/results/decode_probe/twenty-first/scripts/hit_vs_fp32.py --device cuda --conversations 2 \
  --fp32-hit --prefilled-hit --chunk-control 4096 --skip-bf16 --out $OUT/hit_split.json > $OUT/hit_split.log 2>&1
echo "probe rc=$? t=$SECONDS"; grep -E "^conversation|Error" $OUT/hit_split.log
