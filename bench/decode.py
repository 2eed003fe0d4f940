"""Decoding against a long KV cache: flashlite's split-K/V path against SDPA's backends and naive PyTorch.

One query (Lq = 1) per head attends a bf16 cache of Lk keys: B in {1, 8}, H = 32
query heads, H_kv in {32, 8} (MHA and GQA), D = 128, Lk from 4K to 1M; shapes
whose K/V pass ``KV_BUDGET_GB`` are skipped. Every provider runs in this
process on the same data. Decoding is memory-bound, so the figure of merit is
the achieved bandwidth: the bytes of K and V that must be read
(``kv_bytes``: B·H_kv·Lk·D·2 tensors·2 bytes) over the median time of an eager
call (``common.time_ms``: host cost included where the GPU would wait for it),
as a fraction of the copy bandwidth measured in the same run
(``common.copy_bandwidth_gbs``); ``flashlite_graph_us`` is flashlite's time
replayed from a CUDA graph (device time only). Providers: flashlite with
automatic splits, with ``cache_seqlens`` (the decoding path: the split kernel
even at one split), and with forced ``num_splits``; SDPA flash / cuDNN /
efficient (``enable_gqa``, else K/V repeated to H heads outside the timing; a
backend that still fails is a missing value); naive PyTorch (scores, softmax,
matmul). The target: at least ``TARGET_X_BEST_SDPA`` of the faster SDPA
backend's bandwidth from Lk = 4096. Correctness is tests/test_gpu_decode.py's.

    python bench/decode.py            # full sweep -> bench/results/<gpu>/decode.{json,md,png}
    python bench/decode.py --quick    # Lk in {16K, 256K} only
    python bench/decode.py --tune     # every num_splits per shape -> decode_tune.{json,md} (split_kv's rule)
"""

from __future__ import annotations

import argparse
import functools
import importlib
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flashlite as fa

sk = importlib.import_module("flashlite.attention.split_kv")
from attention import sdpa_backends
from common import (
    copy_bandwidth_gbs,
    environment,
    gbs,
    graph_time_ms,
    plot_lines,
    results_dir,
    time_ms,
    write_results,
)

HEADS, HEAD_DIM = 32, 128
BATCHES = [1, 8]
KV_HEADS = [32, 8]
LENGTHS = [4096, 16384, 65536, 262144, 1048576]
QUICK_LENGTHS = [16384, 262144]
FORCED_SPLITS = [1, 16, 64]
TUNE_SPLITS = [2, 4, 8, 16, 32, 64, 128]
TUNE_LENGTHS = [4096, 16384, 65536, 262144]
KV_BUDGET_GB = 60  # of an 80 GB GPU: room for a repeated copy for GQA peers is not promised (missing values)
PEERS = ("flash", "cudnn", "efficient", "naive")
# The target: this fraction of the faster SDPA backend's bandwidth at every shape from this Lk.
TARGET_X_BEST_SDPA, TARGET_MIN_LK = 0.9, 4096


def kv_bytes(batch: int, kv_heads: int, seqlen_k: int, head_dim: int = HEAD_DIM, elem: int = 2) -> int:
    """Bytes of K and V one decoding step must read."""
    return 2 * batch * kv_heads * seqlen_k * head_dim * elem


def shapes(lengths: list[int]) -> list[tuple[int, int, int]]:
    """(B, H_kv, Lk) of the sweep that fit in KV_BUDGET_GB."""
    return [(b, h_kv, lk) for b in BATCHES for h_kv in KV_HEADS for lk in lengths
            if kv_bytes(b, h_kv, lk) <= KV_BUDGET_GB * 1e9]


def measure_ms(fn, graph: bool = False) -> float | None:
    """Median milliseconds of eager calls (``graph``: of a CUDA-graph replay, device time only); None if it fails."""
    try:
        fn()
        torch.cuda.synchronize()
        return graph_time_ms(fn) if graph else time_ms(fn)
    except (torch.OutOfMemoryError, RuntimeError):
        torch.cuda.empty_cache()
        return None


def naive_decode(q, k, v) -> torch.Tensor:
    """Scores, softmax, matmul; GQA by broadcasting the group dim (no repeat)."""
    b, h, lq, d = q.shape
    h_kv = k.shape[1]
    qg = q.view(b, h_kv, h // h_kv, lq, d)
    s = (qg @ k.unsqueeze(2).transpose(-1, -2)) * (1.0 / math.sqrt(d))
    return (torch.softmax(s.float(), dim=-1).to(v.dtype) @ v.unsqueeze(2)).view(b, h, lq, d)


def sdpa_provider(backend, q, k, v):
    """SDPA pinned to ``backend``: enable_gqa if it takes it, else K/V repeated once (outside the timing)."""
    from torch.nn.attention import sdpa_kernel

    def call(kk, vv, **kw):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, kk, vv, **kw)

    if k.shape[1] == q.shape[1]:
        return lambda: call(k, v)
    try:
        call(k, v, enable_gqa=True)
        return lambda: call(k, v, enable_gqa=True)
    except (RuntimeError, TypeError):
        group = q.shape[1] // k.shape[1]
        k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return lambda: call(k_rep, v_rep)


