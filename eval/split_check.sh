#!/usr/bin/env bash
# RecGuide on a model split past one device, on CUDA (what the CPU tests in tests/test_split.py cannot run here):
#
#     bash eval/split_check.sh OUT        # a step of eval/gpu_session.sh; prints one verdict per run
#
# On the NLD stand-in and a tiny model of the bundled class (recguide_hf/testing/split_check.py writes both):
# 1. the reference: the whole model on cuda:0;
# 2. a device map with layer 1 offloaded to the CPU (accelerate loads it onto cuda:0 for each forward: the way
#    a model larger than one card runs on one card); without a GPU (the script's own check) the CPU is the main
#    device and layer 1 is offloaded to disk;
# 3. with two or more GPUs: a device map over cuda:0 and cuda:1 (layers on two devices, the cache following
#    them), and tensor parallel over 2 ranks with NCCL (torchrun on 127.0.0.1), both ranks' records compared.
# Each run's verdict compares it with the reference (`split_check --compare`): every method = plain greedy = the
# reference's, drafting-adapter logits within the layout tolerance.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/split_check}
PY=${PY:-python3}
CHECK="$PY -m recguide_hf.testing.split_check"
RUN="$CHECK --max-new-tokens 16"
mkdir -p "$OUT"
gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $gpus"
MAIN=0 OFF='"cpu"'  # the main device and where layer 1 is offloaded to
if [ "$gpus" -lt 1 ]; then  # the script's own check, here: the CPU as main device, layer 1 offloaded to disk
    MAIN='"cpu"' OFF='"disk"'
fi
devices() {  # devices KIND FIRST LAYER1 LAST: a device map of a test model (embeddings and layer 0 on FIRST)
    if [ "$1" = tiny ]; then
        echo "{\"model.embed_tokens\": $2, \"model.rotary_emb\": $2, \"model.layers.0\": $2, \"model.layers.1\": $3, \
\"model.norm\": $4, \"lm_head\": $4}"
    else
        echo "{\"encoder.embed_tokens\": $2, \"encoder.layers.0\": $2, \"encoder.layers.1\": $3, \"encoder.norm\": $4, \
\"diffusion_head\": $4}"
    fi
}
for kind in tiny nld; do
    $CHECK --make "$kind" "$OUT/$kind" >/dev/null || exit 1
    $RUN --model "$OUT/$kind" --device-map "{\"\": $MAIN}" --out "$OUT/$kind-ref" || continue
    $RUN --model "$OUT/$kind" --out "$OUT/$kind-offload" --offload-folder "$OUT/offload" \
        --device-map "$(devices "$kind" "$MAIN" "$OFF" "$MAIN")" &&
        $CHECK --compare "$OUT/$kind-offload/rank0.json" "$OUT/$kind-ref/rank0.json"
    [ "$gpus" -ge 1 ] || continue
    if [ "$gpus" -ge 2 ]; then  # the head on another device than the embeddings
        $RUN --model "$OUT/$kind" --out "$OUT/$kind-two" --device-map "$(devices "$kind" 0 1 1)" &&
            $CHECK --compare "$OUT/$kind-two/rank0.json" "$OUT/$kind-ref/rank0.json"
        $PY -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29513 \
            -m recguide_hf.testing.split_check --max-new-tokens 16 --model "$OUT/$kind" --tp --out "$OUT/$kind-tp" &&
            $CHECK --compare "$OUT/$kind-tp/rank0.json" "$OUT/$kind-ref/rank0.json" &&
            cmp -s "$OUT/$kind-tp/rank0.json" "$OUT/$kind-tp/rank1.json" && echo "$kind tp: both ranks' records equal"
    else
        echo "$kind: one GPU: two-device map and NCCL tensor parallel not run"
    fi
done
