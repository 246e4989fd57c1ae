#!/usr/bin/env bash
# Installs deepinfer (editable) for one accelerator. Safe to run again: it only installs what is missing.
#
#   ./build.sh            DEEPINFER_ACCELERATOR=cpu|nvidia|ascend (unset: nvidia when an NVIDIA GPU is found, else cpu)
#   ./build.sh --test     the same, plus the test dependencies (pytest, transformers)
#
# PYTHON selects the interpreter (default python3); install into a virtual environment by activating it first.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0

accel=${DEEPINFER_ACCELERATOR:-}
if [[ -z $accel ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then accel=nvidia; else accel=cpu; fi
fi
case $accel in
  cpu|nvidia|ascend) ;;
  *) echo "build.sh: DEEPINFER_ACCELERATOR='$accel' is not a known accelerator; accepted: cpu, nvidia, ascend" >&2
     exit 2 ;;
esac

extras=()
[[ $accel == ascend ]] && extras+=(ascend)
for arg in "$@"; do
  case $arg in
    --test) extras+=(test) ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument '$arg'; accepted: --test, --help" >&2; exit 2 ;;
  esac
done

say() { printf 'build.sh [%s]: %s\n' "$accel" "$*" >&2; }

# torch first, so that the package's plain `torch` requirement never pulls a multi-GB CUDA build onto a CPU machine.
if "$PYTHON" -c "import torch" 2>/dev/null; then
  say "torch $("$PYTHON" -c 'import torch; print(torch.__version__)') already installed"
else
  # For a small CPU-only wheel elsewhere, install torch from https://download.pytorch.org/whl/cpu first.
  say "installing torch $TORCH_VERSION"
  "$PYTHON" -m pip install -q "torch==$TORCH_VERSION"
fi

spec="."
if ((${#extras[@]})); then spec=".[$(IFS=,; echo "${extras[*]}")]"; fi
say "installing deepinfer from $spec"
"$PYTHON" -m pip install -q -e "$spec"

command -v deepinfer >/dev/null 2>&1 || say "note: the 'deepinfer' script is not on PATH; use '$PYTHON -m deepinfer' or add pip's script directory to PATH"
say "done. Try: deepinfer run offline --prompt 'Hello'"
