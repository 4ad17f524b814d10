#!/usr/bin/env bash
# Soak test of `flint serve` (scripts/test.sh runs it for one minute; longer by hand). Builds nothing: pass the
# binary as the first argument (default target/debug/flint); other arguments go to soak.py.
#   scripts/soak.sh                                 # 60 s, 16 clients, debug build
#   scripts/soak.sh target/release/flint --duration 600 --clients 32 --server-args "--max-num-seqs 8"
set -euo pipefail
cd "$(dirname "$0")/.."
flint=target/debug/flint
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then flint=$1; shift; fi
[ -x "$flint" ] || { echo "soak: no flint binary at $flint (build it: cargo build -p flint --bin flint)" >&2; exit 2; }
exec python3 scripts/soak.py --flint "$flint" "$@"
