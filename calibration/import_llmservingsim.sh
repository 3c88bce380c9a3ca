#!/usr/bin/env bash
# Re-create the shipped RTX PRO 6000 profiles (kvsim/presets/profiles/rtxpro6000-*.json) from
# LLMServingSim's published vLLM-layer profiles (../shared/data/llmservingsim, not committed).
# The composed step rows go to calibration/RTXPRO6000/ (gitignored: derived from that data).
set -euo pipefail
cd "$(dirname "$0")/.."
src="${1:-../shared/data/llmservingsim/profiles/RTXPRO6000}"
py="${PYTHON:-python}"
# Qwen3-30B-A3B (MoE): its fused-MoE layer was profiled at tp 1 only.
for pair in meta-llama/Llama-3.1-8B:llama-3.1-8b:1,2 Qwen/Qwen3-32B:qwen3-32b:1,2 \
        Qwen/Qwen3-30B-A3B-Instruct-2507:qwen3-30b-a3b:1; do
    IFS=: read -r hf name tps <<<"$pair"
    folder="$src/$hf/bf16"
    for tp in ${tps//,/ }; do
        "$py" -m kvsim.cli calibrate --from llmservingsim "$folder" --tp "$tp" \
            --csv "calibration/RTXPRO6000/$name-tp$tp.csv" \
            --out "kvsim/presets/profiles/rtxpro6000-$name-tp$tp.json"
    done
done
