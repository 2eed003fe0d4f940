"""Flash attention forward: flashlite against SDPA's flash, cuDNN and memory-efficient backends and naive PyTorch.

Every provider runs in this process on the same bf16 (B, H, L, D) inputs, with
H = 16 heads, D in {64, 128}, L from 512 to 131072 and B = max(1, 16384 // L)
(16K tokens a batch while L <= 16K; one sequence after). TFLOP/s count
``4·B·H·Lq·Lk·D`` (two matmuls), halved for causal (``attention_flops``). The
ceiling is the dense bf16 matmul throughput measured in the same run
(``common.matmul_tflops``). Peak memory is the memory a call allocates beyond
its inputs, for flashlite, SDPA flash and the naive chain. ``flashlite_graph`` is
flashlite's call replayed from a CUDA graph: its device time alone, which short
calls exceed when the host's launch cost shows. Modes:

    python bench/attention.py            # full sweep -> bench/results/<gpu>/attention.{json,md,png}
    python bench/attention.py --quick    # L in {1024, 8192} only
    python bench/attention.py --tune     # time tile configs at L = 4096 and print the table
    python bench/attention.py --tune-wgmma   # time the Hopper (Gluon) kernel's tile configs
    python bench/attention.py --backward # bwd and fwd+bwd TFLOP/s vs SDPA flash/cuDNN -> attention_backward.*
    python bench/attention.py --backward --head-dims 96 192 256 --lengths 4096 --name attention_backward_head_dims
    python bench/attention.py --backward --one-pass --lengths 2048 8192 --name attention_backward_one_pass
    python bench/attention.py --head-split --head-dims 96 192 160 --lengths 4096   # padded and split: attention_head_split

GPU correctness (float64 references, poisoned memory, every head dim and kernel) is pytest's
(pytest -m gpu): tests/test_gpu_attention.py, tests/test_gpu_decode.py and tests/test_gpu_backward.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flashlite  # noqa: E402
from flashlite.attention.api import attention_forward, clear_routes  # noqa: E402
from flashlite.attention.forward_hopper import attention_forward_hopper  # noqa: E402
from flashlite.attention.plan import column_parts, default_config, wgmma_config  # noqa: E402
from flashlite.attention.tuning import AttentionConfig, WgmmaConfig  # noqa: E402
from common import (  # noqa: E402
    attention_flops, backward_flops, environment, fa4_attention, graph_time_ms, markdown_table, matmul_tflops,
    plot_lines, results_dir, tflops, time_ms, write_results,
)

HEADS = 16
TOKENS = 16384  # B·L while L <= TOKENS
LENGTHS = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
QUICK_LENGTHS = [1024, 8192]
HEAD_DIMS = [64, 128]
PEERS = ("fa4", "flash", "cudnn", "efficient", "naive")  # fa4: FlashAttention-4 where it imports
FA4, FA4_VERSION = fa4_attention()
# Targets of the issue: flashlite over SDPA flash where L >= 1024, over cuDNN at D = 128 where L >= 2048.
TARGET_FLASH, TARGET_FLASH_MIN_L = 1.3, 1024
TARGET_CUDNN, TARGET_CUDNN_MIN_L, TARGET_CUDNN_D = 0.9, 2048, 128
# Calls longer than this are timed as the median of three (do_bench's five estimation runs
# alone would cost tens of seconds per provider at L = 128K).
LONG_CALL_MS = 200.0


def batch_for(length: int) -> int:
    return max(1, TOKENS // length)


def measure_ms(fn) -> float | None:
    """Median milliseconds of ``fn``; None if the provider fails (out of memory, unsupported shape)."""
    try:
        fn()  # compile, allocate
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def once() -> float:
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        first = once()
        if first > LONG_CALL_MS:
            return statistics.median([first, once(), once()])
        return time_ms(fn)
    except (torch.OutOfMemoryError, RuntimeError):
        torch.cuda.empty_cache()
        return None


def naive_attention(q, k, v, causal: bool) -> torch.Tensor:
    """The textbook chain: scores, mask, softmax, matmul, each its own kernel and L×L tensor."""
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril(lk - lq), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def sdpa_backends() -> dict:
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def providers(causal: bool) -> dict:
    """name -> fn(q, k, v) for every provider; each SDPA backend pinned with sdpa_kernel."""
    from torch.nn.attention import sdpa_kernel

    provs = {"flashlite": lambda q, k, v: flashlite.flash_attention(q, k, v, causal=causal),
             "flashlite_tl": lambda q, k, v: tl_kernel_forward(q, k, v, causal)}
    for name, backend in sdpa_backends().items():
        def run(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        provs[name] = run
    provs["fa4"] = lambda q, k, v: fa4_forward(q, k, v, causal)
    provs["naive"] = lambda q, k, v: naive_attention(q, k, v, causal)
    return provs


def fa4_forward(q, k, v, causal: bool) -> torch.Tensor:
    """FlashAttention-4 on (B, H, L, D) tensors, handed over as (B, L, H, D) views (its layout; strides as they
    are); RuntimeError where it does not import or refuses the call (the provider is then not measured)."""
    if FA4 is None:
        raise RuntimeError(f"FlashAttention-4 {FA4_VERSION}")
    try:
        out = FA4(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
    except RuntimeError:
        raise
    except Exception as e:  # noqa: BLE001 (its own error types: reported as not measured)
        raise RuntimeError(f"FlashAttention-4: {type(e).__name__}: {e}") from e
    return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)


def tl_kernel_forward(q, k, v, causal: bool):
    """flashlite's ``triton.language`` kernel alone, on its own tiles (the calls the Hopper kernel does not take)."""
    config = default_config(q.shape[3], q.dtype, q.device, causal, k.shape[2])
    return attention_forward(q, k, v, causal, 1 / math.sqrt(q.shape[3]), None, False, False, config)[0]


