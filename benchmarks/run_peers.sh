#!/usr/bin/env bash
# The `peers` suite, one model per process (results survive a crash of a later model):
# docs/results/peers/<model>/peers.{json,md} and the memory–time plot.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
for model in ${MODELS:-mlp-chain gpt2 llama-tiny resnet50 densenet121}; do
  .venv/bin/remat bench peers --models "$model" --out "docs/results/peers/$model" \
    2> >(grep -v USDT >&2)
done
