. .whl/setup.sh
timeout 150 python3 scratch/diag3.py cuda 6,6,1,2,3,45947 default,no_spare,mla_gather,no_graphs,fla_off,general_prefill,unfused,big_pool > $OUT/diag3.log 2>&1; cut -c1-450 $OUT/diag3.log
