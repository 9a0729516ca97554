. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > $OUT/smi.txt 2>&1
python3 -c "import pytest, hypothesis, xdist, torch, triton, fla; print(pytest.__version__, hypothesis.__version__, xdist.__version__, torch.__version__, triton.__version__, fla.__version__)" > $OUT/versions.txt 2>&1
cat $OUT/versions.txt
# the gate case that returned nothing in two sessions: alone, verbose, with a stack dump if stuck
( TRITON_PRINT_AUTOTUNING=1 timeout 300 python3 -m pytest -p no:cacheprovider -m gpu -v -s tests/serve/test_engine.py \
    -k "dense-graphs-overlapped" --hypothesis-verbosity=verbose -o faulthandler_timeout=200 --durations=0 \
    > $OUT/gate_dgo.txt 2>&1; echo "rc=$?" >> $OUT/gate_dgo.txt ) &
# everything else marked gpu, spread over 6 workers
timeout 560 python3 -m pytest -p no:cacheprovider -m gpu -v -n 6 --durations=30 -o faulthandler_timeout=300 \
    --deselect "tests/serve/test_engine.py::test_the_gate_on_cuda_on_the_fast_path[dense-graphs-overlapped]" tests \
    > $OUT/gpu_rest.txt 2>&1; echo "rc=$?" >> $OUT/gpu_rest.txt
wait
tail -3 $OUT/gate_dgo.txt; tail -40 $OUT/gpu_rest.txt