def make_qkv(batch: int, length: int, head_dim: int, dtype=torch.bfloat16):
    return tuple(torch.randn(batch, HEADS, length, head_dim, device="cuda", dtype=dtype) for _ in range(3))


def measure(length: int, head_dim: int, causal: bool, ceiling: float) -> dict:
    batch = batch_for(length)
    q, k, v = make_qkv(batch, length, head_dim)
    flops = attention_flops(batch, HEADS, length, length, head_dim, causal)
    row = {"D": head_dim, "causal": causal, "L": length, "B": batch}
    for name, fn in providers(causal).items():
        row[name] = tflops(flops, measure_ms(functools.partial(fn, q, k, v)))
    try:  # the same call replayed from a CUDA graph: its device time, without the host's launch cost
        row["flashlite_graph"] = tflops(flops, graph_time_ms(functools.partial(flashlite.flash_attention, q, k, v, causal=causal)))
    except (torch.OutOfMemoryError, RuntimeError):
        row["flashlite_graph"] = None
    mine = row["flashlite"]
    row["frac_matmul"] = mine / ceiling if mine else None
    for peer in PEERS:
        row[f"x_{peer}"] = mine / row[peer] if mine and row[peer] else None
    del q, k, v
    torch.cuda.empty_cache()
    return row


