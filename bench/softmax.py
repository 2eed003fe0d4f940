"""Softmax bandwidth: flashlite (auto, fused, online) against torch, torch.compile, naive PyTorch and textbook kernels.

GB/s counts one read and one write of the tensor. The device-to-device copy
bandwidth measured in the same run (2 GiB) is the ceiling; a copy of each
tensor, timed like the softmax, is the ceiling at its size. Modes:

    python bench/softmax.py            # full sweep -> bench/results/<gpu>/softmax.{json,md,png}
    python bench/softmax.py --tune X   # time the heuristic constants' candidates (X: fused, short, online, grid,
                                       # shared, reread, long, cluster or all)
    python bench/softmax.py --replot   # redraw softmax.png from the committed softmax.json (no GPU)

GPU correctness (poisoned memory, every regime, > 2^31 elements) is tests/test_gpu_softmax.py's (pytest -m gpu).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flashlite  # noqa: E402
from flashlite.core.runtime import loaded  # noqa: E402
from flashlite.softmax import tuning  # noqa: E402  (the tables --tune sets: the planner reads them through the module)
from flashlite.softmax.api import clear_plans, softmax_forward  # noqa: E402
from flashlite.softmax.frames import row_vectors  # noqa: E402
from flashlite.softmax.fused import fused_launch, softmax_fused_kernel  # noqa: E402
from flashlite.softmax.plan import SoftmaxPlan, plan_backward, plan_rows, plan_softmax  # noqa: E402
from flashlite.softmax.shared_rows import shared_rows_launch  # noqa: E402

from baselines import naive_softmax, textbook_fused_softmax, textbook_online_softmax  # noqa: E402
from common import (  # noqa: E402
    copy_bandwidth_gbs, environment, fresh_copy, gbs, graph_time_ms, plot_lines, poison_allocator, quack_provider,
    quack_softmax, results_dir, tensor_softmax_bytes, time_ms, try_time_ms, write_results,
)

WIDE_N = [256, 1024, 4096, 8192, 16384, 32768, 65536]  # with M = 4096 rows
LONG_ROWS = [(128, 1 << 17), (16, 1 << 20), (4, 1 << 22), (1, 1 << 24)]
# Odd row lengths (a GPT-2 vocabulary; a long odd row): contiguous rows that start anywhere in a 16-byte vector.
ODD_ROWS = [(4096, 50257), (16, 1_000_003)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PEERS = ["torch", "compile", "quack"]  # quack where it imports (common.quack_softmax)


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
    return plan_rows(x, x.dtype)


def backward_plan(y: torch.Tensor, algorithm: str = "auto"):
    """The plan flashlite's backward runs for rows like ``y`` (contiguous) after a forward under ``algorithm``, and
    its regime: "fused" (a program a tile of one row or several), "shared" (resident programs share a row) or
    "online" (streamed)."""
    plan = plan_backward(plan_rows(y, y.dtype, algorithm), *y.shape, y.element_size(), y.device)
    return plan, "shared" if plan.shares_rows else plan.algorithm


def providers(compiled) -> dict:
    return {
        "flashlite": lambda x: flashlite.softmax(x),
        "fused": lambda x: flashlite.softmax(x, algorithm="fused") if _fused_plan(x).algorithm != "online" else None,
        "online": lambda x: flashlite.softmax(x, algorithm="online"),
        "torch": lambda x: torch.softmax(x, dim=-1),
        "compile": compiled,
        "quack": quack_provider(),
        "naive": naive_softmax,
        "textbook_fused": lambda x: textbook_fused_softmax(x) if x.shape[1] <= 65536 else None,
        "textbook_online": textbook_online_softmax,
        # A copy of the same tensor, timed the same way: the ceiling at this size. do_bench's L2 flush is a
        # memset whose dirty lines the timed call writes back, which weighs most on small tensors (64 MB
        # copies ran at 2683 GB/s after it, 3092 after a flush that only reads; TUNING.md#timing-method).
        "copy_same_size": lambda x: x.clone(),
    }


def measure(shape, dtype, provs) -> dict:
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    row = {"dtype": str(dtype).replace("torch.", ""), "M": shape[0], "N": shape[1], "elements": x.numel()}
    # Each provider is timed on a copy of its own (common.fresh_copy): lines torch.compile's kernels load with
    # evict_last outlive do_bench's flush, and served every provider timed after it on one shared tensor
    # (bf16 4096 x 4096: flashlite 2434 -> 2770 GB/s once compile had run on it; TUNING.md#timing-method).
    copies = []
    for name, fn in provs.items():
        copies.append(fresh_copy(x))
        if fn(copies[-1]) is None:
            row[name] = None
            continue
        row[name] = gbs(tensor_softmax_bytes(x), try_time_ms(functools.partial(fn, copies[-1])))
    # The same call replayed from a CUDA graph: device time alone. Where it is well above the column
    # "flashlite", the call was host-bound (a launch costs ~50 us of host time; do_bench hides less).
    copies.append(fresh_copy(x))
    row["flashlite_graph"] = gbs(tensor_softmax_bytes(x), graph_time_ms(functools.partial(provs["flashlite"], copies[-1])))
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
            row["x_quack"] = row["flashlite"] / row["quack"] if row["quack"] else None
            rows.append(row)
            print(f"{dname} {shape}: flashlite {row['flashlite']:.0f} GB/s ({row['frac_copy']:.0%} of copy), "
                  f"x{row['x_best_peer']:.2f} best peer  [{time.time() - t0:.1f}s]", flush=True)
    meta = environment() | {"copy_gbs": copy, "flashlite_fused_max_cols": tuning.FUSED_MAX_COLS, "quack": quack_softmax()[1],
                            "inputs": "a fresh copy a provider (common.fresh_copy)"}
    out = results_dir(args.out)
    cols = ["dtype", "M", "N", "flashlite", "flashlite_graph", "fused", "online", "torch", "compile", "quack", "naive",
            "textbook_fused", "textbook_online", "copy_same_size", "frac_copy", "frac_copy_same_size", "x_best_peer",
            "x_quack"]
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
    print(f"{'dtype':9}{'shape':>16}{'flashlite':>10}{'torch':>8}{'compile':>9}{'quack':>7}{'%copy':>7}{'%same':>7}"
          f"{'xbest':>7}")
    for r in rows:
        print(f"{r['dtype']:9}{str((r['M'], r['N'])):>16}{r['flashlite']:>10.0f}{r['torch']:>8.0f}"
              f"{(r['compile'] or 0):>9.0f}{(r.get('quack') or 0):>7.0f}{r['frac_copy']:>7.0%}"
              f"{r['frac_copy_same_size']:>7.0%}{r['x_best_peer']:>7.2f}")


# ----------------------------------------------------------------------------- --tune

HEADS_FRACTION = tuning.SHARED_HEADS_L2_FRACTION


def _softmax_close(err: float, dtype: torch.dtype) -> bool:
    """Whether a tuned candidate's largest error against float64 is a softmax's in ``dtype`` (NaN is not)."""
    return err <= (2e-6 if dtype == torch.float32 else 8e-3)


def _time_plan(x: torch.Tensor, plan, graph: bool = True) -> str:
    """'do_bench/graph' GB/s of softmax_forward under ``plan`` (do_bench alone without ``graph``), checked against
    float64 first."""
    fn = lambda: softmax_forward(x, x.dtype, plan)[0]  # noqa: E731
    poison_allocator()
    err = (fn().double() - torch.softmax(x.double(), -1)).abs().max().item()
    if not _softmax_close(err, x.dtype):
        return f"WRONG({err:.1e})"
    nbytes = tensor_softmax_bytes(x)
    if not graph:
        return f"{gbs(nbytes, time_ms(fn)):.0f}"
    return f"{gbs(nbytes, time_ms(fn)):.0f}/{gbs(nbytes, graph_time_ms(fn)):.0f}"


def _registers(x: torch.Tensor, plan) -> str:
    """'registers/spilled' of the fused kernel compiled for ``x`` under ``plan``."""
    y = torch.empty_like(x)
    grid, args, meta, _ = fused_launch(x, y, x, x.dtype, plan, True, False)
    compiled = loaded(softmax_fused_kernel.warmup(*args, grid=grid, **meta))
    return f"{compiled.n_regs}r/{compiled.n_spills}s"


REREAD_SHAPES = {torch.float32: ((4096, 16384), (4096, 32768), (4096, 65536)),
                 torch.bfloat16: ((4096, 16384), (4096, 32768), (4096, 40000), (4096, 49168), (4096, 50257),
                                  (4096, 57344), (4096, 61440), (4096, 65536), (1024, 65536), (768, 65536))}


def tune_reread(cols: list[int] | None = None, rounds: int = 2, warps_tried=(16, 32)) -> None:
    """Rows past FUSED_MAX_COLS (and wide fused rows): flashlite's plan, and its plan without the reread rule
    (FWD_REREAD_MAX_COLS), against a program a row that reads its row twice (REREAD) on several warp counts;
    ``rounds`` alternating rounds, each plan on a fresh copy; ``cols``: only the shapes of those row lengths.
    Planned as on a GPU without thread-block clusters (CLUSTER emptied: on Hopper they take these rows)."""
    print("reread: plan -> GB/s do_bench / CUDA graph (registers/spilled), rounds alternate; compile for reference")
    compiled = _compiled_softmax()
    with _emptied(tuning.CLUSTER):
        for dtype, shape, x in _tune_inputs(REREAD_SHAPES, cols):
            plans = _plans_with_and_without(x, tuning.FWD_REREAD_MAX_COLS, "no reread")
            vec_cols = max(row_vectors(x, dtype), 1)
            block_n = triton.next_power_of_2(shape[1])
            for warps in warps_tried:
                if block_n // (32 * warps) <= 128:  # at most 128 values a thread
                    plans[f"reread/w{warps}"] = SoftmaxPlan("fused", 1, block_n, warps, vec_cols=vec_cols, reread=True)
            regs = {name: _registers(x, plan) for name, plan in plans.items()
                    if plan.algorithm == "fused" and not plan.shares_rows}
            for r in range(rounds):
                line = [f"compile:{gbs(tensor_softmax_bytes(x), time_ms(functools.partial(compiled, x))):.0f}"]
                for name, plan in (plans.items() if r % 2 == 0 else reversed(plans.items())):
                    xc = fresh_copy(x)
                    line.append(f"{name}:{_time_plan(xc, plan)}" + (f"({regs[name]})" if name in regs else ""))
                    del xc
                print(f"  {str(dtype)[6:]:9} {str(shape):16} r{r} " + "  ".join(line), flush=True)
            del x  # (freed by _tune_inputs before the next shape's)


LONG_TUNE_SHAPES = ((4096, 16384), (4096, 32768), (4096, 65536), (1024, 131072), (128, 262144), (16, 1 << 20))
LONG_TUNE_PARTS = ((8192, 4), (8192, 8), (16384, 4), (16384, 8), (16384, 16), (32768, 8), (32768, 16))  # cols, warps


def _shared_programs(x: torch.Tensor, plan) -> int:
    """Programs of the shared-row launch of ``x`` under ``plan`` (one wave of resident programs), 0 where a
    row's parts cannot all be resident."""
    slots = torch.zeros(x.shape[0] * plan.n_splits, dtype=torch.int64, device=x.device)
    launch = shared_rows_launch(x, torch.empty_like(x), x, (slots, slots, 0), plan, True, False)
    return launch[0][0] if launch is not None else 0


