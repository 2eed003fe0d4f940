"""Float64 references, tolerances and error helpers shared by every test file."""

from __future__ import annotations

import math

import torch

from flashlite._runtime import DeviceInfo

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# A stand-in H100 for plans made without a GPU: 132 multiprocessors, 64K registers and 227 KB of shared memory
# each, 64 warps, sm_90, 50 MB of L2.
H100 = DeviceInfo(132, 65536, 232448, 64, (9, 0), 50 << 20)

# Elementwise tolerances of a softmax-like output against float64, by output dtype:
# one rounding of the output (fp16 2^-11, bf16 2^-8) plus fp32 accumulation.
TOL = {
    torch.float32: dict(atol=1e-6, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=8e-3, rtol=8e-3),
}
# Absolute floor added to the FlashAttention-style bound (2x PyTorch's own error).
ATTN_ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def randn(*shape, dtype=torch.float32, scale: float = 1.0, requires_grad: bool = False) -> torch.Tensor:
    """Fresh normal data in ``dtype`` (on CPU, where the interpreter runs)."""
    x = (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype)
    return x.requires_grad_(requires_grad)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, **kw) -> None:
    """Compare against a float64 reference with the tolerance of ``dtype`` (default: actual's); NaN must match NaN."""
    tol = dict(TOL[dtype or actual.dtype])
    tol.update(kw)
    torch.testing.assert_close(actual.double(), expected.double(), equal_nan=True, check_dtype=False, **tol)


def softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Float64 softmax."""
    return torch.softmax(x.double(), dim)


def softmax_grad_ref(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Float64 softmax backward over the last dim: ``y * (dy - sum(dy * y))``, ``y`` the output, ``dy`` its
    gradient."""
    y, dy = y.double(), dy.double()
    return y * (dy - (y * dy).sum(-1, keepdim=True))


def masked_softmax_ref(x, mask=None, scale=None, causal=False) -> torch.Tensor:
    """Float64 masked softmax over the last dim, built from masked_fill + torch.softmax; empty rows give 0."""
    s = x.double() * (1.0 if scale is None else scale)
    lq, lk = s.shape[-2:]
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        keep = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    if mask is not None:
        if mask.dtype == torch.bool:
            keep = keep & mask
        else:
            s = s + mask.double()
    keep = torch.broadcast_to(keep, s.shape)
    y = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.nan_to_num(y, nan=0.0)


def attention_ref(q, k, v, causal=False, scale=None, attn_mask=None, dtype=torch.float64, return_lse=False):
    """Attention computed as softmax(q k^T * scale + mask) v in ``dtype`` (float64 for the reference,
    the input dtype for PyTorch's own error). GQA by repeating K/V heads; empty rows give 0."""
    h, h_kv = q.shape[1], k.shape[1]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if h != h_kv:
        k = k.repeat_interleave(h // h_kv, dim=1)
        v = v.repeat_interleave(h // h_kv, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)).float() * scale if dtype != torch.float64 else (q @ k.transpose(-1, -2)) * scale
    lq, lk = s.shape[-2:]
    keep = torch.ones(lq, lk, dtype=torch.bool, device=s.device)  # on the inputs' device: also a GPU reference
    if causal:
        keep = keep.tril(diagonal=lk - lq)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = keep & attn_mask
        else:
            s = s + attn_mask.to(s.dtype)
    keep = torch.broadcast_to(keep, s.shape)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    out = p.to(v.dtype) @ v
    return (out, lse) if return_lse else out


def assert_attention_close(out, ref64, out_torch, dtype) -> None:
    """FlashAttention's rule: max|out - ref64| <= 2 * max|out_torch - ref64| + floor."""
    err = (out.double() - ref64).abs().max().item()
    torch_err = (out_torch.double() - ref64).abs().max().item()
    bound = 2 * torch_err + ATTN_ATOL[dtype]
    assert not math.isnan(err), "NaN in output"
    assert err <= bound, f"max error {err:.3e} > 2 x torch's {torch_err:.3e} + {ATTN_ATOL[dtype]:.0e}"
