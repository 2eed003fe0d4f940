"""Sliding windows (``flash_attention(..., window_size=(left, right))``, FlashAttention's) against float64.

Query ``i`` sees key ``j`` iff ``i + Lk - Lq - left <= j <= i + Lk - Lq + right`` (-1: unbounded side); with
``causal`` a key must pass both. The kernels skip the key tiles (forward, split-K/V, the dQ kernel) and query
tiles (the dK/dV kernel) outside the window and mask the tiles on its two edges (``core.masking.key_ranges``,
``query_ranges``). Tiles are forced to 16 x 16 so that short sequences cross many of them, with windows
narrower than a tile, wider than the sequence, one-sided, and off the diagonal (Lq != Lk both ways).
Checked through the interpreter: outputs, LSE and dq/dk/dv (FlashAttention's rule) on both backward paths,
combined with softcap, sinks, masks and GQA; decoding with ragged ``cache_seqlens``; the PyTorch path; the
compiled op; that the windowed tiles are really skipped; bad arguments.
"""

import pytest
import torch

import flashlite
from flashlite.attention import api, plan

from .utils import assert_attention_close, attention_ref, check_attention, randn

pytestmark = pytest.mark.usefixtures("small_attention_tiles")


@pytest.mark.parametrize("window", [
    (5, 3),     # narrower than a tile on both sides: every visited tile masked
    (20, 0),    # Mistral/Gemma-2 style (with causal: the same)
    (-1, 7),    # bounded on the right only
    (33, -1),   # bounded on the left only: the far edge of the dK/dV kernel's query range
    (0, 0),     # the diagonal alone
    (200, 200),  # wider than the sequence: every key
])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq, lk, h_kv", [(50, 50, 2), (37, 70, 1), (70, 37, 4)])
def test_window_against_float64(window, causal, lq, lk, h_kv, backward_path):
    q = randn(1, 4, lq, 32, requires_grad=True)
    k, v = randn(1, h_kv, lk, 32, requires_grad=True), randn(1, h_kv, lk, 32, requires_grad=True)
    check_attention(q, k, v, causal=causal, window_size=window)


def test_window_changes_the_result():
    q, k, v = (randn(1, 2, 40, 16) for _ in range(3))
    full = flashlite.flash_attention(q, k, v, causal=True)
    windowed = flashlite.flash_attention(q, k, v, causal=True, window_size=(8, 0))
    assert (full - windowed)[:, :, 9:].abs().max() > 0.05
    torch.testing.assert_close(full[:, :, :9], windowed[:, :, :9])  # rows whose window holds every earlier key


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_window_low_precision(dtype):
    q, k, v = (randn(2, 2, 64, 64, dtype=dtype, requires_grad=True) for _ in range(3))
    check_attention(q, k, v, causal=True, window_size=(19, 0))


def test_window_with_softcap_sinks_and_masks(backward_path):
    q, k, v = (randn(1, 4, 45, 16, scale=2.0, requires_grad=True) for _ in range(3))
    sinks = randn(4, requires_grad=True)
    check_attention(q, k, v, causal=True, window_size=(9, 4), softcap=3.0, sinks=sinks)
    keep = torch.rand(1, 4, 45, 45) > 0.3
    check_attention(q, k, v, attn_mask=keep, window_size=(12, 12))
    bias = randn(1, 1, 45, 45, requires_grad=True)  # additive, with its own gradient
    check_attention(q, k, v, attn_mask=bias, window_size=(6, 2))


def test_rows_outside_every_window_are_empty():
    # Lq > Lk with a right-bounded window: the first queries' windows end before key 0, so they see nothing.
    q, k, v = (randn(1, 2, n, 16, requires_grad=True) for n in (40, 10, 10))
    out, lse = flashlite.flash_attention(q, k, v, window_size=(2, 1), return_lse=True)
    assert torch.equal(out[:, :, :27], torch.zeros_like(out[:, :, :27]))
    assert torch.isinf(lse[:, :, :27]).all()
    check_attention(q, k, v, window_size=(2, 1))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_window_decoding_ragged_cache(num_splits):
    q = randn(3, 4, 2, 32)
    k, v = randn(3, 2, 90, 32), randn(3, 2, 90, 32)
    lens = torch.tensor([90, 23, 1])
    out = flashlite.flash_attention(q, k, v, causal=True, window_size=(30, 0), cache_seqlens=lens,
                                    num_splits=num_splits)
    for b, n in enumerate(lens.tolist()):
        args = (q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])
        kw = dict(causal=True, window_size=(30, 0))
        assert_attention_close(out[b:b + 1], attention_ref(*args, **kw), attention_ref(*args, dtype=q.dtype, **kw),
                               q.dtype)