def peak_memory_mb(fn) -> float | None:
    """MB a call allocates beyond what was allocated before it (inputs excluded, output included)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        out = fn()
        torch.cuda.synchronize()
    except (torch.OutOfMemoryError, RuntimeError):
        torch.cuda.empty_cache()
        return None
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def measure_memory(length: int, head_dim: int) -> dict:
    batch = batch_for(length)
    q, k, v = make_qkv(batch, length, head_dim)
    provs = providers(False)
    row = {"D": head_dim, "L": length, "B": batch, "inputs_MB": 3 * q.numel() * q.element_size() / 2**20}
    for name in ("flashlite", "flash", "naive"):
        row[f"{name}_MB"] = peak_memory_mb(functools.partial(provs[name], q, k, v))
    del q, k, v
    torch.cuda.empty_cache()
    return row


def run_bench(args) -> None:
    ceiling = matmul_tflops()
    print(f"bf16 matmul ceiling: {ceiling:.0f} TFLOP/s; H = {HEADS}, B = max(1, {TOKENS} // L)", flush=True)
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
    rows = []
    for head_dim in args.head_dims:
        for causal in (False, True):
            for length in lengths:
                t0 = time.time()
                row = measure(length, head_dim, causal, ceiling)
                rows.append(row)
                print(f"D={head_dim} causal={causal!s:5} L={length:6}: " + "  ".join(
                    f"{n} {row[n]:.0f}" if row[n] else f"{n} —" for n in ("flashlite", "flashlite_graph", "flashlite_tl") + PEERS)
                    + f"  ({time.time() - t0:.0f}s)", flush=True)
    memory = [measure_memory(length, 128) for length in lengths]
    print(markdown_table(memory, list(memory[0])))

    out = results_dir(args.out)
    meta = environment() | {"matmul_tflops_bf16": ceiling, "heads": HEADS, "tokens_per_batch": TOKENS,
                            "dtype": "bfloat16", "flops": "4·B·H·L²·D, halved for causal", "flash_attn_4": FA4_VERSION}
    cols = ["D", "causal", "L", "B", "flashlite", "flashlite_graph", "flashlite_tl", *PEERS, "frac_matmul",
            *(f"x_{p}" for p in PEERS)]
    name = args.name or "attention"
    write_results(name, out, meta, rows, cols, "Attention forward, TFLOP/s (bf16, H = 16)")
    _append_memory(out, memory)
    panels = []
    for head_dim in args.head_dims:
        for causal in (False, True):
            sel = [r for r in rows if r["D"] == head_dim and r["causal"] == causal]
            series = {n: [r[n] for r in sel] for n in ("flashlite", "flashlite_graph", "flashlite_tl") + PEERS}
            series["matmul (ceiling)"] = [ceiling for _ in sel]
            panels.append((f"attention fwd, D={head_dim}, causal={causal}", [r["L"] for r in sel], series, "TFLOP/s"))
    panels.append(("peak memory beyond inputs, D=128, non-causal", [r["L"] for r in memory],
                   {n: [r[f"{n}_MB"] for r in memory] for n in ("flashlite", "flash", "naive")}, "MB"))
    plot_lines(os.path.join(out, f"{name}.png"), panels)
    print_summary(rows)


def _append_memory(out: str, memory: list[dict]) -> None:
    """Add the peak-memory table to attention.md and attention.json (write_results holds one table)."""
    import json

    with open(os.path.join(out, "attention.md"), "a") as f:
        f.write("\n## Peak memory beyond the inputs, MB (D = 128, non-causal)\n\n"
                + markdown_table(memory, list(memory[0])) + "\n")
    path = os.path.join(out, "attention.json")
    with open(path) as f:
        data = json.load(f)
    data["memory"] = memory
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def print_summary(rows: list[dict]) -> None:
    """Ratios to each peer and the issue's targets, met or not."""
    print(f"\n{'D':>4}{'causal':>7}{'L':>8}{'TFLOP/s':>9}{'%mm':>6}" + "".join(f"{'x' + p:>11}" for p in PEERS))
    for r in rows:
        ratios = "".join(f"{r[f'x_{p}']:>11.2f}" if r[f"x_{p}"] else f"{'—':>11}" for p in PEERS)
        mine = f"{r['flashlite']:>9.0f}{r['frac_matmul']:>6.0%}" if r["flashlite"] else f"{'—':>9}{'':>6}"
        print(f"{r['D']:>4}{r['causal']!s:>7}{r['L']:>8}{mine}{ratios}")
    misses = [f"D={r['D']} causal={r['causal']} L={r['L']}: x{r['x_flash'] or 0:.2f} flash"
              for r in rows if r["L"] >= TARGET_FLASH_MIN_L and (r["x_flash"] or 0) < TARGET_FLASH and r["flash"]]
    misses += [f"D={r['D']} causal={r['causal']} L={r['L']}: x{r['x_cudnn'] or 0:.2f} cuDNN"
               for r in rows if r["D"] == TARGET_CUDNN_D and r["L"] >= TARGET_CUDNN_MIN_L
               and (r["x_cudnn"] or 0) < TARGET_CUDNN and r["cudnn"]]
    print(f"\ntargets: >= {TARGET_FLASH}x SDPA flash for L >= {TARGET_FLASH_MIN_L}; >= {TARGET_CUDNN}x cuDNN at "
          f"D = {TARGET_CUDNN_D}, L >= {TARGET_CUDNN_MIN_L}: " + ("all met" if not misses else f"{len(misses)} missed"))
    for miss in misses:
        print("  missed: " + miss)


