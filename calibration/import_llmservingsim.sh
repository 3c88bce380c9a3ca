#!/usr/bin/env bash
# Re-create the shipped RTX PRO 6000 profiles (kvsim/presets/profiles/rtxpro6000-*.json) from
# LLMServingSim's published vLLM-layer profiles (../shared/data/llmservingsim, not committed).
# The composed step rows go to calibration/RTXPRO6000/ (gitignored: derived from that data).
set -euo pipefail
cd "$(dirname "$0")/.."
src="${1:-../shared/data/llmservingsim/profiles/RTXPRO6000}"
py="${PYTHON:-python}"
for pair in meta-llama/Llama-3.1-8B:llama-3.1-8b Qwen/Qwen3-32B:qwen3-32b; do
    folder="$src/${pair%%:*}/bf16"
    name="${pair##*:}"
    for tp in 1 2; do
        "$py" -m kvsim.cli calibrate --from llmservingsim "$folder" --tp "$tp" \
            --csv "calibration/RTXPRO6000/$name-tp$tp.csv" \
            --out "kvsim/presets/profiles/rtxpro6000-$name-tp$tp.json"
    done
done
