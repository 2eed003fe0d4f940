"""A V head dim of its own (``v`` (B, H_kv, Lk, Dv), Dv != D: MLA's 192/128) against float64, through the
interpreter.

Q and K tiles are D wide (padded to a power of two), V tiles, the output accumulator, O and dO Dv wide (padded
apart): the forward's K/V loop, the split-K/V kernel and its merge, the δ kernel, both backward kernels (dV
and dP over Dv, dQ and dK over D). Tiles are forced to 16 x 16. Checked: outputs, LSE and dq/dk/dv
(FlashAttention's rule) on both backward paths, Dv narrower and wider than D (powers of two and not),
causal and not, Lq != Lk, GQA, with each variant and with masks, fp16/bf16, decoding, the output's memory
order, the PyTorch path, the compiled op, and bad head dims.
"""

import pytest
import torch

import flashlite
from flashlite.core.runtime import pytorch_path

from .utils import assert_attention_close, attention_ref, check_attention, randn

pytestmark = pytest.mark.usefixtures("small_attention_tiles")


def qkv(lq: int, lk: int, d: int, dv: int, h: int = 4, h_kv: int = 2, dtype=torch.float32, batch: int = 2):
    q = randn(batch, h, lq, d, dtype=dtype, requires_grad=True)
    k = randn(batch, h_kv, lk, d, dtype=dtype, requires_grad=True)
    v = randn(batch, h_kv, lk, dv, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("d, dv", [(32, 16), (16, 32), (24, 40), (48, 20)])  # narrower, wider, padded both
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq, lk", [(33, 33), (20, 41), (41, 20)])
def test_head_dim_v_against_float64(d, dv, causal, lq, lk, backward_path):
    q, k, v = qkv(lq, lk, d, dv)
    out = check_attention(q, k, v, causal=causal)
    assert out.shape == (2, 4, lq, dv)


@pytest.mark.parametrize("variant", [
    dict(causal=True, window_size=(7, 0)),
    dict(softcap=2.0),
    dict(alibi_slopes=torch.tensor([0.3, 0.1, 0.2, 0.05])),
    dict(causal=True, window_size=(11, 3), softcap=3.0, alibi_slopes=torch.tensor([0.1, 0.2, 0.3, 0.4])),
])
def test_head_dim_v_with_each_variant(variant, backward_path):
    q, k, v = qkv(30, 37, 32, 16)
    check_attention(q, k, v, **variant)
    check_attention(q, k, v, sinks=randn(4, requires_grad=True), **variant)


def test_head_dim_v_with_masks(backward_path):
    q, k, v = qkv(25, 30, 16, 48)
    check_attention(q, k, v, attn_mask=torch.rand(2, 4, 25, 30) > 0.3)
    check_attention(q, k, v, attn_mask=randn(2, 1, 25, 30, requires_grad=True), causal=True)  # bias gradient


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_dim_v_low_precision(dtype):
    q, k, v = qkv(40, 40, 64, 32, dtype=dtype)
    check_attention(q, k, v, causal=True)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_head_dim_v_decoding(num_splits):
    # The split kernel's partial accumulators and its merge are Dv wide; GQA rows packed; a ragged cache.
    q = randn(3, 8, 1, 32)
    k, v = randn(3, 2, 80, 32), randn(3, 2, 80, 24)
    lens = torch.tensor([80, 17, 0])
    sinks = randn(8)
    for kw in (dict(), dict(sinks=sinks, causal=True)):
        out = flashlite.flash_attention(q, k, v, cache_seqlens=lens, num_splits=num_splits, **kw)
        assert out.shape == (3, 8, 1, 24)
        assert_attention_close(out, attention_ref(q, k, v, cache_seqlens=lens, **kw),
                               attention_ref(q, k, v, cache_seqlens=lens, dtype=q.dtype, **kw), q.dtype)


def test_output_in_the_queries_memory_order():
    # Queries viewed from a (B, L, H, D) tensor: the output comes out (B, L, H, Dv) in memory, so that merging
    # its heads is a view.
    q = randn(2, 20, 4, 32).transpose(1, 2)
    k, v = randn(2, 2, 20, 32), randn(2, 2, 20, 16)
    out = flashlite.flash_attention(q, k, v)
    assert out.shape == (2, 4, 20, 16) and out.transpose(1, 2).is_contiguous()
    assert_attention_close(out, attention_ref(q, k, v), attention_ref(q, k, v, dtype=q.dtype), q.dtype)


def test_empty_keys_give_zeros_of_v_width():
    q, k, v = randn(1, 2, 5, 32, requires_grad=True), randn(1, 2, 0, 32), randn(1, 2, 0, 16)
    out, lse = flashlite.flash_attention(q, k, v, return_lse=True)
    assert out.shape == (1, 2, 5, 16) and not out.any() and torch.isinf(lse).all()


def test_head_dim_v_pytorch_path_agrees():
    q, k, v = qkv(21, 26, 32, 16)
    kernels = flashlite.flash_attention(q, k, v, causal=True)
    with pytorch_path():
        torch_path = flashlite.flash_attention(q, k, v, causal=True)
    torch.testing.assert_close(kernels, torch_path, atol=1e-5, rtol=1e-5)


def test_head_dim_v_compiled_op():
    q, k, v = (t.detach() for t in qkv(16, 16, 32, 16))
    compiled = torch.compile(lambda q, k, v: flashlite.flash_attention(q, k, v, causal=True), fullgraph=True,
                             backend="aot_eager")
    out = compiled(q, k, v)
    assert out.shape == (2, 4, 16, 16)
    torch.testing.assert_close(out, flashlite.flash_attention(q, k, v, causal=True))


@pytest.mark.parametrize("shapes, match", [
    (((1, 2, 8, 32), (1, 2, 8, 16), (1, 2, 8, 16)), "head dims differ: q 32, k 16"),
    (((1, 2, 8, 32), (1, 2, 8, 32), (1, 2, 8, 8)), "v head dim 8 is not supported"),
    (((1, 2, 8, 32), (1, 2, 8, 32), (1, 2, 8, 300)), "v head dim 300 is not supported"),
])
def test_bad_head_dims(shapes, match):
    q, k, v = (randn(*shape) for shape in shapes)
    with pytest.raises(ValueError, match=match):
        flashlite.flash_attention(q, k, v)


def test_every_variant_compiled_with_gradients():
    # torch.compile(fullgraph=True) through the custom ops: Dv != D, softcap, ALiBi and sinks, the sinks'
    # gradient through the compiled backward; the same as eager and as float64.
    q, k = (randn(1, 2, 20, 16, requires_grad=True) for _ in range(2))
    v, sinks = randn(1, 2, 20, 24, requires_grad=True), randn(2, requires_grad=True)
    kw = dict(causal=True, softcap=3.0, alibi_slopes=torch.tensor([0.1, 0.3]))
    compiled = torch.compile(lambda q, k, v, s: flashlite.flash_attention(q, k, v, sinks=s, **kw), fullgraph=True,
                             backend="aot_eager")
    out = compiled(q, k, v, sinks)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), do)
    eager = flashlite.flash_attention(q, k, v, sinks=sinks, **kw)
    torch.testing.assert_close(out, eager)
    for g, e in zip(grads, torch.autograd.grad(eager, (q, k, v, sinks), do)):
        torch.testing.assert_close(g, e)
    check_attention(q, k, v, sinks=sinks, **kw)