# ----------------------------------------------------------------------------- --backward

BACKWARD_PEERS = ("fa4", "flash", "cudnn")


def backward_inputs(length: int, head_dim: int, causal: bool) -> tuple:
    """``(q, k, v, do, fwd_flops, bwd_flops, row)`` of a backward measurement: q/k/v requiring gradients, the
    output's gradient, both FLOP counts, and the result row's shape columns."""
    batch = batch_for(length)
    q, k, v = (t.requires_grad_() for t in make_qkv(batch, length, head_dim))
    do = torch.randn_like(q)
    fwd = attention_flops(batch, HEADS, length, length, head_dim, causal)
    bwd = backward_flops(batch, HEADS, length, length, head_dim, causal)
    return q, k, v, do, fwd, bwd, {"D": head_dim, "causal": causal, "L": length, "B": batch}


def set_switch(variable: str, on: bool) -> None:
    """One of flashlite's switches (``FLASHLITE_HEAD_SPLIT``, ``FLASHLITE_BACKWARD_ONE_PASS``) on or off for the
    calls that follow (routes planned under the other setting forgotten)."""
    os.environ[variable] = "1" if on else "0"
    clear_routes()


def set_head_split(on: bool) -> None:
    """FLASHLITE_HEAD_SPLIT on or off for the calls that follow."""
    set_switch("FLASHLITE_HEAD_SPLIT", on)


def measure_backward(length: int, head_dim: int, causal: bool, ceiling: float, one_pass: bool = False) -> dict:
    """bwd and fwd+bwd TFLOP/s of flashlite and each peer, and with ``one_pass`` of flashlite's one-pass backward
    (``FLASHLITE_BACKWARD_ONE_PASS=1``); bwd alone re-runs autograd on one retained graph. ``one_pass_max_diff``:
    the largest |one pass - two passes| of the gradients (a sanity line: float64 checks are
    tests/test_gpu_backward.py's)."""
    q, k, v, do, fwd, bwd, row = backward_inputs(length, head_dim, causal)
    provs = providers(causal)
    grads = {}
    previous = os.environ.get("FLASHLITE_BACKWARD_ONE_PASS")
    for name in ("flashlite",) + (("one_pass",) if one_pass else ()) + BACKWARD_PEERS:
        set_switch("FLASHLITE_BACKWARD_ONE_PASS", name == "one_pass")
        fn = provs["flashlite" if name == "one_pass" else name]

        def fwd_bwd(fn=fn, inputs=(q, k, v), do=do):
            return torch.autograd.grad(fn(*inputs), inputs, do)
        try:
            out = fn(q, k, v)
        except RuntimeError:  # backend unavailable for this shape
            row[f"{name}_bwd"] = row[f"{name}_fwdbwd"] = None
            continue
        row[f"{name}_bwd"] = tflops(bwd, measure_ms(functools.partial(torch.autograd.grad, out, (q, k, v), do, retain_graph=True)))
        row[f"{name}_fwdbwd"] = tflops(fwd + bwd, measure_ms(fwd_bwd))
        if name in ("flashlite", "one_pass"):
            grads[name] = torch.autograd.grad(out, (q, k, v), do)
        del out
    if previous is None:  # (the caller's setting again)
        os.environ.pop("FLASHLITE_BACKWARD_ONE_PASS", None)
    else:
        os.environ["FLASHLITE_BACKWARD_ONE_PASS"] = previous
    clear_routes()
    if one_pass and len(grads) == 2:
        row["one_pass_max_diff"] = max((a.float() - b.float()).abs().max().item()
                                       for a, b in zip(grads["flashlite"], grads["one_pass"]))
        row["x_one_pass_bwd"] = row["one_pass_bwd"] / row["flashlite_bwd"]
    mine = row["flashlite_bwd"]
    row["frac_matmul_bwd"] = mine / ceiling if mine else None
    for peer in BACKWARD_PEERS:
        row[f"x_{peer}_bwd"] = mine / row[f"{peer}_bwd"] if mine and row[f"{peer}_bwd"] else None
    del q, k, v, do
    torch.cuda.empty_cache()
    return row


