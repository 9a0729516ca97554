# Twenty-second session, call 4, run on the device from the repository root:
#   bash bench/results/decode_probe/twenty-second/scripts/call4.sh
# (.whl/ as in call1.sh.) Calls 1-3's --ieee left fla's KDA intra-chunk solve in TF32 (their JSON records
# fla_solve_tril_dot_precision "constexpr[tf32]": importing fla imports its KDA modules, so the flag the probe set
# came too late). With the probe fixed (it sets that constant itself), the IEEE runs again: the dense model as call
# 1, the MoE model with the last-257-tokens control as call 3.
# NOTE: this probe's --ieee imported fla before openk3 chose its KDA backend, so fla autotuned its kernels
# instead of running openk3's shipped H200 configs (the JSON's hardware.kda_backend says so); call 5 reran it
# with the committed probe, which selects the backend first.
. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
P=bench/results/decode_probe/twenty-first/scripts/hit_vs_fp32.py
timeout 260 python3 $P --device cuda --dense --ieee --conversations 2 --fp32-hit --prefilled-hit --chunk-control 4096 \
  --skip-bf16 --out $OUT/dense_ieee.json > $OUT/dense_ieee.log 2>&1
echo "dense ieee rc=$? t=$SECONDS"; grep -E "^conversation|Error" $OUT/dense_ieee.log; grep -o '"fla_solve[^,]*' $OUT/dense_ieee.json
timeout $((560 - SECONDS)) python3 $P --device cuda --ieee --conversations 3 --fp32-hit --chunk-control 10837 \
  --skip-bf16 --out $OUT/moe_ieee_last257.json > $OUT/moe_ieee_last257.log 2>&1
echo "moe ieee rc=$? t=$SECONDS"; grep -E "^conversation|Error" $OUT/moe_ieee_last257.log
grep -o '"fla_solve[^,]*' $OUT/moe_ieee_last257.json
