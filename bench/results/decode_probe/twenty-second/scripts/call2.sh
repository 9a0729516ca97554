# Twenty-second session, call 2, run on the device from the repository root:
#   bash bench/results/decode_probe/twenty-second/scripts/call2.sh
# (.whl/ as in call1.sh.) Call 1 found the dense model's hit within 1.0e-4 of the cold prefill in IEEE fp32 at 32K
# (the chunk control 4.2e-5). The same in the bench's MoE model (kimi-linear-1.5b as it is), IEEE fp32, with the
# router's near-ties reported: the twenty-first session's turns 0-2, where the TF32 hit was 0.07-0.44 nats off.
. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
timeout 420 python3 bench/results/decode_probe/twenty-first/scripts/hit_vs_fp32.py --device cuda --ieee \
  --conversations 3 --fp32-hit --prefilled-hit --chunk-control 4096 --skip-bf16 --router-gaps \
  --out $OUT/moe_ieee.json > $OUT/moe_ieee.log 2>&1
echo "moe ieee rc=$? t=$SECONDS"; grep -E "^conversation|Error" $OUT/moe_ieee.log