def run_backward(args) -> None:
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
    names = ("flashlite",) + (("one_pass",) if args.one_pass else ()) + BACKWARD_PEERS
    ceiling = matmul_tflops()
    print(f"bf16 matmul: {ceiling:.0f} TFLOP/s", flush=True)
    rows = []
    for head_dim in args.head_dims:
        for causal in (False, True):
            for length in lengths:
                row = measure_backward(length, head_dim, causal, ceiling, args.one_pass)
                rows.append(row)
                print(f"D={head_dim} causal={causal!s:5} L={length:6} bwd: " + "  ".join(
                    f"{n} {row[f'{n}_bwd']:.0f}" if row[f"{n}_bwd"] else f"{n} —" for n in names), flush=True)
    out = results_dir(args.out)
    meta = environment() | {"matmul_tflops_bf16": ceiling, "heads": HEADS, "tokens_per_batch": TOKENS, "dtype": "bfloat16",
                            "flops": "bwd 2.5x fwd (4·B·H·L²·D, halved for causal); fwd+bwd 3.5x",
                            "flash_attn_4": FA4_VERSION}
    cols = ["D", "causal", "L", "B", *(f"{n}_bwd" for n in names), *(f"{n}_fwdbwd" for n in names),
            "frac_matmul_bwd", *(f"x_{p}_bwd" for p in BACKWARD_PEERS)]
    if args.one_pass:  # (one pass over the default's two)
        cols += ["x_one_pass_bwd", "one_pass_max_diff"]
    name = args.name or "attention_backward"
    write_results(name, out, meta, rows, cols, "Attention backward, TFLOP/s (bf16, H = 16)")
    panels = []
    for head_dim in args.head_dims:
        for causal in (False, True):
            sel = [r for r in rows if r["D"] == head_dim and r["causal"] == causal]
            for kind in ("bwd", "fwdbwd"):
                panels.append((f"attention {kind}, D={head_dim}, causal={causal}", [r["L"] for r in sel],
                               {n: [r[f"{n}_{kind}"] for r in sel] for n in names}, "TFLOP/s"))
    plot_lines(os.path.join(out, f"{name}.png"), panels)


# ----------------------------------------------------------------------------- --head-split