def _pipelined_fused(x: torch.Tensor, programs: int, warps: int, stages: int):
    """The fused kernel, a row a tile, on a persistent grid of ``programs``, its row loop software-pipelined over
    ``stages`` (Triton's cp.async ring in shared memory: the next row loads while this one is reduced); or None
    if that does not compile for the device."""
    n_rows, n_cols = x.shape
    y = torch.empty_like(x)
    meta = dict(BLOCK_M=1, BLOCK_N=triton.next_power_of_2(n_cols), VEC_COLS=1, REREAD=False, WRITE_Y=True,
                WRITE_LSE=False, num_warps=warps, num_stages=stages)

    def run():
        softmax_fused_kernel[(min(programs, n_rows),)](x, y, x, n_rows, n_cols, 0, x.stride(0), x.stride(1), n_cols,
                                                       **meta)
        return y
    try:
        run()
    except Exception as e:  # noqa: BLE001 (out of shared memory, say: not timed)
        print(f"    (pipelined w{warps}/s{stages}: {type(e).__name__})")
        return None
    return run


@contextlib.contextmanager
def _emptied(table: dict):
    """The tuning table ``table`` empty inside the block and restored after it, the plans made from it forgotten
    on the way in and out."""
    saved = dict(table)
    table.clear()
    clear_plans()
    try:
        yield
    finally:
        table.update(saved)
        clear_plans()


