"""Softmax backward bandwidth: flashlite against torch's backward, torch.compile and naive PyTorch.

dx = y * (dy - sum(dy * y)) reads y and dy and writes dx: GB/s counts those
three tensors once each. flashlite runs ``softmax_backward`` under the plan its
forward made for the same input (what autograd calls), and under the streamed
("online") plan. The peers: ``torch._softmax_backward_data`` (torch.softmax's
backward), the same op under torch.compile, quack's backward where it imports
(``common.quack_softmax``), and the formula in eager PyTorch.
The ceilings are the device copy bandwidth measured in the same run and a copy
moving the same number of bytes, timed the same way. The shapes are the forward
sweep's (bench/softmax.py).

    python bench/softmax_backward.py     # -> bench/results/<gpu>/softmax_backward.{json,md,png}
    python bench/softmax_backward.py --tune cluster   # rows over a cluster (tuning.BWD_CLUSTER), printed
    python bench/softmax_backward.py --tune short     # short rows' tiles, printed
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from flashlite.softmax import api, tuning  # noqa: E402
from flashlite.softmax.backward import softmax_backward  # noqa: E402
from flashlite.softmax.cluster import launch_backward_cluster  # noqa: E402
from flashlite.softmax.plan import SoftmaxPlan, plan_rows  # noqa: E402

from common import (  # noqa: E402
    copy_bandwidth_gbs, environment, fresh_copy, gbs, graph_time_ms, plot_lines, quack_provider, quack_softmax, results_dir,
    try_time_ms, write_results,
)
from softmax import DTYPES, LONG_ROWS, ODD_ROWS, WIDE_N, backward_plan, raise_recompile_limits  # noqa: E402

PEERS = ["torch", "compile", "quack"]  # quack where it imports and takes the shape


def backward_bytes(y: torch.Tensor) -> int:
    """Bytes a softmax backward must move: read y and dy, write dx (all of y's dtype here)."""
    return 3 * y.numel() * y.element_size()


def torch_backward(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """torch.softmax's backward, as autograd calls it."""
    return torch._softmax_backward_data(dy, y, -1, y.dtype)


def naive_backward(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The formula in eager PyTorch, accumulated in fp32: four ops and their temporaries."""
    y32, dy32 = y.float(), dy.float()
    return (y32 * (dy32 - (dy32 * y32).sum(-1, keepdim=True))).to(y.dtype)


def _compiled_backward():
    raise_recompile_limits()
    return torch.compile(torch_backward, dynamic=False)


def flashlite_backward(y: torch.Tensor, dy: torch.Tensor, algorithm: str = "auto") -> torch.Tensor:
    """flashlite's backward under the plan its forward makes for an input like ``y`` (``algorithm``)."""
    return softmax_backward(y, dy, y.dtype, plan_rows(y, y.dtype, algorithm))


def providers(compiled) -> dict:
    """Backward providers, each called as ``fn(y, dy)``."""
    return {
        "flashlite": flashlite_backward,
        "online": functools.partial(flashlite_backward, algorithm="online"),
        "torch": torch_backward,
        "compile": compiled,
        "quack": (lambda y, dy, quack=quack_provider(backward=True): quack(dy, y)),
        "naive": naive_backward,
    }


def measure(shape, dtype, provs) -> dict:
    """GB/s of every provider on fresh (y, dy) of ``shape``: y a softmax of random logits, dy random."""
    y = torch.softmax(torch.randn(*shape, device="cuda", dtype=torch.float32), dim=-1).to(dtype)
    dy = torch.randn(*shape, device="cuda", dtype=dtype)
    n_bytes = backward_bytes(y)
    row = {"dtype": str(dtype).replace("torch.", ""), "M": shape[0], "N": shape[1], "elements": y.numel()}
    inputs = []  # each provider's own copies (common.fresh_copy), alive until all are timed
    for name, fn in provs.items():
        inputs.append((fresh_copy(y), fresh_copy(dy)))
        if fn(*inputs[-1]) is None:
            row[name] = None
            continue
        row[name] = gbs(n_bytes, try_time_ms(functools.partial(fn, *inputs[-1])))
    inputs.append((fresh_copy(y), fresh_copy(dy)))
    row["flashlite_graph"] = gbs(n_bytes, graph_time_ms(functools.partial(provs["flashlite"], *inputs[-1])))
    # The ceiling at this size: one copy moving the backward's bytes (1.5 tensors read, 1.5 written).
    source = fresh_copy(torch.randn(y.numel() * 3 // 2, device="cuda", dtype=dtype))
    row["copy_same_bytes"] = gbs(2 * source.numel() * source.element_size(), try_time_ms(source.clone))
    row["plan"] = backward_plan(y)[1]
    del y, dy, inputs, source
    torch.cuda.empty_cache()
    return row


def run_bench(args) -> None:
    copy = copy_bandwidth_gbs()
    provs = providers(_compiled_backward())
    shapes = [s for s in [(4096, n) for n in WIDE_N] + LONG_ROWS + ODD_ROWS if not args.cols or s[1] in args.cols]
    rows = []
    for dname in args.dtypes:
        for shape in shapes:
            t0 = time.time()
            row = measure(shape, DTYPES[dname], provs)
            row["odd"] = shape in ODD_ROWS
            row["frac_copy"] = row["flashlite"] / copy
            row["frac_copy_same_bytes"] = row["flashlite"] / row["copy_same_bytes"]
            row["x_best_peer"] = row["flashlite"] / max(row[p] for p in PEERS if row[p] is not None)
            rows.append(row)
            print(f"{dname} {shape}: flashlite {row['flashlite']:.0f} GB/s ({row['frac_copy']:.0%} of copy), "
                  f"x{row['x_best_peer']:.2f} best peer  [{time.time() - t0:.1f}s]", flush=True)
    meta = environment() | {"copy_gbs": copy, "inputs": "y and dy, a fresh copy a provider (common.fresh_copy)",
                            "quack": quack_softmax()[1]}
    out = results_dir(args.out)
    cols = ["dtype", "M", "N", "plan", "flashlite", "flashlite_graph", "online", "torch", "compile", "quack", "naive",
            "copy_same_bytes", "frac_copy", "frac_copy_same_bytes", "x_best_peer"]
    write_results("softmax_backward", out, meta, rows, cols, "Softmax backward, GB/s (y and dy read, dx written)")
    plot_results(rows, copy, out)
    print_summary(rows, copy)


def plot_results(rows: list[dict], copy: float, out: str) -> None:
    """softmax_backward.png: a panel per dtype for M = 4096 and for long rows, copy as the ceiling."""
    panels = []
    names = ["flashlite", "online", "torch", "compile", "naive", "copy_same_bytes"]
    rows = [r for r in rows if not r.get("odd")]
    for dt in dict.fromkeys(r["dtype"] for r in rows):
        for label, sel in (("M = 4096", [r for r in rows if r["dtype"] == dt and r["M"] == 4096]),
                           ("long rows (M x N = 16M)", [r for r in rows if r["dtype"] == dt and r["M"] != 4096])):
            series = {n: [r.get(n) for r in sel] for n in names}
            series["copy (ceiling)"] = [copy for _ in sel]
            panels.append((f"softmax backward {dt}, {label}", [r["N"] for r in sel], series, "GB/s"))
    plot_lines(os.path.join(out, "softmax_backward.png"), panels)


def print_summary(rows, copy) -> None:
    print(f"\ncopy {copy:.0f} GB/s")
    print(f"{'dtype':9}{'shape':>16}{'plan':>8}{'flashlite':>10}{'online':>8}{'torch':>8}{'compile':>9}{'%copy':>7}"
          f"{'%same':>7}{'xbest':>7}")
    for r in rows:
        print(f"{r['dtype']:9}{str((r['M'], r['N'])):>16}{r['plan']:>8}{r['flashlite']:>10.0f}{r['online']:>8.0f}"
              f"{r['torch']:>8.0f}{(r['compile'] or 0):>9.0f}{r['frac_copy']:>7.0%}{r['frac_copy_same_bytes']:>7.0%}"
              f"{r['x_best_peer']:>7.2f}")


BWD_CLUSTER_TUNE_SHAPES = {torch.bfloat16: ((128, 131072), (1024, 131072), (4096, 65536), (4096, 32768)),
                           torch.float32: ((128, 131072), (1024, 131072), (4096, 65536), (256, 65536))}
SHORT_TUNE_SHAPES = {torch.float32: ((4096, 256), (4096, 1024)), torch.bfloat16: ((4096, 256), (4096, 1024))}


def _grad_inputs(dtype: torch.dtype, shape: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, dy, dx64)``: y a softmax of random logits, dy random, and the float64 gradient."""
    y = torch.softmax(torch.randn(*shape, device="cuda", dtype=torch.float32), dim=-1).to(dtype)
    dy = torch.randn(*shape, device="cuda", dtype=dtype)
    y64, dy64 = y.double(), dy.double()
    return y, dy, y64 * (dy64 - (y64 * dy64).sum(-1, keepdim=True))


def _tune_round(y, dy, ref, variants: dict, peers: dict, r: int) -> str:
    """'name:GB/s' of each variant (``fn(y, dy)``, checked against ``ref`` relative to its largest value; in reverse
    order on odd rounds) and of each peer, each on fresh copies of y and dy."""
    line = []
    for name, fn in (variants.items() if r % 2 == 0 else reversed(variants.items())):
        yc, dyc = fresh_copy(y), fresh_copy(dy)
        err = ((fn(yc, dyc).double() - ref).abs().max() / ref.abs().max()).item()
        ms = try_time_ms(functools.partial(fn, yc, dyc))
        line.append(f"{name}:{gbs(backward_bytes(y), ms) or 0:.0f}" + ("" if err < 3e-2 else f"(ERR {err:.1e})"))
        del yc, dyc
    for name, fn in peers.items():
        yc, dyc = fresh_copy(y), fresh_copy(dy)
        ms = try_time_ms(functools.partial(fn, yc, dyc)) if fn(yc, dyc) is not None else None
        line.append(f"{name}:{gbs(backward_bytes(y), ms) or 0:.0f}")
        del yc, dyc
    return "  ".join(line)


def tune_cluster(rounds: int = 2) -> None:
    """The backward over a thread-block cluster (tuning.BWD_CLUSTER): flashlite's plan (the table as it stands),
    its plan without the table, and the cluster kernel on 2/4/8 CTAs of 4/8/16 warps (16-64 columns of y and dy a
    thread), against torch.compile, quack and a copy; do_bench GB/s, ``rounds`` rounds in alternating order."""
    peers = {"compile": _compiled_backward(), "quack": (lambda y, dy, q=quack_provider(backward=True): q(dy, y)),
             "copy": lambda y, dy: torch.cat((y, dy[: y.shape[0] // 2]))}  # moves the backward's bytes
    print(f"backward cluster rows: plan -> GB/s do_bench (CTAs x warps, columns a CTA); quack {quack_softmax()[1]}")
    for dtype, shapes in BWD_CLUSTER_TUNE_SHAPES.items():
        for shape in shapes:
            y, dy, ref = _grad_inputs(dtype, shape)
            saved = tuning.BWD_CLUSTER
            tuning.BWD_CLUSTER = {}
            api.clear_plans()
            without = backward_plan(y)[0]
            tuning.BWD_CLUSTER = saved
            api.clear_plans()
            variants = {"auto": flashlite_backward,
                        "no-cluster": lambda y, dy, p=without: softmax_backward(y, dy, y.dtype, p)}
            for ctas in (2, 4, 8):
                for warps in (4, 8, 16):
                    part = triton.next_power_of_2(shape[1]) // ctas
                    if 16 <= part // (32 * warps) <= 64:
                        plan = SoftmaxPlan("cluster", 1, part, warps, ctas, part)
                        variants[f"c{ctas}w{warps}"] = (lambda y, dy, p=plan: _cluster_dx(y, dy, p))
            for r in range(rounds):
                print(f"  {str(dtype)[6:]:9} {str(shape):16} r{r} " + _tune_round(y, dy, ref, variants, peers, r),
                      flush=True)
            del y, dy, ref
            torch.cuda.empty_cache()
    api.clear_plans()


def _cluster_dx(y: torch.Tensor, dy: torch.Tensor, plan: SoftmaxPlan) -> torch.Tensor:
    dx = torch.empty_like(y)
    launch_backward_cluster(y, dy, dx, plan)
    return dx


def tune_short(rounds: int = 2) -> None:
    """Short rows: the backward on the forward's tiles ("auto": tuning.BWD_SHORT_TILES emptied while this runs, as
    before the table), and tiles of 1-16 rows on 2-8 warps (16-64 columns of y and dy a thread), on the persistent
    grid (P) or a program a tile (G), against torch, torch.compile and quack; do_bench GB/s, ``rounds`` rounds in
    alternating order."""
    peers = {"torch": torch_backward, "compile": _compiled_backward(),
             "quack": (lambda y, dy, q=quack_provider(backward=True): q(dy, y))}
    print("backward short rows: rows x warps, persistent (P) or a program a tile (G) -> GB/s do_bench")
    saved, tuning.BWD_SHORT_TILES = tuning.BWD_SHORT_TILES, {}
    api.clear_plans()
    for dtype, shapes in SHORT_TUNE_SHAPES.items():
        for shape in shapes:
            y, dy, ref = _grad_inputs(dtype, shape)
            variants = {"auto": flashlite_backward}
            for bm in (1, 2, 4, 8, 16):
                for warps in (2, 4, 8):
                    per_thread = bm * shape[1] // (32 * warps)
                    if 16 <= per_thread <= 64:
                        plan = SoftmaxPlan("fused", bm, shape[1], warps)
                        for grid, bound in (("P", 1 << 30), ("G", 0)):
                            variants[f"{bm}x{warps}{grid}"] = (
                                lambda y, dy, p=plan, b=bound: _with_persistent_bound(b, y, dy, p))
            for r in range(rounds):
                print(f"  {str(dtype)[6:]:9} {str(shape):16} r{r} " + _tune_round(y, dy, ref, variants, peers, r),
                      flush=True)
            del y, dy, ref
            torch.cuda.empty_cache()
    tuning.BWD_SHORT_TILES = saved
    api.clear_plans()


def _with_persistent_bound(bound: int, y: torch.Tensor, dy: torch.Tensor, plan: SoftmaxPlan) -> torch.Tensor:
    saved, tuning.FUSED_PERSISTENT_MAX_COLS = tuning.FUSED_PERSISTENT_MAX_COLS, bound  # read at the call
    try:  # persistent while block_n <= bound
        return softmax_backward(y, dy, y.dtype, plan)
    finally:
        tuning.FUSED_PERSISTENT_MAX_COLS = saved


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="output folder (default bench/results/<gpu>)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--cols", nargs="+", type=int, help="only rows this long (the JSON then holds only those)")
    parser.add_argument("--tune", choices=["cluster", "short"], help="time a tuning table's candidates instead")
    args = parser.parse_args(argv)
    if args.tune == "cluster":
        tune_cluster()
    elif args.tune == "short":
        tune_short()
    else:
        run_bench(args)


if __name__ == "__main__":
    main()
