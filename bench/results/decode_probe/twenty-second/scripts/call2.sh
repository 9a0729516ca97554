# Twenty-second session, call 2, run on the device from the repository root:
#   bash bench/results/decode_probe/twenty-second/scripts/call2.sh
# (.whl/ as in call1.sh.) Call 1 found the dense model's hit within 1.03e-4 of the cold prefill in IEEE fp32 at 32K
# (the chunk control 4.1e-5). The same in the bench's MoE model (kimi-linear-1.5b as it is), IEEE fp32, with the
# router's near-ties reported: the twenty-first session's turns 0-2, where the TF32 hit was 0.07-0.44 nats off.
# NOTE: calls 1-3 ran an earlier --ieee of the probe, which imported fla.utils and set its IS_TF32_SUPPORTED to
# False. Importing fla had already imported its KDA modules, which read that flag at import, so fla's intra-chunk
# solve stayed TF32 (the JSON records fla_solve_tril_dot_precision "constexpr[tf32]"): "IEEE" in these calls
# means Triton's default dot precision at ieee and cuBLAS / cuDNN without TF32, the solve in TF32; and, fla being
# imported before openk3 chose its KDA backend, fla autotuned instead of running openk3's shipped H200 configs.
# The committed probe fixes both (call 5), so rerunning this script gives IEEE throughout.
. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
timeout 420 python3 bench/results/decode_probe/twenty-first/scripts/hit_vs_fp32.py --device cuda --ieee \
  --conversations 3 --fp32-hit --prefilled-hit --chunk-control 4096 --skip-bf16 --router-gaps \
  --out $OUT/moe_ieee.json > $OUT/moe_ieee.log 2>&1
echo "moe ieee rc=$? t=$SECONDS"; grep -E "^conversation|Error" $OUT/moe_ieee.log
