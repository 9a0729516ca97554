# Twenty-second session, call 3, run on the device from the repository root:
#   bash bench/results/decode_probe/twenty-second/scripts/call3.sh
# (.whl/ as in call1.sh.) Call 2 (MoE, IEEE fp32): the hit and the prefilled hit moved alike (1.3e-2, 0.29, 1e-3),
# the 4,096-chunk control up to 7e-3. The hit computes the turn's last 257 tokens in a forward of their own; a cold
# prefill in chunks of 10,837 does the same without any cache (32,768 = 3 x 10,837 + 257). If that control moves as
# the hit does, the hit's difference is how those tokens are batched (expert GEMM shapes, router near-ties), not the
# cache. In IEEE fp32, then in the default fp32 (TF32 in fla's chunk kernels, as the twenty-first session's calls 6-7).
# NOTE: calls 1-3 ran an earlier --ieee of the probe, which imported fla.utils and set its IS_TF32_SUPPORTED to
# False. Importing fla had already imported its KDA modules, which read that flag at import, so fla's intra-chunk
# solve stayed TF32 (the JSON records fla_solve_tril_dot_precision "constexpr[tf32]"): "IEEE" in these calls
# means Triton's default dot precision at ieee and cuBLAS / cuDNN without TF32, the solve in TF32; and, fla being
# imported before openk3 chose its KDA backend, fla autotuned instead of running openk3's shipped H200 configs.
# The committed probe fixes both (call 5), so rerunning this script gives IEEE throughout.
. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
P=bench/results/decode_probe/twenty-first/scripts/hit_vs_fp32.py
timeout 250 python3 $P --device cuda --ieee --conversations 3 --fp32-hit --chunk-control 10837 --skip-bf16 \
  --out $OUT/moe_ieee_last257.json > $OUT/moe_ieee_last257.log 2>&1
echo "moe ieee rc=$? t=$SECONDS"; grep -E "^conversation|Error" $OUT/moe_ieee_last257.log
timeout $((560 - SECONDS)) python3 $P --device cuda --conversations 3 --fp32-hit --chunk-control 10837 --skip-bf16 \
  --out $OUT/moe_tf32_last257.json > $OUT/moe_tf32_last257.log 2>&1
echo "moe tf32 rc=$? t=$SECONDS"; grep -E "^conversation|Error" $OUT/moe_tf32_last257.log
