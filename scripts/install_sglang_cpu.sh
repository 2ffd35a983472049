#!/usr/bin/env bash
# Makes SGLang 0.5.23's Python classes importable in a CPU venv, so the SGLang plugin tests run on
# CI instead of skipping: `scripts/install_sglang_cpu.sh .venv`.
#
# Installs requirements/sglang-cpu.txt with `pip install --no-deps` (sglang itself would pull a
# CUDA torch and ~8 GB of kernels), then checks that torch is still the venv's CPU build and that
# the plugin's SGLang imports work. Idempotent: when every pinned version is already installed it
# only runs the version check (well under a second) and exits.
set -euo pipefail

VENV=${1:?usage: scripts/install_sglang_cpu.sh <venv>}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REQ="$ROOT/requirements/sglang-cpu.txt"
PY="$VENV/bin/python"
if [[ ! -x "$PY" ]]; then
  echo "install_sglang_cpu: no python at $PY (build the venv first: make venv)" >&2
  exit 2
fi

# Exit status 0 when every `name==version` line of the requirements file is installed.
pinned_present() {
  "$PY" - "$REQ" <<'EOF'
import importlib.metadata as md
import sys

missing = []
for line in open(sys.argv[1]):
  line = line.split("#", 1)[0].strip()
  if not line:
    continue
  name, want = line.split("==")
  try:
    have = md.version(name)
  except md.PackageNotFoundError:
    have = None
  if have != want:
    missing.append(f"{name}=={want} (have {have})")
if missing:
  print("install_sglang_cpu: to install: " + ", ".join(missing))
sys.exit(1 if missing else 0)
EOF
}

if pinned_present; then
  echo "install_sglang_cpu: sglang-cpu requirements already installed in $VENV"
  exit 0
fi

torch_version() { "$PY" -c "import torch; print(torch.__version__)"; }
torch_before=$(torch_version)
start=$(date +%s)
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps -r "$REQ"
torch_after=$(torch_version)
if [[ "$torch_before" != "$torch_after" ]]; then
  echo "install_sglang_cpu: torch changed from $torch_before to $torch_after; this must not" \
       "happen (every package is installed --no-deps). Rebuild the venv: make clean venv" >&2
  exit 1
fi
pinned_present

# The imports the plugin tests need, with the torchvision placeholder the tests use.
"$PY" - "$ROOT/tests/rollout_bridge/_stubs" <<'EOF'
import sys
import warnings

sys.path.insert(0, sys.argv[1])
warnings.simplefilter("ignore")
import sglang.srt.layers.moe.fused_moe_triton.layer  # noqa: F401
import sglang.srt.server_args  # noqa: F401
from sglang.srt.layers.quantization import QUANTIZATION_METHODS

print(f"install_sglang_cpu: sglang imports on CPU ({len(QUANTIZATION_METHODS)} quantization "
      "methods)")
EOF
echo "install_sglang_cpu: done in $(( $(date +%s) - start )) s (torch $torch_after)"
