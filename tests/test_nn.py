"""flashlite.nn.MultiheadAttention against a float64 layer built from the same weights on scaled_dot_product_attention."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import flashlite
from flashlite.nn import MultiheadAttention

from .utils import assert_attention_close, randn


def mha_ref(layer: MultiheadAttention, x, kv=None, key_padding_mask=None, attn_mask=None) -> torch.Tensor:
    """The layer's computation in its parameters' dtype, written independently: SDPA, K/V heads repeated for GQA,
    the causal mask aligned bottom-right, every mask as one additive mask; rows that see no key give 0."""
    dtype = layer.qkv.weight.dtype
    h, h_kv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    x = x.to(dtype)
    kv = x if kv is None else kv.to(dtype)
    (batch, seqlen_q, _), seqlen_k = x.shape, kv.shape[1]
    w, b = layer.qkv.weight, layer.qkv.bias
    q = F.linear(x, w[: h * d], None if b is None else b[: h * d])
    k, v = F.linear(kv, w[h * d:], None if b is None else b[h * d:]).chunk(2, dim=-1)
    q = q.reshape(batch, seqlen_q, h, d).transpose(1, 2)
    k = k.reshape(batch, seqlen_k, h_kv, d).transpose(1, 2).repeat_interleave(h // h_kv, dim=1)
    v = v.reshape(batch, seqlen_k, h_kv, d).transpose(1, 2).repeat_interleave(h // h_kv, dim=1)
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if layer.causal:
        keep = keep.tril(seqlen_k - seqlen_q)
    if key_padding_mask is not None:
        keep = keep & key_padding_mask[:, None, None, :]
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = keep & attn_mask
    mask = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        mask = mask + attn_mask.to(dtype)
    o = torch.nan_to_num(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), nan=0.0)
    return layer.out_proj(o.transpose(1, 2).reshape(batch, seqlen_q, h * d))


def check_layer(layer: MultiheadAttention, x, kv=None, **masks) -> None:
    """flashlite's layer vs float64, within twice the error of the same layer in PyTorch at the input dtype."""
    dtype = x.dtype
    with torch.no_grad():
        out = layer(x, kv, **masks)
        ref64 = mha_ref(copy.deepcopy(layer).double(), x, kv, **masks)
        out_torch = mha_ref(layer, x, kv, **masks)
    assert out.shape == x.shape and out.dtype == dtype
    assert_attention_close(out, ref64, out_torch, dtype)


def left_padding(batch: int, seqlen: int, n_pad: list[int]) -> torch.Tensor:
    """(B, L) True = keep, with ``n_pad[b]`` padding positions at the start of row b."""
    return torch.arange(seqlen)[None, :] >= torch.tensor(n_pad)[:, None]


DTYPES = [torch.float32, torch.bfloat16]

