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
@pytest.mark.parametrize("mode", ["default", "deterministic_one_pass"])
def test_backward_is_bitwise_repeatable(head_dim, hopper, mode, monkeypatch):
    # The default backward runs two passes, no atomic adds; so does a call under torch.use_deterministic_algorithms
    # where the Hopper kernels' one pass (dQ by TMA reductions) is asked for: runs give the same bits, on the
    # Hopper kernels and on the tl ones.
    from flashlite.attention import api

    if mode == "deterministic_one_pass":
        monkeypatch.setenv("FLASHLITE_BACKWARD_ONE_PASS", "1")
    if not hopper:
        monkeypatch.setenv("FLASHLITE_WGMMA_BACKWARD", "0")
    api.clear_routes()
    q = torch.randn(2, 8, 1500, head_dim, device="cuda", dtype=BF16, requires_grad=True)
    k, v = (torch.randn(2, 2, 1700, head_dim, device="cuda", dtype=BF16, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(mode == "deterministic_one_pass")
    try:
        first, *others = [torch.autograd.grad(flashlite.flash_attention(q, k, v, causal=True), (q, k, v), do)
                          for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(previous)
    for other in others:
        for name, a, b in zip(("dq", "dk", "dv"), first, other):
            assert torch.equal(a, b), f"{name} differs between runs"


# The Hopper backward's one pass (FLASHLITE_BACKWARD_ONE_PASS=1: two key tiles a program, dQ added by TMA
# reductions): lengths that cut the program's second key tile and the last query tile, GQA, Dv != D, and each
# variant; the kernel that ran is recorded (``TmaLaunch`` spied on as the plans build it).
ONE_PASS_CASES = [
    dict(lq=1000, lk=1100, h=(8, 2), d=(64, 64), kw=dict(causal=False)),
    dict(lq=1000, lk=1100, h=(8, 2), d=(128, 128), kw=dict(causal=True)),
    dict(lq=333, lk=197, h=(4, 4), d=(128, 64), kw=dict(causal=True)),
    dict(lq=700, lk=700, h=(6, 1), d=(96, 96), kw=dict(causal=False, window_size=(100, 37))),
    dict(lq=513, lk=700, h=(4, 2), d=(64, 64), kw=dict(causal=True, softcap=20.0)),
    dict(lq=640, lk=640, h=(4, 4), d=(128, 128), kw=dict(causal=False, alibi=True)),
    dict(lq=64, lk=65, h=(2, 2), d=(32, 32), kw=dict(causal=False)),
    dict(lq=300, lk=450, h=(4, 2), d=(64, 128), kw=dict(causal=True)),  # (added after the 2026-12-02 GPU run)
]


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("case", ONE_PASS_CASES, ids=lambda c: f"{c['lq']}x{c['lk']}-d{c['d']}-{sorted(c['kw'])}")
def test_one_pass_backward_on_the_gpu(case, dtype, monkeypatch):
    from flashlite.attention import api, backward_hopper

    from .test_gpu_attention import check_output_and_grads, make
    from .test_gpu_decode import require_hopper

    require_hopper()
    ran = []

    class Spy(backward_hopper.TmaLaunch):
        def __call__(self, *args):
            ran.append(self.kernel.fn.__name__ if hasattr(self.kernel, "fn") else str(self.kernel))
            super().__call__(*args)

    monkeypatch.setattr(backward_hopper, "TmaLaunch", Spy)
    monkeypatch.setenv("FLASHLITE_BACKWARD_ONE_PASS", "1")
    api.clear_routes()
    (h, h_kv), (d, dv) = case["h"], case["d"]
    kw = dict(case["kw"])
    if kw.pop("alibi", False):
        from flashlite.nn import alibi_slopes

        kw["alibi_slopes"] = alibi_slopes(h).cuda()
    q = make(2, h, case["lq"], d, dtype, True)
    k, v = make(2, h_kv, case["lk"], d, dtype, True), make(2, h_kv, case["lk"], dv, dtype, True)
    check_output_and_grads(q, k, v, dtype, **kw)
    assert any("one_pass" in name for name in ran), f"the one-pass kernel did not run: {ran}"
    assert not any("dq_wgmma" in name for name in ran), f"the dQ pass ran: {ran}"
