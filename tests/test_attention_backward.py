"""Gradients of flashlite.flash_attention against float64 autograd of the reference, through the interpreter.

Tiles are forced small (16 x 16 in both backward kernels, and in the forward)
so that lengths of 17 to 130 cross many query and key tiles: the dK/dV
kernel's skipped, diagonal and full query tiles, the dQ kernel's full and
masked key tiles, ragged last tiles on both sides. Tolerance, FlashAttention's
rule for each of dq, dk, dv: at most twice the error of the same gradient taken
by PyTorch autograd in the input dtype, plus a floor (``assert_attention_close``).
"""

import types

import pytest
import torch

from flashlite.core import runtime

from flashlite import flash_attention
from flashlite.attention import backward as fb
from flashlite.attention import tuning
from flashlite.attention.tuning import AttentionConfig, BackwardConfig

from .utils import assert_attention_close, attention_grads_ref as grads_ref, attention_ref, randn

TILES_16 = AttentionConfig(16, 16, 4, 1)
BWD_TILES_16 = BackwardConfig(TILES_16, TILES_16)
# dK/dV: 16 query rows against a 32-key tile (the diagonal spans three query tiles);
# dQ: 32 query rows against 16-key tiles (the diagonal spans three key tiles).
BWD_TILES_UNEVEN = BackwardConfig(AttentionConfig(16, 32, 4, 1), AttentionConfig(32, 16, 4, 1))


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(tuning, "INTERPRETER_CONFIG", TILES_16)
    monkeypatch.setattr(tuning, "BACKWARD_INTERPRETER_CONFIG", BWD_TILES_16)


def qkv(b, h, lq, lk, d, dtype=torch.float32, h_kv=None):
    h_kv = h if h_kv is None else h_kv
    return (randn(b, h, lq, d, dtype=dtype, requires_grad=True), randn(b, h_kv, lk, d, dtype=dtype, requires_grad=True),
            randn(b, h_kv, lk, d, dtype=dtype, requires_grad=True))


def check_grads(q, k, v, do=None, **kw):
    """Gradients of flash_attention within FlashAttention's tolerance of the float64 ones; returns them."""
    out = flash_attention(q, k, v, **kw)
    do = torch.randn_like(out) if do is None else do
    inputs = [q, k, v] + ([kw["attn_mask"]] if kw.get("attn_mask") is not None and kw["attn_mask"].requires_grad else [])
    grads = torch.autograd.grad(out, inputs, do)
    ref = grads_ref(q, k, v, do, **kw)
    low = grads_ref(q, k, v, do, dtype=q.dtype, **kw)
    for name, g, r, t, x in zip("q k v mask".split(), grads, ref, low, inputs):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert torch.isfinite(g).all(), f"d{name} not finite"
        assert_attention_close(g, r, t, q.dtype)
    return grads


