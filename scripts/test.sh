#!/usr/bin/env bash
# The whole test suite: every Rust test, the OpenAI SDK conformance run against the real
# `flint serve` binary (installs the pinned `openai` package into a venv under target/), then a
# one-minute soak (scripts/soak.sh; longer runs by hand).
set -euo pipefail
cd "$(dirname "$0")/.."

cargo test --workspace --locked

if ! command -v python3 >/dev/null 2>&1; then
  echo "python3 not found: needed for the OpenAI SDK conformance test" >&2
  exit 1
fi
venv=target/conformance-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check -r scripts/requirements-conformance.txt
"$venv/bin/python" scripts/openai_conformance.py --flint target/debug/flint
scripts/soak.sh target/debug/flint --duration 60
