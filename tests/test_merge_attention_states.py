"""``flashlite.merge_attention_states``: two partial attention results merged, against float64, through the interpreter.

Checked: attention over two parts of the keys (``flash_attention(..., return_lse=True)`` on each) merged equals
attention over all of them (FlashAttention's rule against float64; parts of uneven length, GQA, a mask that
hides whole rows on one side, an empty part), an empty side is neutral (its ``o`` unread, even NaN), both sides
empty give ``o = 0`` and ``lse = −inf`` with zero gradients, gradients of all four inputs through both outputs
against float64 autograd, mixed dtypes, strided views and head dims past one column block, the in-place merge
into sequence slices that ring attention uses, the PyTorch path, bad arguments; on a GPU (``-m gpu``) the kernel
on poisoned outputs.
"""

from __future__ import annotations

import pytest
import torch

import flashlite
from flashlite.attention import merge, tuning
from flashlite.attention.tuning import AttentionConfig, BackwardConfig
from flashlite.core.runtime import pytorch_path

from .utils import DTYPES, TOL, assert_attention_close, attention_ref, poison, randn

TILES_16 = AttentionConfig(16, 16, 4, 1)
INF = float("inf")


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(tuning, "INTERPRETER_CONFIG", TILES_16)
    monkeypatch.setattr(tuning, "BACKWARD_INTERPRETER_CONFIG", BackwardConfig(TILES_16, TILES_16))


def merge_ref(o_a, lse_a, o_b, lse_b):
    """The merge in float64 from its definition (logaddexp, then the weights): rows with one finite side only."""
    lse = torch.logaddexp(lse_a.double(), lse_b.double())
    w_a, w_b = torch.exp(lse_a.double() - lse).unsqueeze(-1), torch.exp(lse_b.double() - lse).unsqueeze(-1)
    return w_a * o_a.double() + w_b * o_b.double(), lse


def random_sides(shape, dtype_a=torch.float32, dtype_b=torch.float32, empty_a=(), empty_b=()):
    """Random (o_a, lse_a, o_b, lse_b) of (..., L, D) ``shape``; rows ``empty_x`` of side x have lse = −inf and NaN
    in o (an empty side's o must not be read)."""
    o_a, o_b = randn(*shape, dtype=dtype_a), randn(*shape, dtype=dtype_b)
    lse_a, lse_b = randn(*shape[:-1], scale=3.0), randn(*shape[:-1], scale=3.0)
    for o, lse, rows in ((o_a, lse_a, empty_a), (o_b, lse_b, empty_b)):
        for row in rows:
            lse[..., row] = -INF
            o[..., row, :] = float("nan")
    return o_a, lse_a, o_b, lse_b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lk, split, h_kv", [
    (37, 16, 4),  # the split on a tile boundary, the second part ragged
    (37, 20, 2),  # both parts ragged, GQA
    (50, 1, 1),   # one key against 49, MQA
])
def test_two_halves_of_the_keys(dtype, lk, split, h_kv):
    # Attention over keys [0, split) and [split, lk) separately, merged: attention over all lk keys.
    q = randn(1, 4, 33, 32, dtype=dtype)
    k, v = randn(1, h_kv, lk, 32, dtype=dtype), randn(1, h_kv, lk, 32, dtype=dtype)
    o_a, lse_a = flashlite.flash_attention(q, k[:, :, :split], v[:, :, :split], return_lse=True)
    o_b, lse_b = flashlite.flash_attention(q, k[:, :, split:], v[:, :, split:], return_lse=True)
    o, lse = flashlite.merge_attention_states(o_a, lse_a, o_b, lse_b)
    assert o.dtype == dtype and lse.dtype == torch.float32
    ref, ref_lse = attention_ref(q, k, v, return_lse=True)
    assert_attention_close(o, ref, attention_ref(q, k, v, dtype=dtype), dtype)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_rows_hidden_on_one_side():
    # A boolean mask hides whole rows from the first part (lse_a = −inf there) and others from the second:
    # those rows are the other part's attention alone.
    q = randn(1, 2, 24, 16)
    k, v = randn(1, 2, 40, 16), randn(1, 2, 40, 16)
    keep = torch.rand(1, 2, 24, 40) > 0.3
    keep[:, :, :5, :25] = False  # rows 0..4 see nothing of the first part
    keep[:, :, 5:9, 25:] = False  # rows 5..8 see nothing of the second
    o_a, lse_a = flashlite.flash_attention(q, k[:, :, :25], v[:, :, :25], attn_mask=keep[..., :25], return_lse=True)
    o_b, lse_b = flashlite.flash_attention(q, k[:, :, 25:], v[:, :, 25:], attn_mask=keep[..., 25:], return_lse=True)
    assert (lse_a[:, :, :5] == -INF).all() and (lse_b[:, :, 5:9] == -INF).all()
    o, lse = flashlite.merge_attention_states(o_a, lse_a, o_b, lse_b)
    ref, ref_lse = attention_ref(q, k, v, attn_mask=keep, return_lse=True)
    assert_attention_close(o, ref, attention_ref(q, k, v, attn_mask=keep, dtype=q.dtype), q.dtype)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("empty_first", [True, False])
