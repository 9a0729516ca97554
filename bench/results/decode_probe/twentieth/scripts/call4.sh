# Twentieth session, run on the device from the repository root (the session ran a copy under scratch/):
#   bash bench/results/decode_probe/twentieth/scripts/call4.sh
# .whl/ holds the wheels the device lacks (fla-core and flash-linear-attention 0.6.0, transformers 5.23.0,
# pytest-xdist, execnet) and setup.sh, which installs them under /tmp/site and puts that on PYTHONPATH.
# The old kernel it swaps in is 154fba8's openk3/ops/mla_decode.py, made first with
#   mkdir -p bench/results/decode_probe/twentieth/scripts/variants
#   git show 154fba8:openk3/ops/mla_decode.py > bench/results/decode_probe/twentieth/scripts/variants/mla_cur.py
# (the parallel tests in the background had imported openk3 before the swap). Files kept: mla_gather.txt ->
# call4_mla_tests_gather.txt, mla_select_and_sum.txt -> call4_new_test_on_the_old_kernel.txt, parallel.txt ->
# call4_parallel_tests.txt.
. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
( timeout 420 python3 -m pytest -p no:cacheprovider -m gpu -v -s --durations=5 tests/parallel/test_gpu.py > $OUT/parallel.txt 2>&1; echo "rc=$?" >> $OUT/parallel.txt ) &
timeout 200 python3 -m pytest -p no:cacheprovider -m gpu -v -n 4 tests/ops/test_mla_decode.py > $OUT/mla_gather.txt 2>&1; echo "rc=$?" >> $OUT/mla_gather.txt
echo "mla t=$SECONDS"; grep -E "FAILED|passed|failed|rc=" $OUT/mla_gather.txt | tail -5
# the new test against the kernel before this session's fix (154fba8's module): it should fail
cp openk3/ops/mla_decode.py /tmp/mla_gather.py && cp bench/results/decode_probe/twentieth/scripts/variants/mla_cur.py openk3/ops/mla_decode.py
timeout 150 python3 -m pytest -p no:cacheprovider -m gpu -v -n 4 -k every_small_page tests/ops/test_mla_decode.py > $OUT/mla_select_and_sum.txt 2>&1; echo "rc=$?" >> $OUT/mla_select_and_sum.txt
cp /tmp/mla_gather.py openk3/ops/mla_decode.py
echo "old t=$SECONDS"; grep -E "FAILED|passed|failed|rc=" $OUT/mla_select_and_sum.txt | cut -c1-250 | tail -14
wait
echo "all t=$SECONDS"; grep -E "PASSED|FAILED|passed|failed|rc=|fsdp_loss|fla cp_context|s call" $OUT/parallel.txt | cut -c1-300 | tail -25