# ----------------------------------------------------------------------------- lengths, causal


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "lq, lk",
    [
        (1, 1),  # a single ragged tile each way
        (17, 17),  # one full tile + a 1-row tail: every causal tile is a diagonal or ragged one
        (65, 65),  # 5 x 5 tiles: dK/dV skips the query tiles above the diagonal, dQ the key tiles right of it
        (100, 130),  # Lq < Lk: diagonal shifted right by 30; the first key tiles are seen whole by every query
        (130, 100),  # Lq > Lk: the first 30 queries see no key (LSE = -inf rows, zero gradients)
        (1, 65),  # decoding shape: one query over 5 key tiles
    ],
)
def test_lengths(lq, lk, causal, backward_path):
    check_grads(*qkv(1, 2, lq, lk, 32), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_uneven_tiles(monkeypatch, causal, backward_path):
    monkeypatch.setattr(tuning, "BACKWARD_INTERPRETER_CONFIG", BWD_TILES_UNEVEN)
    check_grads(*qkv(1, 2, 70, 45, 32), causal=causal)
    check_grads(*qkv(1, 2, 45, 70, 32), causal=causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision(dtype, causal, backward_path):
    # P and dS are rounded to the input dtype for the dots, as PyTorch's own low-precision chain does.
    check_grads(*qkv(1, 2, 65, 100, 64, dtype=dtype), causal=causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_large_scores(dtype):
    # Scores around +-16: the recomputed P must come from the same rounded q * scale as the forward's LSE.
    q, k, v = (randn(1, 2, 32, 64, dtype=dtype, scale=4.0, requires_grad=True) for _ in range(3))
    check_grads(q, k, v)


@pytest.mark.parametrize("head_dim", [16, 24, 64])  # 24: padded to a 32-wide tile, masked columns
def test_head_dims(head_dim):
    check_grads(*qkv(1, 2, 33, 40, head_dim), causal=True)


def test_default_interpreter_tiles(monkeypatch):
    monkeypatch.setattr(tuning, "BACKWARD_INTERPRETER_CONFIG", BackwardConfig(AttentionConfig(32, 32, 4, 1), AttentionConfig(32, 32, 4, 1)))
    check_grads(*qkv(1, 1, 70, 70, 32), causal=True)


# ----------------------------------------------------------------------------- GQA, layouts, determinism


@pytest.mark.parametrize("h_kv", [2, 1])  # GQA (2 query heads per K/V head) and MQA (4)
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query(h_kv, causal, backward_path):
    check_grads(*qkv(2, 4, 33, 50, 32, h_kv=h_kv), causal=causal)


def test_non_contiguous_inputs():
    # (B, L, H, D) tensors seen as (B, H, L, D), and a dO of the same layout: read through strides.
    b, l, h, d = 1, 30, 2, 24
    q, k, v = (randn(b, l, h, d, requires_grad=True).transpose(1, 2) for _ in range(3))
    do = randn(b, l, h, d).transpose(1, 2)
    dq, dk, dv = check_grads(q, k, v, do=do, causal=True)
    assert not dq.is_contiguous() or dq.shape[1] == 1  # in q's own memory order


def test_deterministic(backward_path):
    # Two passes: no atomics (dK/dV sum their GQA group in one program, dQ has its own pass): two runs, same
    # bits (tests/test_gpu_backward.py checks it on the GPU, where programs run concurrently).
    q, k, v = qkv(1, 4, 40, 50, 32, h_kv=1)
    do = torch.randn(1, 4, 40, 32)
    first = torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), do)
    second = torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), do)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mask_grad", [False, True])
def test_which_kernels_run(monkeypatch, mask_grad):
    # δ, the dK/dV kernel, then the dQ kernel; the additive mask's gradient replaces the δ kernel by a first walk
    # of the dQ kernel (DELTA_PASS: δ from the P the kernels recompute) before dK/dV.
    launched = []

    def spy(kernel, grid, args, **options):
        name = kernel.__name__ if hasattr(kernel, "__name__") else kernel.fn.__name__
        if name.startswith("_attention_bwd"):
            launched.append((name, options.get("DELTA_PASS")))
        return real(kernel, grid, args, **options)

    real = runtime.launch
    monkeypatch.setattr(runtime, "launch", spy)  # every planned launch (core.runtime.KernelLaunch) goes through it
    q, k, v = qkv(1, 2, 20, 24, 16)
    bias = randn(20, 24, requires_grad=mask_grad)
    check_grads(q, k, v, attn_mask=bias)
    first = ([("_attention_bwd_dq_kernel", True)] if mask_grad
             else [("_attention_bwd_preprocess_kernel", None)])
    assert launched == first + [("_attention_bwd_dkdv_kernel", None), ("_attention_bwd_dq_kernel", False)]


# ----------------------------------------------------------------------------- masks


@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_mask(causal):
    q, k, v = qkv(2, 2, 40, 50, 32)
    mask = (torch.arange(50)[None, :] < torch.tensor([50, 23])[:, None]).view(2, 1, 1, 50)  # MASK_PER_KEY
    check_grads(q, k, v, attn_mask=mask, causal=causal)


def test_full_bool_mask(backward_path):
    q, k, v = qkv(1, 2, 33, 40, 32, dtype=torch.float16)
    check_grads(q, k, v, attn_mask=torch.rand(1, 2, 33, 40) > 0.3, causal=True)


def test_additive_mask_without_grad():
    q, k, v = qkv(2, 2, 33, 40, 32)
    check_grads(q, k, v, attn_mask=randn(33, 40, scale=2.0))  # (Lq, Lk): broadcast over batch and heads


@pytest.mark.parametrize("shape", [(2, 1, 1, 40), (2, 33, 40)], ids=["key-padding", "per-query"])
def test_additive_mask_gradient(shape):
    # d(bias) = dS, summed by autograd over the mask's broadcast dims (batch/heads here).
    q, k, v = qkv(2, 2, 33, 40, 32)
    bias = randn(*shape, scale=2.0, requires_grad=True)
    check_grads(q, k, v, attn_mask=bias, causal=True)