def _tune_inputs(shapes: dict, cols: list[int] | None):
    """``(dtype, shape, x)`` for each shape of ``shapes`` (``{dtype: shapes}``) whose row length is in ``cols`` (every
    one without): ``x`` normal data on the GPU, freed once the caller has dropped it and asks for the next."""
    for dtype, of_dtype in shapes.items():
        for shape in of_dtype:
            if cols and shape[1] not in cols:
                continue
            x = torch.randn(*shape, device="cuda", dtype=dtype)
            yield dtype, shape, x
            del x
            torch.cuda.empty_cache()


def _plans_with_and_without(x: torch.Tensor, table: dict, label: str) -> dict:
    """``{label: the plan for x with the tuning table ``table`` emptied, "auto": the plan with it}``."""
    with _emptied(table):
        plans = {label: _fused_plan(x)}
    plans["auto"] = _fused_plan(x)
    return plans


def _round_line(x: torch.Tensor, plans: dict, peers: dict, r: int) -> list[str]:
    """One round of a tune: 'name:GB/s' of each plan (softmax_forward, checked against float64; in reverse order on
    odd rounds) and of each peer, every one on a fresh copy of ``x``."""
    line = []
    for name, plan in (plans.items() if r % 2 == 0 else reversed(plans.items())):
        xc = fresh_copy(x)
        line.append(f"{name}:{_time_plan(xc, plan, graph=False)}")
        del xc
    for name, fn in peers.items():
        xc = fresh_copy(x)
        ms = try_time_ms(functools.partial(fn, xc)) if fn(xc) is not None else None
        line.append(f"{name}:{gbs(tensor_softmax_bytes(x), ms) or 0:.0f}")
        del xc
    return line