def test_window_split_kv_long_block():
    # A query block split over its keys: each split clips the window's three parts (masked, full, masked).
    q, k, v = randn(1, 2, 40, 16), randn(1, 2, 130, 16), randn(1, 2, 130, 16)
    for window in [(35, 5), (10, 10), (-1, 3)]:
        out = flashlite.flash_attention(q, k, v, window_size=window, num_splits=4)
        assert_attention_close(out, attention_ref(q, k, v, window_size=window),
                               attention_ref(q, k, v, dtype=q.dtype, window_size=window), q.dtype)


def test_tiles_outside_the_window_are_not_read():
    # NaN in every key/value the window hides from every query: read, it would spread through the dots.
    lq = lk = 96
    q = randn(1, 1, lq, 16, requires_grad=True)
    k, v = randn(1, 1, lk, 16), randn(1, 1, lk, 16)
    k[:, :, :32], v[:, :, :32] = float("nan"), float("nan")  # keys 0..31: only queries <= 31 + 16 see them
    k, v = k.requires_grad_(), v.requires_grad_()
    out = flashlite.flash_attention(q, k, v, causal=True, window_size=(16, 0))
    assert torch.isfinite(out[:, :, 48:]).all()
    dq, = torch.autograd.grad(out[:, :, 64:].sum(), q)  # dQ kernel: key tiles outside the window skipped
    assert torch.isfinite(dq[:, :, 64:]).all()


def test_visibility_folds_causal_into_the_window():
    assert plan.visibility(True, (4, -1)) == (False, (4, 0))
    assert plan.visibility(True, (4, 9)) == (False, (4, 0))
    assert plan.visibility(False, (-1, 0)) == (True, None)
    assert plan.visibility(True, (-1, -1)) == (True, None)
    assert plan.visibility(False, (-1, -1)) == (False, None)
    assert plan.visibility(False, (3, 2)) == (False, (3, 2))
    assert plan.window_bounds((3, -1), 10, 20) == (3, 30)
    assert plan.window_bounds((10**9, 2), 10, 20) == (30, 2)


def test_pytorch_path_agrees(monkeypatch):
    q, k, v = (randn(1, 2, 25, 16, requires_grad=True) for _ in range(3))
    kw = dict(causal=True, window_size=(6, 0))
    kernels = flashlite.flash_attention(q, k, v, **kw)
    grads = torch.autograd.grad(kernels.sum(), (q, k, v))
    monkeypatch.setattr(api, "runs_kernels", lambda t: False)
    torch_path = flashlite.flash_attention(q, k, v, **kw)
    torch.testing.assert_close(kernels, torch_path, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, torch.autograd.grad(torch_path.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_compiled_op_takes_a_window():
    q, k, v = (randn(1, 2, 30, 16) for _ in range(3))
    o, _, _ = torch.ops.flashlite.flash_attention(q, k, v, None, None, None, None, False, 0.25, None, [5, 0], 1,
                                                 False, False)
    torch.testing.assert_close(o.double(), attention_ref(q, k, v, scale=0.25, window_size=(5, 0)),
                               atol=1e-5, rtol=1e-5)


def test_repeated_inference_calls_key_the_window():
    q, k, v = (randn(1, 2, 30, 16) for _ in range(3))
    first = flashlite.flash_attention(q, k, v, window_size=(3, 0))
    other = flashlite.flash_attention(q, k, v, window_size=(9, 0))  # same shapes: must not replay the first's route
    assert (first - other).abs().max() > 1e-3
    torch.testing.assert_close(other.double(), attention_ref(q, k, v, window_size=(9, 0)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window_size, error", [
    ((1,), TypeError), ((1, 2, 3), TypeError), (5, TypeError), ((1.0, 2), TypeError), ((True, 2), TypeError),
    ("ab", TypeError), ((-2, 0), ValueError), ((0, -5), ValueError),
])
def test_bad_window_size(window_size, error):
    q = randn(1, 2, 5, 16)
    with pytest.raises(error, match="window_size"):
        flashlite.flash_attention(q, q, q, window_size=window_size)
