"""Softmax bandwidth: flashlite (auto, fused, online) against torch, torch.compile, naive PyTorch and textbook kernels.

GB/s counts one read and one write of the tensor. The device-to-device copy
bandwidth measured in the same run (2 GiB) is the ceiling; a copy of each
tensor, timed like the softmax, is the ceiling at its size. Modes:

    python bench/softmax.py            # full sweep -> bench/results/<gpu>/softmax.{json,md,png}
    python bench/softmax.py --check    # GPU correctness (poisoned memory, >2^31 elements)
    python bench/softmax.py --tune X   # time the heuristic constants' candidates (X: fused, short, online, grid,
                                       # shared, reread or all)
    python bench/softmax.py --replot   # redraw softmax.png from the committed softmax.json (no GPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import importlib  # noqa: E402

import flashlite  # noqa: E402
from flashlite._runtime import loaded  # noqa: E402

fs = importlib.import_module("flashlite.softmax")  # the module (flashlite.softmax is the function)
from baselines import naive_softmax, textbook_fused_softmax, textbook_online_softmax  # noqa: E402
from common import (  # noqa: E402
    copy_bandwidth_gbs, environment, fresh_copy, gbs, graph_time_ms, plot_lines, poison_allocator, results_dir,
    time_ms, try_time_ms, write_results,
)

WIDE_N = [256, 1024, 4096, 8192, 16384, 32768, 65536]  # with M = 4096 rows
LONG_ROWS = [(128, 1 << 17), (16, 1 << 20), (4, 1 << 22), (1, 1 << 24)]
# Odd row lengths (a GPT-2 vocabulary; a long odd row): contiguous rows that start anywhere in a 16-byte vector.
ODD_ROWS = [(4096, 50257), (16, 1_000_003)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PEERS = ["torch", "compile"]


def softmax_bytes(x: torch.Tensor) -> int:
    """Bytes a softmax must move: read x once, write y once."""
    return 2 * x.numel() * x.element_size()


def raise_recompile_limits() -> None:
    """Let torch.compile specialize for every shape of a sweep (dynamo's cache limits, under their names old
    and new), so that no shape falls back to eager."""
    import torch._dynamo

    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1024)


def _compiled_softmax():
    raise_recompile_limits()
    return torch.compile(lambda x: torch.softmax(x, dim=-1), dynamic=False)


def _fused_plan(x: torch.Tensor):
    """The plan flashlite makes for ``x`` under algorithm="auto": fused (one program or shared rows), or online."""
    return fs.plan_rows(x, x.dtype)


def providers(compiled) -> dict:
    return {
        "flashlite": lambda x: flashlite.softmax(x),
        "fused": lambda x: flashlite.softmax(x, algorithm="fused") if _fused_plan(x).algorithm == "fused" else None,
        "online": lambda x: flashlite.softmax(x, algorithm="online"),
        "torch": lambda x: torch.softmax(x, dim=-1),
        "compile": compiled,
        "naive": naive_softmax,
        "textbook_fused": lambda x: textbook_fused_softmax(x) if x.shape[1] <= 65536 else None,
        "textbook_online": textbook_online_softmax,
        # A copy of the same tensor, timed the same way: the ceiling at this size. do_bench's L2 flush is a
        # memset whose dirty lines the timed call writes back, which weighs most on small tensors (64 MB
        # copies ran at 2683 GB/s after it, 3092 after a flush that only reads: softmax_flush_weight.log).
        "copy_same_size": lambda x: x.clone(),
    }


def measure(shape, dtype, provs) -> dict:
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    row = {"dtype": str(dtype).replace("torch.", ""), "M": shape[0], "N": shape[1], "elements": x.numel()}
    # Each provider is timed on a copy of its own (common.fresh_copy): lines torch.compile's kernels load with
    # evict_last outlive do_bench's flush, and served every provider timed after it on one shared tensor
    # (bf16 4096 x 4096: flashlite 2434 -> 2770 GB/s once compile had run on it; softmax_head_eviction_ab.log).
    copies = []
    for name, fn in provs.items():
        copies.append(fresh_copy(x))
        if fn(copies[-1]) is None:
            row[name] = None
            continue
        row[name] = gbs(softmax_bytes(x), try_time_ms(functools.partial(fn, copies[-1])))
    # The same call replayed from a CUDA graph: device time alone. Where it is well above the column
    # "flashlite", the call was host-bound (a launch costs ~50 us of host time; do_bench hides less).
    copies.append(fresh_copy(x))
    row["flashlite_graph"] = gbs(softmax_bytes(x), graph_time_ms(functools.partial(provs["flashlite"], copies[-1])))
    del x, copies
    torch.cuda.empty_cache()
    return row


def run_bench(args) -> None:
    copy = copy_bandwidth_gbs()
    compiled = _compiled_softmax()
    provs = providers(compiled)
    shapes = [(4096, n) for n in WIDE_N] + LONG_ROWS + ODD_ROWS
    if args.quick:
        shapes = [(4096, 1024), (4096, 32768), (1, 1 << 24)]
    rows = []
    for dname in args.dtypes:
        for shape in shapes:
            t0 = time.time()
            row = measure(shape, DTYPES[dname], provs)
            row["odd"] = shape in ODD_ROWS  # not in the sweep, nor in the plot
            best_peer = max(row[p] for p in PEERS if row[p] is not None)
            row["frac_copy"] = row["flashlite"] / copy
            row["frac_copy_same_size"] = row["flashlite"] / row["copy_same_size"]
            row["x_best_peer"] = row["flashlite"] / best_peer
            row["x_torch"] = row["flashlite"] / row["torch"]
            row["x_compile"] = row["flashlite"] / row["compile"] if row["compile"] else None
            rows.append(row)
            print(f"{dname} {shape}: flashlite {row['flashlite']:.0f} GB/s ({row['frac_copy']:.0%} of copy), "
                  f"x{row['x_best_peer']:.2f} best peer  [{time.time() - t0:.1f}s]", flush=True)
    meta = environment() | {"copy_gbs": copy, "flashlite_fused_max_cols": fs.FUSED_MAX_COLS,
                            "inputs": "a fresh copy a provider (common.fresh_copy)"}
    out = results_dir(args.out)
    cols = ["dtype", "M", "N", "flashlite", "flashlite_graph", "fused", "online", "torch", "compile", "naive", "textbook_fused",
            "textbook_online", "copy_same_size", "frac_copy", "frac_copy_same_size", "x_best_peer"]
    write_results("softmax", out, meta, rows, cols, "Softmax forward, GB/s (read + write)")
    plot_results(rows, copy, out)
    print_summary(rows, copy)


def plot_results(rows: list[dict], copy: float, out: str) -> None:
    """softmax.png from the sweep's rows: a panel per dtype for M = 4096 and for long rows, copy as the ceiling."""
    panels = []
    names = ["flashlite", "torch", "compile", "naive", "textbook_fused", "textbook_online", "copy_same_size"]
    rows = [r for r in rows if not r.get("odd")]
    for dt in dict.fromkeys(r["dtype"] for r in rows):
        wide = [r for r in rows if r["dtype"] == dt and r["M"] == 4096]
        long = [r for r in rows if r["dtype"] == dt and r["M"] != 4096]
        for label, sel in (("M = 4096", wide), ("long rows (M x N = 16M)", long)):
            if sel:
                series = {n: [r.get(n) for r in sel] for n in names}
                series["copy (ceiling)"] = [copy for _ in sel]
                panels.append((f"softmax {dt}, {label}", [r["N"] for r in sel], series, "GB/s"))
    plot_lines(os.path.join(out, "softmax.png"), panels)


