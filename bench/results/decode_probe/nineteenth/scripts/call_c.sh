. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
SEQ="2,4,None,1,1,0 4,4,None,1,1,0 4,8,None,1,1,412 4,4,1,2,1,31484 2,6,1,3,3,635 6,4,None,2,1,298 4,4,1,1,2,29992 6,6,2,1,1,4966 6,6,1,2,3,45947 6,6,1,3,3,45947 6,6,1,1,3,45947 6,6,1,2,3,45947"
timeout 200 python3 scratch/diag2.py cuda plain $SEQ > $OUT/diag2_plain.log 2>&1; cat $OUT/diag2_plain.log | cut -c1-400
timeout 150 python3 scratch/diag2.py cuda sync $SEQ > $OUT/diag2_sync.log 2>&1; cat $OUT/diag2_sync.log | cut -c1-400
