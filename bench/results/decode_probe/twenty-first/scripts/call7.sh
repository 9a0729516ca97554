# Twenty-first session, call 7, run on the device from the repository root:
#   bash bench/results/decode_probe/twenty-first/scripts/call7.sh
# (.whl/ as in call1.sh.) Call 6 found an fp32 hit 0.22-0.44 nats off an fp32 cold prefill at 32K. The control: an
# fp32 cold prefill in chunks of 4,096 against the fp32 cold one in chunks of 8,192 (no cache involved), on the same
# turns (the first 3 conversations, which the probe's seed makes the same as call 6's).
. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
timeout 330 python3 bench/results/decode_probe/twenty-first/scripts/hit_vs_fp32.py --device cuda --conversations 3 \
  --fp32-hit --chunk-control 4096 --out $OUT/hit_vs_fp32_chunk_control.json > $OUT/hit_vs_fp32_chunk_control.log 2>&1
echo "probe rc=$? t=$SECONDS"; grep -E "^conversation|Error" $OUT/hit_vs_fp32_chunk_control.log
