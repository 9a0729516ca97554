# Twenty-first session, call 4, run on the device from the repository root:
#   bash bench/results/decode_probe/twenty-first/scripts/call4.sh
# (.whl/ as in call1.sh.) openk3's 64K prefill alone, one process each, under the engine settings that change its
# attention: the bench's 8,192-token chunks (varlen flash for cached chunks, the default), one 65,536-token chunk,
# and each with the opt-in cuDNN cached-chunk attention; then the default again.
. .whl/setup.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
for v in "c8k" "c64k --prefill-chunk 65536" "c8k_cudnn --cudnn-prefix-attention" \
         "c64k_cudnn --prefill-chunk 65536 --cudnn-prefix-attention" "c8k_again"; do
  set -- $v; name=$1; shift
  [ $SECONDS -gt 480 ] && break
  timeout $((580 - SECONDS)) python3 bench/vs_transformers_decode.py --device cuda --parts prefill \
    --prefill-lengths 65536 --skip-transformers "$@" --out /tmp/p_$name.json > /tmp/p_$name.log 2>&1
  echo "$name rc=$? t=$SECONDS $(grep -E 'prefill +65536' /tmp/p_$name.log)" | tee -a $OUT/prefill_64k_settings.txt
done
