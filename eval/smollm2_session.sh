#!/bin/bash
# Everything measured on SmolLM2-135M-Instruct after its drafting LoRA was trained (docs/distill.md), in order, each
# step logged; run it alone on the machine (every step times or trains). RECGUIDE_CACHE: where the folders live.
#
#   bash eval/smollm2_session.sh WORK [MINUTES [DISTILL FLAGS...]]
#
# WORK: the `recguide distill --work` folder of the training run (the winning arm of eval/drafter_ab.sh: its
# runs/ab/ARM/work), MINUTES the budget it reached, then that run's own recipe flags (e.g. --first-draft verifier).
set -euo pipefail
WORK=${1:?usage: eval/smollm2_session.sh WORK [MINUTES [DISTILL FLAGS...]]}
MINUTES=${2:-15}   # the training budget the run reached (its steps are done: this only finishes it)
shift $(( $# < 2 ? $# : 2 ))
OUT=eval/results/smollm2
SHIP=recguide_hf/bundled/smollm2
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
UNTIL=${UNTIL:-7}  # the last step to run (UNTIL=5: the simulations, not lm-eval and the CPU bench)

# 0. acceptance of the adapter shipped so far, by decoding (before it is replaced)
[ -f "$OUT/engine_tau_before.json" ] || python eval/engine_tau.py --prompts 16 --out "$OUT/engine_tau_before.json"
# the CPU cost table prices the base's forwards on this machine's kind, whatever the adapter: the shipped one is kept
# (delete WORK/parts/cost_table.json to profile again)
mkdir -p "$WORK/parts" && { [ -f "$WORK/parts/cost_table.json" ] || cp "$SHIP/cost_table.json" "$WORK/parts/"; }
# 1. tables and the export (the training run's own command, continued: its steps already done are skipped)
recguide distill "${RECGUIDE_CACHE:-$HOME/.cache/recguide}/smollm2-base" "$WORK/../out" --work "$WORK" --mask-token "<empty_output>" \
    --minutes "$MINUTES" --base-name HuggingFaceTB/SmolLM2-135M-Instruct --eval-prompts 16 \
    --calibrate-prompts 32 --profile-concurrency 1 4 16 --profile-block-sizes 1 2 4 8 16 32 --profile-repeats 3 \
    --adapter-dtype bf16 --block-size 16 "$@"
# 2. what the repository ships: the parts, not the base weights (the CPU cost table measures the base's forwards:
#    kept from the last run when this one made none)
rm -rf "$SHIP" && mkdir -p "$SHIP" && cp -r "$WORK/parts/." "$SHIP/"
recguide fetch smollm2
# 3. acceptance as decoding sees it (held-out chat and code, 64 and 256 new tokens), and the prompt
python eval/engine_tau.py --prompts 16 --out "$OUT/engine_tau.json"
python eval/smollm2_check.py --out "$OUT/check.json"
# 4. the bursty open loop under the B200 cost table (the trace the bundled model was measured on; ~30 CPU-minutes)
recguide bench --model smollm2 --virtual-costs eval/costs/nld8b_b200.json --arrivals bursty:8,64,8 \
    --methods linear-1 linear-4 linear-8 linear-16 recguide:block_sizes=1,2,4,8,16,32 --out "$OUT/b200_open"
# 5. the B200 simulation, closed loop (C = 1: one request at a time, where branches can pay)
# (recguide over the block sizes the value table was calibrated on; linear-32 left out: slow here, never the best)
recguide bench --model smollm2 --virtual-costs eval/costs/nld8b_b200.json --concurrency 1 4 32 --max-new-tokens 48 \
    --methods ar linear-4 linear-8 linear-16 recguide:block_sizes=1,2,4,8,16,32 \
    --repeats 1 --min-prompts 8 --prompts-per-slot 1 --out "$OUT/b200"
[ "$UNTIL" -ge 6 ] || exit 0
# 6. lm-eval's local tasks: recguide responses = AR responses, and the score against the bundled model's
python eval/lm_eval_parity.py --model "$(recguide fetch smollm2)" --limit 16 --json "$OUT/lm_eval_parity.json"
python eval/lm_eval_parity.py --model recguide_hf/bundled/recguide-tiny --limit 16 --json "$OUT/lm_eval_bundled.json"
[ "$UNTIL" -ge 7 ] || exit 0
# 7. CPU closed loop and static batches against HF's fast paths (held-out prompts: HumanEval + prose)
recguide bench --model smollm2 --methods ar ar-static ar-compile linear-1 linear-4 linear-8 recguide --concurrency 1 16 \
    --max-new-tokens 64 --repeats 2 --min-prompts 8 --out "$OUT/cpu"
