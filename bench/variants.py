"""Attention variants against plain attention and FlexAttention on the same inputs (issue 33's targets).

    python bench/variants.py [--lengths 4096 16384] [--head-dims 64 128] [--no-flex] [--out DIR]

bf16, H = 32 with 8 K/V heads, B·L = 32K tokens, causal; forward and forward+backward TFLOP/s as
bench/attention.py counts them (visible pairs). Variants:

* ``sinks``: one logit per head merged into each row's (o, lse) after the kernels; target >= 0.97x plain.
* ``softcap``: ``50 · tanh(s / 50)`` (Gemma-2's value) in the kernels' masked tiles; targets >= 0.85x plain and
  >= 1.0x FlexAttention (``torch.compile(flex_attention)`` with the same ``score_mod`` and a causal block mask).

Writes ``variants.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flashlite  # noqa: E402
from common import environment, markdown_table, results_dir, tflops, time_ms, write_results  # noqa: E402

HEADS, KV_HEADS, TOKENS = 32, 8, 32768
SOFTCAP = 50.0


def flex_softcap(length: int):
    """FlexAttention with Gemma-2's score_mod and a causal block mask, compiled; None where unavailable."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    compiled = torch.compile(flex_attention)
    block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, length, length)

    def softcap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    return lambda q, k, v: compiled(q, k, v, score_mod=softcap, block_mask=block_mask, enable_gqa=True)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes a minute)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for head_dim in args.head_dims:
        for length in args.lengths:
            batch = max(1, TOKENS // length)
            q = torch.randn(batch, HEADS, length, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(batch, KV_HEADS, length, head_dim, device="cuda", dtype=torch.bfloat16,
                                requires_grad=True) for _ in range(2))
            sinks = torch.randn(HEADS, device="cuda", requires_grad=True)
            do = torch.randn_like(q)
            flops = 4.0 * batch * HEADS * length * length * head_dim / 2
            base = {"D": head_dim, "L": length, "B": batch}
            plain = measure(lambda q, k, v: flashlite.flash_attention(q, k, v, causal=True), (q, k, v), do, flops)
            cases = {
                "sinks": (lambda q, k, v: flashlite.flash_attention(q, k, v, causal=True, sinks=sinks), (q, k, v, sinks),
                          None),
                "softcap": (lambda q, k, v: flashlite.flash_attention(q, k, v, causal=True, softcap=SOFTCAP), (q, k, v),
                            None if args.no_flex else flex_softcap(length)),
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
    cols = ["variant", "D", "L", "B", "plain_fwd", "fwd", "x_plain_fwd", "flex_fwd", "x_flex_fwd", "plain_fwdbwd",
            "fwdbwd", "x_plain_fwdbwd", "flex_fwdbwd", "x_flex_fwdbwd"]
    write_results("variants", results_dir(args.out), environment() | {"heads": HEADS, "kv_heads": KV_HEADS,
                  "causal": True, "dtype": "bfloat16", "softcap": SOFTCAP}, rows, cols,
                  "Attention variants against plain and FlexAttention, TFLOP/s")
    print(markdown_table(rows, cols))


if __name__ == "__main__":
    main()