def tune_long(rounds: int = 2, dtypes=(torch.bfloat16, torch.float32), shapes=LONG_TUNE_SHAPES) -> None:
    """Long rows (the shapes where quack led): flashlite's plan against rows shared by resident programs holding
    LONG_TUNE_PARTS columns each (no heads; the next part into L2 or not), and against quack, torch.compile and a
    copy; do_bench GB/s, each plan checked against float64, ``rounds`` rounds in alternating order."""
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    compiled, quack = _compiled_softmax(), quack_provider()
    print(f"long rows: plan -> GB/s do_bench (cols/warps/next part into L2 or not (programs a multiprocessor)); "
          f"quack {quack_softmax()[1]}")
    for dtype in dtypes:
        for shape in shapes:
            x = torch.randn(*shape, device="cuda", dtype=dtype)
            nbytes = tensor_softmax_bytes(x)
            auto = _fused_plan(x)
            plans = {f"auto({auto.block_n}/w{auto.num_warps}x{auto.n_splits}{'/head' if auto.head_cols else ''}"
                     f"{'/reread' if auto.reread else ''})": auto}
            for cols, warps in LONG_TUNE_PARTS:
                parts = triton.cdiv(shape[1], cols)
                for prefetch in (tuning.PREFETCH_NONE.value, tuning.PREFETCH_L2.value):
                    plan = SoftmaxPlan("fused", 1, cols, warps, parts, cols, prefetch=prefetch)
                    programs = _shared_programs(x, plan) if parts > 1 else 0
                    if programs:
                        plans[f"{cols}/w{warps}/{'L2' if prefetch else '-'}({programs / num_sms:.1f})"] = plan
            pipelined = {}
            if shape[1] <= tuning.FUSED_MAX_COLS:
                for warps, stages, per_sm in ((16, 2, 1), (16, 3, 1), (8, 2, 1), (8, 1, 2), (16, 1, 1)):
                    run = _pipelined_fused(x, per_sm * num_sms, warps, stages)
                    if run is not None:
                        err = (run().double() - torch.softmax(x.double(), -1)).abs().max().item()
                        pipelined[f"rows/w{warps}/s{stages}({per_sm})"] = (run, err)
            peers = {"quack": quack, "compile": compiled, "copy": lambda t: t.clone()}
            for r in range(rounds):
                line = []
                for name, (run, err) in pipelined.items():  # on x itself: the kernel was built for it
                    line.append(f"{name}:{gbs(nbytes, time_ms(run)):.0f}" if _softmax_close(err, dtype)
                                else f"{name}:WRONG({err:.1e})")
                line += _round_line(x, plans, peers, r)
                print(f"  {str(dtype)[6:]:9} {str(shape):16} r{r} " + "  ".join(line), flush=True)
            del x
            torch.cuda.empty_cache()