def providers(q, k, v, splits: list[int]) -> dict:
    """name -> zero-argument call, every provider on the same q, k, v."""
    full = torch.full((q.shape[0],), k.shape[2], dtype=torch.int32, device="cuda")
    provs = {"flashlite": lambda: fa.flash_attention(q, k, v),
             "flashlite_cache": lambda: fa.flash_attention(q, k, v, cache_seqlens=full)}
    for n in splits:
        provs[f"flashlite_s{n}"] = lambda n=n: fa.flash_attention(q, k, v, num_splits=n)
    for name, backend in sdpa_backends().items():
        try:
            provs[name] = sdpa_provider(backend, q, k, v)
        except (torch.OutOfMemoryError, RuntimeError):
            provs[name] = None  # cannot even repeat K/V: a missing value (timing a no-op would give nonsense)
    provs["naive"] = lambda: naive_decode(q, k, v)
    return provs


def make_decode_inputs(batch: int, kv_heads: int, seqlen_k: int, seqlen_q: int = 1):
    q = torch.randn(batch, HEADS, seqlen_q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, seqlen_k, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v


def measure(batch: int, kv_heads: int, seqlen_k: int, copy_gbs: float, splits: list[int]) -> dict:
    q, k, v = make_decode_inputs(batch, kv_heads, seqlen_k)
    n_bytes = kv_bytes(batch, kv_heads, seqlen_k)
    row = {"B": batch, "H_kv": kv_heads, "Lk": seqlen_k, "auto_splits": sk.auto_num_splits(q, k, None)}
    for name, fn in providers(q, k, v, splits).items():
        ms = measure_ms(fn) if fn is not None else None
        row[f"{name}_us"] = None if ms is None else ms * 1e3
        row[name] = gbs(n_bytes, ms)
    graph_ms = measure_ms(lambda: fa.flash_attention(q, k, v), graph=True)
    row["flashlite_graph_us"] = None if graph_ms is None else graph_ms * 1e3
    mine = row["flashlite"]
    row["frac_copy"] = mine / copy_gbs if mine else None
    for peer in PEERS:
        row[f"x_{peer}"] = mine / row[peer] if mine and row[peer] else None
    sdpa = [row[p] for p in ("flash", "cudnn", "efficient") if row[p]]
    row["x_best_sdpa"] = mine / max(sdpa) if mine and sdpa else None
    q = k = v = None  # freed before the next shape is allocated
    torch.cuda.empty_cache()
    return row


def run_bench(args) -> None:
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth: {copy_gbs:.0f} GB/s; H = {HEADS}, D = {HEAD_DIM}, Lq = 1, bf16", flush=True)
    names = ["flashlite", "flashlite_cache", *(f"flashlite_s{n}" for n in args.splits), *PEERS]
    rows = []
    for batch, kv_heads, seqlen_k in shapes(args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)):
        t0 = time.time()
        row = measure(batch, kv_heads, seqlen_k, copy_gbs, args.splits)
        rows.append(row)
        print(f"B={batch} H_kv={kv_heads:2} Lk={seqlen_k:7} splits={row['auto_splits']:3}: " + "  ".join(
            f"{n} {row[n]:.0f}" if row[n] else f"{n} —" for n in names) + f" GB/s  ({time.time() - t0:.0f}s)", flush=True)

    meta = environment() | {"copy_GBs": copy_gbs, "heads": HEADS, "head_dim": HEAD_DIM, "seqlen_q": 1,
                            "dtype": "bfloat16", "bytes": "K and V read: 2·B·H_kv·Lk·D·2", "forced_splits": args.splits}
    report(results_dir(args.out), meta, rows)


def report(out: str, meta: dict, rows: list[dict]) -> None:
    """decode.json, decode.md and decode.png in ``out``, and the targets' summary."""
    copy_gbs = meta["copy_GBs"]
    names = ["flashlite", "flashlite_cache", *(f"flashlite_s{n}" for n in meta["forced_splits"]), *PEERS]
    cols = ["B", "H_kv", "Lk", "auto_splits", "flashlite_us", "flashlite_graph_us", *names, "frac_copy",
            "x_best_sdpa", *(f"x_{p}" for p in PEERS)]
    write_results("decode", out, meta, rows, cols, "Decoding (Lq = 1), achieved K/V bandwidth in GB/s (bf16, H = 32, D = 128)")
    panels = []
    for batch in BATCHES:
        for kv_heads in KV_HEADS:
            sel = [r for r in rows if r["B"] == batch and r["H_kv"] == kv_heads]
            if sel:
                series = {n: [r[n] for r in sel] for n in names}
                series["copy (ceiling)"] = [copy_gbs for _ in sel]
                panels.append((f"decode, B={batch}, H={HEADS}, H_kv={kv_heads}", [r["Lk"] for r in sel], series, "GB/s"))
    plot_lines(os.path.join(out, "decode.png"), panels)
    print_summary(rows)


