#!/usr/bin/env bash
# The packages the layout referee (kvsim/oracle/layout_driver.py) needs beside a release's
# oracle environment (make_env.sh), which its model-building path imports but the Scheduler
# oracle never does: compressed-tensors (quantization configs), flashinfer-python and its
# pure-Python dependencies (the FlashInfer backends' import-time checks), triton (the
# GatedDeltaNet / FLA ops' modules) and torchvision (the vision towers of multimodal
# checkpoints), each at the pin of the release's own requirements and of the environment's
# torch (2.13.0: triton 3.9.0, torchvision 0.28.0). Installed with --no-deps into
# ENV-layout-extras, which the driver appends to sys.path; nothing in ENV changes.
#
#   bash kvsim/oracle/make_layout_extras.sh 0.33.0     # prints the folder
#
# Built once (~1.6 GB, about a minute), reused afterwards; KVSIM_ORACLE_HOME as make_env.sh.
set -euo pipefail
VERSION=${1:?usage: make_layout_extras.sh VERSION}
HOME_DIR=${KVSIM_ORACLE_HOME:-$HOME/.cache/kvsim/oracle}
ENV_DIR="$HOME_DIR/vllm-$VERSION"
DIR="$ENV_DIR-layout-extras"
case "$VERSION" in
    0.33.0) PINS=(compressed-tensors==0.17.0 flashinfer-python==0.7.2.post1) ;;
    0.32.0) PINS=(compressed-tensors==0.17.0 flashinfer-python==0.7.0.post1) ;;
    0.22.1) PINS=(compressed-tensors==0.15.0.1 flashinfer-python==0.6.11.post2) ;;
    0.19.0) PINS=(compressed-tensors==0.14.0.1 flashinfer-python==0.6.6) ;;
    *) echo "make_layout_extras.sh: no pins for vLLM $VERSION" >&2; exit 2 ;;
esac
PINS+=(loguru==0.7.3 nvidia-ml-py==13.615.71 tabulate==0.10.0 triton==3.9.0 torchvision==0.28.0)
PY="$ENV_DIR/bin/python"
[[ -x $PY ]] || { echo "make_layout_extras.sh: no oracle environment $ENV_DIR (make_env.sh $VERSION)" >&2; exit 1; }
check() {  # found, not imported: the driver patches what a CUDA build needs first (P10, P11)
    "$PY" - "$DIR" <<'PY'
import importlib.util, sys
sys.path.append(sys.argv[1])
missing = [m for m in ("compressed_tensors", "flashinfer", "torchvision", "triton", "tabulate")
           if importlib.util.find_spec(m) is None]
sys.exit(f"missing: {missing}" if missing else 0)
PY
}
if [[ -d $DIR ]] && check 2>/dev/null; then
    echo "$DIR"
    exit 0
fi
tmp="$DIR.partial-$$"
rm -rf "$tmp"
"$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$tmp" "${PINS[@]}"
rm -rf "$DIR"
mv "$tmp" "$DIR"
check
echo "$DIR"
