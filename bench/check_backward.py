"""GPU check of flash attention's gradients against float64 autograd (FlashAttention's 2x rule).

Runs the Triton backward kernels whatever ``attention_backward.triton_backward_enabled`` says,
so that they can be checked before being switched on:

    PYTHONPATH=. python bench/check_backward.py

The first run (H100, Triton 3.6, 2026-11-23) found dq and dv within bound and dk not
(errors 0.03-0.49 against PyTorch's 0.003-0.02 at D = 128 and D = 64 causal): the dK/dV
kernel scaled the loaded q tile and also fed it to a dot, which Triton 3.6 miscompiled
with 2 pipeline stages (1 stage, or no scaling, was right); the log is
bench/results/h100/check_backward.log. The kernels no longer scale Q: scores are scaled
in fp32 after the dot, and tests/test_gpu_attention.py runs FlashAttention's matrix.

Masked cases (a key-padding boolean mask, a full boolean mask, a full additive mask whose
gradient is checked too) run at B = 2, H = 4 = H_kv, Lq = 700, Lk = 900. Their first run
failed only the key-padding cases at D = 64, through the forward (its square TMA boxes,
see ``flashlite.attention.tma_safe``); with that fixed all 128 gradients pass, and masked
calls on CUDA run the Triton backward.
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
MASKED_CASE = (700, 900, 4)
MASK_KINDS = ("key_padding", "bool", "additive")


def make_mask(kind: str | None, seqlen_q: int, seqlen_k: int, dtype: torch.dtype) -> torch.Tensor | None:
    """None, a (2, 1, 1, Lk) key-padding mask, a (2, 4, Lq, Lk) boolean mask, or an additive one that requires grad."""
    if kind is None:
        return None
    if kind == "key_padding":
        return torch.rand(2, 1, 1, seqlen_k, device="cuda") > 0.2
    if kind == "bool":
        return torch.rand(2, 4, seqlen_q, seqlen_k, device="cuda") > 0.3
    return torch.randn(2, 4, seqlen_q, seqlen_k, device="cuda", dtype=dtype).requires_grad_()


def grads_ref(q, k, v, mask, do, causal, dtype):
    inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    if mask is not None and mask.requires_grad:
        inputs.append(mask.detach().to(dtype).requires_grad_())
        out = attention_ref(*inputs[:3], causal=causal, attn_mask=inputs[3], dtype=dtype)
    else:
        out = attention_ref(*inputs, causal=causal, attn_mask=mask, dtype=dtype)
    return torch.autograd.grad(out, inputs, do.to(dtype))


def cases():
    """(dtype, head_dim, causal, (Lq, Lk, H_kv), mask kind) of every check."""
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in (64, 128):
            for causal in (False, True):
                for shape in CASES:
                    yield dtype, head_dim, causal, shape, None
                for kind in MASK_KINDS:
                    yield dtype, head_dim, causal, MASKED_CASE, kind


def main() -> int:
    fb.triton_backward_enabled = lambda q: True  # fp32 too, were it in the cases
    torch.manual_seed(0)
    failures = 0
    for dtype, head_dim, causal, (seqlen_q, seqlen_k, kv_heads), kind in cases():
        t0 = time.time()
        q = torch.randn(2, 4, seqlen_q, head_dim, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(2, kv_heads, seqlen_k, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                for _ in range(2))
        mask = make_mask(kind, seqlen_q, seqlen_k, dtype)
        do = torch.randn_like(q)
        inputs = (q, k, v, mask) if mask is not None and mask.requires_grad else (q, k, v)
        grads = torch.autograd.grad(flashlite.flash_attention(q, k, v, causal=causal, attn_mask=mask), inputs, do)
        ref64 = grads_ref(q, k, v, mask, do, causal, torch.float64)
        ref_low = grads_ref(q, k, v, mask, do, causal, dtype)
        for name, g, r, t in zip(("q", "k", "v", "mask"), grads, ref64, ref_low):
            err = (g.double() - r).abs().max().item()
            torch_err = (t.double() - r).abs().max().item()
            ok = err == err and err <= 2 * torch_err + ATTN_ATOL[dtype]
            failures += not ok
            print(f"{'ok ' if ok else 'BAD'} {str(dtype)[6:]:8} D={head_dim:3} causal={causal!s:5} "
                  f"Lq={seqlen_q:4} Lk={seqlen_k:4} H_kv={kv_heads} mask={kind!s:11} d{name:4}: {err:.2e} "
                  f"(torch {torch_err:.2e})  [{time.time() - t0:.1f}s]", flush=True)
    print(f"\n{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