CLUSTER_TUNE_SHAPES = {torch.bfloat16: ((4096, 16384), (4096, 32768), (4096, 65536), (1024, 131072), (128, 131072),
                                        (64, 131072)),
                       torch.float32: ((4096, 32768), (4096, 65536), (1024, 131072), (128, 131072), (64, 131072))}


def tune_cluster(cols: list[int] | None = None, rounds: int = 2) -> None:
    """Rows over a thread-block cluster (tuning.CLUSTER): flashlite's plan, its plan without clusters, and the
    cluster kernel on 2/4/8 CTAs of 4/8/16 warps, against quack and a copy; do_bench GB/s, each plan checked against
    float64, ``rounds`` rounds in alternating order; ``cols``: only rows that long. (Persistent clusters were timed
    by this function at commit 7be9022, the exchange through global memory at 76878b5: TUNING.md#cluster-rows,
    #cluster-exchange.)"""
    quack = quack_provider()
    print(f"cluster rows: plan -> GB/s do_bench (CTAs x warps, columns a CTA); quack {quack_softmax()[1]}")
    for dtype, shape, x in _tune_inputs(CLUSTER_TUNE_SHAPES, cols):
        plans = _plans_with_and_without(x, tuning.CLUSTER, "no-cluster")
        for ctas in (2, 4, 8):
            for warps in (4, 8, 16):
                part = triton.next_power_of_2(shape[1]) // ctas
                if 16 <= part // (32 * warps) <= 128:
                    plans[f"c{ctas}w{warps}({part})"] = SoftmaxPlan("cluster", 1, part, warps, ctas, part)
        peers = {"quack": quack, "copy": lambda t: t.clone()}
        for r in range(rounds):
            line = "  ".join(_round_line(x, plans, peers, r))
            print(f"  {str(dtype)[6:]:9} {str(shape):16} r{r} {line}", flush=True)
        del x  # (freed by _tune_inputs before the next shape's)
    clear_plans()