def test_fully_masked_rows():
    q, k, v = qkv(1, 2, 33, 40, 32)
    mask = torch.rand(1, 2, 33, 40) > 0.5
    mask[:, :, 5] = False  # one row sees nothing
    mask[:, 1, 16:32] = False  # a whole query tile of head 1 sees nothing
    check_grads(q, k, v, attn_mask=mask)
    # An additive -inf row: the float64 reference is NaN there (softmax of -inf), so compare against the
    # reference with that row unmasked and its dO zeroed: an empty row's output is constant 0.
    bias = torch.zeros(1, 2, 33, 40)
    bias[:, :, 7] = float("-inf")
    out = flash_attention(q, k, v, attn_mask=bias)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    do_ref = do.clone()
    do_ref[:, :, 7] = 0
    ref = grads_ref(q, k, v, do_ref, attn_mask=torch.zeros(1, 2, 33, 40))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- LSE, errors


def test_lse_gradient(backward_path):
    # A loss on the returned LSE: d lse_i / d s_ij = P_ij, folded into δ.
    q, k, v = qkv(1, 2, 40, 33, 32)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    do, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out, lse), (q, k, v), (do, dlse))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = attention_ref(q64, k64, v64, causal=True, return_lse=True)
    dlse64 = dlse.double().masked_fill(torch.isinf(lse64), 0.0)  # rows with no key: lse = -inf, no gradient
    ref = torch.autograd.grad((out64, lse64), (q64, k64, v64), (do.double(), dlse64))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=1e-5)


def test_grad_of_q_only():
    # Only q requires grad: the forward still saves LSE, and autograd asks for dq alone.
    q, k, v = qkv(1, 2, 5, 7, 16)
    k, v = k.detach(), v.detach()
    out = flash_attention(q, k, v)
    do = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, q, do)
    assert_attention_close(dq, grads_ref(q, k, v, do)[0], grads_ref(q, k, v, do, dtype=q.dtype)[0], q.dtype)


def test_split_kv_backward_raises():
    q, k, v = qkv(1, 2, 3, 40, 16)
    out = flash_attention(q, k, v, num_splits=2)
    with pytest.raises(NotImplementedError, match="num_splits > 1 or cache_seqlens"):
        out.sum().backward()


def test_which_backward_runs(monkeypatch):
    # The kernels run off CUDA (the interpreter) and for CUDA fp16/bf16, masked or not; CUDA fp32 (not checked
    # on a GPU) and every CUDA dtype with the switch off take the PyTorch stand-in. Stand-ins for CUDA tensors: no GPU here.
    def cuda_like(dtype):
        return types.SimpleNamespace(is_cuda=True, dtype=dtype)

    assert fb.triton_backward_enabled(torch.zeros(1))
    assert fb.triton_backward_enabled(cuda_like(torch.bfloat16)) and fb.triton_backward_enabled(cuda_like(torch.float16))
    assert not fb.triton_backward_enabled(cuda_like(torch.float32))
    monkeypatch.setattr(fb, "TRITON_BACKWARD_ON_GPU", False)
    assert not fb.triton_backward_enabled(cuda_like(torch.bfloat16))
    assert fb.triton_backward_enabled(torch.zeros(1))


@pytest.mark.parametrize("causal", [False, True])
def test_pytorch_stand_in(monkeypatch, causal):
    # CUDA fp32's backward (and every dtype's with TRITON_BACKWARD_ON_GPU off): the same gradients (GQA, an
    # additive mask with its gradient, a gradient through lse), checked here by switching the kernels off on CPU.
    monkeypatch.setattr(fb, "triton_backward_enabled", lambda q, packed=False: False)
    q, k, v = qkv(2, 4, 17, 40, 32, h_kv=2)
    bias = randn(2, 1, 1, 40, requires_grad=True)
    check_grads(q, k, v, attn_mask=bias, causal=causal)
    keep = torch.rand(2, 4, 17, 40) < 0.7
    check_grads(q, k, v, attn_mask=keep, causal=causal)
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    grads = torch.autograd.grad(lse.sum(), (q, k))
    ref = torch.autograd.grad(attention_ref(q, k, v, causal=causal, return_lse=True)[1].sum(), (q, k))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g.double(), r.double(), atol=1e-5, rtol=1e-4)


def test_no_keys_gradient():
    # Lk = 0: every row is empty, the output zeros, and it stays differentiable (gradient 0, not an error).
    q = randn(1, 2, 3, 16, requires_grad=True)
    k, v = randn(1, 2, 0, 16), randn(1, 2, 0, 16)
    out = flash_attention(q, k, v)
    assert out.requires_grad and (out == 0).all()
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert (dq == 0).all()