# (embed_dim, num_heads, num_kv_heads)
HEADS = [
    (32, 2, None),  # plain multi-head, D = 16
    (64, 4, 2),  # GQA: two query heads per K/V head
    (48, 3, 1),  # MQA, D = 16 with three query heads
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("embed_dim, num_heads, num_kv_heads", HEADS)
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention(dtype, embed_dim, num_heads, num_kv_heads, causal):
    layer = MultiheadAttention(embed_dim, num_heads, num_kv_heads=num_kv_heads, causal=causal, dtype=dtype)
    check_layer(layer, randn(2, 13, embed_dim, dtype=dtype))  # L = 13: a ragged last tile


@pytest.mark.parametrize("dtype", DTYPES)
def test_self_attention_key_padding(dtype):
    # Left padding under causal: the first queries of row 1 see only padding, so they are fully
    # masked rows (zero attention output, where SDPA alone gives NaN).
    layer = MultiheadAttention(64, 4, num_kv_heads=2, causal=True, dtype=dtype)
    check_layer(layer, randn(3, 11, 64, dtype=dtype), key_padding_mask=left_padding(3, 11, [0, 4, 10]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_cross_attention(dtype, causal):
    # Lq = 7 < Lk = 19: under causal, query i sees keys j <= i + 12 (bottom-right).
    layer = MultiheadAttention(64, 4, num_kv_heads=1, causal=causal, dtype=dtype)
    x, kv = randn(2, 7, 64, dtype=dtype), randn(2, 19, 64, dtype=dtype)
    padding = torch.ones(2, 19, dtype=torch.bool)
    padding[1, 15:] = False  # right padding of the keys of row 1
    check_layer(layer, x, kv, key_padding_mask=padding)


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_attn_mask_with_key_padding(mask_kind):
    layer = MultiheadAttention(32, 2)
    x = randn(2, 9, 32)
    if mask_kind == "bool":
        attn_mask = torch.rand(9, 9) > 0.3  # (Lq, Lk), broadcast over batch and heads
        attn_mask[:, 0] = True  # every query keeps a key
    else:
        attn_mask = randn(2, 1, 9, 9)  # (B, 1, Lq, Lk) additive bias, broadcast over heads
    check_layer(layer, x, attn_mask=attn_mask, key_padding_mask=left_padding(2, 9, [0, 3]) | (torch.arange(9) == 8))


def test_no_bias_and_layout():
    layer = MultiheadAttention(32, 2, bias=False)
    assert layer.qkv.bias is None and layer.out_proj.bias is None
    assert layer.qkv.weight.shape == (3 * 32, 32)
    gqa = MultiheadAttention(64, 4, num_kv_heads=2)
    assert gqa.qkv.weight.shape == ((4 + 2 * 2) * 16, 64)  # [Q | K | V] rows
    check_layer(layer, randn(2, 5, 32))
    assert isinstance(flashlite.nn.MultiheadAttention(32, 2), torch.nn.Module)  # exported as flashlite.nn


@pytest.mark.parametrize("path", ["kernels", "pytorch"])
def test_gradients(monkeypatch, path):
    """Gradients of the layer against float64 autograd of the reference: through flashlite's Triton forward
    and backward kernels (the interpreter), and through the PyTorch path (plain autograd)."""
    if path == "pytorch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # read per call: CPU tensors take flashlite's PyTorch path
    layer = MultiheadAttention(64, 4, num_kv_heads=2, causal=True)
    layer64 = copy.deepcopy(layer).double()
    x, kv = randn(2, 6, 64, requires_grad=True), randn(2, 10, 64, requires_grad=True)
    padding = left_padding(2, 10, [0, 2])
    grad_out = randn(2, 6, 64)
    out = layer(x, kv, key_padding_mask=padding)
    grads = torch.autograd.grad(out, [x, kv, *layer.parameters()], grad_out)
    out64 = mha_ref(layer64, x, kv, key_padding_mask=padding)
    grads64 = torch.autograd.grad(out64, [x, kv, *layer64.parameters()], grad_out.double())
    for name, g, g64 in zip(["x", "kv"] + [n for n, _ in layer.named_parameters()], grads, grads64):
        torch.testing.assert_close(g.double(), g64.double(), atol=1e-5, rtol=1e-4, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(embed_dim=30, num_heads=4), "embed_dim .* divisible by num_heads"),
        (dict(embed_dim=64, num_heads=4, num_kv_heads=3), "multiple of num_kv_heads"),
        (dict(embed_dim=32, num_heads=4), "head dim .* 8"),  # D = 8 < 16
        (dict(embed_dim=32, num_heads=2, dropout=0.1), "dropout"),
        (dict(embed_dim=32, num_heads=0), "num_heads must be a positive int"),
    ],
)
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiheadAttention(**kwargs)


def test_forward_errors():
    layer = MultiheadAttention(32, 2)
    x = randn(2, 5, 32)
    with pytest.raises(ValueError, match="x must have shape"):
        layer(randn(5, 32))
    with pytest.raises(ValueError, match="x must have shape"):
        layer(randn(2, 5, 16))
    with pytest.raises(ValueError, match="kv must have shape"):
        layer(x, randn(2, 7, 16))
    with pytest.raises(ValueError, match="kv has batch size 3"):
        layer(x, randn(3, 7, 32))
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        layer(x, randn(2, 7, 32), key_padding_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask must be a bool tensor"):
        layer(x, key_padding_mask=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="attn_mask of shape"):
        layer(x, attn_mask=torch.ones(5, 4, dtype=torch.bool))
    assert torch.isfinite(layer(x, attn_mask=torch.ones(2, 2, 5, 5, dtype=torch.bool))).all()


def test_learnable_sinks():
    # sinks=True: a (H,) parameter, zeros at first, in every row's softmax (flash_attention's sinks); it learns.
    layer = MultiheadAttention(32, 2, causal=True, sinks=True)
    assert layer.sinks.shape == (2,) and (layer.sinks == 0).all() and "sinks=True" in repr(layer)
    with torch.no_grad():
        layer.sinks.copy_(torch.tensor([1.5, -0.5]))
    x = torch.randn(2, 9, 32)
    out = layer(x)
    q, k, v = layer.qkv(x).split([32, 32, 32], dim=-1)
    q, k, v = (t.view(2, 9, 2, 16).transpose(1, 2) for t in (q, k, v))
    from flashlite import flash_attention

    expected = layer.out_proj(flash_attention(q, k, v, causal=True, sinks=layer.sinks).transpose(1, 2).reshape(2, 9, 32))
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert layer.sinks.grad is not None and (layer.sinks.grad != 0).all()
    assert MultiheadAttention(32, 2).sinks is None


def test_softcap_option():
    layer = MultiheadAttention(32, 2, causal=True, softcap=2.0)
    with torch.no_grad():
        layer.qkv.weight.mul_(10.0)  # scores of several units: the cap bends them
    x = torch.randn(1, 7, 32)
    q, k, v = (t.view(1, 7, 2, 16).transpose(1, 2) for t in layer.qkv(x).split([32, 32, 32], dim=-1))
    from flashlite import flash_attention

    expected = layer.out_proj(flash_attention(q, k, v, causal=True, softcap=2.0).transpose(1, 2).reshape(1, 7, 32))
    torch.testing.assert_close(layer(x), expected)
    uncapped = layer.out_proj(flash_attention(q, k, v, causal=True).transpose(1, 2).reshape(1, 7, 32))
    assert (layer(x) - uncapped).abs().max() > 1e-3
    with pytest.raises(ValueError, match="softcap"):
        MultiheadAttention(32, 2, softcap=0.0)


def test_window_size_option():
    layer = MultiheadAttention(32, 2, causal=True, window_size=(3, 0))
    x = torch.randn(1, 9, 32)
    with torch.no_grad():
        out = layer(x)
        q, k, v = (t.view(1, 9, 2, 16).transpose(1, 2) for t in layer.qkv(x).split([32, 32, 32], dim=-1))
        windowed = flashlite.flash_attention(q, k, v, causal=True, window_size=(3, 0))
        expected = layer.out_proj(windowed.transpose(1, 2).reshape(1, 9, 32))
        unwindowed = MultiheadAttention(32, 2, causal=True)
        unwindowed.load_state_dict(layer.state_dict())
        assert (unwindowed(x) - out).abs().max() > 1e-3
    torch.testing.assert_close(out, expected)
    assert "window_size=(3, 0)" in repr(layer)
    with pytest.raises(ValueError, match="window_size"):
        MultiheadAttention(32, 2, window_size=(-3, 0))


def test_packed_batch_is_each_sequence_alone():
    # cu_seqlens: a packed (total, E) batch gives each sequence what the layer gives it as a batch of one.
    torch.manual_seed(0)
    layer = MultiheadAttention(64, 4, num_kv_heads=2, causal=True)
    lengths = [7, 1, 20]
    x = torch.randn(sum(lengths), 64)
    cu = torch.tensor([0, 7, 8, 28], dtype=torch.int32)
    packed = layer(x, cu_seqlens=cu)
    one_by_one = torch.cat([layer(part.unsqueeze(0))[0] for part in x.split(lengths)])
    torch.testing.assert_close(packed, one_by_one, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x, cu_seqlens=cu, max_seqlen=20), packed, atol=0, rtol=0)
    with pytest.raises(ValueError, match="cu_seqlens .* takes no kv"):
        layer(x, x, cu_seqlens=cu)