def test_empty_side_is_neutral(empty_first):
    # No key at all on one side (flash_attention over 0 keys: o = 0, lse = −inf), then the same with NaN in that
    # side's o: the result is the other side, exactly.
    q, k, v = randn(2, 3, 21, 16), randn(2, 3, 30, 16), randn(2, 3, 30, 16)
    full, full_lse = flashlite.flash_attention(q, k, v, return_lse=True)
    none, none_lse = flashlite.flash_attention(q, k[:, :, :0], v[:, :, :0], return_lse=True)
    assert (none_lse == -INF).all()
    for empty in (none, torch.full_like(none, float("nan"))):
        sides = (empty, none_lse, full, full_lse) if empty_first else (full, full_lse, empty, none_lse)
        o, lse = flashlite.merge_attention_states(*sides)
        assert torch.equal(o, full) and torch.equal(lse, full_lse)


def test_both_sides_empty():
    # Rows empty on both sides: o = 0 and lse = −inf, never NaN; every gradient 0 there. Other rows stay exact.
    o_a, lse_a, o_b, lse_b = random_sides((2, 3, 19, 24), empty_a=(0, 4, 7), empty_b=(0, 4, 11))
    inputs = [t.requires_grad_() for t in (o_a, lse_a, o_b, lse_b)]
    o, lse = flashlite.merge_attention_states(*inputs)
    assert (o[..., [0, 4], :] == 0).all() and (lse[..., [0, 4]] == -INF).all()
    assert not o.isnan().any() and not lse.isnan().any()
    grads = torch.autograd.grad((o, lse), inputs, (torch.randn_like(o), torch.randn_like(lse)))
    for g in grads:
        assert not g.isnan().any()
        assert (g[..., [0, 4], :] == 0).all() if g.dim() == 4 else (g[..., [0, 4]] == 0).all()


@pytest.mark.parametrize("dtype_a, dtype_b", [
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),  # an fp32 running result merged with a bf16 partial: fp32 out
    (torch.float16, torch.float16),
])
@pytest.mark.parametrize("head_dim", [40, 200])  # one column block padded; two blocks, the second ragged
def test_against_float64(dtype_a, dtype_b, head_dim):
    # Forward and the gradients of all four inputs through both outputs against float64 autograd of the
    # definition, rows with one empty side included (their weights and gradients 0, not NaN).
    o_a, lse_a, o_b, lse_b = random_sides((2, 2, 45, head_dim), dtype_a, dtype_b, empty_a=(3, 8), empty_b=(5,))
    for o, lse in ((o_a, lse_a), (o_b, lse_b)):
        o.nan_to_num_(0.0)  # the float64 reference multiplies an empty side's o by 0: NaN would stay NaN
    inputs = [t.requires_grad_() for t in (o_a, lse_a, o_b, lse_b)]
    o, lse = flashlite.merge_attention_states(*inputs)
    out_dtype = torch.promote_types(dtype_a, dtype_b)
    assert o.dtype == out_dtype
    ref64 = [t.detach().double().requires_grad_() for t in inputs]
    ref, ref_lse = merge_ref(*ref64)
    torch.testing.assert_close(o.double(), ref, **TOL[out_dtype])
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-6, rtol=1e-6)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    grads = torch.autograd.grad((o, lse), inputs, (do, dlse))
    refs = torch.autograd.grad((ref, ref_lse), ref64, (do.double(), dlse.double()))
    for g, r, x in zip(grads, refs, inputs):
        assert g.dtype == x.dtype and g.shape == x.shape
        tol = TOL[x.dtype] if x.dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g.double(), r, **tol)


