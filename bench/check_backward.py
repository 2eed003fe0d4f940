"""GPU check of flash attention's gradients against float64 autograd (FlashAttention's 2x rule).

Runs the Triton backward kernels whatever ``attention_backward.triton_backward_enabled`` says,
so that they can be checked before being switched on:

    PYTHONPATH=. python bench/check_backward.py

The first run (H100, Triton 3.6, 2026-11-23) found dq and dv within bound and dk not
(errors 0.03-0.49 against PyTorch's 0.003-0.02 at D = 128 and D = 64 causal): the dK/dV
kernel scaled the loaded q tile and also fed it to a dot, which Triton 3.6 miscompiled
with 2 pipeline stages (1 stage, or no scaling, was right). Since the fix (the scaled
copy comes from the preprocessing kernel), every case passes, with the tuned tiles too;
the log is bench/results/h100/check_backward.log.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashlite  # noqa: E402
import flashlite.attention_backward as fb  # noqa: E402
from tests.utils import ATTN_ATOL, attention_ref  # noqa: E402

CASES = [(1000, 1000, 2), (333, 1500, 4)]  # (Lq, Lk, H_kv) with B = 2, H = 4


def grads_ref(q, k, v, do, causal, dtype):
    inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(attention_ref(*inputs, causal=causal, dtype=dtype), inputs, do.to(dtype))


def main() -> int:
    fb.triton_backward_enabled = lambda q, mask=None: True  # fp32 and masks too, were they in the cases
    torch.manual_seed(0)
    failures = 0
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in (64, 128):
            for causal in (False, True):
                for seqlen_q, seqlen_k, kv_heads in CASES:
                    t0 = time.time()
                    q = torch.randn(2, 4, seqlen_q, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                    k, v = (torch.randn(2, kv_heads, seqlen_k, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                            for _ in range(2))
                    do = torch.randn_like(q)
                    grads = torch.autograd.grad(flashlite.flash_attention(q, k, v, causal=causal), (q, k, v), do)
                    ref64, ref_low = grads_ref(q, k, v, do, causal, torch.float64), grads_ref(q, k, v, do, causal, dtype)
                    for name, g, r, t in zip("qkv", grads, ref64, ref_low):
                        err = (g.double() - r).abs().max().item()
                        torch_err = (t.double() - r).abs().max().item()
                        ok = err == err and err <= 2 * torch_err + ATTN_ATOL[dtype]
                        failures += not ok
                        print(f"{'ok ' if ok else 'BAD'} {str(dtype)[6:]:8} D={head_dim:3} causal={causal!s:5} "
                              f"Lq={seqlen_q:4} Lk={seqlen_k:4} H_kv={kv_heads} d{name}: {err:.2e} "
                              f"(torch {torch_err:.2e})  [{time.time() - t0:.1f}s]", flush=True)
    print(f"\n{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
