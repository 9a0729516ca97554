#!/usr/bin/env bash
# Post-training at k3-1b on one GPU: SFT -> RL (3 domains x 3 efforts, 2 iterations each) -> MOPD -> the report
# (issue #14: "the same commands run on the GPU at k3-1b scale"). On one H200 it finished in 492 s with the Triton
# cache of an earlier call (docs/posttrain.md "On the GPU"); a cold machine compiles for longer.
#
#   bash bench/posttrain_gpu.sh [OUT]              # k3-1b on CUDA; OUT defaults to $OUT, else runs/posttrain-gpu
#   bash bench/posttrain_gpu.sh --cpu-tiny [OUT]   # the same pipeline at the tiny preset on the CPU (a check)
#
# After every stage OUT holds, flat (a device run brings back a few small files): timings.json (seconds per
# stage), sft_metrics.jsonl, rl_metrics.jsonl (all nine policies), distill_metrics.jsonl, report.md (teachers vs
# student), log.txt. The run itself (checkpoints: ~2.9 GB each at k3-1b with the demo's vocabulary in fp32, 11 of
# them) lives in $WORK, not OUT.
# The demo runs under `timeout $BUDGET_S` (default 540 s): when it is cut, the stage in progress is exported too,
# so a timeout still leaves data; the exit status is then 124.
#
# NOTE: shapes are fixed where this script can fix them (SFT: every batch 8 rows x 512 tokens, --sft-length-split 0),
# because fla autotunes every new kernel shape on its first call (minutes on a fresh machine unless its
# configs are shipped). The engine's rollouts (prefill chunks, decode batches) still vary with the requests.
# Sizes can be overridden: N_DATA, SFT_STEPS, RL_ITERATIONS, RL_POOL, DISTILL_ITERATIONS, EVAL_PROMPTS.
set -euo pipefail

config=k3-1b
device=cuda
if [[ "${1:-}" == "--cpu-tiny" ]]; then
    config=tiny
    device=cpu
    shift
fi
out=${1:-${OUT:-runs/posttrain-gpu}}
work=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/openk3-posttrain.XXXXXX")}
python=${PYTHON:-python}
mkdir -p "$out"
log="$out/log.txt"
start=$(date +%s)
{
    echo "posttrain_gpu.sh: config $config on $device, work dir $work, $(date -u +%FT%TZ)"
    "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
} | tee "$log"

status=0
timeout --signal=INT --kill-after=30 "${BUDGET_S:-540}" "$python" -m openk3.cli posttrain-demo \
    --out "$work" --config "$config" --device "$device" \
    --n-data "${N_DATA:-300}" --sft-steps "${SFT_STEPS:-20}" --sft-length-split 0 \
    --rl-iterations "${RL_ITERATIONS:-2}" --rl-pool "${RL_POOL:-4}" \
    --distill-iterations "${DISTILL_ITERATIONS:-2}" --eval-prompts "${EVAL_PROMPTS:-4}" \
    --ckpt-every 1000 --export-to "$out" 2>&1 | tee -a "$log" || status=$?

# the stage that was running when a timeout came: its metrics so far
"$python" -c "import sys; from pathlib import Path; from openk3.posttrain.demo import export; export(Path(sys.argv[1]), Path(sys.argv[2]))" "$work" "$out"
echo "posttrain_gpu.sh: wall $(( $(date +%s) - start )) s, exit status $status" | tee -a "$log"
exit "$status"
