. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
timeout 200 python3 scratch/diag.py cuda 6,6,1,3,3,45947 default,sync,no_overlap,eager_overlap,unfused > $OUT/diag_a.log 2>&1; tail -6 $OUT/diag_a.log
timeout 80 python3 scratch/diag.py cuda 6,6,1,2,3,45947 default,sync > $OUT/diag_b.log 2>&1; tail -3 $OUT/diag_b.log
timeout 290 python3 -m pytest -p no:cacheprovider -m gpu -v --durations=10 tests/parallel/test_gpu.py > $OUT/parallel.txt 2>&1; tail -15 $OUT/parallel.txt
