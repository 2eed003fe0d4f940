"""Attention's backward on the GPU (``pytest -m gpu``): dq, dk, dv and a float mask's gradient under masks.

tests/test_gpu_attention.py runs FlashAttention's matrix of unmasked calls
(head dims 32..256, MHA/GQA/MQA, causal and not). Here: the masks, each on the
Triton backward (``flashlite.attention.backward``, which the tests check is the
one that runs): a key-padding mask (B, 1, 1, Lk), a full boolean mask and a full
additive mask whose own gradient is checked too (B = 2, H = 4, Lq = 700,
Lk = 900), at D = 64 and 128 in fp16 and bf16, causal and not, and at the
other head dims (16; 80, 96, 160 and 192, padded on chip; 256), most with GQA;
then gradients through the returned LSE. Every gradient meets FlashAttention's
rule: error <= 2x PyTorch's own in the input dtype, plus a floor
(``tests.utils.assert_attention_close``); outputs are allocated from poisoned
memory.

The first GPU run of these checks (H100, Triton 3.6) found dk wrong: a
miscompile with 2 pipeline stages when the kernel scaled the Q tile it also fed
to a dot; scores are now scaled in fp32 after the dot
(bench/results/h200/TUNING.md#backward-dk-miscompile).
"""

from __future__ import annotations

import pytest
import torch

import flashlite
from flashlite.attention import backward, tuning

from .utils import assert_attention_close, attention_ref, poison

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
MASK_KINDS = ("key_padding", "bool", "additive")

# (dtype, head dim, causal, mask kind, K/V heads) with B = 2, H = 4, Lq = 700, Lk = 900.
CASES = [
    (BF16, 64, False, "key_padding", 4),
    (BF16, 64, True, "additive", 4),  # the additive mask's gradient: a δ pass over the keys, dS stored
    (BF16, 128, True, "bool", 4),
    (BF16, 128, False, "additive", 4),
    (FP16, 64, True, "bool", 2),
    (FP16, 128, True, "additive", 2),
    (FP16, 128, False, "key_padding", 2),
    (BF16, 16, False, None, 4),  # the smallest head dim (not in test_gpu_attention's matrix)
    (BF16, 16, False, "additive", 2),
    (BF16, 80, True, "bool", 2),  # head dims padded on chip (EVEN_D off)
    (FP16, 96, True, "additive", 2),
    (BF16, 160, True, "key_padding", 2),
    (FP16, 192, False, "additive", 2),
    (BF16, 256, True, "additive", 2),
    (BF16, 256, False, "key_padding", 4),
]


def make_mask(kind: str | None, batch: int, heads: int, seqlen_q: int, seqlen_k: int, dtype: torch.dtype):
    """None, a (B, 1, 1, Lk) key-padding mask, a (B, H, Lq, Lk) boolean mask, or an additive one that requires grad."""
    if kind is None:
        return None
    if kind == "key_padding":
        return torch.rand(batch, 1, 1, seqlen_k, device="cuda") > 0.2
    if kind == "bool":
        return torch.rand(batch, heads, seqlen_q, seqlen_k, device="cuda") > 0.3
    return torch.randn(batch, heads, seqlen_q, seqlen_k, device="cuda", dtype=dtype).requires_grad_()


