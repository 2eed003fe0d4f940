"""ALiBi (``flash_attention(..., alibi_slopes=)``, FlashAttention's definition) against float64, through the
interpreter.

Each scaled score becomes ``s - slope_h · |i + Lk - Lq - j|`` after the softcap and before the masks, in every
kernel (``core.masking.add_alibi``): the forward's full and masked tiles, the split-K/V kernel (whose packed
GQA rows belong to different heads, each with its own slope), both backward kernels (the bias has no gradient:
dS is unchanged). Tiles are forced to 16 x 16. Checked: outputs, LSE and dq/dk/dv (FlashAttention's rule) on
both backward paths, slopes of shape (H,) and (B, H), causal and not, Lq != Lk both ways, GQA, every variant
combined, masks, fp16/bf16, decoding with a ragged cache, the PyTorch path, the compiled op, the layer, and bad
arguments.
"""

import pytest
import torch
import triton
import triton.language as tl

import flashlite
from flashlite.core.masking import modified_scores_scaled, modify_scores
from flashlite.core.runtime import pytorch_path
from flashlite.nn import MultiheadAttention, alibi_slopes

from .utils import assert_attention_close, attention_grads_ref, attention_ref, check_attention, randn

pytestmark = pytest.mark.usefixtures("small_attention_tiles")


def slopes(n_heads: int, batch: int | None = None) -> torch.Tensor:
    """Slopes of a few tenths (a bias of several units across 40 keys): a missing or misplaced bias shows."""
    shape = (n_heads,) if batch is None else (batch, n_heads)
    return torch.rand(shape, dtype=torch.float32) * 0.3 + 0.05


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq, lk, h_kv", [(37, 37, 2), (20, 45, 1), (45, 20, 4)])
@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi_against_float64(causal, lq, lk, h_kv, per_batch, backward_path):
    q = randn(2, 4, lq, 32, requires_grad=True)
    k, v = randn(2, h_kv, lk, 32, requires_grad=True), randn(2, h_kv, lk, 32, requires_grad=True)
    check_attention(q, k, v, causal=causal, alibi_slopes=slopes(4, 2 if per_batch else None))


@pytest.mark.parametrize("causal", [False, True])
def test_negative_slopes_against_float64(causal, backward_path):
    # Slopes below 0 raise scores with the distance (FlashAttention takes any sign): across 45 keys a bias past
    # fp32's exp range. The rows a ragged query tile holds past Lq must still weigh exactly 0 in dK and dV (their
    # P once overflowed to inf, and inf times their zero dO gave NaN). Scores of ~100 put ~1e-5 of rounding into
    # the LSE that the backward recomputes P from (FlashAttention's way; PyTorch's softmax subtracts the row's
    # maximum instead): the rule's floor is taken 4 times the unit-variance one.
    q = randn(1, 2, 45, 32, requires_grad=True)
    k, v = randn(1, 2, 45, 32, requires_grad=True), randn(1, 2, 45, 32, requires_grad=True)
    kw = dict(causal=causal, alibi_slopes=torch.tensor([-2.5, -2.0]))
    out = flashlite.flash_attention(q, k, v, **kw)
    assert_attention_close(out, attention_ref(q, k, v, **kw), attention_ref(q, k, v, dtype=q.dtype, **kw), q.dtype)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    for g, r, t in zip(grads, attention_grads_ref(q, k, v, do, **kw), attention_grads_ref(q, k, v, do, q.dtype, **kw)):
        assert torch.isfinite(g).all()
        assert_attention_close(g, r, t, q.dtype, magnitude=4.0)


def test_alibi_changes_the_result():
    q, k, v = (randn(1, 2, 30, 16) for _ in range(3))
    plain = flashlite.flash_attention(q, k, v)
    biased = flashlite.flash_attention(q, k, v, alibi_slopes=torch.tensor([0.5, 0.1]))
    assert (plain - biased).abs().max() > 0.05
    # Slopes of 0 are no bias at all.
    torch.testing.assert_close(flashlite.flash_attention(q, k, v, alibi_slopes=torch.zeros(2)), plain)


