"""Decoding against a long KV cache: flashlite's split-K/V path against SDPA's backends and naive PyTorch.

One query (Lq = 1) per head attends a bf16 cache of Lk keys: B in {1, 8}, H = 32
query heads, H_kv in {32, 8} (MHA and GQA), D = 128, Lk from 4K to 1M; shapes
whose K/V pass ``KV_BUDGET_GB`` are skipped. Every provider runs in this
process on the same data. Decoding is memory-bound, so the figure of merit is
the achieved bandwidth: the bytes of K and V that must be read
(``kv_bytes``: B·H_kv·Lk·D·2 tensors·2 bytes) over the median device time,
taken from a CUDA-graph replay (no host launch cost, as a serving loop runs
it), as a fraction of the copy bandwidth measured in the same run
(``common.copy_bandwidth_gbs``). Providers: flashlite with automatic splits,
with ``cache_seqlens`` (the decoding path: the split kernel even at one split),
and with forced ``num_splits``; SDPA flash / cuDNN / efficient (``enable_gqa``,
else K/V repeated to H heads outside the timing; a backend that still fails is
a missing value); naive PyTorch (scores, softmax, matmul). Modes:

    python bench/decode.py            # full sweep -> bench/results/<gpu>/decode.{json,md,png}
    python bench/decode.py --quick    # Lk in {16K, 256K} only
    python bench/decode.py --check    # GPU correctness against float64 with poisoned memory
    python bench/decode.py --tune     # time num_splits per shape; print the best (sets split_kv's rule)
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

fa = importlib.import_module("flashlite.attention")
sk = importlib.import_module("flashlite.split_kv")
from attention import poisoned, sdpa_backends  # noqa: E402  (bench/attention.py: shared check and peer helpers)
from common import (  # noqa: E402
    copy_bandwidth_gbs, environment, gbs, graph_time_ms, plot_lines, poison_allocator, results_dir, time_ms,
    write_results,
)

HEADS, HEAD_DIM = 32, 128
BATCHES = [1, 8]
KV_HEADS = [32, 8]
LENGTHS = [4096, 16384, 65536, 262144, 1048576]
QUICK_LENGTHS = [16384, 262144]
FORCED_SPLITS = [1, 16, 64]
TUNE_SPLITS = [1, 2, 4, 8, 16, 32, 64, 128]
KV_BUDGET_GB = 60  # of an 80 GB GPU: room for a repeated copy for GQA peers is not promised (missing values)
PEERS = ("flash", "cudnn", "efficient", "naive")
# Targets of the issue on the H100: a fraction of the copy bandwidth from Lk = 64K, a multiple of SDPA flash at B = 1.
TARGET_COPY_FRAC, TARGET_COPY_MIN_LK = 0.8, 65536
TARGET_FLASH, TARGET_FLASH_BATCH = 2.0, 1


def kv_bytes(batch: int, kv_heads: int, seqlen_k: int, head_dim: int = HEAD_DIM, elem: int = 2) -> int:
    """Bytes of K and V one decoding step must read."""
    return 2 * batch * kv_heads * seqlen_k * head_dim * elem


def shapes(lengths: list[int]) -> list[tuple[int, int, int]]:
    """(B, H_kv, Lk) of the sweep that fit in KV_BUDGET_GB."""
    return [(b, h_kv, lk) for b in BATCHES for h_kv in KV_HEADS for lk in lengths
            if kv_bytes(b, h_kv, lk) <= KV_BUDGET_GB * 1e9]


def measure_ms(fn) -> float | None:
    """Median device milliseconds from a CUDA-graph replay (plain launches if capture fails); None if it fails."""
    try:
        fn()
        torch.cuda.synchronize()
        try:
            return graph_time_ms(fn)
        except RuntimeError:  # not capturable: time the launches
            torch.cuda.synchronize()
            return time_ms(fn)
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
    mine = row["flashlite"]
    row["frac_copy"] = mine / copy_gbs if mine else None
    for peer in PEERS:
        row[f"x_{peer}"] = mine / row[peer] if mine and row[peer] else None
    del q, k, v
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
    cols = ["B", "H_kv", "Lk", "auto_splits", "flashlite_us", *names, "frac_copy", *(f"x_{p}" for p in PEERS)]
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
    misses = [f"B={r['B']} H_kv={r['H_kv']} Lk={r['Lk']}: {r['frac_copy'] or 0:.2f} of copy" for r in rows
              if r["Lk"] >= TARGET_COPY_MIN_LK and (r["frac_copy"] or 0) < TARGET_COPY_FRAC]
    misses += [f"B={r['B']} H_kv={r['H_kv']} Lk={r['Lk']}: x{r['x_flash'] or 0:.2f} flash" for r in rows
               if r["B"] == TARGET_FLASH_BATCH and r["flash"] and (r["x_flash"] or 0) < TARGET_FLASH]
    print(f"\ntargets: >= {TARGET_COPY_FRAC} of copy bandwidth for Lk >= {TARGET_COPY_MIN_LK}; >= {TARGET_FLASH}x "
          f"SDPA flash at B = {TARGET_FLASH_BATCH}: " + ("all met" if not misses else f"{len(misses)} missed"))
    for miss in misses:
        print("  missed: " + miss)


# ----------------------------------------------------------------------------- --check


def check_cases(quick: bool) -> list[dict]:
    """Decoding cases: GQA/MQA, Lq > 1 under causal, per-element cache lengths (0, ragged, L_max), masks, splits."""
    cases = []
    for h_kv in (8, 1, 32):
        for lq, causal in ((1, False), (4, True)) if quick else ((1, False), (1, True), (4, True), (16, False)):
            cases.append(dict(b=3, h_kv=h_kv, lq=lq, lk=9000, causal=causal, lens=(0, 4097, 9000)))
            cases.append(dict(b=2, h_kv=h_kv, lq=lq, lk=20001, causal=causal, lens=None))
    cases.append(dict(b=2, h_kv=8, lq=1, lk=5000, causal=False, lens=(5000, 1), mask=True))
    return cases


def run_check(args) -> None:
    from tests.utils import ATTN_ATOL, attention_ref

    failures, t_start = 0, time.time()
    for case in check_cases(args.quick):
        b, h_kv, lq, lk, causal = (case[key] for key in ("b", "h_kv", "lq", "lk", "causal"))
        q = poisoned((b, HEADS, lq, HEAD_DIM), torch.bfloat16, "contiguous")
        k, v = (poisoned((b, h_kv, lk, HEAD_DIM), torch.bfloat16, "contiguous") for _ in range(2))
        lens = None if case["lens"] is None else torch.tensor(case["lens"], dtype=torch.int32, device="cuda")
        mask = (torch.rand(b, 1, 1, lk, device="cuda") > 0.3) if case.get("mask") else None
        keep = mask  # the reference: cache lengths and causal (bottom-right to each length) as an explicit mask
        if lens is not None:
            used = lens.long().view(b, 1, 1, 1)
            key = torch.arange(lk, device="cuda")
            keep = (key < used).expand(b, 1, lq, lk)
            if causal:
                keep = keep & (key <= torch.arange(lq, device="cuda")[:, None] + used - lq)
            if mask is not None:
                keep = keep & mask
        ref_kw = dict(attn_mask=keep, causal=causal and lens is None)
        ref, ref_lse = attention_ref(q, k, v, return_lse=True, **ref_kw)
        tol = 2 * (attention_ref(q, k, v, dtype=q.dtype, **ref_kw).double() - ref).abs().max().item() + ATTN_ATOL[q.dtype]
        for splits in (None, 1, 7, 64):
            poison_allocator()
            out, lse = fa.flash_attention(q, k, v, causal=causal, attn_mask=mask, cache_seqlens=lens,
                                          num_splits=splits, return_lse=True)
            err = (out.double() - ref).abs().max().item()
            finite = torch.isfinite(ref_lse)
            lse_err = (lse.double() - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
            ok = err <= tol and lse_err <= 2e-2 and bool((lse[~finite] == float("-inf")).all())
            failures += not ok
            print(f"{'ok ' if ok else 'BAD'} B={b} H={HEADS}/{h_kv} Lq={lq:2} Lk={lk:5} causal={causal!s:5} "
                  f"lens={case['lens']} mask={mask is not None!s:5} splits={splits!s:4} "
                  f"err {err:.1e} (tol {tol:.1e}) lse err {lse_err:.1e}", flush=True)
        del q, k, v, ref
    # The longest cache: 1M keys, two heads, against fp32 on a few rows' worth of work.
    q, k, v = make_decode_inputs(1, 2, 2**20)
    q = q[:, :8]  # GQA 4:1 over the two K/V heads
    out = fa.flash_attention(q, k, v, cache_seqlens=torch.tensor([2**20 - 3], device="cuda"))
    ref = attention_ref(q.float(), k[:, :, :2**20 - 3].float(), v[:, :, :2**20 - 3].float(), dtype=torch.float32)
    err = (out.float() - ref).abs().max().item()
    failures += not err <= 2e-2
    print(f"{'ok ' if err <= 2e-2 else 'BAD'} Lk=1M GQA cache_seqlens: err {err:.1e} (tol 2e-2)")
    print(f"\n{failures} failure(s) in {time.time() - t_start:.0f}s")
    if failures:
        sys.exit(1)


# ----------------------------------------------------------------------------- --tune


def run_tune(args) -> None:
    """For each sweep shape: the forward kernel and the split kernel at each num_splits; print the ranking."""
    for batch, kv_heads, seqlen_k in shapes(args.lengths or LENGTHS):
        q, k, v = make_decode_inputs(batch, kv_heads, seqlen_k)
        full = torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda")
        runs = {"forward kernel": lambda: fa.flash_attention(q, k, v, num_splits=1)}
        for n in TUNE_SPLITS:  # through cache_seqlens: the split kernel, even at one split
            runs[f"split {n}"] = lambda n=n: fa.flash_attention(q, k, v, cache_seqlens=full, num_splits=n)
        results = sorted(((measure_ms(fn) or math.inf, name) for name, fn in runs.items()))
        automatic, sk.SPLIT_AUTOMATIC = sk.SPLIT_AUTOMATIC, True  # what the rule picks, even while it is off
        auto = sk.auto_num_splits(q, k, None)
        sk.SPLIT_AUTOMATIC = automatic
        print(f"B={batch} H={HEADS}/{kv_heads} Lk={seqlen_k}: best {results[0][1]} ({results[0][0] * 1e3:.0f} us); "
              f"automatic rule: {auto}; " + "  ".join(f"{name} {ms * 1e3:.0f}" for ms, name in results) + " us",
              flush=True)
        del q, k, v
        torch.cuda.empty_cache()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="output folder (default bench/results/<gpu>)")
    parser.add_argument("--quick", action="store_true", help=f"Lk in {QUICK_LENGTHS} only (with --check: fewer cases)")
    parser.add_argument("--lengths", type=int, nargs="+", help="cache lengths Lk (default: the full sweep)")
    parser.add_argument("--splits", type=int, nargs="+", default=FORCED_SPLITS, help="forced num_splits to time too")
    parser.add_argument("--check", action="store_true", help="GPU correctness checks instead of timing")
    parser.add_argument("--tune", action="store_true", help="time num_splits per shape instead of the sweep")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.check:
        run_check(args)
    elif args.tune:
        run_tune(args)
    else:
        run_bench(args)


if __name__ == "__main__":
    main()
