# Twentieth session, call 7: openk3's 64K-token prefill at this tree (HEAD) and at three earlier commits, run on the
# device from the repository root. The earlier trees were made first, on the CPU machine, with
#   for c in 7ebcfcc 53d3587 8040ca1; do mkdir -p scratch/bisect/$c && git archive $c openk3 bench | tar x -C scratch/bisect/$c; done
# (their bench/results removed), and travelled with the working tree.
. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
ROOT=$PWD
for c in HEAD 7ebcfcc 53d3587 8040ca1 HEAD2; do
  [ $SECONDS -gt 230 ] && break
  d=$ROOT; case $c in HEAD*) ;; *) d=$ROOT/scratch/bisect/$c;; esac
  (cd $d && PYTHONPATH=/tmp/site:$d timeout $((275 - SECONDS)) python3 bench/vs_transformers_decode.py --device cuda --parts prefill \
     --prefill-lengths 65536 --skip-transformers --out $OUT/p_$c.json > $OUT/p_$c.log 2>&1)
  echo "$c rc=$? t=$SECONDS $(grep -E 'prefill +65536' $OUT/p_$c.log)"
done
