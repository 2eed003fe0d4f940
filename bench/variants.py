"""Attention variants against plain attention and FlexAttention on the same inputs (issue 33's targets).

    python bench/variants.py [--lengths 4096 16384] [--head-dims 64 128] [--no-flex] [--out DIR]
    python bench/variants.py --window [--window-lengths 8192 32768 131072] [--out DIR]
    python bench/variants.py --head-dim-v [--lengths 4096 16384] [--out DIR]

bf16, H = 32 with 8 K/V heads, B·L = 32K tokens, causal; forward and forward+backward TFLOP/s as
bench/attention.py counts them (visible pairs). Variants:

* ``sinks``: one logit per head merged into each row's final state by every kernel; target >= 0.97x plain.
* ``softcap``: ``50 · tanh(s / 50)`` (Gemma-2's value) on every tile; targets >= 0.85x plain and
  >= 1.0x FlexAttention (``torch.compile(flex_attention)`` with the same ``score_mod`` and a causal block mask).
* ``alibi``: the ALiBi paper's slopes for 32 heads on every tile; the same targets, FlexAttention with the
  ALiBi ``score_mod``.

* ``--head-dim-v``: q/k head dim 192 with v's 128 (MLA's shape) against D = Dv = 192, causal and not, TFLOP/s
  counting ``2·B·H·Lq·Lk·(D + Dv)`` (halved under causal); target >= 0.9x the D = Dv = 192 forward. SDPA (its
  default backend choice) on the same tensors where it runs.

* ``window`` (``--window``): a causal sliding window of 4096 keys (Mistral's), D = 128, B·L = 128K tokens,
  L from 8K to 128K; TFLOP/s counted on the visible pairs only. Targets: >= 0.9x flashlite's full causal
  TFLOP/s at the same L and >= 1.0x FlexAttention (the same window as a block mask); SDPA's
  memory-efficient backend with the window materialised as a boolean (L, L) mask where it fits (L <= 16K).
  Also the peak memory of a windowed forward beyond its inputs, against its output and LSE.

Writes ``variants.{json,md}`` (``variants_window.{json,md}`` with ``--window``, ``variants_head_dim_v.{json,md}``
with ``--head-dim-v``), then ``variants.png`` from whichever of the three the folder holds (``--plot``: only
that, from the committed JSON, no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flashlite  # noqa: E402
from common import (  # noqa: E402
    attention_flops, environment, markdown_table, plot_lines, results_dir, tflops, time_ms, write_results,
)

HEADS, KV_HEADS, TOKENS = 32, 8, 32768
SOFTCAP = 50.0
WINDOW, WINDOW_HEAD_DIM, WINDOW_TOKENS, SDPA_MASK_MAX_L = 4096, 128, 131072, 16384


def flex_causal(length: int, score_mod):
    """FlexAttention with ``score_mod`` and a causal block mask, compiled; None where unavailable."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    compiled = torch.compile(flex_attention)
    block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, length, length)
    return lambda q, k, v: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)


def softcap_mod(score, b, h, q_idx, kv_idx):
    """Gemma-2's softcap as FlexAttention's score_mod."""
    return SOFTCAP * torch.tanh(score / SOFTCAP)


def alibi_mod(slopes: torch.Tensor):
    """ALiBi as FlexAttention's score_mod: ``score - slope[h] · |q - kv|``."""
    return lambda score, b, h, q_idx, kv_idx: score - slopes[h] * (q_idx - kv_idx).abs()


