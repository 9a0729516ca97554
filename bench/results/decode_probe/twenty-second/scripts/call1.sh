# Twenty-second session, call 1, run on the device from the repository root:
#   bash bench/results/decode_probe/twenty-second/scripts/call1.sh
# (.whl/ holds fla-core and flash-linear-attention 0.6.0, transformers 5.23.0, pytest-xdist and execnet, with
# .whl/setup.sh installing them into /tmp/site; see the twenty-first session's call1.sh.)
# (1) The paged MLA kernel's GPU tests that have not run on a GPU: 20K-66K cached keys, and the kimi-shape test on
# its shared helper. (2) The hit against a cold prefill with a dense MLP in every layer (no router, so no top-k tie
# can swap an expert), in IEEE fp32 (no TF32 in fla's or Triton's dots, nor in cuBLAS), then in the default fp32
# (TF32 dots in fla's chunk kernels): 2 conversations of 32K tokens each.
# NOTE: calls 1-3 ran an earlier --ieee of the probe, which imported fla.utils and set its IS_TF32_SUPPORTED to
# False. Importing fla had already imported its KDA modules, which read that flag at import, so fla's intra-chunk
# solve stayed TF32 (the JSON records fla_solve_tril_dot_precision "constexpr[tf32]"): "IEEE" in these calls
# means Triton's default dot precision at ieee and cuBLAS / cuDNN without TF32, the solve in TF32; and, fla being
# imported before openk3 chose its KDA backend, fla autotuned instead of running openk3's shipped H200 configs.
# The committed probe fixes both (call 5), so rerunning this script gives IEEE throughout.
. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
P=bench/results/decode_probe/twenty-first/scripts/hit_vs_fp32.py
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
timeout 170 python3 -m pytest -p no:cacheprovider -m gpu -v tests/ops/test_mla_decode.py \
  -k "long_contexts or kimi_linear" > $OUT/kernel_tests.txt 2>&1
echo "tests rc=$? t=$SECONDS"; tail -4 $OUT/kernel_tests.txt
timeout 210 python3 $P --device cuda --dense --ieee --conversations 2 --fp32-hit --prefilled-hit --chunk-control 4096 \
  --skip-bf16 --out $OUT/dense_ieee.json > $OUT/dense_ieee.log 2>&1
echo "dense ieee rc=$? t=$SECONDS"; grep -E "^conversation|Error" $OUT/dense_ieee.log
timeout $((590 - SECONDS)) python3 $P --device cuda --dense --conversations 2 --fp32-hit --prefilled-hit \
  --chunk-control 4096 --skip-bf16 --out $OUT/dense_tf32.json > $OUT/dense_tf32.log 2>&1
echo "dense tf32 rc=$? t=$SECONDS"; grep -E "^conversation|Error" $OUT/dense_tf32.log
