"""Logit softcapping (``flash_attention(..., softcap=)``, Gemma-2's) against float64, through the interpreter.

The scaled scores become ``c · tanh(s / c)`` before the masks, in every kernel's masked tiles (forward,
split-K/V, both backward kernels, whose dS goes back through ``1 - tanh²``). Tiles are forced to 16 x 16 so
that short sequences cross many of them. Checked: outputs, LSE and dq/dk/dv (FlashAttention's rule) on both
backward paths, causal and not, GQA, Lq != Lk, masks (boolean, additive with its gradient), fp16/bf16, a
negative scale, decoding, sinks, the PyTorch path, torch.compile's op, and bad arguments.
"""

import pytest
import torch

import flashlite
from flashlite.attention import api

from .utils import assert_attention_close, attention_ref, check_attention, randn

pytestmark = pytest.mark.usefixtures("small_attention_tiles")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq, lk, h_kv", [(33, 40, 2), (45, 20, 1), (1, 37, 4)])
def test_softcap_against_float64(causal, lq, lk, h_kv, backward_path):
    # Scores of a few units against a cap of 2: tanh far from linear, so a missing cap or a missing 1 - tanh²
    # in dS shows.
    q = randn(1, 4, lq, 32, scale=2.0, requires_grad=True)
    k, v = randn(1, h_kv, lk, 32, scale=2.0, requires_grad=True), randn(1, h_kv, lk, 32, requires_grad=True)
    check_attention(q, k, v, causal=causal, softcap=2.0)


def test_softcap_changes_the_result():
    q, k, v = (randn(1, 2, 20, 16, scale=3.0) for _ in range(3))
    plain = flashlite.flash_attention(q, k, v)
    capped = flashlite.flash_attention(q, k, v, softcap=1.0)
    assert (plain - capped).abs().max() > 0.05


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_softcap_low_precision(dtype):
    q, k, v = (randn(1, 2, 40, 64, dtype=dtype, scale=2.0, requires_grad=True) for _ in range(3))
    check_attention(q, k, v, causal=True, softcap=5.0)


def test_softcap_with_masks(backward_path):
    q, k, v = (randn(2, 2, 30, 16, scale=2.0, requires_grad=True) for _ in range(3))
    keep = torch.rand(2, 2, 30, 30) > 0.3
    check_attention(q, k, v, attn_mask=keep, softcap=3.0)
    bias = randn(2, 1, 30, 30, requires_grad=True)  # additive, with its own gradient (two passes, dS stored)
    check_attention(q, k, v, attn_mask=bias, softcap=3.0, causal=True)


def test_softcap_negative_scale():
    q, k, v = (randn(1, 2, 20, 16, scale=2.0, requires_grad=True) for _ in range(3))
    check_attention(q, k, v, scale=-0.4, softcap=1.5)


def test_softcap_decoding_and_sinks():
    q = randn(2, 4, 2, 32, scale=2.0)
    k, v = randn(2, 2, 70, 32, scale=2.0), randn(2, 2, 70, 32)
    lens = torch.tensor([70, 23])
    sinks = randn(4)
    out = flashlite.flash_attention(q, k, v, causal=True, cache_seqlens=lens, num_splits=3, softcap=2.5, sinks=sinks)
    for b, n in enumerate(lens.tolist()):
        args = (q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])
        kw = dict(causal=True, softcap=2.5, sinks=sinks)
        assert_attention_close(out[b:b + 1], attention_ref(*args, **kw), attention_ref(*args, dtype=q.dtype, **kw),
                               q.dtype)


def test_pytorch_path_agrees(monkeypatch):
    q, k, v = (randn(1, 2, 25, 16, scale=2.0, requires_grad=True) for _ in range(3))
    kernels = flashlite.flash_attention(q, k, v, causal=True, softcap=2.0)
    grads = torch.autograd.grad(kernels.sum(), (q, k, v))
    monkeypatch.setattr(api, "runs_kernels", lambda t: False)
    torch_path = flashlite.flash_attention(q, k, v, causal=True, softcap=2.0)
    torch.testing.assert_close(kernels, torch_path, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, torch.autograd.grad(torch_path.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_compiled_op_takes_softcap():
    q, k, v = (randn(1, 2, 20, 16, scale=2.0) for _ in range(3))
    o, lse, _ = torch.ops.flashlite.flash_attention(q, k, v, None, None, None, None, True, 0.25, 2.0, None, 1, True,
                                                   False)
    torch.testing.assert_close(o.double(), attention_ref(q, k, v, causal=True, scale=0.25, softcap=2.0),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap, error", [(0.0, ValueError), (-1.0, ValueError), (float("inf"), ValueError),
                                            (float("nan"), ValueError), (True, TypeError), ("30", TypeError)])
def test_bad_softcap(softcap, error):
    q = randn(1, 2, 5, 16)
    with pytest.raises(error, match="softcap"):
        flashlite.flash_attention(q, q, q, softcap=softcap)