def print_summary(rows: list[dict]) -> None:
    misses = [f"B={r['B']} H_kv={r['H_kv']} Lk={r['Lk']}: x{r['x_best_sdpa'] or 0:.3f} of the faster SDPA backend"
              for r in rows if r["Lk"] >= TARGET_MIN_LK and (r["x_best_sdpa"] or 0) < TARGET_X_BEST_SDPA]
    print(f"\ntarget: >= {TARGET_X_BEST_SDPA}x the faster SDPA backend's GB/s from Lk = {TARGET_MIN_LK}: "
          + ("all met" if not misses else f"{len(misses)} missed"))
    for miss in misses:
        print("  missed: " + miss)


# ----------------------------------------------------------------------------- --tune


def run_tune(args) -> None:
    """For each shape: the automatic choice, the forward kernel (1) and the split kernel at each num_splits (eager
    do_bench medians), next to the fastest SDPA backend; the best split per shape -> decode_tune.{json,md}."""
    rows = []
    for batch, kv_heads, seqlen_k in [(b, h, lk) for b in BATCHES for h in KV_HEADS for lk in args.lengths or TUNE_LENGTHS]:
        q, k, v = make_decode_inputs(batch, kv_heads, seqlen_k)
        runs = {"auto": None, "1": 1, **{str(n): n for n in TUNE_SPLITS}}
        row = {"B": batch, "H_kv": kv_heads, "Lk": seqlen_k, "auto_splits": sk.auto_num_splits(q, k, None)}
        for name, splits in runs.items():
            ms = measure_ms(functools.partial(fa.flash_attention, q, k, v, num_splits=splits))
            row[f"s{name}_us"] = None if ms is None else ms * 1e3
        sdpa = [measure_ms(sdpa_provider(backend, q, k, v)) for backend in sdpa_backends().values()]
        row["best_sdpa_us"] = min((ms for ms in sdpa if ms), default=math.inf) * 1e3
        timed = {n: row[f"s{n}_us"] for n in ["1", *map(str, TUNE_SPLITS)] if row[f"s{n}_us"]}
        best = min(timed, key=timed.get)
        row["best_splits"] = int(best)
        row["x_best_vs_auto"] = timed[best] / row["sauto_us"]
        row["x_sdpa_auto"] = row["best_sdpa_us"] / row["sauto_us"]
        row["x_sdpa_best"] = row["best_sdpa_us"] / timed[best]
        rows.append(row)
        print(f"B={batch} H={HEADS}/{kv_heads} Lk={seqlen_k}: best {best} ({timed[best]:.1f} us), auto "
              f"{row['auto_splits']} ({row['sauto_us']:.1f} us), SDPA {row['best_sdpa_us']:.1f} us; "
              + " ".join(f"{n}:{t:.0f}" for n, t in timed.items()), flush=True)
        q = k = v = None  # freed before the next shape is allocated
        torch.cuda.empty_cache()
    cols = ["B", "H_kv", "Lk", "auto_splits", "best_splits", "x_best_vs_auto", "x_sdpa_auto", "x_sdpa_best",
            "best_sdpa_us", "sauto_us", "s1_us", *(f"s{n}_us" for n in TUNE_SPLITS)]
    meta = environment() | {"heads": HEADS, "head_dim": HEAD_DIM, "seqlen_q": 1, "dtype": "bfloat16",
                            "n_sms": torch.cuda.get_device_properties(0).multi_processor_count}
    write_results("decode_tune", results_dir(args.out), meta, rows, cols,
                  "num_splits per decoding shape: eager do_bench medians in us (bf16, H = 32, D = 128, Lq = 1)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="output folder (default bench/results/<gpu>)")
    parser.add_argument("--quick", action="store_true", help=f"Lk in {QUICK_LENGTHS} only")
    parser.add_argument("--lengths", type=int, nargs="+", help="cache lengths Lk (default: the full sweep)")
    parser.add_argument("--splits", type=int, nargs="+", default=FORCED_SPLITS, help="forced num_splits to time too")
    parser.add_argument("--tune", action="store_true", help="time num_splits per shape instead of the sweep")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.tune:
        run_tune(args)
    else:
        run_bench(args)


if __name__ == "__main__":
    main()
