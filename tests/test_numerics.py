"""The numerical contract: scores in fp32, PyTorch's answers on special values, the same answer on both paths.

Each case here was a defect: scores rounded to the input dtype before the
softmax (errors up to ~30x PyTorch's), a PyTorch fallback that returned Lk times
the output under a bias of -1e9, ``logsumexp`` of ``+inf`` giving NaN, NaN
gradients at hidden positions of a NaN row, noise in the gradient of a
row-broadcast bias, and arguments accepted that should have been refused.
References are float64; attention follows FlashAttention's rule (at most twice
PyTorch's own error in the input dtype, plus a floor).
"""

import contextlib
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import flashlite
from flashlite.core.runtime import pytorch_path, runs_kernels

from .utils import assert_attention_close, attention_grads_ref, attention_ref, randn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _qkv(b, h, lq, lk, d, dtype, h_kv=None, requires_grad=False):
    h_kv = h if h_kv is None else h_kv
    return (randn(b, h, lq, d, dtype=dtype, requires_grad=requires_grad),
            randn(b, h_kv, lk, d, dtype=dtype, requires_grad=requires_grad),
            randn(b, h_kv, lk, d, dtype=dtype, requires_grad=requires_grad))


# ----------------------------------------------------------------------------- 1. scores in fp32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_issue_example_lse_in_fp32(dtype):
    # fp16, B = 1, H = 2, Lq = Lk = 1, D = 160, scale 1.0: the LSE was 2.45e-3 off (PyTorch's own error 7.9e-5),
    # from q * scale * log2(e) rounded to fp16 before the dot. Scores in fp32: fp32 rounding of the LSE.
    q, k, v = _qkv(1, 2, 1, 1, 160, dtype)
    out, lse = flashlite.flash_attention(q, k, v, scale=1.0, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, scale=1.0, return_lse=True)
    assert ((lse.double() - ref_lse).abs() <= 1e-4 * ref_lse.abs().clamp_min(1.0)).all()
    assert_attention_close(out, ref, attention_ref(q, k, v, scale=1.0, dtype=dtype), dtype)


# Every head dim class: powers of two, padded non-powers (40, 59, 111, 224), and the largest.
HEAD_DIMS = [16, 32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_head_dim_within_the_rule(head_dim, dtype):
    # Output, LSE (fp32 rounding) and dq/dk/dv within FlashAttention's rule, at a large scale where rounded
    # scores showed most (the scores of random inputs are ~sqrt(D) here).
    causal = head_dim % 2 == 1
    q, k, v = _qkv(1, 2, 37, 45, head_dim, dtype, h_kv=1, requires_grad=True)
    kw = dict(scale=0.5, causal=causal)
    out, lse = flashlite.flash_attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse = attention_ref(q, k, v, return_lse=True, **kw)
    assert_attention_close(out, ref, attention_ref(q, k, v, dtype=dtype, **kw), dtype)
    finite = torch.isfinite(ref_lse)
    assert ((lse.double() - ref_lse)[finite].abs() <= 1e-4 * ref_lse[finite].abs().clamp_min(1.0)).all()
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    for g, r, t in zip(grads, attention_grads_ref(q, k, v, do, **kw), attention_grads_ref(q, k, v, do, dtype=dtype, **kw)):
        assert_attention_close(g, r, t, dtype)


@pytest.mark.parametrize("scale", [-0.3, 0.0])
def test_negative_and_zero_scale(scale):
    # A negative scale runs as -q with |scale| (exact); 0 makes every visible key weigh the same.
    q, k, v = _qkv(2, 2, 20, 33, 32, torch.bfloat16, requires_grad=True)
    for causal in (False, True):
        out = flashlite.flash_attention(q, k, v, scale=scale, causal=causal)
        ref = attention_ref(q, k, v, scale=scale, causal=causal)
        assert_attention_close(out, ref, attention_ref(q, k, v, scale=scale, causal=causal, dtype=q.dtype), q.dtype)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
        kw = dict(scale=scale, causal=causal)
        for g, r, t in zip(grads, attention_grads_ref(q, k, v, do, **kw),
                           attention_grads_ref(q, k, v, do, dtype=q.dtype, **kw)):
            assert_attention_close(g, r, t, q.dtype)


def test_fp16_huge_scale():
    # scale = 1e30 made fp16 all NaN (q * scale overflowed fp16); applied in fp32 it is one-hot attention.
    q, k, v = _qkv(1, 2, 9, 13, 32, torch.float16)
    out = flashlite.flash_attention(q, k, v, scale=1e30)
    ref = attention_ref(q.float(), k.float(), v.float(), scale=1e30)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=0)


