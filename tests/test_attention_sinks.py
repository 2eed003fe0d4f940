"""Attention sinks (``flash_attention(..., sinks=)``, gpt-oss's ``s_aux``) against float64, through the interpreter.

The sink is one more logit per head in every row's softmax, with a zero value vector: every kernel merges its
state into its rows' final states (``core.online_softmax.merge_sink``; the split-K/V path after its splits),
and the backward takes its gradient from the rows' δ (``backward.sink_gradient``). Checked: outputs, LSE and the gradients of q,
k, v and the sinks (FlashAttention's rule), causal and not, GQA, Lq != Lk, rows that see no key (o = 0,
LSE = the sink), a boolean mask, decoding with a ragged cache, the PyTorch path, and bad arguments.
"""

import pytest
import torch

import flashlite
from flashlite.attention import api

from .utils import assert_attention_close, attention_grads_ref, attention_ref, randn

pytestmark = pytest.mark.usefixtures("small_attention_tiles")


def check(q, k, v, sinks, **kw):
    out, lse = flashlite.flash_attention(q, k, v, sinks=sinks, return_lse=True, **kw)
    ref, ref_lse = attention_ref(q, k, v, sinks=sinks.detach(), return_lse=True, **kw)
    assert_attention_close(out, ref, attention_ref(q, k, v, sinks=sinks.detach(), dtype=q.dtype, **kw), q.dtype)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    do = torch.randn_like(out)
    inputs = [t for t in (q, k, v, sinks) if t.requires_grad]
    grads = torch.autograd.grad(out, inputs, do)
    refs = attention_grads_ref(q, k, v, do, sinks=sinks, **kw)
    lows = attention_grads_ref(q, k, v, do, dtype=q.dtype, sinks=sinks, **kw)
    for g, r, t in zip(grads, refs, lows):
        assert torch.isfinite(g).all()
        assert_attention_close(g, r, t, q.dtype)
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq, lk, h_kv", [(33, 40, 4), (40, 33, 2), (1, 50, 1)])
def test_sinks_against_float64(causal, lq, lk, h_kv):
    q = randn(2, 4, lq, 32, requires_grad=True)
    k, v = randn(2, h_kv, lk, 32, requires_grad=True), randn(2, h_kv, lk, 32, requires_grad=True)
    sinks = randn(4, scale=2.0, requires_grad=True)
    check(q, k, v, sinks, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sinks_low_precision(dtype):
    q, k, v = (randn(1, 2, 30, 64, dtype=dtype, requires_grad=True) for _ in range(3))
    check(q, k, v, randn(2, requires_grad=True), causal=True)


def test_rows_that_see_no_key():
    # Lq > Lk under causal: the first rows see no key; with a sink their softmax is the sink alone: o = 0,
    # LSE = the sink, no gradient but the sink's own (1 - 1 = 0 for the output, the LSE's through dlse).
    q = randn(1, 2, 40, 16, requires_grad=True)
    k, v = randn(1, 2, 25, 16, requires_grad=True), randn(1, 2, 25, 16, requires_grad=True)
    sinks = torch.tensor([0.5, -3.0], requires_grad=True)
    out, lse = check(q, k, v, sinks, causal=True)
    assert (out[:, :, :15] == 0).all()
    assert torch.equal(lse[:, :, :15], sinks.detach().view(1, 2, 1).expand(1, 2, 15))
    hidden = torch.rand(1, 2, 40, 25) > 0.5
    hidden[:, :, 3] = False  # a row hidden by the mask
    check(q, k, v, sinks, attn_mask=hidden)


def test_decoding_with_sinks():
    # The split-K/V path (a ragged cache): the same merge after it.
    q = randn(2, 4, 1, 32)
    k, v = randn(2, 2, 90, 32), randn(2, 2, 90, 32)
    sinks = randn(4)
    lens = torch.tensor([90, 17])
    out, lse = flashlite.flash_attention(q, k, v, cache_seqlens=lens, num_splits=3, sinks=sinks, return_lse=True)
    for b, n in enumerate(lens.tolist()):
        args = (q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])
        ref, ref_lse = attention_ref(*args, sinks=sinks, return_lse=True)
        assert_attention_close(out[b:b + 1], ref, attention_ref(*args, sinks=sinks, dtype=q.dtype), q.dtype)
        torch.testing.assert_close(lse[b:b + 1].double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_pytorch_path_agrees(monkeypatch):
    q, k, v = (randn(1, 4, 20, 16, requires_grad=True) for _ in range(3))
    sinks = randn(4, requires_grad=True)
    kernels = flashlite.flash_attention(q, k, v, causal=True, sinks=sinks)
    monkeypatch.setattr(api, "runs_kernels", lambda t: False)
    torch_path = flashlite.flash_attention(q, k, v, causal=True, sinks=sinks)
    torch.testing.assert_close(kernels, torch_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sinks, error, match", [
    ([0.0, 1.0], TypeError, "sinks must be a tensor"),
    (torch.zeros(4, dtype=torch.int32), TypeError, "floating-point"),
    (torch.zeros(3), ValueError, r"shape \(H,\) = \(4,\)"),
    (torch.zeros(1, 4), ValueError, "shape"),
])
def test_bad_sinks(sinks, error, match):
    q = randn(1, 4, 5, 16)
    with pytest.raises(error, match=match):
        flashlite.flash_attention(q, q, q, sinks=sinks)
