"""Every public op on the same inputs through both paths: the Triton kernels (interpreter) and the PyTorch fallback.

Both answers, and their gradients, are compared with the float64 reference
and with each other: a difference is a bug in one of the paths (the fallback
once returned Lk times the output of a row hidden by a bias of -1e9).
"""

import math

import pytest
import torch

import flashlite
from flashlite.core.runtime import pytorch_path

from .utils import TOL, assert_close, attention_ref, masked_softmax_ref, randn, softmax_ref


def _key_padding(b: int, lk: int) -> torch.Tensor:
    keep = torch.rand(b, 1, 1, lk) > 0.3
    keep[..., 0] = True
    return keep


def _float_bias(*shape: int) -> torch.Tensor:
    bias = randn(*shape, requires_grad=False)
    bias.view(-1)[::7] = -1e9  # hidden by a huge finite value, not -inf
    return bias.requires_grad_()


def _mha_ref(layer, x, keep):
    """The layer's function in float64 from its own weights (key padding True = keep)."""
    w, bqkv = layer.qkv.weight.double(), layer.qkv.bias.double()
    qkv = x.double() @ w.t() + bqkv
    h, h_kv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q, k, v = qkv.split([h * d, h_kv * d, h_kv * d], dim=-1)
    q, k, v = (t.unflatten(-1, (n, d)).transpose(1, 2) for t, n in ((q, h), (k, h_kv), (v, h_kv)))
    o = attention_ref(q, k, v, causal=layer.causal, attn_mask=keep[:, None, None, :])
    return o.transpose(1, 2).flatten(2) @ layer.out_proj.weight.double().t() + layer.out_proj.bias.double()


def _cases() -> dict:
    """name -> (op, inputs that require grad or not, float64 reference of the op's output)."""
    cases = {}
    x = randn(5, 37, requires_grad=True)
    cases["softmax"] = (lambda x: flashlite.softmax(x, 0), [x], lambda x: softmax_ref(x, 0))
    cases["softmax_bf16_out"] = (lambda x: flashlite.softmax(x, -1, dtype=torch.bfloat16), [randn(4, 19)],
                                 lambda x: softmax_ref(x, -1))
    cases["logsumexp"] = (lambda x: flashlite.logsumexp(x, 1), [randn(4, 50, requires_grad=True)],
                          lambda x: torch.logsumexp(x.double(), 1))
    special = randn(3, 6, requires_grad=False)
    special[0, 2], special[1] = math.inf, -math.inf
    cases["logsumexp_special"] = (lambda x: flashlite.logsumexp(x, -1), [special],
                                  lambda x: torch.logsumexp(x.double(), -1))
    xs = randn(2, 3, 5, 9, requires_grad=True)
    keep = torch.rand(2, 1, 5, 9) > 0.4
    cases["masked_softmax_bool_causal"] = (
        lambda x: flashlite.masked_softmax(x, keep, scale=0.7, causal=True), [xs],
        lambda x: masked_softmax_ref(x, keep, scale=0.7, causal=True))
    bias = _float_bias(5, 9)
    cases["masked_softmax_bias"] = (
        lambda x, b: flashlite.masked_softmax(x, b, scale=-1.3), [randn(2, 3, 5, 9, requires_grad=True), bias],
        lambda x, b: masked_softmax_ref(x, b, scale=-1.3))
    q, k, v = randn(2, 4, 13, 32, requires_grad=True), randn(2, 2, 21, 32, requires_grad=True), randn(
        2, 2, 21, 32, requires_grad=True)
    cases["attention_gqa_causal"] = (lambda q, k, v: flashlite.flash_attention(q, k, v, causal=True), [q, k, v],
                                     lambda q, k, v: attention_ref(q, k, v, causal=True))
    kp = _key_padding(2, 21)
    cases["attention_key_padding_lse"] = (
        lambda q, k, v: flashlite.flash_attention(q, k, v, attn_mask=kp, return_lse=True)[1], [q, k, v],
        lambda q, k, v: attention_ref(q, k, v, attn_mask=kp, return_lse=True)[1])
    bias = _float_bias(2, 1, 13, 21)
    cases["attention_bias_grad"] = (
        lambda q, k, v, b: flashlite.flash_attention(q, k, v, attn_mask=b, scale=0.3), [q, k, v, bias],
        lambda q, k, v, b: attention_ref(q, k, v, attn_mask=b, scale=0.3))
    lens = torch.tensor([21, 6])
    cases["attention_decode_cache"] = (
        lambda q, k, v: flashlite.flash_attention(q, k, v, causal=True, cache_seqlens=lens, num_splits=3),
        [randn(2, 4, 2, 32), randn(2, 2, 21, 32), randn(2, 2, 21, 32)],
        lambda q, k, v: torch.cat([attention_ref(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n], causal=True)
                                   for i, n in enumerate(lens.tolist())]))
    layer = flashlite.nn.MultiheadAttention(64, 4, num_kv_heads=2, causal=True)
    keep_tokens = _key_padding(2, 9)[:, 0, 0]
    cases["mha_layer"] = (lambda x: layer(x, key_padding_mask=keep_tokens), [randn(2, 9, 64, requires_grad=True)],
                          lambda x: _mha_ref(layer, x, keep_tokens))
    return cases


CASES = list(_cases())


@pytest.mark.parametrize("case", CASES)
def test_both_paths_agree_with_the_reference(case):
    op, inputs, reference = _cases()[case]
    ref = reference(*[t.detach().double() for t in inputs])
    grad_inputs = [t for t in inputs if t.requires_grad]
    results = {}
    for path in ("kernels", "pytorch"):
        with pytorch_path() if path == "pytorch" else torch.enable_grad():
            out = op(*inputs)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
        grads = torch.autograd.grad(out, grad_inputs, dout, allow_unused=True) if grad_inputs else ()
        grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, grad_inputs)]  # v: lse ignores it
        results[path] = (out, grads)
        finite = torch.isfinite(ref)
        if case.startswith("attention") or case == "mha_layer":
            torch.testing.assert_close(out.double()[finite], ref[finite], atol=2e-5, rtol=1e-4)
        else:
            assert_close(out, ref, dtype=out.dtype)
        assert (out.isnan() == ref.isnan()).all() and (out[~finite] == ref[~finite]).all(), path
    (out_k, grads_k), (out_p, grads_p) = results["kernels"], results["pytorch"]
    torch.testing.assert_close(out_k, out_p, equal_nan=True, **TOL[out_k.dtype])
    for name, g_k, g_p, x in zip("abcd", grads_k, grads_p, grad_inputs):
        assert g_k.shape == x.shape and g_k.dtype == x.dtype
        torch.testing.assert_close(g_k, g_p, equal_nan=True, atol=5e-5, rtol=1e-4, msg=f"grad of input {name}")
