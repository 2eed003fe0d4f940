"""Attention variants against plain attention on the same inputs: TFLOP/s and the ratio (issue 33's targets).

    python bench/variants.py [--lengths 4096 16384] [--head-dims 64 128] [--out DIR]

bf16, H = 32 with 8 K/V heads, B·L = 32K tokens, causal. Variants now: ``sinks`` (one logit per head merged
into each row's (o, lse) after the kernels), forward and forward+backward, against the same call without
sinks; target >= 0.97x plain. TFLOP/s as bench/attention.py counts them (visible pairs only).
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
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
            fwd_flops = 4.0 * batch * HEADS * length * length * head_dim / 2
            row = {"variant": "sinks", "D": head_dim, "L": length, "B": batch}
            for name, kw, inputs in (("plain", {}, (q, k, v)), ("sinks", {"sinks": sinks}, (q, k, v, sinks))):
                with torch.no_grad():
                    row[f"{name}_fwd"] = tflops(fwd_flops, time_ms(
                        lambda kw=kw: flashlite.flash_attention(q, k, v, causal=True, **kw)))
                row[f"{name}_fwdbwd"] = tflops(3.5 * fwd_flops, time_ms(
                    lambda kw=kw, inputs=inputs: torch.autograd.grad(
                        flashlite.flash_attention(q, k, v, causal=True, **kw), inputs, do)))
            row["x_plain_fwd"] = row["sinks_fwd"] / row["plain_fwd"]
            row["x_plain_fwdbwd"] = row["sinks_fwdbwd"] / row["plain_fwdbwd"]
            rows.append(row)
            print(row, flush=True)
    cols = ["variant", "D", "L", "B", "plain_fwd", "sinks_fwd", "x_plain_fwd", "plain_fwdbwd", "sinks_fwdbwd",
            "x_plain_fwdbwd"]
    write_results("variants", results_dir(args.out), environment() | {"heads": HEADS, "kv_heads": KV_HEADS,
                  "causal": True, "dtype": "bfloat16"}, rows, cols, "Attention variants against plain, TFLOP/s")
    print(markdown_table(rows, cols))


if __name__ == "__main__":
    main()
