# Twenty-first session, call 1, run on the device from the repository root:
#   bash bench/results/decode_probe/twenty-first/scripts/call1.sh
# .whl/ holds the wheels the device lacks (fla-core and flash-linear-attention 0.6.0, transformers 5.23.0,
# pytest-xdist, execnet) and setup.sh, which installs them under /tmp/site and puts that on PYTHONPATH.
# scratch/bisect/7ebcfcc is the fourteenth session's tree, made first on the CPU machine with
#   mkdir -p scratch/bisect/7ebcfcc && git archive 7ebcfcc openk3 bench | tar x -C scratch/bisect/7ebcfcc
# (its bench/results removed), and travelled with the working tree.
# Parts: (1) the GPU tests of the MLA decode kernel, the engine's gate and the static path, with the clamped
# kernel, and (beside them) the scale-out GPU tests but fla's context-parallel one; (2) the prefix-hit part, which
# now records the first token's logprobs; (3) the 64K prefill, this tree and 7ebcfcc alternately, one run per
# process, as many as time allows.
. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
ROOT=$PWD
python3 -c "import torch, triton, fla; print(torch.__version__, triton.__version__, fla.__version__)" > $OUT/versions.txt 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv >> $OUT/versions.txt 2>&1; cat $OUT/versions.txt
(timeout 300 python3 -m pytest -p no:cacheprovider -m gpu -v -s tests/parallel/test_gpu.py -k "not fla_cp" \
   > $OUT/parallel_tests.txt 2>&1; echo "rc=$?" >> $OUT/parallel_tests.txt) &
timeout 330 python3 -m pytest -p no:cacheprovider -m gpu -v -n 4 --durations=10 -o faulthandler_timeout=320 \
  tests/ops/test_mla_decode.py tests/serve/test_engine.py tests/serve/test_static.py > $OUT/gpu_tests.txt 2>&1
echo "rc=$?" >> $OUT/gpu_tests.txt
wait
echo "tests done t=$SECONDS"
grep -E "FAILED|ERROR|passed|failed|rc=|fsdp_still" $OUT/gpu_tests.txt $OUT/parallel_tests.txt | tail -30
timeout $((520 - SECONDS)) python3 bench/vs_transformers_decode.py --device cuda --parts prefix_hit_ttft \
  --skip-transformers --out $OUT/prefix_hit.json > $OUT/prefix_hit.log 2>&1
echo "prefix hit rc=$? t=$SECONDS"; grep "token turn" $OUT/prefix_hit.log
for c in HEAD 7ebcfcc HEAD2 7ebcfcc2 HEAD3 7ebcfcc3; do
  [ $SECONDS -gt 500 ] && break
  d=$ROOT; case $c in HEAD*) ;; *) d=$ROOT/scratch/bisect/7ebcfcc;; esac
  (cd $d && PYTHONPATH=/tmp/site:$d timeout $((585 - SECONDS)) python3 bench/vs_transformers_decode.py --device cuda \
     --parts prefill --prefill-lengths 65536 --skip-transformers --out /tmp/p_$c.json > /tmp/p_$c.log 2>&1)
  echo "$c rc=$? t=$SECONDS $(grep -E 'prefill +65536' /tmp/p_$c.log)" | tee -a $OUT/prefill_64k.txt
done