def test_alibi_with_every_variant(backward_path):
    # softcap, then ALiBi, then the window and causal; the sinks in every row's softmax.
    q, k, v = (randn(1, 4, 40, 16, scale=2.0, requires_grad=True) for _ in range(3))
    sinks = randn(4, requires_grad=True)
    check_attention(q, k, v, causal=True, window_size=(9, 0), softcap=3.0, alibi_slopes=slopes(4), sinks=sinks)
    check_attention(q, k, v, window_size=(5, 12), alibi_slopes=slopes(1, 1).expand(1, 4).contiguous())


def test_alibi_with_masks(backward_path):
    q, k, v = (randn(2, 2, 30, 16, requires_grad=True) for _ in range(3))
    keep = torch.rand(2, 2, 30, 30) > 0.3
    check_attention(q, k, v, attn_mask=keep, alibi_slopes=slopes(2))
    bias = randn(2, 1, 30, 30, requires_grad=True)  # additive, its gradient through the two-pass path
    check_attention(q, k, v, attn_mask=bias, alibi_slopes=slopes(2, 2), causal=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_alibi_low_precision(dtype):
    q, k, v = (randn(1, 2, 40, 64, dtype=dtype, requires_grad=True) for _ in range(3))
    check_attention(q, k, v, causal=True, alibi_slopes=slopes(2))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_alibi_decoding_ragged_cache(num_splits):
    # Lq = 2 against a cache: the split kernel packs the 4 query heads of each K/V head into one tile, each
    # row with its own head's slope; the distance is to each element's own diagonal (cache_seqlens[b]).
    q = randn(3, 8, 2, 32)
    k, v = randn(3, 2, 70, 32), randn(3, 2, 70, 32)
    lens = torch.tensor([70, 23, 1])
    for alibi in (slopes(8), slopes(8, 3)):
        kw = dict(causal=True, alibi_slopes=alibi)
        out = flashlite.flash_attention(q, k, v, cache_seqlens=lens, num_splits=num_splits, **kw)
        assert_attention_close(out, attention_ref(q, k, v, cache_seqlens=lens, **kw),
                               attention_ref(q, k, v, cache_seqlens=lens, dtype=q.dtype, **kw), q.dtype)


def test_alibi_pytorch_path_agrees():
    q, k, v = (randn(2, 4, 25, 16, requires_grad=True) for _ in range(3))
    kw = dict(causal=True, alibi_slopes=slopes(4, 2), softcap=4.0, sinks=randn(4))
    kernels = flashlite.flash_attention(q, k, v, **kw)
    with pytorch_path():
        torch_path = flashlite.flash_attention(q, k, v, **kw)
    torch.testing.assert_close(kernels, torch_path, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(kernels.sum(), (q, k, v))
    with pytorch_path():
        torch_grads = torch.autograd.grad(flashlite.flash_attention(q, k, v, **kw).sum(), (q, k, v))
    for g, t in zip(grads, torch_grads):
        torch.testing.assert_close(g, t, atol=1e-5, rtol=1e-5)


def test_alibi_slopes_take_no_gradient():
    # The slopes are constants (FlashAttention's too): a slope tensor that requires grad gets none.
    q, k, v = (randn(1, 2, 20, 16, requires_grad=True) for _ in range(3))
    alibi = slopes(2).requires_grad_()
    out = flashlite.flash_attention(q, k, v, alibi_slopes=alibi)
    dq, da = torch.autograd.grad(out.sum(), (q, alibi), allow_unused=True)
    assert da is None and torch.isfinite(dq).all()


def test_alibi_compiled_op():
    q, k, v = (randn(1, 2, 24, 16) for _ in range(3))
    alibi = slopes(2)
    compiled = torch.compile(lambda q, k, v: flashlite.flash_attention(q, k, v, causal=True, alibi_slopes=alibi),
                             fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), flashlite.flash_attention(q, k, v, causal=True, alibi_slopes=alibi))


def test_paper_slopes():
    assert torch.equal(alibi_slopes(8), 2.0 ** -torch.arange(1, 9, dtype=torch.float32))
    twelve = alibi_slopes(12)  # 8 heads' slopes, then the odd ones of 16 heads'
    torch.testing.assert_close(twelve[8:], 2.0 ** -(torch.arange(4, dtype=torch.float32) + 0.5))
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(0)


def test_layer_with_alibi():
    torch.manual_seed(0)
    layer = MultiheadAttention(64, 4, causal=True, alibi=True)
    x = randn(2, 20, 64)
    q, k, v = (t.reshape(2, 20, 4, 16).transpose(1, 2) for t in layer.qkv(x).split(64, dim=-1))
    o = flashlite.flash_attention(q, k, v, causal=True, alibi_slopes=alibi_slopes(4))
    expected = layer.out_proj(o.transpose(1, 2).reshape(2, 20, 64))
    torch.testing.assert_close(layer(x), expected)
    assert "alibi=True" in repr(layer) and not any("alibi" in key for key in layer.state_dict())
    layer.to(torch.bfloat16)  # the slopes stay fp32 whatever the parameters' dtype
    assert layer._slopes(x.device).dtype == torch.float32


@pytest.mark.parametrize("alibi, error, match", [
    ([0.5, 0.25], TypeError, "alibi_slopes must be a float32 tensor"),
    (torch.ones(2, dtype=torch.float16), TypeError, "alibi_slopes must be float32"),
    (torch.ones(3), ValueError, r"alibi_slopes must have shape \(H,\)"),
    (torch.ones(3, 2), ValueError, r"alibi_slopes must have shape"),
])
def test_bad_alibi_slopes(alibi, error, match):
    q = randn(2, 2, 8, 16)
    with pytest.raises(error, match=match):
        flashlite.flash_attention(q, q, q, alibi_slopes=alibi)


@triton.jit
def _both_forms_kernel(s_ptr, logits_ptr, x_ptr, c_ptr, qk_scale, softcap, slope, seqlen_q, seqlen_k,
                       HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, M: tl.constexpr, N: tl.constexpr):
    rows, cols = tl.arange(0, M), tl.arange(0, N)
    s = tl.load(s_ptr + rows[:, None] * N + cols[None, :])
    mods = (softcap, slope, 0, 0)
    MODS: tl.constexpr = (HAS_SOFTCAP, False, HAS_ALIBI, False)
    logits, _ = modify_scores(s * qk_scale, rows, 0, cols, seqlen_q, seqlen_k, mods, MODS)
    x, c = modified_scores_scaled(s, qk_scale, rows, 0, cols, seqlen_q, seqlen_k, mods, MODS)
    tl.store(logits_ptr + rows[:, None] * N + cols[None, :], logits)
    tl.store(x_ptr + rows[:, None] * N + cols[None, :], x)
    tl.store(c_ptr, c)


@pytest.mark.parametrize("softcap, alibi", [(False, True), (True, False), (True, True)])
def test_prescaled_modifiers_give_the_same_logits(softcap, alibi):
    # The Hopper kernel's form (x with logits c · x, c folded into the exponential) against modify_scores on
    # scaled logits: the same logits to fp32 rounding, for Lq != Lk (the diagonal's offset).
    s = randn(16, 32, scale=4.0)
    logits, x, c = torch.empty_like(s), torch.empty_like(s), torch.empty(1)
    _both_forms_kernel[(1,)](s, logits, x, c, 0.3, 2.5, 0.2, 16, 32, softcap, alibi, 16, 32)
    torch.testing.assert_close(c * x, logits, atol=1e-5, rtol=1e-5)
    assert (logits - 0.3 * s).abs().max() > 0.1  # the modifiers did something
