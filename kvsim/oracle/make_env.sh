#!/usr/bin/env bash
# Build (or reuse) a CPU-only virtualenv holding one vLLM release, for running
# kvsim/oracle/vllm_driver.py against vLLM's real v1 Scheduler.
#
#   kvsim/oracle/make_env.sh VERSION [DIR]
#
# DIR defaults to ${KVSIM_ORACLE_HOME:-$HOME/.cache/kvsim/oracle}/vllm-VERSION.
# The last line printed on stdout is the path of the environment's python.
#
# Recipe (reference doc section 12; 0.22.x variant from section 13): torch
# 2.13.0 CPU, vllm --no-deps, a hand-picked dependency list, xgrammar --no-deps.
# No model weights are needed; vLLM's own pins (torch, fastapi[standard], ...)
# are deliberately not honoured, so pip reports conflicts: that is expected.
#
# Environment knobs:
#   KVSIM_ORACLE_PYTHON       interpreter to create the venv with (python3)
#   KVSIM_ORACLE_TORCH_INDEX  index URL for torch, e.g.
#                             https://download.pytorch.org/whl/cpu (plain PyPI
#                             serves the CUDA build on Linux); default: pip's
#                             configured indexes
#   KVSIM_ORACLE_VLLM_SPEC    what to pip-install for vLLM (default
#                             vllm==VERSION; may be a local wheel path)
set -euo pipefail

usage() {
    echo "usage: $0 VERSION [DIR]" >&2
    exit 2
}

[[ $# -ge 1 && $# -le 2 ]] || usage
VERSION=$1
[[ $VERSION =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?([.a-z0-9+-]*)?$ ]] || {
    echo "make_env.sh: bad vLLM version '$VERSION'" >&2
    exit 2
}
ROOT=${KVSIM_ORACLE_HOME:-$HOME/.cache/kvsim/oracle}
DIR=${2:-$ROOT/vllm-$VERSION}
PY=${KVSIM_ORACLE_PYTHON:-python3}
VLLM_SPEC=${KVSIM_ORACLE_VLLM_SPEC:-vllm==$VERSION}
MARKER="$DIR/.kvsim-oracle-ok"

log() { echo "make_env.sh: $*" >&2; }

# Dependencies (pins measured for 0.33.0; 0.32.0 was driven with the same set).
TORCH_PIN="torch==2.13.0"
TRANSFORMERS_PIN="transformers>=5.16.1,<5.21"
EXTRA_DEPS=()
case "$VERSION" in
    0.2[2-9].* | 0.3[01].*)
        # Section 13: older release, same recipe with these changes.
        TRANSFORMERS_PIN="transformers==5.20.2"
        EXTRA_DEPS=(gguf)
        ;;
    0.19.* | 0.20.* | 0.21.*)
        # Built this way here (transformers 5.20.2 and torch 2.13 work despite their pins).
        TRANSFORMERS_PIN="transformers==5.20.2"
        EXTRA_DEPS=(gguf diskcache)
        ;;
esac
DEPS=(
    packaging pydantic regex numpy cbor2 psutil pyzmq urllib3
    "$TRANSFORMERS_PIN"
    aiohttp requests openai-harmony openai pillow pybase64 cachetools msgspec
    cloudpickle uvloop py-cpuinfo prometheus_client fastapi partial_json_parser
    "llguidance>=1.7,<1.8" einops
    # 0.1.9 breaks xgrammar 0.2.8's import.
    apache-tvm-ffi==0.1.11
    "${EXTRA_DEPS[@]}"
)
XGRAMMAR_PIN="xgrammar==0.2.8"

# What the driver needs: the v1 scheduler stack, importable on CPU.
SMOKE='
import sys, vllm
want = sys.argv[1]
if vllm.__version__ != want:
    sys.exit(f"vllm is {vllm.__version__}, wanted {want}")
from vllm.config import VllmConfig, ModelConfig, SchedulerConfig, CacheConfig, DeviceConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
'

quick_check() {  # the python imports vllm of the wanted version
    [[ -x "$DIR/bin/python" ]] &&
        "$DIR/bin/python" -c 'import sys, vllm; sys.exit(vllm.__version__ != sys.argv[1])' \
            "$VERSION" >/dev/null 2>&1
}

full_check() {
    HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR "$DIR/bin/python" -c "$SMOKE" "$VERSION" \
        >/dev/null 2>"$DIR/.smoke.log" || {
        log "import check failed, see $DIR/.smoke.log:"
        tail -n 5 "$DIR/.smoke.log" >&2
        return 1
    }
}

mkdir -p "$(dirname "$DIR")"

# Serialise concurrent builds of the same environment.
if command -v flock >/dev/null 2>&1; then
    exec 9>"$DIR.lock"
    flock 9
fi

if quick_check; then
    if [[ -f $MARKER ]]; then
        log "reusing $DIR"
        echo "$DIR/bin/python"
        exit 0
    fi
    if full_check; then
        touch "$MARKER"
        log "reusing $DIR"
        echo "$DIR/bin/python"
        exit 0
    fi
    log "existing environment incomplete; (re)installing into $DIR"
elif [[ -x "$DIR/bin/python" ]] && "$DIR/bin/python" -c 'import vllm' >/dev/null 2>&1; then
    log "$DIR holds a different vLLM version; remove it or pass another DIR"
    exit 1
fi

rm -f "$MARKER"
if [[ ! -x "$DIR/bin/python" ]]; then
    log "creating venv $DIR with $PY"
    "$PY" -m venv "$DIR"
fi
PIP=("$DIR/bin/python" -m pip install --disable-pip-version-check)

log "installing $TORCH_PIN (CPU)"
if [[ -n ${KVSIM_ORACLE_TORCH_INDEX:-} ]]; then
    "${PIP[@]}" -q --index-url "$KVSIM_ORACLE_TORCH_INDEX" "$TORCH_PIN"
else
    "${PIP[@]}" -q "$TORCH_PIN"
fi

log "installing $VLLM_SPEC (--no-deps)"
"${PIP[@]}" -q --no-deps "$VLLM_SPEC"

log "installing dependencies"
"${PIP[@]}" -q "${DEPS[@]}" "$TORCH_PIN" ||
    { log "dependency install failed"; exit 1; }

log "installing $XGRAMMAR_PIN (--no-deps)"
"${PIP[@]}" -q --no-deps "$XGRAMMAR_PIN"

# A CUDA torch build would still work on CPU but costs gigabytes; say so.
"$DIR/bin/python" -c 'import torch, sys; sys.exit(torch.version.cuda is not None)' ||
    log "warning: torch in $DIR is a CUDA build (set KVSIM_ORACLE_TORCH_INDEX=https://download.pytorch.org/whl/cpu)"

log "checking imports"
full_check
touch "$MARKER"
log "ready: $DIR"
echo "$DIR/bin/python"
