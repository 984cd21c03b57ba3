#!/bin/bash
# Equal-budget A/B arms for SmolLM2's drafting LoRA (docs/distill.md, "Choosing the recipe"): each arm continues the
# shipped adapter (recguide_hf/bundled/smollm2/draft_lora) for the same MINUTES of training on the same teacher rows,
# and `recguide distill` measures it by decoding (LinearSS through the engine on 16 held-out chat and code prompts and
# 16 training prompts, 128 new tokens) at its start and end. Run it alone on the machine: every arm trains, and the
# budget is wall-clock. The arms' logs land in eval/results/smollm2/ab/ (`python eval/update_readme.py` renders them).
#
#   bash eval/drafter_ab.sh TEACHER [MINUTES [ARM ...]]   # TEACHER: a `recguide distill --work` folder's teacher/
#   ARM: mask | verifier | verifier-confidence (default: all three, in that order)
#   INIT=DIR: the drafting LoRA every arm starts from (default: the shipped one). The table's arms started from the
#   adapter shipped at 4074f90: `git show 4074f90:recguide_hf/bundled/smollm2/draft_lora/FILE` for its two files.
set -euo pipefail
TEACHER=$(realpath "${1:?usage: eval/drafter_ab.sh TEACHER [MINUTES [ARM ...]]}")
MINUTES=${2:-15}
shift $(( $# < 2 ? $# : 2 ))
ARMS=("$@")
[ ${#ARMS[@]} -gt 0 ] || ARMS=(mask verifier verifier-confidence)
BASE=${RECGUIDE_CACHE:-$HOME/.cache/recguide}/smollm2-base
INIT=${INIT:-recguide_hf/bundled/smollm2/draft_lora}
OUT=eval/results/smollm2/ab
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
for name in "${ARMS[@]}"; do
    case $name in
        mask) flags=(--first-draft mask) ;;
        verifier) flags=(--first-draft verifier) ;;
        verifier-confidence) flags=(--first-draft verifier --weights confidence) ;;
        *) echo "unknown arm $name" >&2; exit 2 ;;
    esac
    work=runs/ab/$name/work
    mkdir -p "$work"
    ln -sfn "$TEACHER" "$work/teacher"
    recguide distill "$BASE" "runs/ab/$name/out" --work "$work" --mask-token "<empty_output>" --stop-after train \
        --minutes "$MINUTES" --init "$INIT" --lr 5e-4 --warmup 10 --eval-minutes 1000 \
        --eval-prompts 16 --base-name HuggingFaceTB/SmolLM2-135M-Instruct "${flags[@]}"
    cp "$work/run/final/distill_log.json" "$OUT/$name.json"
done