def out_and_grads_ref(q, k, v, mask, do, causal: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    """``[out, dq, dk, dv(, dmask)]`` by autograd of ``attention_ref`` in ``dtype`` (float64: the reference; the
    input dtype: PyTorch's own error)."""
    inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    if mask is not None and mask.requires_grad:
        inputs.append(mask.detach().to(dtype).requires_grad_())
        out = attention_ref(*inputs[:3], causal=causal, attn_mask=inputs[3], dtype=dtype)
    else:
        out = attention_ref(*inputs, causal=causal, attn_mask=mask, dtype=dtype)
    return [out, *torch.autograd.grad(out, inputs, do.to(dtype))]


@pytest.mark.parametrize("dtype,head_dim,causal,kind,kv_heads", CASES,
                         ids=[f"{str(c[0])[6:]}-D{c[1]}-{'causal' if c[2] else 'full'}-{c[3]}-Hkv{c[4]}"
                              for c in CASES])
def test_backward_under_masks(dtype, head_dim, causal, kind, kv_heads):
    batch, heads, seqlen_q, seqlen_k = 2, 4, 700, 900
    q = torch.randn(batch, heads, seqlen_q, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, seqlen_k, head_dim, device="cuda", dtype=dtype, requires_grad=True)
            for _ in range(2))
    mask = make_mask(kind, batch, heads, seqlen_q, seqlen_k, dtype)
    assert backward.triton_backward_enabled(q), "the Triton backward is off for this call: nothing of it is tested"
    do = torch.randn_like(q)
    inputs = (q, k, v, mask) if mask is not None and mask.requires_grad else (q, k, v)
    poison()
    out = flashlite.flash_attention(q, k, v, causal=causal, attn_mask=mask)
    poison()
    mine = [out, *torch.autograd.grad(out, inputs, do)]
    failures = []
    ref64 = out_and_grads_ref(q, k, v, mask, do, causal, torch.float64)
    low = out_and_grads_ref(q, k, v, mask, do, causal, dtype)
    for name, g, r, t in zip(("out", "dq", "dk", "dv", "dmask"), mine, ref64, low):
        try:
            assert g.shape == r.shape, f"shape {tuple(g.shape)}, expected {tuple(r.shape)}"
            assert_attention_close(g, r, t, dtype)
        except AssertionError as err:
            failures.append(f"{name}: {err}")
    assert not failures, "\n".join(failures)


def test_backward_through_lse():
    # Gradients of a loss on both outputs, o and the LSE (returned with return_lse): causal and unmasked, and under
    # an additive mask (whose backward keeps each row's (m, log d) apart).
    head_dim, dtype = 128, BF16
    batch, heads, seqlen_q, seqlen_k = 2, 4, 500, 777
    failures = []
    for causal, kind in ((True, None), (False, "additive")):
        q = torch.randn(batch, heads, seqlen_q, head_dim, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(batch, heads, seqlen_k, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                for _ in range(2))
        mask = make_mask(kind, batch, heads, seqlen_q, seqlen_k, dtype)
        inputs = (q, k, v) if mask is None else (q, k, v, mask)
        poison()
        out, lse = flashlite.flash_attention(q, k, v, causal=causal, attn_mask=mask, return_lse=True)
        do, dlse = torch.randn_like(out), torch.randn_like(lse)
        poison()
        mine = torch.autograd.grad((out, lse), inputs, (do, dlse))
        refs = []
        for target in (torch.float64, dtype):
            ins = [t.detach().to(target).requires_grad_() for t in inputs]
            o, s = attention_ref(*ins[:3], causal=causal, attn_mask=ins[3] if mask is not None else None,
                                 dtype=target, return_lse=True)
            refs.append(torch.autograd.grad((o, s), ins, (do.to(target), dlse.to(s.dtype))))
        for name, g, r, t in zip(("dq", "dk", "dv", "dmask"), mine, *refs):
            try:
                assert_attention_close(g, r, t, dtype)
            except AssertionError as err:
                failures.append(f"causal={causal} mask={kind} {name}: {err}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("hopper", [True, False])
def test_backward_is_bitwise_repeatable(head_dim, hopper, monkeypatch):
    # Two passes, no atomic adds: runs give the same bits, on the Hopper kernels and on the tl ones.
    if not hopper:
        monkeypatch.setenv("FLASHLITE_WGMMA_BACKWARD", "0")
    q = torch.randn(2, 8, 1500, head_dim, device="cuda", dtype=BF16, requires_grad=True)
    k, v = (torch.randn(2, 2, 1700, head_dim, device="cuda", dtype=BF16, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    first, *others = [torch.autograd.grad(flashlite.flash_attention(q, k, v, causal=True), (q, k, v), do)
                      for _ in range(3)]
    for other in others:
        for name, a, b in zip(("dq", "dk", "dv"), first, other):
            assert torch.equal(a, b), f"{name} differs between runs"