def test_split_kv_and_trace_scale_in_fp32():
    # The decoding kernel and the study trace make their scores as the forward kernel does.
    q, k, v = _qkv(2, 4, 3, 70, 160, torch.float16, h_kv=2)
    out, lse = flashlite.flash_attention(q, k, v, scale=1.0, num_splits=3, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, scale=1.0, return_lse=True)
    assert (lse.double() - ref_lse).abs().max() <= 1e-4 * ref_lse.abs().max()
    assert_attention_close(out, ref, attention_ref(q, k, v, scale=1.0, dtype=q.dtype), q.dtype)
    trace = flashlite.study.trace_attention(q[0, 0], k[0, 0], v[0, 0], scale=-0.7)
    assert flashlite.study.check_trace(trace)["m"] < 2e-5


# ----------------------------------------------------------------------------- 2. one contract, every path


def _sdpa(q, k, v, bias, do, dtype):
    """SDPA's output and dq, dk, dv by its math backend in ``dtype`` from the same inputs (the bias in its own
    dtype). Its CPU flash backend recomputes P from the LSE in its backward and has the very defect tested here
    (fp32, -1e9: dq off by 10)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*inputs, attn_mask=bias.to(dtype) if dtype == torch.float32 else bias)
    return (out, *torch.autograd.grad(out, inputs, do.to(dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias_value", ["-1e9", "finfo.min"])
def test_rows_hidden_by_a_huge_finite_bias(dtype, bias_value):
    # Every key of a row carries -1e9 (an fp32 bias) or finfo(dtype).min (one in q's dtype): SDPA averages
    # that row's values (the scores are lost to the bias's rounding). The fallback returned Lk times that (it
    # subtracted an LSE that had lost log d), the kernels zeros (finfo.min * log2(e) overflowed to -inf), and
    # the gradients of such rows were off by the key count. Reference: SDPA in fp32 on the same inputs (in
    # float64 the scores would survive the bias); bound: FlashAttention's rule against SDPA in the input dtype.
    q, k, v = _qkv(2, 2, 6, 11, 32, dtype, requires_grad=True)
    bias = randn(2, 1, 6, 11, dtype=torch.float32 if bias_value == "-1e9" else dtype)
    big = -1e9 if bias_value == "-1e9" else torch.finfo(dtype).min
    bias[:, :, 1] = big
    bias[0, :, 4] = big
    do = torch.randn(2, 2, 6, 32)
    ref = [t.double() for t in _sdpa(q, k, v, bias, do, torch.float32)]
    low = _sdpa(q, k, v, bias, do, dtype)
    for path in ("kernels", "pytorch"):
        with pytorch_path() if path == "pytorch" else contextlib.nullcontext():
            out = flashlite.flash_attention(q, k, v, attn_mask=bias)
            grads = torch.autograd.grad(out, (q, k, v), do.to(dtype))
        for mine, r, t in zip((out, *grads), ref, low):
            assert_attention_close(mine, r, t, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_broadcast_bias_gradient_is_zero(dtype):
    # A bias (B, 1, Lq, 1) shifts whole rows: softmax ignores it, so its gradient is exactly 0. It was up to
    # 3e-2 in bf16 (δ from the output rounded to bf16); now δ comes from the backward's own P and the
    # gradient is summed in fp32 before its rounding.
    q, k, v = _qkv(2, 2, 40, 50, 32, dtype)
    bias = randn(2, 1, 40, 1, dtype=dtype, requires_grad=True)
    out = flashlite.flash_attention(q, k, v, attn_mask=bias, causal=True)
    (grad,) = torch.autograd.grad(out, bias, torch.randn_like(out))
    assert grad.abs().max() <= 1e-5


@pytest.mark.parametrize("row", [
    [math.inf, 1.0, 2.0], [math.inf, math.inf, 2.0], [-math.inf, -math.inf], [math.nan, 1.0],
    [math.inf, -math.inf, 1.0], [math.inf, math.nan], [3.0, -math.inf, 1.0],
])
def test_logsumexp_and_softmax_special_rows_match_torch(row):
    # torch.logsumexp of a row with +inf is +inf, its gradient NaN at the +inf entries and 0 elsewhere.
    for path in ("kernels", "pytorch"):
        x = torch.tensor([row, [0.5, 0.25, -1.0][:len(row)]], requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        with pytorch_path() if path == "pytorch" else contextlib.nullcontext():
            lse = flashlite.logsumexp(x, -1)
            y = flashlite.softmax(x.detach(), -1)
        ref = torch.logsumexp(x_ref, -1)
        torch.testing.assert_close(lse, ref, equal_nan=True)
        lse.sum().backward()
        ref.sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, equal_nan=True)
        torch.testing.assert_close(y, torch.softmax(x.detach(), -1), equal_nan=True)


def test_masked_softmax_nan_row_gradient():
    # A NaN in a visible score: the row's visible weights and gradients are NaN; hidden positions are exactly 0,
    # and their gradient is 0, as through torch's masked_fill.
    x = randn(2, 3, 5, requires_grad=True)
    with torch.no_grad():
        x[0, 1, 2] = math.nan
    keep = torch.rand(2, 3, 5) > 0.4
    keep[0, 1, 2] = True
    dy = torch.randn(2, 3, 5)
    x_ref = x.detach().clone().requires_grad_()
    s = x_ref.masked_fill(~keep, -math.inf)
    torch.softmax(s, -1).backward(dy)
    for path in ("kernels", "pytorch"):
        x.grad = None
        with pytorch_path() if path == "pytorch" else contextlib.nullcontext():
            y = flashlite.masked_softmax(x, keep)
        y.backward(dy)
        assert (y[~keep] == 0).all() and (x.grad[~keep] == 0).all(), path
        torch.testing.assert_close(x.grad[keep], x_ref.grad[keep], equal_nan=True)


@pytest.mark.parametrize("special", [math.nan, math.inf])
def test_masked_softmax_special_row_with_underflowing_weights(special):
    # A row holding NaN or +inf, and a visible score whose weight under the row's maximum underflows to 0: torch
    # gives NaN at every visible position, flashlite too; hidden positions stay exactly 0 (the forward stores
    # 0 · NaN there, masked_softmax._zero_hidden_kernel zeroes them). The other rows are untouched.
    x = randn(3, 8, 8)
    x[1, 2, :4] = torch.tensor([1000.0, -1000.0, special, 0.0])
    keep = torch.ones(8, dtype=torch.bool)
    keep[5:] = False
    for path in ("kernels", "pytorch"):
        with pytorch_path() if path == "pytorch" else contextlib.nullcontext():
            y = flashlite.masked_softmax(x, keep)
        assert torch.isnan(y[1, 2, :5]).all() and (y[1, 2, 5:] == 0).all(), path
        others = torch.ones(3, 8, dtype=torch.bool)
        others[1, 2] = False
        torch.testing.assert_close(y[others], torch.softmax(x.masked_fill(~keep, -math.inf), -1)[others])


@pytest.mark.parametrize("algorithm", ["fused", "online"])
@pytest.mark.parametrize("causal", [False, True])
def test_masked_softmax_nonfinite_dy_at_hidden_positions(algorithm, causal):
    # Finite scores, an inf in dy at a hidden position: the row's sum y·dy is NaN (0 · inf), so its visible
    # gradients are NaN as through torch; the hidden positions' gradient stays exactly 0 (the kernels zero them
    # only in rows whose sum is not finite, masked_softmax._any_nonfinite), on both paths and both regimes.
    x = randn(2, 3, 6, 6, requires_grad=True)
    keep = torch.rand(2, 1, 6, 6) > 0.3
    keep[..., 0] = True
    future = torch.ones(6, 6).triu(1).bool() if causal else torch.zeros(6, 6, dtype=torch.bool)
    hidden = ~keep.expand(2, 3, 6, 6) | future
    dy = torch.randn(2, 3, 6, 6)
    # inf at every position the mask hides in one (batch, head); not past the diagonal, whose dy the kernels
    # never read (masked_softmax._visible_y_dy: the forward never looked there), where torch's sum takes 0 · inf
    dy[0, 1][hidden[0, 1] & ~future] = math.inf
    x_ref = x.detach().clone().requires_grad_()
    torch.softmax(x_ref.masked_fill(hidden, -math.inf), -1).backward(dy)
    for path in ("kernels", "pytorch"):
        x.grad = None
        with pytorch_path() if path == "pytorch" else contextlib.nullcontext():
            y = flashlite.masked_softmax(x, keep, causal=causal, algorithm=algorithm)
        y.backward(dy)
        assert (x.grad[hidden] == 0).all(), path
        assert torch.isnan(x.grad[0, 1]).any(), path  # rows with a hidden position: NaN where visible
        torch.testing.assert_close(x.grad[~hidden], x_ref.grad[~hidden], equal_nan=True)


# ----------------------------------------------------------------------------- 3. input validation


ATTENTION_ARGS = dict(q=randn(1, 2, 3, 16), k=randn(1, 2, 4, 16), v=randn(1, 2, 4, 16))


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(scale=math.nan), ValueError, "scale must be finite"),
    (dict(scale=math.inf), ValueError, "scale must be finite"),
    (dict(scale=-math.inf), ValueError, "scale must be finite"),
    (dict(scale=1e39), ValueError, r"scale=1e\+39 is too large"),
    (dict(scale=torch.tensor(0.5)), TypeError, "scale must be a real number"),
    (dict(causal="no"), TypeError, "causal must be a bool"),
    (dict(causal=None), TypeError, "causal must be a bool"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(return_lse="yes"), TypeError, "return_lse must be a bool"),
])
def test_attention_arguments_refused(kwargs, error, words):
    for path in ("kernels", "pytorch"):
        with pytorch_path() if path == "pytorch" else contextlib.nullcontext():
            with pytest.raises(error, match=words):
                flashlite.flash_attention(*ATTENTION_ARGS.values(), **kwargs)


@pytest.mark.parametrize("dim", ["1", None, (0,), 1.0, True])
def test_dim_must_be_an_int(dim):
    x = randn(3, 4)
    for path in ("kernels", "pytorch"):
        with pytorch_path() if path == "pytorch" else contextlib.nullcontext():
            for op in (flashlite.softmax, flashlite.logsumexp):
                with pytest.raises(TypeError, match="dim must be an int"):
                    op(x, dim)
            with pytest.raises(TypeError, match="dim must be an int"):
                flashlite.masked_softmax(x, dim=dim)


def test_flags_of_the_layer_and_masked_softmax():
    with pytest.raises(TypeError, match="causal must be a bool"):
        flashlite.masked_softmax(randn(2, 3, 3), causal="no")
    with pytest.raises(TypeError, match="causal must be a bool"):
        flashlite.nn.MultiheadAttention(32, 2, causal=None)
    with pytest.raises(TypeError, match="bias must be a bool"):
        flashlite.nn.MultiheadAttention(32, 2, bias="yes")
    with pytest.raises(ValueError, match="scale must be finite"):
        flashlite.masked_softmax(randn(2, 3, 3), scale=math.nan)


def test_numpy_warnings_stay_inside():
    # Empty rows make the interpreter compute log2(0) and 0/0 in lanes it then drops: no warning may reach
    # the caller (flashlite silences numpy only around its own launches).
    q, k, v = _qkv(1, 2, 8, 8, 16, torch.float32)
    mask = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = flashlite.flash_attention(q, k, v, attn_mask=mask)
        flashlite.masked_softmax(randn(4, 6), torch.zeros(4, 6, dtype=torch.bool))
        flashlite.softmax(torch.full((2, 5), -math.inf))
    assert (out == 0).all()
    import numpy as np
    assert np.geterr()["divide"] == "warn"  # numpy's own state is left as it was


def test_interpreter_switched_on_after_import():
    # TRITON_INTERPRET=1 set after importing flashlite (a notebook habit) crashed deep inside; now CPU tensors
    # take the PyTorch path, with a warning that says how to run the kernels.
    code = (
        "import os, warnings, torch, flashlite\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "x = torch.randn(3, 7)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    y = flashlite.softmax(x)\n"
        "    o = flashlite.flash_attention(*(torch.randn(1, 1, 4, 16) for _ in range(3)))\n"
        "assert torch.allclose(y, torch.softmax(x, -1)) and o.shape == (1, 1, 4, 16)\n"
        "assert any('TRITON_INTERPRET' in str(m.message) for m in w), [str(m.message) for m in w]\n"
        "print('ok')\n"
    )
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_fallback_matches_kernels_on_the_gqa_layer():
    # The layer on both paths, GQA and a key-padding mask: the same answer within fp32 rounding.
    layer = flashlite.nn.MultiheadAttention(64, 4, num_kv_heads=2, causal=True)
    x = randn(2, 9, 64)
    keep = torch.rand(2, 9) > 0.3
    keep[:, 0] = True
    out = layer(x, key_padding_mask=keep)
    with pytorch_path():
        ref = layer(x, key_padding_mask=keep)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert runs_kernels(x)