def test_gradient_of_one_output_only():
    # Only o (or only lse) in the loss: the other output's gradient is None inside the Function.
    inputs = [t.requires_grad_() for t in random_sides((1, 2, 9, 16))]
    o, lse = flashlite.merge_attention_states(*inputs)
    ref64 = [t.detach().double().requires_grad_() for t in inputs]
    ref, ref_lse = merge_ref(*ref64)
    for out, r in ((o, ref), (lse, ref_lse)):
        grads = torch.autograd.grad(out.sum(), inputs, retain_graph=True)
        refs = torch.autograd.grad(r.sum(), ref64, retain_graph=True, allow_unused=True)  # lse does not use o
        for g, rg, x in zip(grads, refs, ref64):
            torch.testing.assert_close(g.double(), torch.zeros_like(x) if rg is None else rg, atol=1e-5, rtol=1e-5)


def test_strided_views():
    # o as a (B, L, H, D) tensor seen as (B, H, L, D), lse a slice: read in place or copied, same result.
    o_a = randn(2, 17, 3, 32).transpose(1, 2)
    o_b = randn(2, 3, 40, 32)[:, :, 5:22]
    lse_a, lse_b = randn(2, 3, 30)[:, :, :17], randn(2, 17, 3).transpose(1, 2)
    o, lse = flashlite.merge_attention_states(o_a, lse_a, o_b, lse_b)
    ref, ref_lse = merge_ref(o_a, lse_a, o_b, lse_b)
    torch.testing.assert_close(o.double(), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-6, rtol=1e-6)


