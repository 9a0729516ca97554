# Twenty-first session, call 5, run on the device from the repository root:
#   bash bench/results/decode_probe/twenty-first/scripts/call5.sh
# (.whl/ as in call1.sh.) Every other `gpu` test with the final code: all but call 1's files, the server tests
# (CPU-only, and the device has no `openai`) and fla's context-parallel test (passed in the twentieth session,
# unchanged since).
. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
timeout 480 python3 -m pytest -p no:cacheprovider -m gpu -v -n 5 --durations=15 -o faulthandler_timeout=470 \
  --ignore tests/ops/test_mla_decode.py --ignore tests/serve/test_engine.py --ignore tests/serve/test_static.py \
  --ignore tests/serve/test_server.py --ignore tests/vision/test_server.py --ignore tests/parallel/test_gpu.py tests \
  > $OUT/gpu_tests_rest.txt 2>&1; echo "rc=$?" >> $OUT/gpu_tests_rest.txt
grep -E "FAILED|ERROR|passed|failed|rc=" $OUT/gpu_tests_rest.txt | tail -15
