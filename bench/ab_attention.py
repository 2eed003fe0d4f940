"""Attention forward (and backward) of two flashlite trees in one process: the working tree against a baseline.

The baseline is an older commit's ``flashlite`` package copied under another
name by ``bench/make_baseline.sh REV DIR`` (its ``__init__`` emptied, so that
its custom ops are not registered twice); both trees then run on the same
inputs, alternating round by round, and each shape reports the median of
each tree's rounds and their ratio (new / baseline). Shapes: bench/attention.py's
sweep (bf16, H = 16, B·L = 16K) at D = 64 and 128 (the Hopper kernels), the
triton.language kernel forced at D = 128, and D = 80 and 256 (which only it
serves).

    bench/make_baseline.sh HEAD~1 .baseline
    PYTHONPATH=. python bench/ab_attention.py --baseline .baseline [--backward] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import statistics
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention import HEADS, batch_for, make_qkv  # noqa: E402
from common import (  # noqa: E402
    attention_flops, backward_flops, environment, markdown_table, results_dir, tflops, time_ms, write_results,
)

LENGTHS = [512, 1024, 2048, 4096, 8192, 16384]
ROUNDS = 3  # alternating rounds a shape (--rounds)


def attention_api(package: str) -> SimpleNamespace:
    """``flash_attention``, ``attention_forward`` and ``default_config`` of the flashlite tree ``package`` (``flashlite``
    or ``flashlite_base``), wherever its layout keeps them: the ``attention`` package's ``api`` and ``plan``
    modules, or (a baseline from before the package was split into subpackages) one ``attention`` module."""
    try:
        api = importlib.import_module(f"{package}.attention.api")
        plan = importlib.import_module(f"{package}.attention.plan")
    except ModuleNotFoundError:  # 'flashlite_base.attention' is not a package: the flat layout
        api = plan = importlib.import_module(f"{package}.attention")
    return SimpleNamespace(flash_attention=api.flash_attention, attention_forward=api.attention_forward,
                           default_config=plan.default_config)


def trees(baseline_dir: str) -> dict:
    """``{"base": attention_api, "new": attention_api}``; the baseline from ``baseline_dir/flashlite_base``."""
    sys.path.insert(0, baseline_dir)
    import flashlite  # noqa: F401  (the working tree, with its ops registered)

    return {"base": attention_api("flashlite_base"), "new": attention_api("flashlite")}


def forward_call(module: SimpleNamespace, q, k, v, causal: bool, tl_kernel: bool):
    """One tree's forward, as ``flash_attention`` runs it, or its tl kernel forced on that kernel's own tiles."""
    scale = 1 / math.sqrt(q.shape[3])
    if tl_kernel:
        config = module.default_config(q.shape[3], q.dtype, q.device, causal, k.shape[2])
        return lambda: module.attention_forward(q, k, v, causal, scale, None, False, False, config)
    return lambda: module.flash_attention(q, k, v, causal=causal)


def shapes(backward: bool) -> list[tuple]:
    """(D, L, causal, tl kernel forced) to time."""
    out = [(d, length, causal, False) for d in (64, 128) for length in LENGTHS for causal in (False, True)]
    if not backward:
        out += [(128, length, causal, True) for length in (1024, 4096, 16384) for causal in (False, True)]
        out += [(d, 4096, causal, False) for d in (80, 256) for causal in (False, True)]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="folder holding flashlite_base (bench/make_baseline.sh)")
    parser.add_argument("--backward", action="store_true", help="time the backward (autograd of one forward)")
    parser.add_argument("--out", help="output folder (default bench/results/<gpu>)")
    parser.add_argument("--name", default=None, help="result file name (default ab_attention[_backward])")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"alternating rounds a shape (default {ROUNDS})")
    parser.add_argument("--only", nargs="+", metavar="D:L:CAUSAL:KERNEL",
                        help="time only these shapes, e.g. 128:4096:1:tl 80:4096:0:auto")
    args = parser.parse_args(argv)
    selected = shapes(args.backward)
    if args.only:
        wanted = {(int(d), int(length), causal == "1", kernel == "tl")
                  for d, length, causal, kernel in (item.split(":") for item in args.only)}
        selected = [s for s in selected if s in wanted]
    modules = trees(args.baseline)
    rows = []
    for d, length, causal, tl_kernel in selected:
        batch = batch_for(length)
        q, k, v = make_qkv(batch, length, d)
        flops = attention_flops(batch, HEADS, length, length, d, causal)
        times = {name: [] for name in modules}
        for _ in range(args.rounds):
            for name, module in modules.items():
                if args.backward:
                    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                    out = module.flash_attention(qg, kg, vg, causal=causal)
                    do = torch.randn_like(out)
                    fn = lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)  # noqa: E731
                else:
                    fn = forward_call(module, q, k, v, causal, tl_kernel)
                times[name].append(time_ms(fn))
        work = backward_flops(batch, HEADS, length, length, d, causal) if args.backward else flops
        row = {"D": d, "L": length, "causal": causal, "kernel": "tl" if tl_kernel else "auto", "B": batch}
        for name in modules:
            row[name] = tflops(work, statistics.median(times[name]))
            row[f"{name}_spread"] = (max(times[name]) - min(times[name])) / statistics.median(times[name])
        row["new/base"] = row["new"] / row["base"]
        rows.append(row)
        print(f"D={d:3} L={length:5} causal={causal!s:5} {row['kernel']:4}: base {row['base']:.0f} new {row['new']:.0f} "
              f"TFLOP/s  x{row['new/base']:.3f}", flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    name = args.name or ("ab_attention_backward" if args.backward else "ab_attention")
    meta = environment() | {"baseline": open(os.path.join(args.baseline, "REV")).read().strip()
                            if os.path.exists(os.path.join(args.baseline, "REV")) else args.baseline,
                            "rounds": args.rounds, "heads": HEADS, "dtype": "bfloat16",
                            "flops": "4·B·H·L²·D, halved for causal" + (", x2.5 backward" if args.backward else "")}
    cols = ["D", "L", "causal", "kernel", "B", "base", "new", "new/base", "base_spread", "new_spread"]
    write_results(name, results_dir(args.out), meta, rows, cols,
                  f"Attention {'backward' if args.backward else 'forward'}: working tree against {meta['baseline']}")
    worst = min(rows, key=lambda r: r["new/base"])
    print("\n" + markdown_table(rows, cols))
    print(f"\nworst new/base: x{worst['new/base']:.3f} at D={worst['D']} L={worst['L']} causal={worst['causal']} "
          f"{worst['kernel']}; median x{statistics.median(r['new/base'] for r in rows):.3f}")


if __name__ == "__main__":
    main()