def measure_head_split(length: int, head_dim: int, causal: bool) -> dict:
    """Forward and backward TFLOP/s of flashlite with head dims padded (``padded``) and in column parts (``split``),
    beside FA4 and cuDNN on the same inputs; ``split_max_diff`` is the largest |split - padded| of the outputs and
    gradients (a sanity line: float64 checks are tests/test_gpu_attention.py's)."""
    q, k, v, do, fwd, bwd, row = backward_inputs(length, head_dim, causal)
    provs = providers(causal)
    results = {}
    for name in ("padded", "split", "fa4", "cudnn"):
        if name in ("padded", "split"):
            set_head_split(name == "split")
        fn = provs["flashlite" if name in ("padded", "split") else name]
        row[f"{name}_fwd"] = tflops(fwd, measure_ms(functools.partial(fn, q, k, v)))
        try:
            out = fn(q, k, v)
        except RuntimeError:
            row[f"{name}_bwd"] = None
            continue
        row[f"{name}_bwd"] = tflops(bwd, measure_ms(functools.partial(torch.autograd.grad, out, (q, k, v), do, retain_graph=True)))
        if name in ("padded", "split"):
            results[name] = (out.detach(), *torch.autograd.grad(out, (q, k, v), do))
        del out
    set_head_split(True)  # (the default again)
    row["split_max_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(results["padded"], results["split"]))
    for kind in ("fwd", "bwd"):
        mine = row[f"split_{kind}"]
        for ref in ("padded", "fa4", "cudnn"):
            row[f"x_{ref}_{kind}"] = mine / row[f"{ref}_{kind}"] if mine and row[f"{ref}_{kind}"] else None
    del q, k, v, do, results
    torch.cuda.empty_cache()
    return row


def run_head_split(args) -> None:
    rows = []
    for head_dim in args.head_dims:
        for causal in (False, True):
            for length in args.lengths or [4096]:
                row = measure_head_split(length, head_dim, causal)
                rows.append(row)
                print(f"D={head_dim} causal={causal!s:5} L={length:6} fwd/bwd: " + "  ".join(
                    f"{n} {row[f'{n}_fwd'] or 0:.0f}/{row[f'{n}_bwd'] or 0:.0f}" for n in ("padded", "split", "fa4", "cudnn"))
                    + f"  diff {row['split_max_diff']:.2e}", flush=True)
    meta = environment() | {"heads": HEADS, "tokens_per_batch": TOKENS, "dtype": "bfloat16", "flash_attn_4": FA4_VERSION,
                            "flops": "fwd 4·B·H·L²·D, halved for causal; bwd 2.5x fwd",
                            "padded": "FLASHLITE_HEAD_SPLIT=0", "split": "FLASHLITE_HEAD_SPLIT=1"}
    cols = ["D", "causal", "L", "B", *(f"{n}_{k}" for k in ("fwd", "bwd") for n in ("padded", "split", "fa4", "cudnn")),
            *(f"x_{r}_{k}" for k in ("fwd", "bwd") for r in ("padded", "fa4", "cudnn")), "split_max_diff"]
    write_results(args.name or "attention_head_split", results_dir(args.out), meta, rows, cols,
                  "Head dims in column parts (split) against padded, FA4 and cuDNN, TFLOP/s (bf16, H = 16)")


# ----------------------------------------------------------------------------- --tune


def tune_configs(head_dim: int) -> list:
    """The sweep: tile shapes around the Hopper recipe, each through TMA and through pointers, plus persistent grids.

    BLOCK_M 64 with 4 warps and 2 stages is small enough for two programs per
    multiprocessor (about 80 KB of shared memory at D = 128): one program's
    softmax can then overlap the other's matmuls, which one program of two
    warpgroups in lockstep cannot.
    """
    shapes = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3),
              (64, 128, 4, 2)]
    shapes += [(128, 128, 4, 3), (64, 128, 4, 3)] if head_dim <= 64 else [(128, 64, 8, 4)]
    configs = [AttentionConfig(bm, bn, w, s, use_tma=tma) for bm, bn, w, s in shapes for tma in (True, False)]
    configs += [dataclasses.replace(default_config(head_dim, torch.bfloat16, torch.device("cuda")), persistent=True),
                AttentionConfig(128, 64, 8, 3, use_tma=True, persistent=True),
                AttentionConfig(64, 64, 4, 2, use_tma=True, persistent=True)]
    return list(dict.fromkeys(configs))


