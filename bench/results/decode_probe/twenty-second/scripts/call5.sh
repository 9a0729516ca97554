# Twenty-second session, call 5, run on the device from the repository root:
#   bash bench/results/decode_probe/twenty-second/scripts/call5.sh   (its output: call5_stdout.txt)
# (.whl/ as in call1.sh.) Call 4 again with the probe as committed: its --ieee imported fla before openk3 chose
# its KDA backend, so fla autotuned its kernels instead of running openk3's shipped configs for the H200 (the JSON's
# hardware.kda_backend said so); now the probe selects the backend first. The dense model as call 1, the MoE model
# with the last-257-tokens control as call 3, IEEE fp32.
. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
P=bench/results/decode_probe/twenty-first/scripts/hit_vs_fp32.py
python3 -c "import torch, triton, fla
print(torch.__version__, triton.__version__, fla.__version__, torch.cuda.get_device_name())"
timeout 260 python3 $P --device cuda --dense --ieee --conversations 2 --fp32-hit --prefilled-hit --chunk-control 4096 \
  --skip-bf16 --out $OUT/dense_ieee.json > $OUT/dense_ieee.log 2>&1
echo "dense ieee rc=$? t=$SECONDS"; grep -E "^conversation|Error" $OUT/dense_ieee.log
grep -oE '"(fla_solve|kda_backend)[^,]*' $OUT/dense_ieee.json
timeout $((560 - SECONDS)) python3 $P --device cuda --ieee --conversations 3 --fp32-hit --chunk-control 10837 \
  --skip-bf16 --out $OUT/moe_ieee_last257.json > $OUT/moe_ieee_last257.log 2>&1
echo "moe ieee rc=$? t=$SECONDS"; grep -E "^conversation|Error" $OUT/moe_ieee_last257.log
grep -oE '"(fla_solve|kda_backend)[^,]*' $OUT/moe_ieee_last257.json