def replot(args) -> None:
    """Redraw softmax.png from the softmax.json already in the results folder."""
    import json

    out = results_dir(args.out)
    with open(os.path.join(out, "softmax.json")) as f:
        data = json.load(f)
    plot_results(data["rows"], data["meta"]["copy_gbs"], out)


def print_summary(rows, copy) -> None:
    print(f"\ncopy {copy:.0f} GB/s")
    print(f"{'dtype':9}{'shape':>16}{'flashlite':>10}{'torch':>8}{'compile':>9}{'%copy':>7}{'%same':>7}{'xbest':>7}")
    for r in rows:
        print(f"{r['dtype']:9}{str((r['M'], r['N'])):>16}{r['flashlite']:>10.0f}{r['torch']:>8.0f}"
              f"{(r['compile'] or 0):>9.0f}{r['frac_copy']:>7.0%}{r['frac_copy_same_size']:>7.0%}{r['x_best_peer']:>7.2f}")


# ----------------------------------------------------------------------------- --check


def backward_plan(y: torch.Tensor, algorithm: str = "auto"):
    """The plan flashlite's backward runs for rows like ``y`` (contiguous) after a forward under ``algorithm``, and
    its regime: "fused" (a program a tile of one row or several), "shared" (resident programs share a row) or
    "online" (streamed)."""
    plan = fs.plan_backward(fs.plan_rows(y, y.dtype, algorithm), *y.shape, y.element_size(), y.device)
    return plan, "shared" if plan.shares_rows else plan.algorithm


def _backward_label(y: torch.Tensor, algorithm: str) -> str:
    """How flashlite's backward runs for rows like ``y`` (contiguous) under ``algorithm``: regime and frames."""
    plan, regime = backward_plan(y, algorithm)
    return f"{regime} {plan.block_n}/w{plan.num_warps}, vectors {fs.backward_vectors(y, y, y.dtype, plan)}"