def flex_window(length: int, window: int):
    """FlexAttention with a causal sliding-window block mask (tiles outside it skipped), compiled; or None."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    compiled = torch.compile(flex_attention)
    try:  # compiled, the block mask is built block by block (eagerly it materialises L x L: 128 GiB at 128K)
        block_mask = create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv <= window), None, None, length, length,
                                       _compile=True)
    except Exception as err:  # noqa: BLE001 - a peer that cannot run here is reported as missing
        print(f"  FlexAttention block mask failed at L={length}: {type(err).__name__}: {str(err)[:120]}", flush=True)
        return None
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=True)


def visible_pairs(length: int, window: int) -> int:
    """(query, key) pairs a causal window of ``window`` keys before the diagonal leaves: query i sees min(i, W) + 1."""
    full = min(length, window + 1)
    return full * (full + 1) // 2 + (length - full) * (window + 1)


def measure(fn, inputs, do, flops: float) -> tuple[float | None, float | None]:
    """(fwd, fwd+bwd) TFLOP/s of ``fn(*inputs[:3])``; gradients of every tensor of ``inputs``."""
    try:
        with torch.no_grad():
            fwd = tflops(flops, time_ms(lambda: fn(*inputs[:3])))
        fwdbwd = tflops(3.5 * flops, time_ms(lambda: torch.autograd.grad(fn(*inputs[:3]), inputs, do)))
        return fwd, fwdbwd
    except Exception as err:  # a peer that does not run here
        print(f"  failed: {type(err).__name__}: {str(err)[:120]}", flush=True)
        return None, None


def ratio(a, b):
    return a / b if a and b else None


def window_main(args) -> None:
    """The sliding-window rows: flashlite windowed vs its full causal, FlexAttention and SDPA (masked)."""
    import torch.nn.functional as F

    rows = []
    head_dim = WINDOW_HEAD_DIM
    for length in args.window_lengths:
        batch = max(1, WINDOW_TOKENS // length)
        q = torch.randn(batch, HEADS, length, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(batch, KV_HEADS, length, head_dim, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        do = torch.randn_like(q)
        full_flops = attention_flops(batch, HEADS, length, length, head_dim, True)
        flops = 4.0 * batch * HEADS * visible_pairs(length, WINDOW) * head_dim
        full = measure(lambda q, k, v: flashlite.flash_attention(q, k, v, causal=True), (q, k, v), do, full_flops)
        mine = measure(lambda q, k, v: flashlite.flash_attention(q, k, v, causal=True, window_size=(WINDOW, 0)),
                       (q, k, v), do, flops)
        flex = None if args.no_flex else flex_window(length, WINDOW)
        theirs = measure(flex, (q, k, v), do, flops) if flex is not None else (None, None)
        sdpa = (None, None)
        if length <= SDPA_MASK_MAX_L:
            i = torch.arange(length, device="cuda")
            keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= WINDOW)
            sdpa = measure(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True),
                           (q, k, v), do, flops)
        with torch.no_grad():  # peak memory of one windowed forward beyond its inputs
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            out, lse = flashlite.flash_attention(q, k, v, causal=True, window_size=(WINDOW, 0), return_lse=True)
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - before
            output_bytes = out.numel() * out.element_size() + lse.numel() * lse.element_size()
            del out, lse
        row = dict(variant="window", D=head_dim, L=length, B=batch, window=WINDOW, full_causal_fwd=full[0],
                   fwd=mine[0], x_full_fwd=ratio(mine[0], full[0]), flex_fwd=theirs[0],
                   x_flex_fwd=ratio(mine[0], theirs[0]), sdpa_mask_fwd=sdpa[0], full_causal_fwdbwd=full[1],
                   fwdbwd=mine[1], x_full_fwdbwd=ratio(mine[1], full[1]), flex_fwdbwd=theirs[1],
                   x_flex_fwdbwd=ratio(mine[1], theirs[1]), sdpa_mask_fwdbwd=sdpa[1],
                   extra_mib=extra / 2**20, output_lse_mib=output_bytes / 2**20)
        rows.append(row)
        print(row, flush=True)
        torch._dynamo.reset()  # one compiled FlexAttention per length; free its caches before the next
    cols = ["variant", "D", "L", "B", "window", "full_causal_fwd", "fwd", "x_full_fwd", "flex_fwd", "x_flex_fwd",
            "sdpa_mask_fwd", "full_causal_fwdbwd", "fwdbwd", "x_full_fwdbwd", "flex_fwdbwd", "x_flex_fwdbwd",
            "sdpa_mask_fwdbwd", "extra_mib", "output_lse_mib"]
    write_results("variants_window", results_dir(args.out), environment() | {
        "heads": HEADS, "kv_heads": KV_HEADS, "causal": True, "dtype": "bfloat16", "window": WINDOW,
        "tokens": WINDOW_TOKENS, "flops": "visible pairs only"}, rows, cols,
        "Causal sliding window (4096) against full causal, FlexAttention and SDPA, TFLOP/s on visible pairs")
    print(markdown_table(rows, cols))


def head_dim_v_main(args) -> None:
    """The V-head-dim rows: D = 192 with Dv = 128 against D = Dv = 192 (flashlite both), and SDPA on the first."""
    import torch.nn.functional as F

    rows = []
    head_dim = 192
    for causal in (False, True):
        for length in args.lengths:
            batch = max(1, TOKENS // length)
            q = torch.randn(batch, HEADS, length, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(batch, KV_HEADS, length, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            results = {}
            for dv in (192, 128):
                v = torch.randn(batch, KV_HEADS, length, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                do = torch.randn(batch, HEADS, length, dv, device="cuda", dtype=torch.bfloat16)
                flops = 2.0 * batch * HEADS * length * length * (head_dim + dv) / (2 if causal else 1)
                results[dv] = measure(lambda q, k, v: flashlite.flash_attention(q, k, v, causal=causal), (q, k, v),
                                      do, flops)
                if dv == 128:
                    results["sdpa"] = measure(
                        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
                        (q, k, v), do, flops)
            row = dict(D=head_dim, Dv=128, causal=causal, L=length, B=batch, same_dv_fwd=results[192][0],
                       fwd=results[128][0], x_same_dv_fwd=ratio(results[128][0], results[192][0]),
                       sdpa_fwd=results["sdpa"][0], x_sdpa_fwd=ratio(results[128][0], results["sdpa"][0]),
                       same_dv_fwdbwd=results[192][1], fwdbwd=results[128][1],
                       x_same_dv_fwdbwd=ratio(results[128][1], results[192][1]), sdpa_fwdbwd=results["sdpa"][1],
                       x_sdpa_fwdbwd=ratio(results[128][1], results["sdpa"][1]))
            rows.append(row)
            print(row, flush=True)
    cols = ["D", "Dv", "causal", "L", "B", "same_dv_fwd", "fwd", "x_same_dv_fwd", "sdpa_fwd", "x_sdpa_fwd",
            "same_dv_fwdbwd", "fwdbwd", "x_same_dv_fwdbwd", "sdpa_fwdbwd", "x_sdpa_fwdbwd"]
    write_results("variants_head_dim_v", results_dir(args.out), environment() | {
        "heads": HEADS, "kv_heads": KV_HEADS, "dtype": "bfloat16", "flops": "2·B·H·Lq·Lk·(D + Dv), halved causal"},
        rows, cols, "V head dim 128 with q/k's 192 against D = Dv = 192 (and SDPA), TFLOP/s")
    print(markdown_table(rows, cols))


def plot_variants(folder: str) -> None:
    """``variants.png``: forward TFLOP/s against L, one panel a head dim (plain, each variant, FlexAttention),
    the window's against full causal and Flex, and the V head dim's against D = Dv and SDPA."""
    def load(name):
        path = os.path.join(folder, f"{name}.json")
        return json.load(open(path))["rows"] if os.path.exists(path) else []

    panels = []
    rows = load("variants")
    for head_dim in sorted({r["D"] for r in rows}):
        mine = [r for r in rows if r["D"] == head_dim]
        lengths = sorted({r["L"] for r in mine})
        series = {"plain": [next(r["plain_fwd"] for r in mine if r["L"] == n) for n in lengths]}
        for variant in dict.fromkeys(r["variant"] for r in mine):
            at = {r["L"]: r for r in mine if r["variant"] == variant}
            series[variant] = [at[n]["fwd"] for n in lengths]
            if any(at[n].get("flex_fwd") for n in lengths):
                series[f"Flex {variant}"] = [at[n].get("flex_fwd") for n in lengths]
        panels.append((f"variants, causal, D = {head_dim}: forward", lengths, series, "TFLOP/s"))
    rows = load("variants_window")
    if rows:
        lengths = [r["L"] for r in rows]
        panels.append(("causal window 4096, D = 128: forward (visible pairs)", lengths,
                       {"full causal": [r["full_causal_fwd"] for r in rows], "window": [r["fwd"] for r in rows],
                        "Flex window": [r["flex_fwd"] for r in rows]}, "TFLOP/s"))
    rows = load("variants_head_dim_v")
    for causal in (False, True):
        mine = [r for r in rows if r["causal"] == causal]
        if mine:
            panels.append((f"D = 192, Dv = 128{', causal' if causal else ''}: forward", [r["L"] for r in mine],
                           {"Dv = D = 192": [r["same_dv_fwd"] for r in mine], "Dv = 128": [r["fwd"] for r in mine],
                            "SDPA, Dv = 128": [r["sdpa_fwd"] for r in mine]}, "TFLOP/s"))
    if panels:
        plot_lines(os.path.join(folder, "variants.png"), panels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes a minute)")
    parser.add_argument("--window", action="store_true", help="the sliding-window rows instead (variants_window)")
    parser.add_argument("--window-lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--head-dim-v", action="store_true", help="the V-head-dim rows instead (variants_head_dim_v)")
    parser.add_argument("--plot", action="store_true", help="only variants.png, from the folder's JSON files")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.plot:
        plot_variants(args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "h200"))
        return
    if args.window:
        window_main(args)
    elif args.head_dim_v:
        head_dim_v_main(args)
    else:
        variants_main(args)
    plot_variants(results_dir(args.out))


def variants_main(args) -> None:
    """The sinks, softcap and ALiBi rows: flashlite with each against its plain call and FlexAttention."""
    from flashlite.nn import alibi_slopes

    slopes = alibi_slopes(HEADS).cuda()
    rows = []
    for head_dim in args.head_dims:
        for length in args.lengths:
            batch = max(1, TOKENS // length)
            q = torch.randn(batch, HEADS, length, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(batch, KV_HEADS, length, head_dim, device="cuda", dtype=torch.bfloat16,
                                requires_grad=True) for _ in range(2))
            sinks = torch.randn(HEADS, device="cuda", requires_grad=True)
            do = torch.randn_like(q)
            flops = attention_flops(batch, HEADS, length, length, head_dim, True)
            base = {"D": head_dim, "L": length, "B": batch}
            plain = measure(lambda q, k, v: flashlite.flash_attention(q, k, v, causal=True), (q, k, v), do, flops)
            cases = {
                "sinks": (lambda q, k, v: flashlite.flash_attention(q, k, v, causal=True, sinks=sinks), (q, k, v, sinks),
                          None),
                "softcap": (lambda q, k, v: flashlite.flash_attention(q, k, v, causal=True, softcap=SOFTCAP), (q, k, v),
                            None if args.no_flex else flex_causal(length, softcap_mod)),
                "alibi": (lambda q, k, v: flashlite.flash_attention(q, k, v, causal=True, alibi_slopes=slopes),
                          (q, k, v), None if args.no_flex else flex_causal(length, alibi_mod(slopes))),
            }
            for name, (fn, inputs, flex) in cases.items():
                mine = measure(fn, inputs, do, flops)
                theirs = measure(flex, (q, k, v), do, flops) if flex is not None else (None, None)
                row = dict(base, variant=name, plain_fwd=plain[0], fwd=mine[0], x_plain_fwd=ratio(mine[0], plain[0]),
                           flex_fwd=theirs[0], x_flex_fwd=ratio(mine[0], theirs[0]), plain_fwdbwd=plain[1],
                           fwdbwd=mine[1], x_plain_fwdbwd=ratio(mine[1], plain[1]), flex_fwdbwd=theirs[1],
                           x_flex_fwdbwd=ratio(mine[1], theirs[1]))
                rows.append(row)
                print(row, flush=True)
            torch._dynamo.reset()  # this shape's compiled FlexAttentions: freed before the next (recompile limit)
    cols = ["variant", "D", "L", "B", "plain_fwd", "fwd", "x_plain_fwd", "flex_fwd", "x_flex_fwd", "plain_fwdbwd",
            "fwdbwd", "x_plain_fwdbwd", "flex_fwdbwd", "x_flex_fwdbwd"]
    write_results("variants", results_dir(args.out), environment() | {"heads": HEADS, "kv_heads": KV_HEADS,
                  "causal": True, "dtype": "bfloat16", "softcap": SOFTCAP, "alibi": "paper slopes"}, rows, cols,
                  "Attention variants against plain and FlexAttention, TFLOP/s")
    print(markdown_table(rows, cols))


if __name__ == "__main__":
    main()
