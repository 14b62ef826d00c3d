# Sourced by scripts/demo and scripts/test: make or reuse .venv and install what reshard needs.
# Works on a fresh machine with only Python 3.10+ (PYTHON=... picks the interpreter).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
# torch first, pinned to the CPU build, so the package's own range never pulls a CUDA build.
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "$VPY" -m pip install -q --disable-pip-version-check "torch==${RESHARD_TORCH:-2.13.0}" 2>&1 \
    | grep -v "^WARNING: Location" || true
fi
stamp=".venv/.reshard-installed"
want="$(cat pyproject.toml | cksum)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$VPY" -c "import reshard, pytest, hypothesis, xdist" >/dev/null 2>&1; then
  "$VPY" -m pip install -q --disable-pip-version-check -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
  "$VPY" -c "import reshard, pytest, hypothesis, xdist"
  # torchtitan: the oracle of the hf-to-torchtitan-llama profile (tests only). Its own
  # dependencies (datasets, wandb, tensorboard, ...) are not needed by the state-dict adapter
  # the tests run, so it goes in without them, plus the two its imports need.
  "$VPY" -m pip install -q --disable-pip-version-check "tyro" 2>&1 | grep -v "^WARNING: Location" || true
  "$VPY" -m pip install -q --disable-pip-version-check --no-deps "torchtitan==0.3.0" "spmd-types==0.2.3" 2>&1 \
    | grep -v -e "^WARNING: Location" -e "dependency resolver" -e "^torchtitan .* requires" || true
  echo "$want" > "$stamp"
fi
# byte-compile reshard as a wheel install would: an editable install does not, and under
# PYTHONDONTWRITEBYTECODE=1 every command would compile it again (~30 ms of start-up)
"$VPY" -m compileall -q reshard >/dev/null 2>&1 || true  # a read-only checkout just runs slower
export PATH="$ROOT/.venv/bin:$PATH"
