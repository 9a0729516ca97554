# Twentieth session, run on the device from the repository root (the session ran a copy under scratch/):
#   bash bench/results/decode_probe/twentieth/scripts/call2.sh
# .whl/ holds the wheels the device lacks (fla-core and flash-linear-attention 0.6.0, transformers 5.23.0,
# pytest-xdist, execnet) and setup.sh, which installs them under /tmp/site and puts that on PYTHONPATH.
# The kernel variants the probe loads are earlier versions of openk3/ops/mla_decode.py, made first with
#   mkdir -p bench/results/decode_probe/twentieth/scripts/variants
#   git show 154fba8:openk3/ops/mla_decode.py > bench/results/decode_probe/twentieth/scripts/variants/mla_cur.py
#   git show 0ea363e~1:openk3/ops/mla_decode.py > bench/results/decode_probe/twentieth/scripts/variants/mla_pre.py
# Files kept: k_{new,cur,cur_stages1,new_keys16}.json as they are, gpu_tests_new.txt -> call2_gpu_tests_gather.txt,
# the stdout -> call2_stdout.txt (the other files did not come back: the device tool returns at most 8).
. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
python3 -c "import torch, triton, fla, hypothesis; print(torch.__version__, triton.__version__, fla.__version__, hypothesis.__version__)" > $OUT/versions.txt 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv >> $OUT/versions.txt 2>&1; cat $OUT/versions.txt
V="new cur cur_stages1 new_stages2 new_keys16 pre"
for v in $V; do (K_BUDGET=150 timeout 200 python3 bench/results/decode_probe/twentieth/scripts/probe_fix.py k $v > $OUT/k_$v.log 2>&1) & done
wait; echo "k done t=$SECONDS"
for v in $V; do tail -1 $OUT/k_$v.log | cut -c1-300; done
timeout 120 python3 bench/results/decode_probe/twentieth/scripts/probe_fix.py t new,cur,cur_stages1,new_stages2,new_keys16,pre > $OUT/t.log 2>&1; echo "t done t=$SECONDS"
grep "^T" $OUT/t.log
PICK=$(python3 -c "
import json
def ok(n):
    try: d = json.load(open('$OUT/k_%s.json' % n))
    except Exception: return False
    return d['bad'] == 0 and d['checks'] > 100
print(next((n for n in ('new', 'cur_stages1') if ok(n)), ''))")
LEFT=$((570 - SECONDS)); echo "pick=$PICK left=$LEFT"
if [ -n "$PICK" ]; then
  [ "$PICK" = cur_stages1 ] && cp bench/results/decode_probe/twentieth/scripts/variants/mla_cur.py openk3/ops/mla_decode.py && sed -i 's/^STAGES = 3$/STAGES = 1/' openk3/ops/mla_decode.py
  grep -n "^STAGES\|tl.gather\|tl.sum(tl.where" openk3/ops/mla_decode.py > $OUT/tests_variant.txt
  timeout $LEFT python3 -m pytest -p no:cacheprovider -m gpu -v -n 4 --durations=15 -o faulthandler_timeout=$((LEFT - 10)) \
    tests/ops/test_mla_decode.py tests/serve/test_engine.py tests/serve/test_static.py > $OUT/gpu_tests_$PICK.txt 2>&1
  echo "rc=$?" >> $OUT/gpu_tests_$PICK.txt
  grep -E "FAILED|ERROR|passed|failed|rc=" $OUT/gpu_tests_$PICK.txt | tail -25
fi
