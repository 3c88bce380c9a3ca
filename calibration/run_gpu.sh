#!/usr/bin/env bash
# The GPU calibration run: on a machine with torch + CUDA (no vLLM needed), benchmark one engine
# step of Llama-3.1-8B in bf16 (random weights from the preset's shape, all 32 layers) over the
# designed sweep for at most ~7 minutes, fit the step-time model and write
#   calibration/<gpu>/llama-3.1-8b.csv    the measured rows (device, torch, dtype, shapes on each)
#   calibration/<gpu>/llama-3.1-8b.json   the profile, with its held-out error
# Usage: bash calibration/run_gpu.sh [MODEL_PRESET] [BUDGET_S]     (defaults: llama-3.1-8b 420)
# Needs kvsim importable (pip install -e . or PYTHONPATH=.) and a CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-llama-3.1-8b}"
budget="${2:-420}"
py="${PYTHON:-python}"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
gpu="$("$py" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; \
import re; print(re.sub(r"[^A-Za-z0-9.-]+", "-", torch.cuda.get_device_name(0)).strip("-"))')"
out="calibration/$gpu"
mkdir -p "$out"
"$py" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))'
time "$py" -m kvsim.cli calibrate --model "$model" --device cuda --dtype bfloat16 --budget-s "$budget" \
    --csv "$out/$model.csv" --out "$out/$model.json" 2> "$out/$model.log"
tail -n 3 "$out/$model.log"