def run_check(args) -> None:
    failures = 0

    def report(name, err, tol):
        nonlocal failures
        ok = err == err and err <= tol
        failures += not ok
        print(f"{'ok ' if ok else 'BAD'} {name}: max err {err:.2e} (tol {tol:.0e})", flush=True)

    def report_logsumexp(name, x):
        # Log-sum-exps of these rows are far from 0 (a bf16 ulp at 60 is 0.25): the bound is relative.
        ref = torch.logsumexp(x.double(), -1)
        report(f"{name} (relative)", ((flashlite.logsumexp(x).double() - ref) / ref).abs().max().item(),
               2e-6 if x.dtype == torch.float32 else 8e-3)

    tol = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}
    # (1, 1 << 24) and (3, 5_000_001): longer than the resident programs hold, each part streams a head twice
    # Odd row lengths (7 x 100003, 4096 x 50257, ...): contiguous rows that start anywhere, read from the
    # first 16-byte boundary in each (softmax.row_vectors).
    shapes = [(1, 1), (37, 100), (4096, 257), (3, 16384), (5, 16385), (7, 100_003), (4096, 50257), (5, 1_000_003),
              (2, 3_000_000), (1, 1 << 24), (1, (1 << 24) - 1), (3, 5_000_001)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in shapes:
            x = torch.randn(*shape, device="cuda", dtype=dtype) * 3
            for algo in ("auto", "online") + (("fused",) if _fused_plan(x).algorithm == "fused" else ()):
                poison_allocator()
                y = flashlite.softmax(x, algorithm=algo)
                ref = torch.softmax(x.double(), -1)
                report(f"softmax {dtype} {shape} {algo}", (y.double() - ref).abs().max().item(), tol[dtype])
        # Backward: rows on chip and streamed, of lengths that are multiples of 16 and odd ones (read in
        # frames, softmax.backward_vectors), and the gradient of an odd-length dim taken from a strided view.
        # Past BWD_TILES' fused rows (16384 fp32, 32768 16-bit) programs share the rows: in parts that end
        # inside the row, in parts that fill it (32768), framed, and in waves (300 rows of 65536).
        for shape in ((64, 3000), (64, 3001), (37, 30001), (16, 32768), (64, 20000), (300, 65536), (3, 200_000),
                      (3, 200_003), (5, 7, 1001)):
            x = torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
            dy = torch.randn_like(x)
            poison_allocator()
            (dx,) = torch.autograd.grad(flashlite.softmax(x), x, dy)
            x64 = x.detach().double().requires_grad_()
            (ref,) = torch.autograd.grad(torch.softmax(x64, -1), x64, dy.double())
            rows_like = dy.view(-1, shape[-1])  # y's layout: contiguous, from a fresh allocation
            # Relative to the largest gradient (about 1 / n_cols): an absolute bound would pass zeros.
            report(f"backward {dtype} {shape} ({_backward_label(rows_like, 'auto')}, relative)",
                   ((dx.double() - ref).abs().max() / ref.abs().max()).item(), 4 * tol[dtype])
        x = torch.randn(40, 3001, device="cuda", dtype=dtype, requires_grad=True)
        dy = torch.randn(40, 3100, device="cuda", dtype=dtype)[:, :3001]
        (dx,) = torch.autograd.grad(flashlite.softmax(x), x, dy)
        x64 = x.detach().double().requires_grad_()
        (ref,) = torch.autograd.grad(torch.softmax(x64, -1), x64, dy.double())
        report(f"backward {dtype} (40, 3001), dy a strided view (relative)",
               ((dx.double() - ref).abs().max() / ref.abs().max()).item(), 4 * tol[dtype])
        x = torch.randn(6, 70_000, device="cuda", dtype=dtype) * 10
        report_logsumexp(f"logsumexp {dtype}", x)  # about 60
        if dtype != torch.float32:
            # Many 16-bit rows of 32769..65536 (FWD_REREAD_MAX_COLS) read twice, a program a row: special rows and
            # large magnitudes, in rows that fill the tile and in rows of 40000 (too short for it since: shared
            # rows; the label says which); errors relative to each row's largest value.
            for n_cols in (65536, 40000):
                x = torch.randn(1100, n_cols, device="cuda", dtype=dtype) * 3
                x[0] = float("-inf")  # NaN, as torch
                x[1, 50] = float("nan")
                x[2, -1] = 60.0  # the maximum in the last column, in the high half
                x[3, :32768] = float("-inf")  # an empty low half
                x[4] = x[4] * 3000  # about +-1e4
                poison_allocator()
                y, ref = flashlite.softmax(x).double(), torch.softmax(x.double(), -1)
                same_nan = bool((y.isnan() == ref.isnan()).all())
                rel = ((y - ref).nan_to_num(0.0).abs().amax(-1) / ref.nan_to_num(0.0).abs().amax(-1).clamp_min(1e-30))
                report(f"read twice (reread {_fused_plan(x).reread}) {dtype} (1100, {n_cols}), special rows (relative)",
                       rel.max().item() if same_nan else float("nan"), 8e-3)
                report_logsumexp(f"logsumexp read twice {dtype} (1100, {n_cols})", x[5:] * 10)
        # Rows shared by resident programs (on an H100): special rows, a row stride that is not the
        # row length, and the same long rows again and again (each run must give the same bits).
        x = torch.randn(5, 200_000, device="cuda", dtype=dtype) * 3
        x[0, :100_000] = float("-inf")  # the first parts hold nothing
        x[1] = float("-inf")  # NaN, as torch
        x[2, 150_000] = float("nan")  # NaN in one part: the whole row NaN
        x[3] = torch.linspace(-30, 30, 200_000, device="cuda")  # the maximum in the last part
        poison_allocator()
        y, ref = flashlite.softmax(x).double(), torch.softmax(x.double(), -1)
        same_nan = bool((y.isnan() == ref.isnan()).all())
        err = (y - ref).nan_to_num(0.0).abs().max().item() if same_nan else float("nan")
        report(f"shared rows, special rows {dtype} ({_fused_plan(x).n_splits} parts)", err, tol[dtype])
        wide = torch.randn(3, 150_000, device="cuda", dtype=dtype) * 3
        x = wide[:, :100_003]  # row stride 150000
        report(f"shared rows, strided view {dtype}",
               (flashlite.softmax(x).double() - torch.softmax(x.double(), -1)).abs().max().item(), tol[dtype])
        # Bases past a 16-byte boundary (rows read from the first boundary in each, the output as far past
        # one), twice each: the second call repeats the first one's launch.
        for n_rows, n_cols, skip in ((3, 100_003, 1), (4096, 50257, 5), (64, 65536, 3)):
            x = torch.randn(n_rows * n_cols + skip, device="cuda", dtype=dtype)[skip:].view(n_rows, n_cols).mul_(3)
            ref = torch.softmax(x.double(), -1)
            for call in ("first", "second"):
                for out_dtype in dict.fromkeys((dtype, torch.float32)):
                    poison_allocator()
                    y = flashlite.softmax(x, dtype=out_dtype)
                    taken = call == "first" or fs._REPEATS.get(fs.repeat_key(x, 1, out_dtype, "auto")) is not None
                    report(f"shared rows, base {skip} elements past (x % 16 = {x.data_ptr() % 16}), {call} call "
                           f"({n_rows}, {n_cols}) {dtype}->{out_dtype} (row_vectors {fs.row_vectors(x, out_dtype)}, "
                           f"fast path {'ready' if taken else 'MISSING'})",
                           (y.double() - ref).abs().max().item() if taken else float("nan"), tol[out_dtype])
            report_logsumexp(f"logsumexp, base {skip} elements past ({n_rows}, {n_cols}) {dtype}", x)
        x = torch.randn(9, 70_001, device="cuda", dtype=dtype) * 3
        poison_allocator()
        report(f"shared rows, odd rows {dtype} -> float32 (row_vectors {fs.row_vectors(x, torch.float32)})",
               (flashlite.softmax(x, dtype=torch.float32).double() - torch.softmax(x.double(), -1)).abs().max().item(),
               tol[torch.float32])
        report_logsumexp(f"logsumexp odd rows {dtype}", x)
        # Rows longer than the resident programs hold (heads streamed twice): empty heads, the maximum at the end.
        x = torch.randn(2, 9_000_000, device="cuda", dtype=dtype) * 3
        x[0, :4_000_000] = float("-inf")
        x[1, 8_999_000] = 40.0
        poison_allocator()
        report(f"shared rows with heads, special rows {dtype} ({_fused_plan(x).head_cols} head columns a part)",
               (flashlite.softmax(x).double() - torch.softmax(x.double(), -1)).abs().max().item(), tol[dtype])
        for shape in ((16, 1 << 20), (1, 1 << 24)):
            x = torch.randn(*shape, device="cuda", dtype=dtype)
            first = flashlite.softmax(x)
            repeats_differ = sum(not torch.equal(flashlite.softmax(x), first) for _ in range(20))
            report(f"shared rows {shape}, 20 repeats bit-identical {dtype} ({repeats_differ} differ)", float(repeats_differ), 0)
        del x, y, ref, wide, first
        torch.cuda.empty_cache()
    # Repeated calls (softmax's fast path for a signature seen before): the second call of each must
    # take it (an entry that is not None) and agree with float64; misaligned x and another output dtype too.
    base = torch.randn(4096 * 256 + 8, device="cuda")
    cases = [(torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16), None),
             (torch.randn(2, 8, 100, 1000, device="cuda", dtype=torch.float16), None),
             (torch.randn(4096, 5000, device="cuda"), None),
             (torch.randn(64, 300, device="cuda", dtype=torch.bfloat16), torch.float32),
             (base[1:1 + 4096 * 256].view(4096, 256), None),  # 4 bytes past 16-byte alignment
             (base[4:4 + 4096 * 256].view(4096, 256), None),
             (torch.randn(3, 100_003, device="cuda"), None),  # shared rows, the last part ragged
             (torch.randn(16, 1 << 20, device="cuda", dtype=torch.bfloat16), None),  # one wave with heads
             (torch.randn(1100, 57344, device="cuda", dtype=torch.bfloat16), None),  # a program a row, read twice
             (torch.randn(1, 1 << 24, device="cuda"), None)]  # a row longer than the resident programs hold
    for x, out_dtype in cases:
        ref = torch.softmax(x.double(), -1)
        for call in ("first", "repeat"):
            poison_allocator()
            y = flashlite.softmax(x, dtype=out_dtype)
            taken = fs._REPEATS.get(fs.repeat_key(x, x.dim() - 1, out_dtype or x.dtype, "auto")) is not None
            ok_dtype = y.dtype == (out_dtype or x.dtype)
            report(f"{call} call {tuple(x.shape)} {x.dtype}->{y.dtype} ptr%16={x.data_ptr() % 16} "
                   f"(fast path {'ready' if taken else 'MISSING'})",
                   (y.double() - ref).abs().max().item() if taken and ok_dtype else float("nan"), tol[x.dtype])
    del base, cases, x, y, ref
    # Shared-row slots are not zeroed between launches (_runtime.zeroed_slots): launches of few and many
    # slots in turn, a second stream, and a captured CUDA graph replayed on new data between eager calls.
    few, many = torch.randn(2, 3_000_000, device="cuda"), torch.randn(4096, 40_000, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    for turn in range(3):
        for x in (few, many, few):
            report(f"slots turn {turn} {tuple(x.shape)}", (flashlite.softmax(x).double() - torch.softmax(x.double(), -1)).abs().max().item(),
                   tol[x.dtype])
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y_side = flashlite.softmax(many)
        y_main = flashlite.softmax(few)
        torch.cuda.current_stream().wait_stream(side)
        for x, y in ((many, y_side), (few, y_main)):
            report(f"slots turn {turn}, two streams {tuple(x.shape)}",
                   (y.double() - torch.softmax(x.double(), -1)).abs().max().item(), tol[x.dtype])
    static = torch.randn(16, 1 << 20, device="cuda")
    graph_stream = torch.cuda.Stream()
    graph_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(graph_stream):
        flashlite.softmax(static)
    torch.cuda.current_stream().wait_stream(graph_stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = flashlite.softmax(static)
    for turn in range(3):
        static.copy_(torch.randn_like(static) * (turn + 1))
        graph.replay()
        flashlite.softmax(few)  # an eager launch between replays
        report(f"CUDA graph replay {turn} (16, 1 << 20)", (y_graph.double() - torch.softmax(static.double(), -1)).abs().max().item(),
               2e-6)
    del few, many, static, y_side, y_main, y_graph, graph
    x = torch.randn(8, 9, 300, device="cuda")
    for dim in range(3):
        report(f"dim {dim}", (flashlite.softmax(x, dim=dim) - torch.softmax(x, dim)).abs().max().item(), 2e-6)
    # More than 2^31 elements: 64-bit offsets, checked on the last rows (one program a row, then shared rows).
    for shape in ((2**31 // 8192 + 1, 8192), (2**31 // 32768 + 1, 32768), (2**31 // 65536 + 1, 65536),
                  (2**31 // 50257 + 1, 50257), (2**31 // 2**24 + 1, 2**24)):
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        y = flashlite.softmax(x)
        tail = torch.softmax(x[-3:].double(), -1)
        report(f"> 2^31 elements {shape}", (y[-3:].double() - tail).abs().max().item(), 8e-3)
        del x, y
        torch.cuda.empty_cache()
    # ... rows of odd lengths, read in frames: on chip (forward and backward) and streamed (online). Errors
    # relative to the largest value of the last rows (about 1 / n_cols): bf16 rounding is 4e-3 of that.
    # The last: fp32 rows of 65536, whose backward is shared by resident programs (y, dy, dx 8.6 GB each).
    for shape, algo, dtype in (((2**31 // 4095 + 1, 4095), "auto", torch.bfloat16),
                               ((2**31 // 30001 + 1, 30001), "auto", torch.bfloat16),
                               ((2**31 // 50257 + 1, 50257), "online", torch.bfloat16),
                               ((2**31 // 50257 + 1, 50257), "auto", torch.bfloat16),
                               ((2**31 // 65536 + 1, 65536), "auto", torch.bfloat16),  # read twice (reread)
                               ((2**31 // 65536 + 1, 65536), "auto", torch.float32)):
        x = torch.randn(*shape, device="cuda", dtype=dtype)
        rel_tol = 8e-3 if dtype == torch.bfloat16 else 2e-5
        poison_allocator()
        y = flashlite.softmax(x, algorithm=algo)
        tail = torch.softmax(x[-3:].double(), -1)
        report(f"> 2^31 elements {shape} {algo} (relative)",
               ((y[-3:].double() - tail).abs().max() / tail.abs().max()).item(), rel_tol)
        del x
        dy = torch.randn_like(y)
        poison_allocator()
        dx = fs.softmax_backward(y, dy, y.dtype, fs.plan_rows(y, y.dtype, algo))
        yd, dyd = y[-3:].double(), dy[-3:].double()
        tail = yd * (dyd - (yd * dyd).sum(-1, keepdim=True))
        report(f"> 2^31 elements {shape} {algo} backward ({_backward_label(y, algo)}, relative)",
               ((dx[-3:].double() - tail).abs().max() / tail.abs().max()).item(), rel_tol)
        del y, dy, dx
        torch.cuda.empty_cache()
    print(f"\n{failures} failure(s)")


# ----------------------------------------------------------------------------- --tune

HEADS_FRACTION = fs.SHARED_HEADS_L2_FRACTION


def _time_plan(x: torch.Tensor, plan) -> str:
    """'do_bench/graph' GB/s of softmax_forward under ``plan``, checked against float64 first."""
    fn = lambda: fs.softmax_forward(x, x.dtype, plan)[0]  # noqa: E731
    poison_allocator()
    err = (fn().double() - torch.softmax(x.double(), -1)).abs().max().item()
    if not err <= (2e-6 if x.dtype == torch.float32 else 8e-3):
        return f"WRONG({err:.1e})"
    nbytes = softmax_bytes(x)
    return f"{gbs(nbytes, time_ms(fn)):.0f}/{gbs(nbytes, graph_time_ms(fn)):.0f}"


def _registers(x: torch.Tensor, plan) -> str:
    """'registers/spilled' of the fused kernel compiled for ``x`` under ``plan``."""
    y = torch.empty_like(x)
    grid, args, meta, _ = fs._fused_launch(x, y, x, x.dtype, plan, True, False)
    compiled = loaded(fs._softmax_fused_kernel.warmup(*args, grid=grid, **meta))
    return f"{compiled.n_regs}r/{compiled.n_spills}s"


REREAD_SHAPES = {torch.float32: ((4096, 16384), (4096, 32768), (4096, 65536)),
                 torch.bfloat16: ((4096, 16384), (4096, 32768), (4096, 40000), (4096, 49168), (4096, 50257),
                                  (4096, 57344), (4096, 61440), (4096, 65536), (1024, 65536), (768, 65536))}


def tune_reread(cols: list[int] | None = None, rounds: int = 2, warps_tried=(16, 32)) -> None:
    """Rows past FUSED_MAX_COLS (and wide fused rows): flashlite's plan, and its plan without the reread rule
    (FWD_REREAD_MAX_COLS), against a program a row that reads its row twice (REREAD) on several warp counts;
    ``rounds`` alternating rounds, each plan on a fresh copy; ``cols``: only the shapes of those row lengths."""
    print("reread: plan -> GB/s do_bench / CUDA graph (registers/spilled), rounds alternate; compile for reference")
    compiled = _compiled_softmax()
    saved_max = dict(fs.FWD_REREAD_MAX_COLS)
    for dtype, shapes in REREAD_SHAPES.items():
        for shape in shapes:
            if cols and shape[1] not in cols:
                continue
            x = torch.randn(*shape, device="cuda", dtype=dtype)
            fs.FWD_REREAD_MAX_COLS.clear()
            fs.clear_plans()
            plans = {"no reread": _fused_plan(x)}
            fs.FWD_REREAD_MAX_COLS.update(saved_max)
            fs.clear_plans()
            plans["auto"] = _fused_plan(x)
            vec_cols = max(fs.row_vectors(x, dtype), 1)
            block_n = triton.next_power_of_2(shape[1])
            for warps in warps_tried:
                if block_n // (32 * warps) <= 128:  # at most 128 values a thread
                    plans[f"reread/w{warps}"] = fs.SoftmaxPlan("fused", 1, block_n, warps, vec_cols=vec_cols, reread=True)
            regs = {name: _registers(x, plan) for name, plan in plans.items()
                    if plan.algorithm == "fused" and not plan.shares_rows}
            for r in range(rounds):
                line = [f"compile:{gbs(softmax_bytes(x), time_ms(lambda: compiled(x))):.0f}"]
                for name, plan in (plans.items() if r % 2 == 0 else reversed(plans.items())):
                    xc = fresh_copy(x)
                    line.append(f"{name}:{_time_plan(xc, plan)}" + (f"({regs[name]})" if name in regs else ""))
                    del xc
                print(f"  {str(dtype)[6:]:9} {str(shape):16} r{r} " + "  ".join(line), flush=True)
            del x
            torch.cuda.empty_cache()


def run_tune(args) -> None:
    """Time candidates for the constants in flashlite/softmax.py; print the table they were chosen from."""
    compiled = _compiled_softmax()
    fs.FUSED_MAX_COLS = 65536
    print("fused: tile elems x elems/thread -> GB/s")
    for dtype in (torch.float32, torch.bfloat16) if args.tune in ("all", "fused") else ():
        for n in (256, 1024, 4096, 16384, 32768, 65536):
            x = torch.randn(4096, n, device="cuda", dtype=dtype)
            line = []
            for tile in (2048, 4096, 8192, 16384):
                for ept in (8, 16, 32):
                    fs.FUSED_TILE_ELEMS = fs.FUSED_SHORT_TILE_ELEMS = tile
                    fs.FUSED_ELEMS_PER_THREAD = ept
                    fs.clear_plans()
                    ms = graph_time_ms(lambda: flashlite.softmax(x, algorithm="fused"))
                    line.append(f"{tile}/{ept}:{gbs(softmax_bytes(x), ms) or 0:.0f}")
            print(f"  {str(dtype)[6:]:9} N={n:6}  " + "  ".join(line), flush=True)
    fs.FUSED_MAX_COLS = 32768
    fs.clear_plans()
    print("online: block_n/warps (whole rows | split rows) x num_stages -> GB/s")
    for dtype in (torch.float32, torch.bfloat16) if args.tune in ("all", "online") else ():
        for shape in ((4096, 65536),) + tuple(LONG_ROWS):
            x = torch.randn(*shape, device="cuda", dtype=dtype)
            line = []
            for bn, warps in ((1024, 4), (2048, 4), (4096, 8), (4096, 16)):
                for stages in (1, 2, 3, 4):
                    fs.ONLINE_BLOCK_N, fs.ONLINE_NUM_WARPS = bn, warps
                    fs.SPLIT_BLOCK_N, fs.SPLIT_NUM_WARPS = bn, warps
                    fs.ONLINE_NUM_STAGES = stages
                    fs.clear_plans()
                    ms = graph_time_ms(lambda: flashlite.softmax(x, algorithm="online"))
                    line.append((gbs(softmax_bytes(x), ms) or 0, f"{bn}/{warps}/s{stages}"))
            line.sort(reverse=True)
            print(f"  {str(dtype)[6:]:9} {str(shape):16} best: " + "  ".join(f"{c}:{v:.0f}" for v, c in line[:6])
                  + f"   worst: {line[-1][1]}:{line[-1][0]:.0f}", flush=True)
            del x
    print("short rows: tile elems/warps, persistent (P) or one program a tile (G) -> GB/s, CUDA graph (peers too)")
    saved = fs.FUSED_TILE_ELEMS, fs.FUSED_SHORT_TILE_ELEMS, fs.FUSED_ELEMS_PER_THREAD, fs.FUSED_PERSISTENT_MAX_COLS
    for dtype in (torch.float32, torch.bfloat16) if args.tune in ("all", "short") else ():
        for n in (256, 512, 1024, 2048):
            x = torch.randn(4096, n, device="cuda", dtype=dtype)
            nbytes = softmax_bytes(x)
            fs.FUSED_TILE_ELEMS, fs.FUSED_SHORT_TILE_ELEMS, fs.FUSED_ELEMS_PER_THREAD, fs.FUSED_PERSISTENT_MAX_COLS = saved
            fs.clear_plans()
            plan = fs.plan_softmax(4096, n, x.device, "auto", shared_rows=dtype)
            now = f"{plan.block_m * plan.block_n}/w{plan.num_warps}/{'P' if n <= saved[3] else 'G'}"
            line = {"torch": graph_time_ms(lambda: torch.softmax(x, -1)), "compile": graph_time_ms(lambda: compiled(x))}
            for tile in (512, 1024, 2048, 4096, 8192):
                for ept in (8, 16, 32):
                    fs.FUSED_TILE_ELEMS = fs.FUSED_SHORT_TILE_ELEMS = tile
                    fs.FUSED_ELEMS_PER_THREAD = ept
                    fs.clear_plans()
                    plan = fs.plan_softmax(4096, n, x.device, "auto", shared_rows=dtype)
                    for name, max_cols in (("P", 1 << 30), ("G", 0)):
                        fs.FUSED_PERSISTENT_MAX_COLS = max_cols
                        line[f"{plan.block_m * plan.block_n}/w{plan.num_warps}/{name}"] = graph_time_ms(
                            lambda: flashlite.softmax(x))
            rates = sorted(((gbs(nbytes, ms), label) for label, ms in line.items()), reverse=True)
            print(f"  {str(dtype)[6:]:9} 4096 x {n:<5} now {now}: {gbs(nbytes, line[now]):.0f}  "
                  + "  ".join(f"{label}:{rate:.0f}" for rate, label in rates[:8]), flush=True)
            del x
    fs.FUSED_TILE_ELEMS, fs.FUSED_SHORT_TILE_ELEMS, fs.FUSED_ELEMS_PER_THREAD, fs.FUSED_PERSISTENT_MAX_COLS = saved
    fs.clear_plans()
    print("fused grid: persistent (P) or one program a tile (G) -> GB/s do_bench / CUDA graph")
    saved_max = fs.FUSED_PERSISTENT_MAX_COLS
    for dtype in (torch.float32, torch.bfloat16) if args.tune in ("all", "grid") else ():
        for n in (1024, 2048, 4096, 8192, 16384, 32768):
            x = torch.randn(4096, n, device="cuda", dtype=dtype)
            nbytes = softmax_bytes(x)
            line = [f"compile:{gbs(nbytes, time_ms(lambda: compiled(x))):.0f}",
                    f"textbook:{gbs(nbytes, time_ms(lambda: textbook_fused_softmax(x))):.0f}"]
            for name, max_cols in (("P", 1 << 30), ("G", 0)):
                fs.FUSED_PERSISTENT_MAX_COLS = max_cols
                fn = lambda: flashlite.softmax(x)  # noqa: E731
                fn()
                line.append(f"{name}:{gbs(nbytes, time_ms(fn)):.0f}/{gbs(nbytes, graph_time_ms(fn)):.0f}")
            print(f"  {str(dtype)[6:]:9} 4096 x {n:<6} " + "  ".join(line), flush=True)
            del x
    fs.FUSED_PERSISTENT_MAX_COLS = saved_max
    print("shared rows: tiles (cols/warps/programs a multiprocessor/prefetch of the next part; each tried as both "
          "SHARED_TILES and SHARED_WAVE_TILES), waves of held parts, fewer waves with heads, or one wave; head block -> "
          "GB/s do_bench / CUDA graph; 'auto' is flashlite's plan")
    saved, saved_waves = dict(fs.SHARED_TILES), dict(fs.SHARED_WAVE_TILES)
    for dtype in (torch.float32, torch.bfloat16) if args.tune in ("all", "shared") else ():
        size = dtype.itemsize
        tiles = {"now": saved[size], "wave tile now": saved_waves[size]}
        if size == 2:  # the fp32 shape, and two bf16 programs a multiprocessor
            tiles |= {"16384/4/2/none": fs.SharedRowTile(16384, 4, 2, fs.PREFETCH_NONE.value, 4096),
                      "16384/8/2/none": fs.SharedRowTile(16384, 8, 2, fs.PREFETCH_NONE.value, 4096),
                      "32768/16/1/none": dataclasses.replace(saved[size], prefetch=fs.PREFETCH_NONE.value)}
        for shape in ((4096, 65536),) + tuple(LONG_ROWS):
            x = torch.randn(*shape, device="cuda", dtype=dtype)
            nbytes = softmax_bytes(x)
            line = [f"online:{gbs(nbytes, time_ms(lambda: flashlite.softmax(x, algorithm='online'))):.0f}"]
            fs.clear_plans()
            line.append(f"auto:{_time_plan(x, _fused_plan(x))}")
            timed = set()
            for name, tile in tiles.items():
                for head_block in sorted({tile.head_block, 4096, 8192}):
                    fs.SHARED_TILES[size] = fs.SHARED_WAVE_TILES[size] = dataclasses.replace(tile, head_block=head_block)
                    for wave_label, fraction in (("waves", 0.0), ("heads", HEADS_FRACTION), ("one wave", 1.0)):
                        # 0: waves of held parts unless one row is too long; then as few waves as fit
                        # the fraction of L2 (at most SHARED_MAX_HEAD_WAVES); 1: (nearly) always one.
                        fs.SHARED_HEADS_L2_FRACTION = fraction
                        fs.clear_plans()
                        plan = _fused_plan(x)
                        if plan in timed:
                            continue
                        timed.add(plan)
                        label = f"{name}/{wave_label if plan.head_cols else 'waves'}"
                        label += f"/head {plan.n_splits}x{plan.head_cols}+{plan.block_n} in {head_block}s" if plan.head_cols else ""
                        line.append(f"{label}:{_time_plan(x, plan)}")
                fs.SHARED_TILES[size], fs.SHARED_WAVE_TILES[size] = saved[size], saved_waves[size]
            fs.SHARED_HEADS_L2_FRACTION = HEADS_FRACTION
            print(f"  {str(dtype)[6:]:9} {str(shape):16} " + "  ".join(dict.fromkeys(line)), flush=True)
            del x
    fs.SHARED_TILES.update(saved)
    fs.SHARED_WAVE_TILES.update(saved_waves)
    fs.clear_plans()
    if args.tune in ("all", "reread"):
        tune_reread(args.cols)
    print("host cost per call (us), 4096 x 256 fp32:")
    x = torch.randn(4096, 256, device="cuda")
    for name, fn in (("flashlite", lambda: flashlite.softmax(x)), ("torch", lambda: torch.softmax(x, -1))):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(300):
            fn()
        torch.cuda.synchronize()
        print(f"  {name}: {(time.perf_counter() - t0) / 300 * 1e6:.1f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="output folder (default bench/results/<gpu>)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--quick", action="store_true", help="three shapes only")
    parser.add_argument("--check", action="store_true", help="GPU correctness checks instead of timing")
    parser.add_argument("--replot", action="store_true", help="redraw softmax.png from the results folder's JSON")
    parser.add_argument("--tune", choices=["all", "fused", "short", "online", "grid", "shared", "reread"], help="time heuristic candidates instead of the sweep")
    parser.add_argument("--cols", nargs="+", type=int, help="--tune reread: only the shapes of these row lengths")
    args = parser.parse_args(argv)
    if args.replot:
        replot(args)
    elif args.check:
        run_check(args)
    elif args.tune:
        run_tune(args)
    else:
        run_bench(args)


if __name__ == "__main__":
    main()
