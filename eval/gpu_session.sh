#!/usr/bin/env bash
# One device call with everything a lent GPU session should run, in order of value (docs/gpu.md):
#
#     bash eval/gpu_session.sh                      # there, with .gpu carried (eval/gpu_pack.sh made it here)
#     DEVICE=cpu SMOKE=1 bash eval/gpu_session.sh   # here: the same steps, tiny, to check the script itself
#
# Each step is time-boxed (together at most 8.9 minutes, inside one call's 10) and appends to $OUT/session.log;
# results land in $OUT as at most 8 files (what a call can bring back). Steps:
# 1. environment: torch, transformers and the device;
# 2. eval/gpu_check.py: parity of every mode (streams overlap included) on the NLD stand-in, on CUDA;
# 3. eval/split_check.sh: RecGuide on a model split past one device (CPU offload onto the GPU; with 2+ GPUs, a
#    device map over two of them and NCCL tensor parallel), every method = plain greedy;
# 4. recguide profile: the cost table of this GPU (the policy's T_C(B) and the branch prices);
# 5. eval/branch_check.py: do branches pay where a forward is memory-bound?
# 6. recguide bench: AR, LinearSS and RecGuide with the bundled (CPU) cost table and with this GPU's;
# 7. recguide bench against HF's fast paths: static cache, static cache + HF's compiled forward (CUDA graphs on
#    CUDA, the warm-up reported beside it) and continuous batching, and recguide's own compiled forward
#    (`recguide_compile=true`: mode="reduce-overhead", CUDA graphs), its warm-up reported the same way.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
mkdir -p "$OUT"
LOG="$OUT/session.log"
if [ -f .gpu/site.tar.xz ]; then
    mkdir -p /tmp/gpu_site && tar -C /tmp/gpu_site -xJf .gpu/site.tar.xz || exit 1
    export PYTHONPATH="/tmp/gpu_site/site:$PWD:${PYTHONPATH:-}"
else
    export PYTHONPATH="$PWD:${PYTHONPATH:-}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ -n "${SMOKE:-}" ]; then
    GPU_CHECK="--max-new-tokens 8 --batch 2"; PROFILE="--concurrency 1 2 --repeats 1"
    BRANCH="--concurrency 1 --blocks 8 --num-prompts 4 --repeats 1 --forward-repeats 1 --max-new-tokens 16"
    BENCH="--concurrency 1 2 --repeats 1 --min-prompts 4 --prompts-per-slot 1 --max-new-tokens 16"
    FAST="--concurrency 1 2 --repeats 1 --min-prompts 4 --prompts-per-slot 1 --max-new-tokens 16"
    FAST_METHODS="ar ar-static hf-cb recguide"  # compiling takes minutes on a CPU: not in the smoke run
else
    GPU_CHECK=""; PROFILE=""
    BRANCH="--concurrency 1 4 16 64"
    BENCH="--concurrency 1 4 16 64 --repeats 2 --min-prompts 24"
    FAST="--concurrency 1 16 --repeats 2 --min-prompts 24"
    FAST_METHODS="ar ar-static ar-compile hf-cb recguide recguide:compile=true"  # compiled: CUDA graphs there
fi

step() {  # step NAME SECONDS COMMAND...: run it time-boxed, log it, say how it ended
    local name=$1 secs=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), at most ${secs}s): $*" | tee -a "$LOG"
    timeout "$secs" "$@" >>"$LOG" 2>&1
    echo "=== $name: exit $?" | tee -a "$LOG"
    tail -n 25 "$LOG" | grep -v "^===" | tail -n 12
}

step environment 30 $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', \
transformers.__version__, transformers.__file__); print(torch.cuda.get_device_name() if torch.cuda.is_available() \
else 'no CUDA')"
step gpu_check 60 $PY eval/gpu_check.py --device "$DEVICE" $GPU_CHECK
step split_check 75 bash eval/split_check.sh "$OUT/split"
rm -rf "$OUT/split"  # its verdicts are in the log; at most 8 files come back
step profile 90 $PY -m recguide_hf profile --device "$DEVICE" $PROFILE --out "$OUT/cost_table.json"
step branch_check 45 $PY eval/branch_check.py --device "$DEVICE" $BRANCH --out "$OUT/branch_check.json"
COSTED=()
[ -f "$OUT/cost_table.json" ] && COSTED=("recguide:cost_table=$OUT/cost_table.json")
step bench 130 $PY -m recguide_hf bench --device "$DEVICE" $BENCH --methods ar linear-4 linear-8 linear-16 \
    recguide "recguide:block_sizes=8,16,32" "${COSTED[@]}" --out "$OUT/bench"
# shellcheck disable=SC2086
step hf_fast_paths 105 $PY -m recguide_hf bench --device "$DEVICE" $FAST --methods $FAST_METHODS --out "$OUT/fast"
rm -f "$OUT/bench/frontier.png" "$OUT/fast/frontier.png" "$OUT/fast/tpf_tau.png"  # at most 8 files come back
ls -la "$OUT" "$OUT/bench" 2>/dev/null | tee -a "$LOG"