def run_tune(args) -> None:
    """Time every tune config for D = 64/128, causal and not, at L = 4096 (B = 4, H = 16); print the ranking."""
    from torch.nn.attention import sdpa_kernel

    length = args.tune_length
    batch = batch_for(length)
    for head_dim in args.head_dims:
        q, k, v = make_qkv(batch, length, head_dim)
        for causal in (False, True):
            flops = attention_flops(batch, HEADS, length, length, head_dim, causal)
            peers = {}
            for name, backend in sdpa_backends().items():
                with sdpa_kernel(backend):
                    peers[name] = tflops(flops, measure_ms(functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal)))
            print(f"\nD={head_dim} causal={causal} L={length} B={batch} H={HEADS}: SDPA "
                  + "  ".join(f"{n} {p:.0f}" for n, p in peers.items() if p) + " TFLOP/s", flush=True)
            default = default_config(head_dim, q.dtype, q.device, causal, length)
            results = []
            for config in tune_configs(head_dim):
                run = functools.partial(attention_forward, q, k, v, causal, 1 / math.sqrt(head_dim), None, False, False, config)

                t0 = time.time()
                try:
                    run()
                    value, note = tflops(flops, time_ms(run)), ""
                except Exception as err:  # out of resources, a compiler failure: a row of the table, not a crash
                    value, note = 0.0, f"failed: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:80]}"
                results.append((value, config, note))
                print(f"  ... {_config_str(config)}  {value:.0f} TFLOP/s  ({time.time() - t0:.1f}s) {note}", flush=True)
            results.sort(key=lambda r: -r[0])
            print(f"  {'TFLOP/s':>8}  {'BM':>4} {'BN':>4} {'warps':>5} {'stages':>6} {'tma':>5} {'persist':>7}")
            for value, c, note in results:
                print(f"  {value:>8.0f}  {c.block_m:>4} {c.block_n:>4} {c.num_warps:>5} {c.num_stages:>6} "
                      f"{c.use_tma!s:>5} {c.persistent!s:>7}  {'<- current' if c == default else ''}{note}", flush=True)
        del q, k, v
        torch.cuda.empty_cache()


WGMMA_TUNE_SHAPES = {
    64: [(1024, False), (1024, True), (2048, True), (4096, False), (4096, True)],
    128: [(length, causal) for length in (512, 1024, 2048, 4096, 16384, 65536) for causal in (False, True)],
    96: [(4096, False), (4096, True)],
    192: [(4096, False), (4096, True)],
}
WGMMA_TUNE_CONFIGS = {
    64: [WgmmaConfig(64, 128, 4, 2), WgmmaConfig(64, 64, 4, 2),
         WgmmaConfig(64, 128, 4, 2, True, warp_specialized=True)],
    128: [WgmmaConfig(64, 128, 4, 2, True, warp_specialized=True),
          WgmmaConfig(64, 64, 4, 4, True, warp_specialized=True),
          WgmmaConfig(64, 64, 4, 2, True), WgmmaConfig(64, 64, 4, 2)],
    # In column parts (96 = 64 + 32, 192 = 128 + 64): the smaller tiles leave room for more K/V buffers (sm_90
    # builds: D = 192 with two 128-key buffers takes 221 KB, 224 registers, no spills).
    96: [WgmmaConfig(64, 128, 4, 2, True, warp_specialized=True), WgmmaConfig(64, 128, 4, 3, True, warp_specialized=True),
         WgmmaConfig(64, 128, 4, 2), WgmmaConfig(64, 128, 4, 3)],
    192: [WgmmaConfig(64, 128, 4, 1), WgmmaConfig(64, 128, 4, 2), WgmmaConfig(64, 64, 4, 2), WgmmaConfig(64, 64, 4, 3)],
}


