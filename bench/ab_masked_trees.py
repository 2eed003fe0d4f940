"""The fused masked softmax of several flashlite trees, each in a process of its own, in alternation.

    python bench/ab_masked_trees.py TREE [TREE ...] [--rounds 2] [--out DIR]   # -> DIR/ab_masked_trees.{json,md}

Each TREE is a folder holding a ``flashlite`` package (the working tree ``.``, or an older commit's
``git archive REV flashlite | tar -x -C TREE``); trees whose custom ops share names cannot share a process, so
each round runs every tree once, one process each, and a tree's figure is the median of its rounds. Cases:
``bench/masked_softmax.py``'s twelve ((4, 16, L, L), L in {1024, 2048, 4096}, causal and boolean key padding,
bf16 and fp32; scale 0.125), effective GB/s (one read and one write of the scores, plus the mask's bytes as given);
and each case's backward alone (``torch.autograd.grad`` of a kept graph: y and dy read, dx written).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# One tree's timings: run in a child process whose sys.path starts with the tree.
CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2])
import flashlite
from common import gbs, time_ms
from masked_softmax import make_case, masked_softmax_bytes
out = {}
for dtype in (torch.bfloat16, torch.float32):
    for kind in ("causal", "key_padding"):
        for length in (1024, 2048, 4096):
            s, _, kw = make_case(kind, (4, 16, length, length), dtype)
            ms = time_ms(lambda: flashlite.masked_softmax(s, scale=0.125, **kw))
            out[f"{kind} {str(dtype)[6:]} {length}"] = gbs(masked_softmax_bytes(s, kw.get("mask")), ms)
            # the backward alone (y, dy read, dx written: 1.5x the forward's bytes without the mask)
            leaf = s.detach().requires_grad_()
            y = flashlite.masked_softmax(leaf, scale=0.125, **kw)
            dy = torch.randn_like(y)
            ms = time_ms(lambda: torch.autograd.grad(y, leaf, dy, retain_graph=True))
            out[f"backward {kind} {str(dtype)[6:]} {length}"] = gbs(3 * y.numel() * y.element_size(), ms)
print(json.dumps(out))
"""


def run_tree(tree: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(tree), HERE], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"tree {tree}: the timing process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="+")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    sys.path.insert(0, HERE)
    from common import environment, markdown_table, results_dir

    runs = {tree: [] for tree in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:
            runs[tree].append(run_tree(tree))
    cases = list(runs[args.trees[0]][0])
    rows = [{"case": case, **{tree: statistics.median(r[case] for r in runs[tree]) for tree in args.trees}}
            for case in cases]
    meta = environment() | {"command": "python bench/ab_masked_trees.py " + " ".join(sys.argv[1:]),
                            "units": "GB/s", "rounds": args.rounds}
    out = results_dir(args.out)
    with open(os.path.join(out, "ab_masked_trees.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "runs": runs}, f, indent=1)
    table = markdown_table(rows, ["case", *args.trees])
    with open(os.path.join(out, "ab_masked_trees.md"), "w") as f:
        f.write(f"# Fused masked softmax of several trees (GB/s)\n\n{meta}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
