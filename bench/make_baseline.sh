#!/usr/bin/env bash
# Copy commit REV's flashlite package into DIR/flashlite_base for bench/ab_*.py (same process, two trees).
# Its __init__ is emptied: importing the baseline then registers no custom ops (the working tree's own
# flashlite registers torch.ops.flashlite.*), and only the modules a script imports are loaded.
#   bench/make_baseline.sh REV DIR      e.g. bench/make_baseline.sh HEAD~1 .baseline
set -euo pipefail
rev=${1:?usage: make_baseline.sh REV DIR}
dir=${2:?usage: make_baseline.sh REV DIR}
rm -rf "$dir/flashlite_base"
mkdir -p "$dir"
tmp=$(mktemp -d)
git archive "$rev" flashlite | tar -x -C "$tmp"
mv "$tmp/flashlite" "$dir/flashlite_base"
rm -rf "$tmp"
: > "$dir/flashlite_base/__init__.py"
git rev-parse "$rev" > "$dir/REV"
echo "baseline $(cat "$dir/REV") in $dir/flashlite_base"