def test_in_place_merge_into_sequence_slices():
    # Ring attention's running merge: the second half of a (B, H, L, D) fp32 result merged in place with a bf16
    # partial; the first half untouched.
    acc, acc_lse = randn(2, 4, 20, 16), randn(2, 4, 20)
    part, part_lse = randn(2, 4, 10, 16, dtype=torch.bfloat16), randn(2, 4, 10)
    ref, ref_lse = merge_ref(acc[:, :, 10:], acc_lse[:, :, 10:], part, part_lse)
    before, before_lse = acc[:, :, :10].clone(), acc_lse[:, :, :10].clone()
    rows = slice(10, None)
    merge.merge_states_into(acc[:, :, rows], acc_lse[:, :, rows], part, part_lse, acc[:, :, rows], acc_lse[:, :, rows])
    torch.testing.assert_close(acc[:, :, 10:].double(), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(acc_lse[:, :, 10:].double(), ref_lse, atol=1e-6, rtol=1e-6)
    assert torch.equal(acc[:, :, :10], before) and torch.equal(acc_lse[:, :, :10], before_lse)
    with pytest.raises(ValueError, match="flatten"):  # an output that would be written to a copy
        out = torch.empty(2, 20, 4, 16).transpose(1, 2)
        merge.merge_states_into(acc, acc_lse, acc, acc_lse, out, torch.empty(2, 4, 20))


def test_pytorch_path_agrees():
    inputs = [t.requires_grad_() for t in random_sides((2, 3, 13, 24), empty_a=(1,), empty_b=(1, 2))]
    do, dlse = randn(2, 3, 13, 24), randn(2, 3, 13)
    kernel = flashlite.merge_attention_states(*inputs)
    kernel_grads = torch.autograd.grad(kernel, inputs, (do, dlse))
    with pytorch_path():
        torch_path = flashlite.merge_attention_states(*inputs)
        torch_grads = torch.autograd.grad(torch_path, inputs, (do, dlse))
    for a, b in zip((*kernel, *kernel_grads), (*torch_path, *torch_grads)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, equal_nan=False)


def test_empty_tensors():
    o, lse = flashlite.merge_attention_states(*random_sides((2, 0, 5, 16)))
    assert o.shape == (2, 0, 5, 16) and lse.shape == (2, 0, 5)


def _good():
    return random_sides((1, 2, 5, 16))


@pytest.mark.parametrize("index, bad, error, match", [
    (0, [1.0], TypeError, "o_a must be a torch.Tensor"),
    (1, None, TypeError, "lse_a must be a torch.Tensor"),
    (2, torch.zeros(1, 2, 5, 16, dtype=torch.float64), TypeError, "o_b must be float32, float16 or bfloat16"),
    (0, torch.zeros(1, 2, 5, 16, dtype=torch.int32), TypeError, "o_a must be float32"),
    (3, torch.zeros(1, 2, 5, dtype=torch.bfloat16), TypeError, "lse_b must be float32"),
    (2, torch.zeros(1, 2, 6, 16), ValueError, "o_b has shape"),
    (1, torch.zeros(1, 2, 5, 16), ValueError, r"lse_a must have shape o_a.shape\[:-1\]"),
    (3, torch.zeros(2, 5), ValueError, "lse_b must have shape"),
    (0, torch.zeros(16), ValueError, r"o_a must have shape \(\.\.\., L, D\)"),
    (2, torch.zeros(1, 2, 5, 16, device="meta"), ValueError, "o_b is on meta"),
])
def test_bad_arguments(index, bad, error, match):
    args = list(_good())
    args[index] = bad
    with pytest.raises(error, match=match):
        flashlite.merge_attention_states(*args)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_a, dtype_b", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                              (torch.float16, torch.float16)])
@pytest.mark.parametrize("shape", [(2, 32, 4099, 128), (1, 8, 1000, 80), (3, 5, 77, 256)])
def test_gpu_merge_poisoned(dtype_a, dtype_b, shape):
    # The kernel on CUDA, forward and backward, outputs allocated from NaN-filled memory; rows with an empty side
    # and rows empty on both; against float64 on the GPU.
    o_a, o_b = (torch.randn(shape, device="cuda", dtype=dt) for dt in (dtype_a, dtype_b))
    lse_a, lse_b = (torch.randn(shape[:-1], device="cuda") * 5 for _ in range(2))
    lse_a[..., ::7] = -INF
    lse_b[..., ::11] = -INF  # rows 0, 77, ... empty on both sides
    inputs = [t.requires_grad_() for t in (o_a, lse_a, o_b, lse_b)]
    poison()
    o, lse = flashlite.merge_attention_states(*inputs)
    ref64 = [t.detach().double().requires_grad_() for t in inputs]
    lse64 = torch.logaddexp(ref64[1], ref64[3])
    both = lse64 == -INF
    safe = torch.where(both, 0.0, lse64)
    w_a, w_b = torch.exp(ref64[1] - safe), torch.exp(ref64[3] - safe)
    ref = w_a.unsqueeze(-1) * ref64[0] + w_b.unsqueeze(-1) * ref64[2]
    out_dtype = torch.promote_types(dtype_a, dtype_b)
    assert not o.isnan().any() and not lse.isnan().any()
    assert (o[both] == 0).all() and (lse[both] == -INF).all()
    torch.testing.assert_close(o.double(), ref, **TOL[out_dtype])
    torch.testing.assert_close(lse.double(), lse64, atol=1e-5, rtol=1e-6)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    poison()
    grads = torch.autograd.grad((o, lse), inputs, (do, dlse))
    refs = torch.autograd.grad((ref, torch.where(both, 0.0, lse64)), ref64, (do.double(), dlse.double()))
    for g, r, x in zip(grads, refs, inputs):
        assert not g.isnan().any()
        # fp32: the LSE gradients hold δ = Σ_D dO·(o_a − o_b), a sum of up to 256 fp32 products
        tol = TOL[x.dtype] if x.dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4)
        # float64 autograd of logaddexp(−inf, −inf) gives NaN; the rows empty on both sides must give 0
        torch.testing.assert_close(g.double(), r.nan_to_num(0.0), **tol)
