"""GPU probe of the Triton miscompile behind ``flashlite.attention.plan.tma_safe``.

Runs the forward kernel with a user mask on forced tile configs (TMA or pointer loads,
1-3 stages, square and non-square K/V boxes) at D = 64, 32 and 128 and prints each
config's max error against a float64 reference; ``BAD`` marks errors over 0.05
(tolerances are ~0.03). On the H100 with Triton 3.6 every failure had a square box,
``BLOCK_N == HEAD_DIM_PADDED``, with TMA (bench/results/h100/attention_probe_tma_mask.log).
Re-run it on a newer Triton before relaxing ``tma_safe``:

    PYTHONPATH=. python bench/probe_tma_mask.py
"""

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashlite.attention import forward  # noqa: E402
from flashlite.attention.api import attention_forward  # noqa: E402
from flashlite.attention.tuning import AttentionConfig  # noqa: E402
from flashlite.core.masking import broadcast_mask  # noqa: E402

# (BLOCK_M, BLOCK_N, warps, stages, TMA)
CONFIGS = [(64, 64, 4, 3, True), (64, 64, 4, 2, True), (64, 64, 4, 1, True), (64, 64, 4, 3, False),
           (64, 64, 4, 1, False), (64, 64, 8, 3, True), (128, 64, 8, 3, True), (64, 128, 4, 3, True),
           (64, 32, 4, 3, True), (32, 64, 4, 3, True)]
SHAPES = [(700, 900, "additive"), (500, 600, "bool"), (256, 256, "additive"), (64, 64, "additive")]


def main() -> None:
    # The tl kernel's launcher would route square boxes with a mask to pointer loads (tma_safe): lift that here.
    forward.tma_safe = lambda has_mask, block_n, head_dim_pad: True
    torch.manual_seed(0)
    for head_dim in (64, 32, 128):
        for seqlen_q, seqlen_k, kind in SHAPES:
            q = torch.randn(2, 4, seqlen_q, head_dim, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(2, 4, seqlen_k, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            if kind == "additive":
                mask = torch.randn(2, 4, seqlen_q, seqlen_k, device="cuda", dtype=torch.bfloat16)
            else:
                mask = torch.rand(2, 4, seqlen_q, seqlen_k, device="cuda") > 0.3
            s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(head_dim)
            s = s + mask.double() if kind == "additive" else s.masked_fill(~mask, float("-inf"))
            ref = torch.softmax(s, -1) @ v.double()
            mask_view, is_bool = broadcast_mask(mask, (2, 4, seqlen_q, seqlen_k))
            for bm, bn, warps, stages, tma in CONFIGS:
                config = AttentionConfig(bm, bn, warps, stages, use_tma=tma)
                out, _ = attention_forward(q, k, v, False, 1 / math.sqrt(head_dim), mask_view, is_bool, False, config)
                err = (out.double() - ref).abs().max().item()
                print(f"probe: D={head_dim} {seqlen_q}x{seqlen_k} {kind:8s} {bm}x{bn} w{warps} s{stages} "
                      f"tma={int(tma)} -> {err:.1e}{'   BAD' if err > 0.05 else ''}", flush=True)


if __name__ == "__main__":
    main()
