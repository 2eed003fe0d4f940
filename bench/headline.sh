#!/usr/bin/env bash
# The README's headline figures: the quick variant of every sweep (a few shapes each, every peer in the same
# process), written as JSON + Markdown + PNG into DIR (default bench/results/<gpu>). On the GPU machine:
#   PYTHONPATH=. bench/headline.sh [DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:-.}
out=(); [ $# -gt 0 ] && out=(--out "$1")
status=0
run() { echo "== $*"; timeout "${HEADLINE_TIMEOUT:-240}" python "$@" "${out[@]}" || { echo "FAILED ($?): $*"; status=1; }; }
run bench/softmax.py --quick
run bench/attention.py --quick
run bench/attention.py --backward --quick
run bench/masked_softmax.py --quick
run bench/decode.py --quick
exit $status
