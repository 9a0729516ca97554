# Twentieth session, run on the device from the repository root (the session ran a copy under scratch/):
#   bash bench/results/decode_probe/twentieth/scripts/call3.sh
# .whl/ holds the wheels the device lacks (fla-core and flash-linear-attention 0.6.0, transformers 5.23.0,
# pytest-xdist, execnet) and setup.sh, which installs them under /tmp/site and puts that on PYTHONPATH.
# Files kept (bench/results/decode_probe/twentieth/): x/decode_bench.log -> call3_decode_bench.log, x/gpu_rest.txt ->
# call3_gpu_tests_rest.txt, x/par_fsdp.log and fsdp.json -> call3_fsdp_probe.{log,json}, x/par_cp.log ->
# call3_fla_cp_autotuning.log; x/vs_transformers_decode.json's decode part merged by hand into
# bench/results/vs_transformers_decode.json.
. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p $OUT/x
cp bench/results/vs_transformers_decode.json $OUT/x/vs_transformers_decode.json
timeout 290 python3 bench/vs_transformers_decode.py --device cuda --parts decode --prefill-chunk 32768 \
  --out $OUT/x/vs_transformers_decode.json > $OUT/x/decode_bench.log 2>&1; echo "bench rc=$? t=$SECONDS"
grep -E "^\||batch|tokens/s" $OUT/x/decode_bench.log | tail -12
LEFT=$((560 - SECONDS))
( timeout 120 python3 bench/results/decode_probe/twentieth/scripts/par_probe.py fsdp > $OUT/x/par_fsdp.log 2>&1;
  timeout $((LEFT - 140)) python3 bench/results/decode_probe/twentieth/scripts/par_probe.py cp $((LEFT - 160)) > $OUT/x/par_cp.log 2>&1 ) &
timeout $((LEFT - 10)) python3 -m pytest -p no:cacheprovider -m gpu -v -n 5 --durations=15 -o faulthandler_timeout=$((LEFT - 20)) \
  --ignore tests/ops/test_mla_decode.py --ignore tests/serve/test_engine.py --ignore tests/serve/test_static.py \
  --ignore tests/serve/test_server.py --ignore tests/vision/test_server.py --ignore tests/parallel/test_gpu.py tests \
  > $OUT/x/gpu_rest.txt 2>&1; echo "rc=$?" >> $OUT/x/gpu_rest.txt
wait
grep -E "FAILED|ERROR|passed|failed|rc=" $OUT/x/gpu_rest.txt | tail -15
tail -5 $OUT/x/par_fsdp.log | cut -c1-1500; tail -8 $OUT/x/par_cp.log | cut -c1-600
cp $OUT/x/fsdp.json $OUT/x/cp.pt.stack.txt $OUT/ 2>/dev/null
tar czf $OUT/all.tgz -C $OUT x