def config_error(config: WgmmaConfig, head_dim: int, causal: bool) -> float:
    """Largest |error| of the Hopper kernel under ``config`` against float64 on a GQA call of partial edge tiles
    (Lq 1008, Lk 1776: multiples of 16, as the timed calls, so no new build): a tuning table's check that a config
    it could pick computes the right thing (the tests' matrix is pytest's)."""
    q = torch.randn(1, 4, 1008, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 1776, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = attention_forward_hopper(q, k, v, causal, 1 / math.sqrt(head_dim), False, config)[0]
    kr, vr = (t.double().repeat_interleave(2, dim=1) for t in (k, v))
    s = (q.double() @ kr.transpose(-1, -2)) / math.sqrt(head_dim)
    if causal:
        s = s.masked_fill(~torch.ones(1008, 1776, dtype=torch.bool, device="cuda").tril(1776 - 1008), float("-inf"))
    return (out.double() - torch.softmax(s, dim=-1) @ vr).abs().max().item()


def _wgmma_config_str(c) -> str:
    """A config's label in the --tune-wgmma table."""
    kind = "/ws" if c.warp_specialized else f"/w{c.num_warps}"
    qreg = "/qreg" if c.q_in_registers and not c.warp_specialized else ""
    return f"{c.block_m}x{c.block_n}{kind}/s{c.kv_stages}{qreg}"


def run_tune_wgmma(args) -> None:
    """Time the Hopper kernel's tile configs (``flashlite.attention.forward_hopper``) next to SDPA cuDNN and flashlite's tl kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for head_dim in args.head_dims:
        for length, causal in WGMMA_TUNE_SHAPES[head_dim]:
            batch = batch_for(length)
            q, k, v = make_qkv(batch, length, head_dim)
            flops = attention_flops(batch, HEADS, length, length, head_dim, causal)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cudnn = tflops(flops, measure_ms(functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal)))
            tl_value = tflops(flops, measure_ms(functools.partial(tl_kernel_forward, q, k, v, causal)))
            chosen = wgmma_config(head_dim, causal, length, sum(column_parts(head_dim)))
            cells = []
            for config in WGMMA_TUNE_CONFIGS[head_dim]:
                run = functools.partial(attention_forward_hopper, q, k, v, causal, 1 / math.sqrt(head_dim), False, config)
                value = tflops(flops, measure_ms(run))
                mark = "*" if config == chosen else ""
                error = config_error(config, head_dim, causal) if value else None
                cells.append(f"{_wgmma_config_str(config)}{mark} {value:.0f} (err {error:.1e})" if value else "failed")
            print(f"D={head_dim} L={length} B={batch} causal={causal!s:5}: cudnn {cudnn:.0f} tl-kernel {tl_value:.0f} | "
                  + "  ".join(cells), flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    print("(TFLOP/s; * = the config wgmma_config picks; ws = a load warp and two softmax warpgroups sharing K/V tiles;"
          " w4 = one warpgroup loading its own tiles; qreg = Q in registers; err: against float64, Lq 1008, Lk 1776, GQA)")


def _config_str(c) -> str:
    return (f"BM={c.block_m} BN={c.block_n} warps={c.num_warps} stages={c.num_stages} tma={int(c.use_tma)} "
            f"persistent={int(c.persistent)}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="output folder (default bench/results/<gpu>)")
    parser.add_argument("--quick", action="store_true", help=f"L in {QUICK_LENGTHS} only")
    parser.add_argument("--lengths", type=int, nargs="+", help="sequence lengths (default: the full sweep)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=HEAD_DIMS, help="head dims (default 64 128)")
    parser.add_argument("--tune", action="store_true", help="time tile configs instead of the sweep")
    parser.add_argument("--tune-length", type=int, default=4096, help="sequence length of --tune (default 4096)")
    parser.add_argument("--tune-wgmma", action="store_true", help="time the Hopper kernel's tile configs")
    parser.add_argument("--backward", action="store_true", help="time bwd and fwd+bwd instead of the forward")
    parser.add_argument("--one-pass", action="store_true",
                        help="--backward: also time the one-pass backward (FLASHLITE_BACKWARD_ONE_PASS=1)")
    parser.add_argument("--head-split", action="store_true", help="time head dims padded and in column parts (FLASHLITE_HEAD_SPLIT)")
    parser.add_argument("--name", help="results' file stem (default attention, or attention_backward)")
    args = parser.parse_args(argv)
    if args.head_split:
        run_head_split(args)
    elif args.backward:
        run_backward(args)
    elif args.tune:
        run_tune(args)
    elif args.tune_wgmma:
        run_tune_wgmma(args)
    else:
        run_bench(args)


if __name__ == "__main__":
    main()