def run_tune(args) -> None:
    """Time candidates for the constants in flashlite/softmax/tuning.py; print the table they were chosen from."""
    compiled = _compiled_softmax()
    tuning.FUSED_MAX_COLS = 65536
    print("fused: tile elems x elems/thread -> GB/s")
    for dtype in (torch.float32, torch.bfloat16) if args.tune in ("all", "fused") else ():
        for n in (256, 1024, 4096, 16384, 32768, 65536):
            x = torch.randn(4096, n, device="cuda", dtype=dtype)
            line = []
            for tile in (2048, 4096, 8192, 16384):
                for ept in (8, 16, 32):
                    tuning.FUSED_TILE_ELEMS = tuning.FUSED_SHORT_TILE_ELEMS = tile
                    tuning.FUSED_ELEMS_PER_THREAD = ept
                    clear_plans()
                    ms = graph_time_ms(lambda: flashlite.softmax(x, algorithm="fused"))
                    line.append(f"{tile}/{ept}:{gbs(tensor_softmax_bytes(x), ms) or 0:.0f}")
            print(f"  {str(dtype)[6:]:9} N={n:6}  " + "  ".join(line), flush=True)
    tuning.FUSED_MAX_COLS = 32768
    clear_plans()
    print("online: block_n/warps (whole rows | split rows) x num_stages -> GB/s")
    for dtype in (torch.float32, torch.bfloat16) if args.tune in ("all", "online") else ():
        for shape in ((4096, 65536),) + tuple(LONG_ROWS):
            x = torch.randn(*shape, device="cuda", dtype=dtype)
            line = []
            for bn, warps in ((1024, 4), (2048, 4), (4096, 8), (4096, 16)):
                for stages in (1, 2, 3, 4):
                    tuning.ONLINE_BLOCK_N, tuning.ONLINE_NUM_WARPS = bn, warps
                    tuning.SPLIT_BLOCK_N, tuning.SPLIT_NUM_WARPS = bn, warps
                    tuning.ONLINE_NUM_STAGES = stages
                    clear_plans()
                    ms = graph_time_ms(lambda: flashlite.softmax(x, algorithm="online"))
                    line.append((gbs(tensor_softmax_bytes(x), ms) or 0, f"{bn}/{warps}/s{stages}"))
            line.sort(reverse=True)
            print(f"  {str(dtype)[6:]:9} {str(shape):16} best: " + "  ".join(f"{c}:{v:.0f}" for v, c in line[:6])
                  + f"   worst: {line[-1][1]}:{line[-1][0]:.0f}", flush=True)
            del x
    print("short rows: tile elems/warps, persistent (P) or one program a tile (G) -> GB/s, CUDA graph (peers too)")
    quack = quack_provider()
    saved = tuning.FUSED_TILE_ELEMS, tuning.FUSED_SHORT_TILE_ELEMS, tuning.FUSED_ELEMS_PER_THREAD, tuning.FUSED_PERSISTENT_MAX_COLS
    for dtype in (torch.float32, torch.bfloat16) if args.tune in ("all", "short") else ():
        for n in (256, 512, 1024, 2048):
            x = torch.randn(4096, n, device="cuda", dtype=dtype)
            nbytes = tensor_softmax_bytes(x)
            tuning.FUSED_TILE_ELEMS, tuning.FUSED_SHORT_TILE_ELEMS, tuning.FUSED_ELEMS_PER_THREAD, tuning.FUSED_PERSISTENT_MAX_COLS = saved
            clear_plans()
            plan = plan_softmax(4096, n, x.device, "auto", shared_rows=dtype)
            now = f"{plan.block_m * plan.block_n}/w{plan.num_warps}/{'P' if n <= saved[3] else 'G'}"
            line = {"torch": graph_time_ms(lambda: torch.softmax(x, -1)), "compile": graph_time_ms(lambda: compiled(x))}
            if quack(x) is not None:
                line["quack"] = graph_time_ms(lambda: quack(x))
            for tile in (512, 1024, 2048, 4096, 8192):
                for ept in (8, 16, 32):
                    tuning.FUSED_TILE_ELEMS = tuning.FUSED_SHORT_TILE_ELEMS = tile
                    tuning.FUSED_ELEMS_PER_THREAD = ept
                    clear_plans()
                    plan = plan_softmax(4096, n, x.device, "auto", shared_rows=dtype)
                    for name, max_cols in (("P", 1 << 30), ("G", 0)):
                        tuning.FUSED_PERSISTENT_MAX_COLS = max_cols
                        line[f"{plan.block_m * plan.block_n}/w{plan.num_warps}/{name}"] = graph_time_ms(
                            lambda: flashlite.softmax(x))
            rates = sorted(((gbs(nbytes, ms), label) for label, ms in line.items()), reverse=True)
            print(f"  {str(dtype)[6:]:9} 4096 x {n:<5} now {now}: {gbs(nbytes, line[now]):.0f}  "
                  + "  ".join(f"{label}:{rate:.0f}" for rate, label in rates[:8]), flush=True)
            del x
    tuning.FUSED_TILE_ELEMS, tuning.FUSED_SHORT_TILE_ELEMS, tuning.FUSED_ELEMS_PER_THREAD, tuning.FUSED_PERSISTENT_MAX_COLS = saved
    clear_plans()
    print("fused grid: persistent (P) or one program a tile (G) -> GB/s do_bench / CUDA graph")
    saved_max = tuning.FUSED_PERSISTENT_MAX_COLS
    for dtype in (torch.float32, torch.bfloat16) if args.tune in ("all", "grid") else ():
        for n in (1024, 2048, 4096, 8192, 16384, 32768):
            x = torch.randn(4096, n, device="cuda", dtype=dtype)
            nbytes = tensor_softmax_bytes(x)
            line = [f"compile:{gbs(nbytes, time_ms(lambda: compiled(x))):.0f}",
                    f"textbook:{gbs(nbytes, time_ms(lambda: textbook_fused_softmax(x))):.0f}"]
            for name, max_cols in (("P", 1 << 30), ("G", 0)):
                tuning.FUSED_PERSISTENT_MAX_COLS = max_cols
                fn = lambda: flashlite.softmax(x)  # noqa: E731
                fn()
                line.append(f"{name}:{gbs(nbytes, time_ms(fn)):.0f}/{gbs(nbytes, graph_time_ms(fn)):.0f}")
            print(f"  {str(dtype)[6:]:9} 4096 x {n:<6} " + "  ".join(line), flush=True)
            del x
    tuning.FUSED_PERSISTENT_MAX_COLS = saved_max
    print("shared rows: tiles (cols/warps/programs a multiprocessor/prefetch of the next part; each tried as both "
          "SHARED_TILES and SHARED_WAVE_TILES), waves of held parts, fewer waves with heads, or one wave; head block -> "
          "GB/s do_bench / CUDA graph; 'auto' is flashlite's plan")
    saved, saved_waves = dict(tuning.SHARED_TILES), dict(tuning.SHARED_WAVE_TILES)
    for dtype in (torch.float32, torch.bfloat16) if args.tune in ("all", "shared") else ():
        size = dtype.itemsize
        tiles = {"now": saved[size], "wave tile now": saved_waves[size]}
        if size == 2:  # the fp32 shape, and two bf16 programs a multiprocessor
            tiles |= {"16384/4/2/none": tuning.SharedRowTile(16384, 4, 2, tuning.PREFETCH_NONE.value, 4096),
                      "16384/8/2/none": tuning.SharedRowTile(16384, 8, 2, tuning.PREFETCH_NONE.value, 4096),
                      "32768/16/1/none": dataclasses.replace(saved[size], prefetch=tuning.PREFETCH_NONE.value)}
        for shape in ((4096, 65536),) + tuple(LONG_ROWS):
            x = torch.randn(*shape, device="cuda", dtype=dtype)
            nbytes = tensor_softmax_bytes(x)
            line = [f"online:{gbs(nbytes, time_ms(lambda: flashlite.softmax(x, algorithm='online'))):.0f}"]
            clear_plans()
            line.append(f"auto:{_time_plan(x, _fused_plan(x))}")
            timed = set()
            for name, tile in tiles.items():
                for head_block in sorted({tile.head_block, 4096, 8192}):
                    tuning.SHARED_TILES[size] = tuning.SHARED_WAVE_TILES[size] = dataclasses.replace(tile, head_block=head_block)
                    for wave_label, fraction in (("waves", 0.0), ("heads", HEADS_FRACTION), ("one wave", 1.0)):
                        # 0: waves of held parts unless one row is too long; then as few waves as fit
                        # the fraction of L2 (at most SHARED_MAX_HEAD_WAVES); 1: (nearly) always one.
                        tuning.SHARED_HEADS_L2_FRACTION = fraction
                        clear_plans()
                        plan = _fused_plan(x)
                        if plan in timed:
                            continue
                        timed.add(plan)
                        label = f"{name}/{wave_label if plan.head_cols else 'waves'}"
                        label += f"/head {plan.n_splits}x{plan.head_cols}+{plan.block_n} in {head_block}s" if plan.head_cols else ""
                        line.append(f"{label}:{_time_plan(x, plan)}")
                tuning.SHARED_TILES[size], tuning.SHARED_WAVE_TILES[size] = saved[size], saved_waves[size]
            tuning.SHARED_HEADS_L2_FRACTION = HEADS_FRACTION
            print(f"  {str(dtype)[6:]:9} {str(shape):16} " + "  ".join(dict.fromkeys(line)), flush=True)
            del x
    tuning.SHARED_TILES.update(saved)
    tuning.SHARED_WAVE_TILES.update(saved_waves)
    clear_plans()
    if args.tune in ("all", "reread"):
        tune_reread(args.cols)
    if args.tune in ("all", "long"):
        tune_long()
    if args.tune in ("all", "cluster"):
        tune_cluster(args.cols)
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
    parser.add_argument("--replot", action="store_true", help="redraw softmax.png from the results folder's JSON")
    parser.add_argument("--tune", choices=["all", "fused", "short", "online", "grid", "shared", "reread", "long", "cluster"],
                        help="time heuristic candidates instead of the sweep")
    parser.add_argument("--cols", nargs="+", type=int,
                        help="--tune reread, cluster: only the shapes of these row lengths")
    args = parser.parse_args(argv)
    if args.replot:
        replot(args)
    elif args.tune:
        run_tune(args)
    else:
        run_bench(args)


if __name__ == "__main__":
    main()
