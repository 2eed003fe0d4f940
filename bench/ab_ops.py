"""The no-regression check: softmax, masked softmax and attention forward of two flashlite trees in one process.

The baseline is an older commit's package copied as ``flashlite_base`` by
``bench/make_baseline.sh REV DIR`` (flat modules before 0.2.0:
``flashlite_base.softmax.softmax``, ``.masked_softmax.masked_softmax``,
``.attention.flash_attention``); the working tree's public functions run
beside it on the same inputs, alternating round by round (``--rounds``), each
figure the median of its rounds' ``do_bench`` medians. Shapes and units are
those of the regression list of issue 31: softmax M×N fp32 and bf16 (GB/s: read
+ write), masked softmax (4, 16, L, L) bf16 causal and key-padding (GB/s,
mask bytes counted), attention forward bf16 with H·D = 2048 and B·L = 16K
(TFLOP/s). ``ratio`` is new / base; ``x_issue`` is new over the figure the issue
recorded for that shape (``ISSUE_FIGURES``).

    bench/make_baseline.sh 7641866 .baseline
    PYTHONPATH=. python bench/ab_ops.py --baseline .baseline [--out DIR]   # -> DIR/ab_ops.{json,md}
    ... --only "softmax 4096x256 float32" --rounds 9 --name ab_ops_recheck   # a few cases, more rounds
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import statistics
import sys

import torch
from common import attention_flops, environment, gbs, results_dir, tflops, time_ms, write_results
from masked_softmax import make_case, masked_softmax_bytes

import flashlite

# The figures of issue 31's regression list (H200, eager, the week before): softmax (M, N) -> (fp32, bf16) GB/s;
# masked softmax L -> (causal, key_padding) GB/s; attention (D, L) -> (non-causal, causal) TFLOP/s.
SOFTMAX_FIGURES = {
    (4096, 256): (1110, 693), (4096, 1024): (2601, 1680), (4096, 4096): (3554, 3088), (4096, 8192): (3809, 3506),
    (4096, 16384): (3956, 3611), (4096, 32768): (4058, 3147), (4096, 65536): (3619, 3195),
    (128, 131072): (2818, 2297), (16, 1 << 20): (2739, 2264), (4, 1 << 22): (2460, 2269), (1, 1 << 24): (2335, 2153),
}
MASKED_FIGURES = {1024: (2243, 3352), 2048: (3260, 3595), 4096: (3636, 3591)}
ATTENTION_FIGURES = {
    (64, 1024): (432, 334), (64, 2048): (492, 389), (64, 4096): (451, 409), (64, 16384): (457, 477),
    (128, 1024): (527, 366), (128, 2048): (609, 477), (128, 4096): (652, 550), (128, 16384): (615, 622),
    (128, 131072): (574, 639),
}
TOKENS, HIDDEN = 16384, 2048  # attention: B·L and H·D
ROUNDS = 3


def trees(baseline_dir: str) -> dict:
    """``{"base": (softmax, masked_softmax, flash_attention), "new": (...)}``."""
    sys.path.insert(0, baseline_dir)
    base = [importlib.import_module(f"flashlite_base.{m}") for m in ("softmax", "masked_softmax", "attention")]
    return {"base": (base[0].softmax, base[1].masked_softmax, base[2].flash_attention),
            "new": (flashlite.softmax, flashlite.masked_softmax, flashlite.flash_attention)}


def alternate(calls: dict, rounds: int) -> dict:
    """``{tree: median ms}`` of ``calls`` ({tree: fn}) timed in alternation, ``rounds`` times each."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(time_ms(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def cases(ops: dict):
    """``(row, {tree: fn}, to_figure)`` for every shape of the list; ``to_figure`` turns ms into GB/s or TFLOP/s."""
    for (m, n), figures in SOFTMAX_FIGURES.items():
        for dtype, figure in zip((torch.float32, torch.bfloat16), figures):
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            row = {"op": "softmax", "shape": f"{m}x{n}", "dtype": str(dtype)[6:], "issue": figure}
            # masked_softmax_bytes without a mask: read + write, as softmax counts
            yield row, {t: (lambda f=f[0], x=x: f(x)) for t, f in ops.items()}, (
                lambda ms, x=x: gbs(masked_softmax_bytes(x, None), ms))
    for length, figures in MASKED_FIGURES.items():
        for kind, figure in zip(("causal", "key_padding"), figures):
            s, _, kw = make_case(kind, (4, 16, length, length), torch.bfloat16)
            row = {"op": "masked_softmax", "shape": f"4x16x{length}x{length} {kind}", "dtype": "bfloat16",
                   "issue": figure}
            yield row, {t: (lambda f=f[1], s=s, kw=kw: f(s, **kw)) for t, f in ops.items()}, (
                lambda ms, s=s, kw=kw: gbs(masked_softmax_bytes(s, kw.get("mask")), ms))
    for (d, length), figures in ATTENTION_FIGURES.items():
        heads, batch = HIDDEN // d, max(1, TOKENS // length)
        q, k, v = (torch.randn(batch, heads, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal, figure in zip((False, True), figures):
            row = {"op": "attention", "shape": f"D={d} L={length}" + (" causal" if causal else ""),
                   "dtype": "bfloat16", "issue": figure}
            flops = attention_flops(batch, heads, length, length, d, causal)
            yield row, {t: (lambda f=f[2], c=causal, q=q, k=k, v=v: f(q, k, v, causal=c)) for t, f in ops.items()}, (
                lambda ms, flops=flops: tflops(flops, ms))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="folder holding flashlite_base (bench/make_baseline.sh)")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--out", help="output folder (default bench/results/<gpu>)")
    parser.add_argument("--only", nargs="+", help="only cases whose 'op shape dtype' contains one of these")
    parser.add_argument("--name", default="ab_ops", help="result file name (default ab_ops)")
    args = parser.parse_args(argv)
    rows = []
    for row, calls, to_figure in cases(trees(args.baseline)):
        if args.only and not any(o in f"{row['op']} {row['shape']} {row['dtype']}" for o in args.only):
            continue
        outs = {t: fn() for t, fn in calls.items()}  # compile both, and compare them
        row["max_diff"] = (outs["new"].float() - outs["base"].float()).abs().max().item()
        medians = alternate(calls, args.rounds)
        row["base"], row["new"] = to_figure(medians["base"]), to_figure(medians["new"])
        row["ratio"] = row["new"] / row["base"]
        row["x_issue"] = row["new"] / row["issue"]
        rows.append(row)
        print(f"{row['op']:14} {row['shape']:28} {row['dtype']:8} base {row['base']:7.1f} new {row['new']:7.1f} "
              f"ratio {row['ratio']:.3f} x_issue {row['x_issue']:.3f} diff {row['max_diff']:.1e}", flush=True)
        torch.cuda.empty_cache()
    meta = environment() | {"baseline": pathlib.Path(args.baseline, "REV").read_text().strip(), "rounds": args.rounds,
                            "units": "softmax, masked_softmax: GB/s; attention: TFLOP/s"}
    write_results(args.name, results_dir(args.out), meta, rows,
                  ["op", "shape", "dtype", "issue", "base", "new", "ratio", "x_issue", "max_diff"],
                  "No-regression list of issue 31: the working tree (new) against the baseline, same process")
    worst = min(rows, key=lambda r: r["ratio"])
    low = [r for r in rows if r["x_issue"] < 0.95]
    print(f"\nmedian ratio {statistics.median(r['ratio'] for r in rows):.3f}; worst {worst['ratio']:.3f} "
          f"({worst['op']} {worst['shape']} {worst['dtype']}); below 0.95x the issue's figure: {len(low)}")
    for r in low:
        print(f"  {r['op']} {r['shape']} {r['dtype']}: new {r['new']:.0f} base {r['base']:.0f} issue {r['issue']}")


if __name__ == "__main__":
    main()
