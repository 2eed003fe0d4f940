"""Packed (variable-length) batches: ``flashlite.flash_attention_varlen`` against its peers, same process, same data.

bf16, causal, H = 16 (H_kv = 16), D in {64, 128}, packed batches of T tokens made of documents whose lengths
are drawn (seeded) from

* ``uniform2k`` / ``uniform8k``: uniform in [L/8, L] for L = 2048 / 8192;
* ``longtail``: ``round(exp(N(log 256, 1.5)))`` clipped to [16, 16384] (many short documents, a few long);

the last document cut so that the lengths sum to T. Forward (``fwd``) and forward + ``torch.autograd.grad`` of
q, k, v (``fwd_bwd``), ``triton.testing.do_bench`` medians. TFLOP/s count the visible (query, key) pairs only:
4·H·D per pair forward, 2.5 times that backward.

Providers: ``flashlite`` (varlen, the default kernels: the Hopper ones on Hopper); ``tl``: the same call on the
``triton.language`` kernels (``FLASHLITE_HOPPER_VARLEN=0``, set and the routes cleared before its rows);
``dense``: flashlite's ``flash_attention`` on a uniform (B, H, L_eq, D) batch of the same visible work
(L_eq = Σ Lᵢ² / T, B = T / L_eq), the kernel a user gets there; ``mask``: the route a packed batch had before
``flash_attention_varlen``, ``flash_attention`` with the block-diagonal (T, T) boolean mask (T <= 16K); ``fa4``:
FlashAttention-4's ``flash_attn_varlen_func`` when ``flash_attn.cute`` imports (``../shared/tools/peer_wheels.sh``);
``flex``: FlexAttention with a document-causal block mask (compiled; T <= 16K). Ratios: ``x_dense``,
``x_fa4``, ``x_flex``, ``x_mask`` (flashlite's speed over theirs; > 1 is faster), and ``tl_x_dense``,
``tl_x_fa4`` (the tl kernels' over theirs).

Paged decoding (``--part paged``): B in {1, 8, 32}, H = 32, H_kv = 8, D = 128, Lq = 1, caches of 4K-128K keys
(every sequence full), pages of 16, 64 and 256 keys scattered at random over the pool: flashlite's paged call
against its own contiguous-cache call on the same keys, GB/s of K/V read (``x_contiguous``: paged over
contiguous speed), and FlashAttention-4's paged and contiguous decoding when it imports (``page_table``, one
split: "SplitKV not supported on SM 9.0"; ``x_fa4_paged``). ``--part paged-tune``: the split kernel's paged
variants (``PAGED_VARIANTS``) side by side, with the split kernels' registers, spills and pipeline waits in the
JSON.

The packed backward's register cap at D = 64 (``--part tune``, ``run_tune``): ``varlen_tune_d64.{json,md}``.
GPU time by kernel of a packed and a dense forward + backward (``--part kernels``, torch.profiler):
``varlen_kernels.{json,md}``, and the PyTorch ops (with their Python stacks) of the first packed call,
``varlen_kernels_ops.txt``. The packed and the dense dK/dV kernels under ncu (``--part launches``, a program for
ncu to run; ``--part sass --ncu-csv FILE`` summarises ncu's per-instruction CSV): ``varlen_dkdv_ncu.txt``,
``varlen_dkdv_sass.md``.

Host cost (``--part host``): a small packed training call (4 documents of 64 tokens, H = 16, D = 64) in
microseconds per call, 200 calls back to back, on both kernel families, against SDPA on the same work as a
(4, 16, 64, 64) batch, and a small paged decoding step against the contiguous-cache call and SDPA
(``paged_host_row``); ``--profile`` adds each packed call's cProfile table (``varlen_host_profile.txt``).

    python bench/varlen.py [--out DIR] [--part speed host paged paged-tune] [--totals 16384 65536] [--profile]
        # -> DIR/varlen.{json,md}, DIR/varlen_host.{json,md}, DIR/paged_decode{,_tune}.{json,md}, DIR/varlen.png
    python bench/varlen.py --part plot --out DIR     # varlen.png again from DIR's JSON files (no GPU)
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from call_path import loop_us  # noqa: E402
from common import environment, gbs, plot_lines, results_dir, tflops, try_time_ms, write_results  # noqa: E402

import flashlite  # noqa: E402

HEADS = 16
MIXES = ("uniform2k", "uniform8k", "longtail")
MASK_MAX_TOKENS = 16384  # the (T, T) boolean mask of today's route: 256 MB at 16K
FLEX_MAX_TOKENS = 16384  # each new shape recompiles flex_attention


def document_lengths(mix: str, total: int, seed: int = 0) -> list[int]:
    """Lengths of the documents of one packed batch of ``total`` tokens (the module docstring's mixes)."""
    gen = torch.Generator().manual_seed(seed)
    lengths, filled = [], 0
    while filled < total:
        if mix.startswith("uniform"):
            longest = {"uniform2k": 2048, "uniform8k": 8192}[mix]
            n = int(torch.randint(longest // 8, longest + 1, (1,), generator=gen))
        else:
            n = int(min(max(round(math.exp(math.log(256) + 1.5 * float(torch.randn(1, generator=gen)))), 16), 16384))
        n = min(n, total - filled)
        lengths.append(n)
        filled += n
    return lengths


def visible_pairs(lengths: list[int]) -> int:
    """Causal (query, key) pairs of the documents: L(L + 1)/2 each."""
    return sum(n * (n + 1) // 2 for n in lengths)


def fa4_varlen():
    """FlashAttention-4's ``flash_attn_varlen_func``, or None when it does not import."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - absent, or built for another CUDA: reported as missing
        return None
    return flash_attn_varlen_func


def flex_document_call(doc: torch.Tensor, total: int, device):
    """FlexAttention with a document-causal block mask on (1, H, T, D) tensors (``doc``: each token's document),
    compiled; or None."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(document_causal, None, None, total, total, device=device)
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def hopper_switch(make, on: bool):
    """``make`` (an inputs factory) that first sets ``FLASHLITE_HOPPER_VARLEN=1`` (``on``: the default, the Hopper
    kernels) or ``=0`` (the ``triton.language`` ones) and clears flashlite's planned calls (the switch is read when
    a call is planned): the provider after it runs on the kernels it chooses."""
    def made():
        os.environ["FLASHLITE_HOPPER_VARLEN"] = "1" if on else "0"
        flashlite.attention.api.clear_routes()
        return make()
    return made


def providers(lengths: list[int], head_dim: int, device) -> dict:
    """name -> (inputs factory, call) for one packed batch; each call returns the output to differentiate."""
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    longest = max(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))

    def packed():
        return [torch.randn(total, HEADS, head_dim, device=device, dtype=torch.bfloat16) for _ in range(3)]

    def bhld(batch, length):
        return lambda: [torch.randn(batch, HEADS, length, head_dim, device=device, dtype=torch.bfloat16)
                        for _ in range(3)]

    def varlen_call(q, k, v):
        return flashlite.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)

    out = {"flashlite": (hopper_switch(packed, True), varlen_call),  # the default: the Hopper kernels on Hopper
           "tl": (hopper_switch(packed, False), varlen_call)}
    l_eq = max(16, round(sum(n * n for n in lengths) / total))
    out["dense"] = (bhld(max(1, total // l_eq), l_eq), lambda q, k, v: flashlite.flash_attention(q, k, v, causal=True))
    fa4 = fa4_varlen()
    if fa4 is not None:
        def fa4_call(q, k, v):
            o = fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
                    causal=True)
            return o[0] if isinstance(o, tuple) else o
        out["fa4"] = (packed, fa4_call)
    if total <= FLEX_MAX_TOKENS:
        flex = flex_document_call(doc, total, device)
        if flex is not None:
            out["flex"] = (bhld(1, total), flex)
    if total <= MASK_MAX_TOKENS:
        block_diagonal = (doc[:, None] == doc[None, :]).view(1, 1, total, total)
        out["mask"] = (bhld(1, total), lambda q, k, v: flashlite.flash_attention(q, k, v, causal=True,
                                                                                 attn_mask=block_diagonal))
    return out


def measure(mix: str, total: int, head_dim: int, device) -> dict:
    lengths = document_lengths(mix, total)
    row = dict(mix=mix, tokens=total, D=head_dim, docs=len(lengths), longest=max(lengths))
    for name, (make, call) in providers(lengths, head_dim, device).items():
        inputs = make()
        pairs = visible_pairs(lengths)
        if name == "dense":
            pairs = visible_pairs([inputs[0].shape[2]] * inputs[0].shape[0])
        flops = 4 * HEADS * head_dim * pairs
        row[f"{name}_fwd"] = tflops(flops, try_time_ms(lambda: call(*inputs)))
        leaves = [t.requires_grad_() for t in inputs]
        out = call(*leaves)
        do = torch.randn_like(out)

        def fwd_bwd():
            return torch.autograd.grad(call(*leaves), leaves, do)

        row[f"{name}_fwd_bwd"] = tflops(3.5 * flops, try_time_ms(fwd_bwd))
        del inputs, leaves, out, do
    for part in ("fwd", "fwd_bwd"):
        mine = row.get(f"flashlite_{part}")
        for peer in ("dense", "fa4", "flex", "mask"):
            theirs = row.get(f"{peer}_{part}")
            row[f"x_{peer}_{part}"] = mine / theirs if mine and theirs else None
        tl = row.get(f"tl_{part}")
        for peer in ("dense", "fa4"):
            theirs = row.get(f"{peer}_{part}")
            row[f"tl_x_{peer}_{part}"] = tl / theirs if tl and theirs else None
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return row


def run_speed(out: str, totals: list[int], command: str) -> None:
    device = torch.device("cuda")
    columns = ["mix", "tokens", "D", "docs", "longest"]
    for part in ("fwd", "fwd_bwd"):
        columns += [f"{p}_{part}" for p in ("flashlite", "tl", "dense", "fa4", "flex", "mask")]
        columns += [f"x_{p}_{part}" for p in ("dense", "fa4", "flex", "mask")]
        columns += [f"tl_x_{p}_{part}" for p in ("dense", "fa4")]
    meta = dict(environment(), command=command, heads=HEADS, dtype="bfloat16", causal=True,
                fa4="present" if fa4_varlen() is not None else "not importable",
                units="TFLOP/s on visible pairs (fwd_bwd: 3.5x the forward's FLOPs)")
    rows = []
    for head_dim in (64, 128):
        for total in totals:
            for mix in MIXES:
                rows.append(measure(mix, total, head_dim, device))
                write_results("varlen", out, meta, rows, columns,  # after every row: a cut-short run keeps its rows
                              "Packed batches: flash_attention_varlen and peers (H200)")


def run_host(out: str, command: str, profile: bool = False) -> None:
    device = torch.device("cuda")
    lengths, head_dim = [64] * 4, 64
    cu = torch.tensor([0, 64, 128, 192, 256], dtype=torch.int32, device=device)
    rows, profiles = [], []
    for part in ("fwd", "fwd_bwd"):
        q, k, v = (torch.randn(256, HEADS, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        qd, kd, vd = (torch.randn(4, HEADS, 64, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
                      for _ in range(3))

        def mine():
            o = flashlite.flash_attention_varlen(q, k, v, cu, cu, 64, 64, causal=True)
            return torch.autograd.grad(o, (q, k, v), o) if part == "fwd_bwd" else o

        def sdpa():
            o = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
            return torch.autograd.grad(o, (qd, kd, vd), o) if part == "fwd_bwd" else o

        row = dict(part=part, docs=len(lengths))
        for name, on in (("flashlite", True), ("tl", False)):  # the default kernels (Hopper), then the tl ones
            hopper_switch(lambda: None, on)()
            row[f"{name}_loop_us"] = loop_us(mine)
            if profile:
                profiles.append(f"## {part}, {name} (FLASHLITE_HOPPER_VARLEN={int(on)}): 200 calls\n"
                                + host_profile(mine))
        row["sdpa_loop_us"] = loop_us(sdpa)
        row["x_sdpa"] = row["flashlite_loop_us"] / row["sdpa_loop_us"]
        row["tl_x_sdpa"] = row["tl_loop_us"] / row["sdpa_loop_us"]
        print(row, flush=True)
        rows.append(row)
    hopper_switch(lambda: None, True)()
    rows.append(paged_host_row(device))
    meta = dict(environment(), command=command, shape="4 documents x 64 tokens, H = 16, D = 64, causal, bf16",
                paged_shape="decoding: B = 1, H = 32, H_kv = 8, D = 128, 4096 keys in pages of 64, bf16 (tl: the "
                            "contiguous cache's call)")
    write_results("varlen_host", out, meta, rows,
                  ["part", "docs", "flashlite_loop_us", "tl_loop_us", "sdpa_loop_us", "x_sdpa", "tl_x_sdpa"],
                  "Packed batches and paged decoding: host cost of a small eager call (H200)")


def paged_host_row(device) -> dict:
    """A small decoding step (B = 1, 4096 keys in pages of 64): the paged call's microseconds a call, 200 back to
    back, beside flashlite's contiguous-cache call (in the ``tl_loop_us`` column) and SDPA's on the same keys."""
    q = torch.randn(1, 32, 1, 128, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, 4096, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.full((1,), 4096, dtype=torch.int32, device=device)
    table = torch.arange(64, dtype=torch.int32, device=device).view(1, 64)
    pages = [t[0].view(8, 64, 64, 128).transpose(0, 1).contiguous() for t in (k, v)]  # page i holds keys 64i..
    row = dict(part="paged_decode", docs=1,
               flashlite_loop_us=loop_us(lambda: flashlite.flash_attention(q, *pages, cache_seqlens=seqlens,
                                                                           block_table=table)),
               tl_loop_us=loop_us(lambda: flashlite.flash_attention(q, k, v, cache_seqlens=seqlens)),
               sdpa_loop_us=loop_us(lambda: torch.nn.functional.scaled_dot_product_attention(
                   q, k, v, enable_gqa=True)))
    row["x_sdpa"] = row["flashlite_loop_us"] / row["sdpa_loop_us"]
    row["tl_x_sdpa"] = row["tl_loop_us"] / row["sdpa_loop_us"]
    print(row, flush=True)
    return row
    if profiles:
        with open(os.path.join(out, "varlen_host_profile.txt"), "w") as f:
            f.write(f"# {command}\n\n" + "\n".join(profiles))


def host_profile(fn, calls: int = 200) -> str:
    """cProfile's table (by own time, the first 25 functions) of ``calls`` calls of ``fn`` after a warm-up."""
    import cProfile
    import io
    import pstats

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def run_kernels(out: str, totals: list[int], command: str, calls: int = 10) -> None:
    """Where a packed forward + backward spends its GPU time, beside the dense call of the same visible work:
    torch.profiler's CUDA time of each kernel, microseconds a call (``calls`` calls after a warm-up), for the
    default (Hopper) kernels, bf16, causal, D 64 and 128, each mix."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    rows, traced = [], False
    for total in totals:
        for head_dim in (64, 128):
            for mix in MIXES:
                lengths = document_lengths(mix, total)
                for name, (make, call) in providers(lengths, head_dim, device).items():
                    if name not in ("flashlite", "dense", "fa4"):
                        continue
                    leaves = [t.requires_grad_() for t in make()]
                    do = torch.randn_like(call(*leaves))
                    for _ in range(3):
                        torch.autograd.grad(call(*leaves), leaves, do)
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(calls):
                            torch.autograd.grad(call(*leaves), leaves, do)
                        torch.cuda.synchronize()
                    if name == "flashlite" and not traced:  # which PyTorch ops launch the kernels, and from where
                        traced = True
                        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as ops:
                            torch.autograd.grad(call(*leaves), leaves, do)
                            torch.cuda.synchronize()
                        with open(os.path.join(out, "varlen_kernels_ops.txt"), "w") as f:
                            f.write(f"# {command}: {mix}, {total} tokens, D = {head_dim}, one forward + backward\n\n")
                            f.write(ops.key_averages(group_by_stack_n=8).table(sort_by="self_device_time_total",
                                                                               row_limit=30, max_name_column_width=60))
                    for event in prof.key_averages():
                        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
                        if device_us > 0 and event.device_type == torch.autograd.DeviceType.CUDA:
                            rows.append(dict(mix=mix, tokens=total, D=head_dim, provider=name, kernel=event.key[:60],
                                             launches=event.count // calls, us=device_us / calls))
                            print(rows[-1], flush=True)
                    del leaves, do
    meta = dict(environment(), command=command, heads=HEADS, dtype="bfloat16", causal=True, calls=calls,
                units="GPU microseconds a forward + backward call, by kernel (torch.profiler)")
    write_results("varlen_kernels", out, meta, rows, ["mix", "tokens", "D", "provider", "kernel", "launches", "us"],
                  "Packed forward + backward: GPU time by kernel, beside the dense call of the same work (H200)")


# --part paged-tune: the split kernel's stages in a one-wave grid and its tiles under a block table
# (split_kv.PAGED_ONE_WAVE_STAGES, PAGED_SMALL_BLOCK_N, PAGED_BLOCK_N): 3 stages (as before), 5, and tiles of 64
# keys forced on every paged call (pages of 64 and more then hold whole tiles: one lookup a tile) on 5 or 7.
PAGED_VARIANTS = {"s3": (3, 128, None), "s5": (5, 128, None), "n64s5": (5, 128, 64), "n64s7": (7, 128, 64)}


def fa4_paged():
    """FlashAttention-4's decoding on (B, L, H, D) queries and a (num_blocks, page_size, H_kv, D) cache or a
    contiguous (B, L, H_kv, D) one (``page_table`` None), in one split (its Hopper path has no split-K/V); None
    when it does not import."""
    varlen = fa4_varlen()
    if varlen is None:
        return None

    def call(q, k, v, seqlens, table=None):
        o = varlen(q, k, v, seqused_k=seqlens, page_table=table, num_splits=1)
        return o[0] if isinstance(o, tuple) else o

    return call


def checked_ms(call, reference: torch.Tensor, errors: dict, key) -> float | None:
    """Milliseconds of a peer's ``call`` once its (B, L, H, D) output matches ``reference`` (B, H, L, D), or None
    with the reason under ``errors[key]`` when it refuses the shape or differs."""
    try:
        torch.testing.assert_close(call().transpose(1, 2), reference, atol=2e-2, rtol=2e-2)
        return try_time_ms(call)
    except Exception as e:  # noqa: BLE001 - a shape its Hopper path does not take
        errors[key] = f"{type(e).__name__}: {e}"[:300]
        return None


def split_kernel_builds() -> list[dict]:
    """Registers, spills, shared memory and cp.async wait depths of every split kernel compiled in this process."""
    import re

    from flashlite.attention import split_kv

    builds = []
    for caches in getattr(split_kv._split_kv_kernel, "device_caches", {}).values():  # (none in the interpreter)
        for kernel in caches[0].values():
            ptx = kernel.asm.get("ptx", "")
            builds.append(dict(num_stages=kernel.metadata.num_stages, shared=kernel.metadata.shared,
                               registers=getattr(kernel, "n_regs", None), spills=getattr(kernel, "n_spills", None),
                               waits=sorted(set(re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)))))
    return builds


def run_paged(out: str, command: str, tune: bool = False, device: str = "cuda", batches=(1, 8, 32),
              seqlens_k=(4096, 32768, 131072), page_sizes=(16, 64, 256)) -> None:
    """Paged decoding against the contiguous cache (module docstring); ``tune``: every ``PAGED_VARIANTS`` entry
    in the same process, with the split kernels' resources (``paged_decode_tune``)."""
    from flashlite.attention import split_kv

    heads, kv_heads, head_dim = 32, 8, 128
    fa4 = fa4_paged()
    kept = (split_kv.PAGED_ONE_WAVE_STAGES, split_kv.PAGED_SMALL_BLOCK_N, split_kv.PAGED_BLOCK_N)
    variants = PAGED_VARIANTS if tune else {"paged": kept}
    rows, fa4_errors = [], {}
    try:
        for batch in batches:
            for seqlen_k in seqlens_k:
                if batch * seqlen_k > 32 * 32768:  # K/V of at most 32 x 32K keys (16 GB in bf16)
                    continue
                k = torch.randn(batch, kv_heads, seqlen_k, head_dim, device=device, dtype=torch.bfloat16)
                v = torch.randn_like(k)
                q = torch.randn(batch, heads, 1, head_dim, device=device, dtype=torch.bfloat16)
                seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device=device)
                kv_bytes = 2 * k.numel() * k.element_size()
                reference = flashlite.flash_attention(q, k, v, cache_seqlens=seqlens)
                contiguous_ms = try_time_ms(lambda: flashlite.flash_attention(q, k, v, cache_seqlens=seqlens))
                q4, k4, v4 = (t.transpose(1, 2) for t in (q, k, v))  # FA4's (B, L, H, D): views of the same tensors
                fa4_contiguous_ms = (checked_ms(lambda: fa4(q4, k4, v4, seqlens), reference, fa4_errors, "contiguous")
                                     if fa4 is not None else None)
                for page_size in page_sizes:
                    blocks = seqlen_k // page_size
                    table = torch.randperm(batch * blocks, device=device).view(batch, blocks).to(torch.int32)
                    pool = [torch.empty(batch * blocks, kv_heads, page_size, head_dim, device=device, dtype=k.dtype)
                            for _ in range(2)]
                    for cache, src in zip(pool, (k, v)):  # the same keys, scattered over the pages of the table
                        cache[table.long().flatten()] = src.view(batch, kv_heads, blocks, page_size,
                                                                 head_dim).transpose(1, 2).reshape(
                            batch * blocks, kv_heads, page_size, head_dim)
                    row = dict(B=batch, Lk=seqlen_k, page=page_size, contiguous_gbs=gbs(kv_bytes, contiguous_ms))
                    for name, (stages, small, block_n) in variants.items():
                        split_kv.PAGED_ONE_WAVE_STAGES, split_kv.PAGED_SMALL_BLOCK_N, split_kv.PAGED_BLOCK_N = (
                            stages, small, block_n)
                        flashlite.attention.api.clear_routes()
                        paged = lambda: flashlite.flash_attention(q, *pool, cache_seqlens=seqlens, block_table=table)
                        torch.testing.assert_close(paged(), reference, atol=2e-2, rtol=2e-2)
                        row[f"{name}_gbs"] = gbs(kv_bytes, try_time_ms(paged))
                        ratio = "x_contiguous" if name == "paged" else f"{name}_x_contiguous"
                        row[ratio] = (row[f"{name}_gbs"] / row["contiguous_gbs"]
                                      if row[f"{name}_gbs"] and row["contiguous_gbs"] else None)
                    if fa4 is not None:  # its own layout, (num_blocks, page_size, H_kv, D), a copy of the pages
                        pages4 = [c.transpose(1, 2).contiguous() for c in pool]
                        row["fa4_paged_gbs"] = gbs(kv_bytes, checked_ms(lambda: fa4(q4, *pages4, seqlens, table),
                                                                        reference, fa4_errors, page_size))
                        row["fa4_contiguous_gbs"] = gbs(kv_bytes, fa4_contiguous_ms)
                        best = max(variants, key=lambda name: row[f"{name}_gbs"] or 0)
                        row["x_fa4_paged"] = (row[f"{best}_gbs"] / row["fa4_paged_gbs"]
                                              if row[f"{best}_gbs"] and row["fa4_paged_gbs"] else None)
                        del pages4
                    print({key: (round(val, 3) if isinstance(val, float) else val) for key, val in row.items()},
                          flush=True)
                    rows.append(row)
                    del pool, table
    finally:
        split_kv.PAGED_ONE_WAVE_STAGES, split_kv.PAGED_SMALL_BLOCK_N, split_kv.PAGED_BLOCK_N = kept
        flashlite.attention.api.clear_routes()
    meta = dict(environment(), command=command, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seqlen_q=1,
                dtype="bfloat16", units="GB/s of K/V read", fa4="measured" if fa4 else "not importable",
                fa4_errors=fa4_errors,
                variants={name: dict(one_wave_stages=stages, small_block_n=small, block_n=block_n)
                          for name, (stages, small, block_n) in variants.items()},
                split_kernels=split_kernel_builds())
    columns = list(rows[0]) if rows else []
    write_results("paged_decode_tune" if tune else "paged_decode", out, meta, rows, columns,
                  "Paged decoding: flash_attention with a block table against the contiguous cache (H200)")


def run_tune(out: str, totals: list[int], command: str) -> None:
    """The packed backward's dK/dV register cap at D = 64 (``tuning.WGMMA_BACKWARD_CONFIGS[64].max_registers``):
    168, the dense call's tuned cap (three programs a multiprocessor; the packed kernel spills 164 B under it),
    against no cap and 200 (two programs), on the same packed batches in one process: forward + backward TFLOP/s
    of the default (Hopper) kernels, and the dense call's under the same cap."""
    import dataclasses

    from flashlite.attention import tuning

    device = torch.device("cuda")
    kept = tuning.WGMMA_BACKWARD_CONFIGS[64]
    rows = []
    try:
        for total in totals:
            for mix in MIXES:
                lengths = document_lengths(mix, total)
                row = dict(mix=mix, tokens=total, docs=len(lengths))
                calls = providers(lengths, 64, device)
                for cap in (168, None, 200):
                    tuning.WGMMA_BACKWARD_CONFIGS[64] = dataclasses.replace(kept, max_registers=cap)
                    for name in ("flashlite", "dense"):
                        make, call = calls[name]
                        flashlite.attention.api.clear_routes()
                        leaves = [t.requires_grad_() for t in make()]
                        pairs = (visible_pairs([leaves[0].shape[2]] * leaves[0].shape[0]) if name == "dense"
                                 else visible_pairs(lengths))
                        do = torch.randn_like(call(*leaves))
                        row[f"{name}_cap{cap}"] = tflops(3.5 * 4 * HEADS * 64 * pairs, try_time_ms(
                            lambda: torch.autograd.grad(call(*leaves), leaves, do)))
                print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
                rows.append(row)
                write_results("varlen_tune_d64", out, dict(environment(), command=command, head_dim=64,
                                                           units="TFLOP/s forward + backward on visible pairs"),
                              rows, list(row), "Packed backward, D = 64: the dK/dV register cap (H200)")
    finally:
        tuning.WGMMA_BACKWARD_CONFIGS[64] = kept
        flashlite.attention.api.clear_routes()


def run_launches(calls: int = 3) -> None:
    """``--part launches``: ``calls`` forward + backward calls of the packed (default kernels) and the dense call of
    the same work, uniform2k, 64K tokens, D = 64, nothing timed: the program ncu profiles (TUNING.md#varlen:
    ``ncu --kernel-name regex:^_attention_bwd_wgmma --launch-skip 2 --launch-count 4 ...``, the packed call's
    third dK/dV launch, then the dense call's three)."""
    lengths = document_lengths("uniform2k", 65536)
    for name in ("flashlite", "dense"):
        make, call = providers(lengths, 64, torch.device("cuda"))[name]
        leaves = [t.requires_grad_() for t in make()]
        do = torch.randn_like(call(*leaves))
        for _ in range(calls):
            torch.autograd.grad(call(*leaves), leaves, do)
        torch.cuda.synchronize()


def sass_summary(path: str) -> str:
    """A markdown summary of an ncu source-page CSV of two launches (``ncu --page source --print-source sass --csv``
    over ``--part launches``: the packed kernel's, then the dense one's): instructions executed by opcode, packed
    against dense, and by how often an instruction ran (the loop body runs iterations x warps times)."""
    import collections
    import csv

    kernels, header = [], None
    with open(path) as f:
        for row in csv.reader(f):
            if row and row[0] == "Kernel Name":
                kernels.append([])
            elif row and row[0] == "Address":
                header = row
            elif kernels and len(row) > 5:
                kernels[-1].append(row)
    executed = header.index("Instructions Executed")
    by_opcode, by_count = [], []
    for rows in kernels[:2]:
        opcodes, counts = collections.Counter(), collections.Counter()
        for row in rows:
            n = int(row[executed].replace(",", "") or 0)
            words = [w for w in row[1].split() if not w.startswith("@")]  # the opcode past any predicate
            opcodes[words[0].split(".")[0] if words else "?"] += n
            counts[n] += 1
        by_opcode.append(opcodes)
        by_count.append(counts)
    packed, dense = by_opcode
    lines = ["| opcode | packed | dense | packed - dense |", "|---|---|---|---|"]
    lines += [f"| {op} | {packed[op]:,} | {dense[op]:,} | {packed[op] - dense[op]:,} |"
              for op in sorted(set(packed) | set(dense), key=lambda o: dense[o] - packed[o])[:20]]
    lines += ["", "| launch | total | most frequent counts (runs x instructions) |", "|---|---|---|"]
    for name, ops, counts in zip(("packed", "dense"), by_opcode, by_count):
        top = sorted(counts.items(), key=lambda c: -c[0] * c[1])[:4]
        lines.append(f"| {name} | {sum(ops.values()):,} | " + ", ".join(f"{n:,} x {k}" for n, k in top) + " |")
    return "\n".join(lines) + "\n"


def plot_results(out: str) -> None:
    """``varlen.png`` from the ``varlen.json`` and ``paged_decode.json`` in ``out`` (those present): packed TFLOP/s
    against the batch's tokens, a panel for each head dim and pass (flashlite, its dense call on the same work and
    FlashAttention-4, each mix), and paged decoding's GB/s against the cache's length, a panel for each batch
    (each page size, the contiguous cache, FlashAttention-4's paged call on pages of 64)."""
    import json

    def load(name):
        path = os.path.join(out, f"{name}.json")
        return json.load(open(path))["rows"] if os.path.exists(path) else []

    panels = []
    rows = load("varlen")
    peers = {"flashlite": "flashlite", "dense": "dense call", "fa4": "FA4"}
    for head_dim in sorted({r["D"] for r in rows}):
        mine = [r for r in rows if r["D"] == head_dim]
        tokens = sorted({r["tokens"] for r in mine})
        by_mix = {mix: {r["tokens"]: r for r in mine if r["mix"] == mix} for mix in MIXES}
        for part, label in (("fwd", "forward"), ("fwd_bwd", "forward + backward")):
            series = {}
            for mix, at in by_mix.items():
                for key, name in peers.items():
                    series[f"{name}, {mix}"] = [at[t].get(f"{key}_{part}") if t in at else None for t in tokens]
            panels.append((f"packed, causal, D = {head_dim}: {label}, against the batch's tokens", tokens, series,
                           "TFLOP/s (visible pairs)"))
    rows = load("paged_decode")
    for batch in sorted({r["B"] for r in rows}):
        mine = [r for r in rows if r["B"] == batch]
        lengths = sorted({r["Lk"] for r in mine})
        at = {(r["Lk"], r["page"]): r for r in mine}
        series = {"contiguous": [next(r["contiguous_gbs"] for r in mine if r["Lk"] == n) for n in lengths]}
        for page in sorted({r["page"] for r in mine}):
            series[f"pages of {page}"] = [at[n, page]["paged_gbs"] if (n, page) in at else None for n in lengths]
        series["FA4, pages of 64"] = [at[n, 64].get("fa4_paged_gbs") if (n, 64) in at else None for n in lengths]
        panels.append((f"paged decoding, B = {batch}, H = 32, H_kv = 8, D = 128, against the cache's keys", lengths,
                       series, "GB/s of K/V"))
    if panels:
        plot_lines(os.path.join(out, "varlen.png"), panels)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="output folder (default bench/results/<gpu>)")
    parser.add_argument("--part", nargs="+", default=["speed", "host", "paged"],
                        choices=["speed", "host", "paged", "paged-tune", "tune", "kernels", "launches", "sass", "plot"])
    parser.add_argument("--totals", nargs="+", type=int, default=[16384, 65536])
    parser.add_argument("--profile", action="store_true", help="--part host: also cProfile each provider's calls")
    parser.add_argument("--ncu-csv", help="--part sass: the ncu source-page CSV to summarise (no GPU needed)")
    args = parser.parse_args(argv)
    if "sass" in args.part:
        print(sass_summary(args.ncu_csv), end="")
        return
    if "launches" in args.part:
        run_launches()
        return
    if args.part == ["plot"] and not args.out:
        parser.error("--part plot needs --out, the folder whose JSON files it draws")
    out = results_dir(args.out)
    given = list(sys.argv[1:] if argv is None else argv)
    if "--out" in given:  # where the files went is not part of how they were made
        del given[given.index("--out"):given.index("--out") + 2]
    command = " ".join(["python bench/varlen.py", *given])
    if "host" in args.part:
        run_host(out, command, args.profile)
    if "paged" in args.part:
        run_paged(out, command)
    if "paged-tune" in args.part:
        run_paged(out, command, tune=True)
    if "speed" in args.part:
        run_speed(out, args.totals, command)
    if "tune" in args.part:
        run_tune(out, args.totals, command)
    if "kernels" in args.part:
        run_kernels(out, args.totals, command)
    if {"speed", "paged", "plot"} & set(args.part):
        plot_results(out)


if __name__ == "__main__":
    main()
