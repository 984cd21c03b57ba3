#!/bin/bash
# Everything measured on `recguide serve --replicas` (docs/serving.md, "Replicas on Ray Serve"), in order; run it
# alone on the machine. Each step starts its own server (a local Ray instance on 127.0.0.1) and stops it.
set -euo pipefail
OUT=eval/results/ray
mkdir -p "$OUT"
# 1. 2 replicas x 1 thread: 32 clients for 60 s, half streaming; then a client leaves mid-stream, and a burst
#    past the rows and queue
python eval/serve_load.py --replicas 2 --threads-per-replica 1 --clients 32 --seconds 60 --out "$OUT/load.json"
# 2. the same trace on 1 replica x 2 threads, and on plain `recguide serve` (one process, 2 threads)
python eval/serve_load.py --replicas 1 --threads-per-replica 2 --clients 32 --seconds 60 --no-checks \
    --out "$OUT/load_1x2.json"
OMP_NUM_THREADS=2 python eval/serve_load.py --clients 32 --seconds 60 --no-checks --out "$OUT/load_single.json"
# 3. a replica SIGKILLed 15 s into the load
python eval/serve_load.py --replicas 2 --clients 16 --seconds 45 --kill-replica-at 15 --no-checks \
    --out "$OUT/kill.json"
# 4. autoscaling 1 -> 2 under load, and back to 1 when idle
python eval/serve_load.py --autoscale 1:2 --slots 8 --clients 16 --seconds 45 --idle 60 --no-checks \
    --out "$OUT/autoscale.json"
# 5. lm-eval's local-completions through both servers against the in-process hf backend with RecGuide
python eval/lm_eval_endpoint.py --limit 8 --num-concurrent 4 --replicas 2 --json "$OUT/lm_eval_endpoint.json"
