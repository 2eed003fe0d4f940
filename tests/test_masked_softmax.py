"""flashlite.masked_softmax against the float64 masked_fill + softmax reference, through the Triton interpreter."""

import dataclasses
import importlib

import numpy as np
import pytest
import torch

from flashlite.core import runtime as _runtime
from flashlite.masked_softmax import (
    READ_GROUP,
    batch_layout,
    clear_plans,
    masked_softmax,
    masked_softmax_backward,
    masked_softmax_forward,
)
from flashlite.core.masking import broadcast_mask
from flashlite.softmax import tuning
from flashlite.softmax.plan import plan_softmax
from flashlite.softmax.tuning import FUSED_MAX_COLS

from .utils import DTYPES, assert_close, masked_softmax_ref, randn

CPU = torch.device("cpu")
B, H, LQ, LK = 2, 3, 5, 7  # small scores; LK odd so the fused tile is padded

# Boolean masks, each a broadcast shape the kernels read through strides (True = keep).
BOOL_MASKS = {
    "key_padding": (B, 1, 1, LK),  # stride 0 over heads and queries: (B, H) stay two leading dims
    "shared": (LQ, LK),  # one mask for every (batch, head): (B, H) merge into one
    "per_head": (B, H, LQ, LK),  # nothing broadcast
    "per_head_no_batch": (H, 1, LK),  # fewer dims than x, broadcast over batch and queries
    "per_query": (B, 1, LQ, 1),  # stride 0 along the keys: the whole row kept or removed
}


def bool_mask(shape, keep=0.7):
    return torch.rand(shape) < keep


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", list(BOOL_MASKS))
def test_bool_mask_kinds(kind, causal):
    x = randn(B, H, LQ, LK)
    mask = bool_mask(BOOL_MASKS[kind])
    y = masked_softmax(x, mask, causal=causal)
    ref = masked_softmax_ref(x, mask, causal=causal)
    assert_close(y, ref)
    assert (y[ref == 0] == 0).all()  # masked positions are exactly 0, not just small


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_dtype", DTYPES)
@pytest.mark.parametrize("shape", [(LQ, LK), (B, 1, 1, LK), (B, H, LQ, LK)])
def test_additive_mask_with_scale(shape, mask_dtype, causal):
    x = randn(B, H, LQ, LK)
    bias = randn(*shape, dtype=mask_dtype, scale=2.0)
    bias[..., 0] = float("-inf")  # -inf in a float mask removes the key
    y = masked_softmax(x, bias, scale=0.37, causal=causal)
    assert_close(y, masked_softmax_ref(x, bias, scale=0.37, causal=causal))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_dtypes(dtype, mask, causal):
    x = randn(B, H, LQ, LK, dtype=dtype, scale=2.0)
    m = None if mask is None else bool_mask((B, 1, LQ, LK)) if mask == "bool" else randn(LQ, LK, dtype=dtype)
    y = masked_softmax(x, m, scale=1.5, causal=causal)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, masked_softmax_ref(x, m, scale=1.5, causal=causal))


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k",
    [
        (6, 6),  # the usual lower triangle
        (3, 9),  # Lq < Lk: the last query sees every key
        (9, 4),  # Lq > Lk: queries 0..4 see nothing (zeros), the rest a growing prefix
        (1, 1),
    ],
)
def test_causal_alignment(seqlen_q, seqlen_k):
    x = randn(2, 2, seqlen_q, seqlen_k)
    y = masked_softmax(x, causal=True)
    ref = masked_softmax_ref(x, causal=True)
    assert_close(y, ref)
    hidden = ~torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril(seqlen_k - seqlen_q)
    assert (y[..., hidden] == 0).all()
    assert not torch.isnan(y).any()


def test_fully_masked_rows_give_zeros():
    x = randn(B, H, LQ, LK)
    mask = bool_mask((B, H, LQ, LK))
    mask[0, 1, 2] = False  # one row with every key removed by the boolean mask
    mask[1, :, :, :] = False  # a whole batch entry removed
    y = masked_softmax(x, mask)
    assert (y[0, 1, 2] == 0).all() and (y[1] == 0).all()
    assert_close(y, masked_softmax_ref(x, mask))
    bias = torch.zeros(LQ, LK)
    bias[3] = float("-inf")  # a float mask can empty a row too
    y = masked_softmax(x, bias, causal=True)
    assert (y[:, :, 3] == 0).all() and not torch.isnan(y).any()
    assert_close(y, masked_softmax_ref(x, bias, causal=True))


def test_nan_and_inf_scores():
    x = randn(1, 2, 4, 6)
    mask = bool_mask((4, 6))
    mask[0] = True
    x[0, 0, 0, 2] = float("nan")  # NaN in a visible score: its row is NaN where visible, as in torch
    x[0, 0, 1, :] = float("-inf")  # a row of -inf scores, unmasked: empty, zeros
    x[0, 1, 0, 5] = float("nan")  # NaN where causal masking hides it (query 0 sees keys 0..2) does not leak
    y = masked_softmax(x, mask, causal=True)
    visible = mask[0] & torch.ones(4, 6, dtype=torch.bool).tril(2)[0]
    assert torch.isnan(y[0, 0, 0, visible]).all() and (y[0, 0, 0, ~visible] == 0).all()  # hidden: exactly 0
    assert (y[0, 0, 1] == 0).all()
    assert not torch.isnan(y[0, 1]).any()
    ref = masked_softmax_ref(x.nan_to_num(nan=0.0), mask, causal=True)
    assert_close(y[0, 1], ref[0, 1])


def test_shift_invariance_and_large_magnitudes():
    # x - m is taken before the base-2 rescale: a shift of 1e4 and scores of 1e4 keep fp32 accuracy.
    x = randn(2, 4, 30, scale=1e4)
    mask = bool_mask((4, 30))
    assert_close(masked_softmax(x, mask, causal=True), masked_softmax_ref(x, mask, causal=True))
    shifted = randn(2, 4, 30) + 1e4  # compared with its own reference: fp32 cannot hold x + 1e4 exactly
    assert_close(masked_softmax(shifted, mask, causal=True), masked_softmax_ref(shifted, mask, causal=True))
    # Shift invariance itself: scores on a 2^-10 grid, so that x + 1024 is exact in fp32.
    x = torch.round(randn(2, 4, 30) * 1024) / 1024
    y = masked_softmax(x, mask, causal=True)
    assert_close(masked_softmax(x + 1024, mask, causal=True), y)
    assert_close(masked_softmax(x - 1024, mask, causal=True), y)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "n_splits,mask",
    [
        (1, "key_padding"),  # one program a row: blocks of 16, running max raised block by block
        (3, "key_padding"),  # split rows: partial states merged, some partials empty under causal
        (3, "float"),
        (1, None),
    ],
)
def test_online_blocks_and_split_rows(n_splits, mask, causal):
    # 70 keys in blocks of 16: five blocks, the last ragged; Lq = 3 < Lk, so causal rows end mid-block.
    x = randn(1, 2, 3, 70, scale=3.0)
    m = {"key_padding": bool_mask((1, 1, 1, 70)), "float": randn(3, 70), None: None}[mask]
    view = None if m is None else broadcast_mask(m, x.shape)[0]
    y = masked_softmax_forward(x, view, 0.8, causal, "online", block_n=16, n_splits=n_splits)
    assert_close(y, masked_softmax_ref(x, m, scale=0.8, causal=causal))


def test_online_causal_rows_with_nothing_visible():
    # Lq = 23 > Lk = 20 under split rows (blocks of 8, three chunks): queries 0..2 see nothing, and
    # later chunks of the early rows are empty partials; all must give zeros, not NaN.
    x = randn(1, 1, 23, 20)
    y = masked_softmax_forward(x, None, 1.0, True, "online", block_n=8, n_splits=3)
    assert (y[..., :3, :] == 0).all()
    assert_close(y, masked_softmax_ref(x, causal=True))


@pytest.fixture
def read_addresses(monkeypatch):
    """Byte addresses that the interpreter's loads actually read (lanes with their mask on), in order."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "create_masked_load"):
        pytest.skip("this Triton's interpreter has no create_masked_load to watch")
    seen = []
    load = builder.create_masked_load

    def watched(self, ptrs, mask, *args):
        seen.append(ptrs.data[mask.data].ravel().copy())
        return load(self, ptrs, mask, *args)

    monkeypatch.setattr(builder, "create_masked_load", watched)
    return seen


def _elements_read(seen, t: torch.Tensor) -> np.ndarray:
    """Flat indices of the elements of contiguous ``t`` that the recorded loads read."""
    addr = np.concatenate(seen)
    start, size = t.data_ptr(), t.element_size()
    inside = addr[(addr >= start) & (addr < start + t.numel() * size)]
    return (inside - start) // size


@pytest.mark.parametrize("plan_kw", [{}, dict(algorithm="online", block_n=16, n_splits=2)])
def test_causal_reads_stop_at_the_diagonal(read_addresses, plan_kw):
    # The hidden part of a row is not loaded: not x or the mask (forward), not y or dy (backward). Loads of
    # x, y and dy end on a whole group of READ_GROUP keys (vector-wide), so up to 15 keys past it are read.
    x = randn(1, 1, 36, 36)  # query i sees keys 0..i; loads stop at min(16 * ceil((i + 1) / 16), 36)
    mask = bool_mask((1, 1, 36, 36))
    q, k = torch.arange(36)[:, None], torch.arange(36)[None, :]
    visible = (k <= q).reshape(-1)
    group = READ_GROUP.value
    readable = (k < ((q + group) // group * group).clamp(max=36)).reshape(-1)
    y = masked_softmax_forward(x, broadcast_mask(mask, x.shape)[0], 1.0, True, **plan_kw)
    read = {"x": _elements_read(read_addresses, x), "mask": _elements_read(read_addresses, mask)}
    read_addresses.clear()
    dy = randn(*x.shape)
    masked_softmax_backward(y.view(-1, 36), dy.view(-1, 36), 36, 1.0, True, torch.float32, **plan_kw)
    read |= {"y": _elements_read(read_addresses, y), "dy": _elements_read(read_addresses, dy)}
    for name, elements in read.items():
        elements = torch.from_numpy(np.unique(elements).astype(np.int64))  # the online regime reads twice
        assert readable[elements].all(), f"{name} read past the diagonal's group"
        assert visible[elements].sum() == visible.sum(), f"{name}: some visible keys not read"
    assert not readable.all()  # the test means something: some keys are never read


@pytest.mark.parametrize("algorithm", ["fused", "online"])
def test_public_algorithm_choice(algorithm):
    x = randn(1, 2, 4, 50)
    mask = bool_mask((1, 1, 4, 50))
    assert_close(masked_softmax(x, mask, causal=True, algorithm=algorithm), masked_softmax_ref(x, mask, causal=True))


def test_non_contiguous_scores():
    base = randn(B, LQ, H, 2 * LK)
    x = base.transpose(1, 2)[..., ::2]  # (B, H, LQ, LK): heads and queries swapped, key stride 2
    mask = bool_mask((B, 1, 1, LK))
    assert_close(masked_softmax(x, mask, causal=True), masked_softmax_ref(x, mask, causal=True))
    xt = randn(B, H, LK, LQ).transpose(-1, -2)  # keys not the fastest dim: read through their stride
    assert_close(masked_softmax(xt, mask, scale=2.0), masked_softmax_ref(xt, mask, scale=2.0))
    xo = randn(B + 1, H, LQ, LK)[1:]  # a storage offset: the kernels start at x's first element
    assert_close(masked_softmax(xo, mask, causal=True), masked_softmax_ref(xo, mask, causal=True))
    mt = bool_mask((LK, LQ)).t()  # a transposed mask, read through its strides
    assert_close(masked_softmax(x, mt, causal=True), masked_softmax_ref(x, mt, causal=True))


@pytest.mark.parametrize(
    "x_shape,mask_shape,n_outer",
    [
        ((4, LK), (4, LK), 0),  # no leading dims
        ((LK,), (LK,), 0),  # one row
        ((2, 3, 4, LQ, LK), (2, 1, 4, 1, LK), 1),  # three leading dims that cannot merge: a launch per outer index
        ((2, 3, 4, LQ, LK), (LQ, LK), 0),  # ... that merge into one
        ((2, 1, 3, 4, LQ, LK), (1, 1, 3, 4, 1, LK), 0),  # size-1 dim dropped, (3, 4) merged, 2 kept apart
        ((2, 3, 4, LQ, LK), (2, 1, 1, 1, LK), 0),  # key padding: (3, 4) merge, batch kept apart
    ],
)
def test_leading_dims(x_shape, mask_shape, n_outer):
    x = randn(*x_shape)
    mask = bool_mask(mask_shape)
    causal = x.dim() >= 2
    ref = masked_softmax_ref(x, mask, causal=causal) if causal else masked_softmax_ref(x[None], mask)[0]
    assert_close(masked_softmax(x, mask, causal=causal), ref)
    if causal:
        sizes, _, _ = batch_layout(x, broadcast_mask(mask, x.shape)[0])
        assert len(sizes) == 2 + n_outer


def test_other_dim():
    # Non-causal softmax over dim 1 of (B, Lk, Lq) scores, with a mask broadcast against x's own shape.
    x = randn(B, LK, LQ)
    mask = bool_mask((B, LK, 1))
    y = masked_softmax(x, mask, dim=1)
    ref = masked_softmax_ref(x.transpose(1, 2), mask.transpose(1, 2)).transpose(1, 2)
    assert_close(y, ref)


TOL_GRAD = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _grads_ref(x, mask, scale, causal, dy):
    x64 = x.detach().double().requires_grad_()
    inputs = [x64]
    m64 = mask
    if mask is not None and mask.requires_grad:
        m64 = mask.detach().double().requires_grad_()
        inputs.append(m64)
    return torch.autograd.grad(masked_softmax_ref(x64, m64, scale, causal), inputs, dy.double())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_backward(dtype, causal):
    x = randn(B, H, LQ, LK, dtype=dtype, requires_grad=True)
    mask = bool_mask((B, 1, 1, LK))
    mask[0, ..., :] = False  # fully masked rows: gradient 0
    dy = randn(B, H, LQ, LK, dtype=dtype)
    (dx,) = torch.autograd.grad(masked_softmax(x, mask, scale=0.6, causal=causal), x, dy)
    (ref,) = _grads_ref(x, mask, 0.6, causal, dy)
    assert dx.dtype == dtype
    assert_close(dx, ref, atol=TOL_GRAD[dtype], rtol=TOL_GRAD[dtype])
    assert (dx[0] == 0).all()


def test_backward_float_mask_gradient():
    x = randn(B, H, LQ, LK, requires_grad=True)
    bias = randn(H, 1, LK, requires_grad=True)  # a learned per-head bias, broadcast over batch and queries
    dy = randn(B, H, LQ, LK)
    dx, dbias = torch.autograd.grad(masked_softmax(x, bias, scale=0.5, causal=True), (x, bias), dy)
    rx, rbias = _grads_ref(x, bias, 0.5, True, dy)
    assert dbias.shape == bias.shape
    assert_close(dx, rx, atol=1e-5)
    assert_close(dbias, rbias, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_splits", [1, 3])
def test_backward_online(n_splits, causal):
    x = randn(1, 2, 3, 70)
    mask = bool_mask((1, 1, 1, 70))
    dy = randn(6, 70).t().contiguous().t()  # grad with column stride 6
    plan_kw = dict(algorithm="online", block_n=16, n_splits=n_splits)
    y = masked_softmax_forward(x, broadcast_mask(mask, x.shape)[0], 1.3, causal, **plan_kw)
    dx = masked_softmax_backward(y.view(6, 70), dy, 3, 1.3, causal, torch.float32, **plan_kw)
    (ref,) = _grads_ref(x, mask, 1.3, causal, dy.view(1, 2, 3, 70))
    assert_close(dx.view(x.shape), ref, atol=1e-6)


def test_backward_non_contiguous_and_other_dim():
    x = randn(B, LK, LQ, requires_grad=True)
    dy = randn(LQ, LK, B).permute(2, 1, 0)  # grad arrives with odd strides
    mask = bool_mask((B, LK, 1))
    (dx,) = torch.autograd.grad(masked_softmax(x, mask, dim=1), x, dy)
    x64 = x.detach().double().requires_grad_()
    y64 = masked_softmax_ref(x64.movedim(1, -1), mask.movedim(1, -1)).movedim(-1, 1)
    (ref,) = torch.autograd.grad(y64, x64, dy.double())
    assert_close(dx, ref, atol=1e-6)
    x = randn(LK, requires_grad=True)  # one row
    (dx,) = torch.autograd.grad(masked_softmax(x, scale=2.0), x, torch.ones(LK))
    assert_close(dx, torch.zeros(LK), atol=1e-6)  # softmax sums to 1: a constant upstream grad gives 0


def test_rows_longer_than_the_on_chip_limit(monkeypatch):
    # Past FUSED_MAX_COLS keys "auto" takes the online regime. The limit and the block are shrunk here
    # (the interpreter merges per-lane states one lane at a time: 4096-lane blocks take seconds).
    monkeypatch.setattr(tuning, "FUSED_MAX_COLS", 256)
    for name in ("ONLINE_BLOCK_N", "SPLIT_BLOCK_N"):  # whole-row and split-row blocks
        monkeypatch.setattr(tuning, name, 64)
    clear_plans()
    try:
        x = randn(1, 1, 2, 700)
        mask = bool_mask((700,))
        plan = plan_softmax(2, 700, CPU)
        assert plan.algorithm == "online" and plan.block_n <= 64
        assert_close(masked_softmax(x, mask, causal=True), masked_softmax_ref(x, mask, causal=True))
    finally:
        clear_plans()  # no plan made with the shrunk constants outlives the test


def test_empty_inputs():
    assert masked_softmax(torch.empty(2, 0, 4), causal=True).shape == (2, 0, 4)
    assert masked_softmax(torch.empty(2, 3, 0), torch.ones(3, 0, dtype=torch.bool)).shape == (2, 3, 0)


def test_pytorch_path_without_interpreter(monkeypatch):
    monkeypatch.setattr(_runtime, "interpreter_enabled", lambda: False)
    x = randn(B, H, LQ, LK, dtype=torch.bfloat16)
    mask = bool_mask((B, 1, 1, LK))
    mask[1] = False
    y = masked_softmax(x, mask, scale=0.5, causal=True)
    assert_close(y, masked_softmax_ref(x, mask, scale=0.5, causal=True))
    bias = randn(LQ, LK)
    assert_close(masked_softmax(x, bias), masked_softmax_ref(x, bias), dtype=torch.bfloat16)


def test_bad_arguments():
    x = randn(B, H, LQ, LK)
    with pytest.raises(ValueError, match=r"mask of shape \(3, 7\) does not broadcast"):
        masked_softmax(x, torch.ones(3, LK, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        masked_softmax(x, torch.ones(1, B, H, LQ, LK, dtype=torch.bool))  # would grow x
    with pytest.raises(TypeError, match="mask must be bool"):
        masked_softmax(x, torch.ones(LQ, LK, dtype=torch.int32))
    with pytest.raises(TypeError, match="mask must be bool"):
        masked_softmax(x, torch.zeros(LQ, LK, dtype=torch.float64))
    with pytest.raises(TypeError, match="mask must be a torch.Tensor"):
        masked_softmax(x, [[True]])
    with pytest.raises(ValueError, match="mask is on meta"):
        masked_softmax(x, torch.ones(LQ, LK, dtype=torch.bool, device="meta"))
    with pytest.raises(TypeError, match="x must be float32"):
        masked_softmax(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="scale must be a real number"):
        masked_softmax(x, scale=torch.tensor(0.5))
    with pytest.raises(ValueError, match="causal=True needs the softmax over the last dim"):
        masked_softmax(x, causal=True, dim=2)
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., seqlen_q, seqlen_k\)"):
        masked_softmax(randn(LK), causal=True)
    with pytest.raises(IndexError, match="dim=4"):
        masked_softmax(x, dim=4)
    with pytest.raises(ValueError, match="algorithm must be"):
        masked_softmax(x, algorithm="blocked")
    with pytest.raises(ValueError, match="algorithm='fused' holds rows"):
        masked_softmax(randn(1, FUSED_MAX_COLS + 1), algorithm="fused")



def _far_apart(values: torch.Tensor, stride: int) -> torch.Tensor:
    """A view of ``values`` (1-D) whose elements lie ``stride`` elements apart in a mostly untouched buffer
    (torch.empty reserves the pages; only the ones written are ever backed)."""
    buf = torch.empty((values.numel() - 1) * stride + 1, dtype=values.dtype)
    view = buf.as_strided(values.shape, (stride,))
    view.copy_(values)
    return view


@pytest.mark.parametrize("part", ["scores", "mask"])
def test_key_strides_past_2_31(part):
    """Keys 2^30 elements apart: offsets key x stride pass 2^31 and must not wrap (a crash or wrong keys)."""
    n_keys, stride = 4, 2**30
    x = randn(1, n_keys)
    keep = torch.tensor([[True, False, True, True]])
    if part == "scores":
        x = _far_apart(x[0], stride)[None]
    else:
        keep = _far_apart(keep[0], stride)[None]
    assert_close(masked_softmax(x, keep), masked_softmax_ref(x, keep))


def test_repeated_calls_replay_their_planned_launches(monkeypatch):
    # A call of a signature seen before (shapes, strides, dtypes and 16-byte alignment of x and the mask,
    # causal, algorithm, device) replays the first call's planned launches with its own tensors and scale.
    # The interpreter compiles nothing, so a stand-in launcher runs the same kernel, grid and arguments, and
    # counts: forward and hidden-zero kernels, and the backward's.
    replays = []

    def interpreted_launcher(kernel, grid, args, **meta):
        def run(new_args):
            replays.append(kernel.__name__ if hasattr(kernel, "__name__") else kernel.fn.__name__)
            _runtime.launch(kernel, grid, new_args, **meta)
        return run

    monkeypatch.setattr(_runtime, "compiled_launcher", interpreted_launcher)
    clear_plans()
    bias = lambda: randn(LQ, LK)  # noqa: E731
    cases = [  # (scores, mask, keyword arguments, signature seen before), made afresh for each call
        (lambda: randn(B, H, LQ, LK, scale=3.0), lambda: None, dict(causal=True, scale=0.5), False),
        (lambda: randn(B, H, LQ, LK, dtype=torch.bfloat16), lambda: bool_mask((B, 1, 1, LK)), dict(scale=2.0), False),
        (lambda: randn(B, H, LQ, LK), bias, dict(causal=True), False),
        (lambda: randn(B, H, LQ, LK), bias, dict(causal=True, scale=3.0), True),  # another scale, the same plan
    ]
    try:
        for make_x, make_mask, kw, seen in cases:
            for call in ("first", "second"):
                x, mask = make_x(), make_mask()
                before = len(replays)
                y = masked_softmax(x, mask, **kw)
                assert_close(y, masked_softmax_ref(x, mask, **kw), dtype=x.dtype)
                # A seen signature replays the forward and the hidden-zero kernel; a new one launches them.
                assert replays[before:] == (["_masked_softmax_fwd_kernel", "_zero_hidden_kernel"]
                                            if seen or call == "second" else []), (kw, call)
        # Gradients: the backward's launch replays on the second call too.
        for call in ("first", "second"):
            x = randn(B, H, LQ, LK, requires_grad=True)
            dy = randn(B, H, LQ, LK)
            before = replays.count("_masked_softmax_bwd_kernel")
            (dx,) = torch.autograd.grad(masked_softmax(x, causal=True, scale=0.7), x, dy)
            x64 = x.detach().double().requires_grad_()
            (ref,) = torch.autograd.grad(masked_softmax_ref(x64, None, causal=True, scale=0.7), x64, dy.double())
            assert_close(dx, ref, atol=1e-6)
            assert replays.count("_masked_softmax_bwd_kernel") - before == (call == "second")
        # Leading dims that do not merge launch per outer index, planned afresh (no replay), and agree.
        x, mask = randn(2, 3, 4, LQ, LK), bool_mask((2, 1, 4, 1, LK))
        before = len(replays)
        for _ in range(2):
            assert_close(masked_softmax(x, mask), masked_softmax_ref(x, mask))
        assert len(replays) == before
        # clear_plans forgets them: the next call of a seen signature plans afresh.
        clear_plans()
        x = randn(B, H, LQ, LK, scale=3.0)
        assert_close(masked_softmax(x, causal=True, scale=0.5), masked_softmax_ref(x, None, causal=True, scale=0.5))
        assert len(replays) == before
    finally:
        clear_plans()  # no planned call holds the stand-in launcher past the test


def test_causal_rows_without_a_mask_take_one_row_a_tile():
    # The forward of causal rows without a mask tensor cuts its fused tile to MASKED_CAUSAL_TILE_ELEMS scores
    # (one row a tile from 1024 keys); with a mask, and in the backward, tiles keep MASKED_TILE_ELEMS.
    masked_module = importlib.import_module("flashlite.masked_softmax")
    for seqlen, causal_rows, masked_rows in ((256, 4, 4), (1024, 1, 4), (2048, 1, 2), (4096, 1, 1)):
        x = torch.empty(4, 16, seqlen, seqlen)
        sizes, sx, sm = batch_layout(x, None)
        causal = masked_module._ForwardCall(x, None, sizes, sx, sm, True, "auto", None, None)
        mask = broadcast_mask(torch.ones(4, 1, 1, seqlen, dtype=torch.bool), x.shape)[0]
        sizes, sx, sm = batch_layout(x, mask)
        padded = masked_module._ForwardCall(x, mask, sizes, sx, sm, True, "auto", None, None)
        assert (causal.plan.algorithm, causal.plan.block_m, padded.plan.block_m) == ("fused", causal_rows, masked_rows)
        backward = masked_module._BackwardCall(x.view(-1, seqlen), x.view(-1, seqlen), seqlen, True, x.dtype, "auto",
                                               None, None)
        assert backward.plan.block_m == masked_rows


def test_causal_row_tiles_take_fewer_warps():
    # Their forward tiles hold MASKED_CAUSAL_THREAD_BYTES a thread (32 bf16 or 16 fp32 scores) on as few as
    # MASKED_CAUSAL_FEWEST_WARPS warps; masked rows and the backward keep 4 warps at the fewest.
    masked_module = importlib.import_module("flashlite.masked_softmax")
    assert (masked_module.MASKED_CAUSAL_THREAD_BYTES, masked_module.MASKED_CAUSAL_FEWEST_WARPS) == (64, 1)
    for dtype, warps in ((torch.bfloat16, (1, 1, 2, 4)), (torch.float32, (2, 2, 4, 8))):
        for seqlen, causal_warps in zip((256, 1024, 2048, 4096), warps):
            x = torch.empty(1, 1, 1, seqlen, dtype=dtype).expand(4, 16, seqlen, seqlen)  # (plans read shapes only)
            mask = broadcast_mask(torch.ones(4, 1, 1, seqlen, dtype=torch.bool), x.shape)[0]
            causal = masked_module.forward_plan(x, None, True)
            assert (causal.algorithm, causal.num_warps) == ("fused", causal_warps), (dtype, seqlen)
            assert causal.block_m * causal.block_n * x.element_size() == 64 * 32 * causal_warps
            assert masked_module.forward_plan(x, mask, True).num_warps == 4
            rows = x.reshape(-1, seqlen)  # (a view: the expanded rows)
            backward = masked_module._BackwardCall(rows, rows, seqlen, True, x.dtype, "auto", None, None)
            assert backward.plan.num_warps == 4


def test_wide_fused_rows_keep_their_warps():
    # Plain softmax gives wide fused rows half the warps (64 elements a thread); masked rows keep 32 a
    # thread (they lost 4-10% at 64 on the H100: TUNING.md#masked-elems-per-thread). Rows of up to 8192 keys agree.
    masked_module = importlib.import_module("flashlite.masked_softmax")
    for seqlen_k, masked_warps in ((1024, 4), (4096, 4), (8192, 8), (16384, 16)):
        plain = plan_softmax(8, seqlen_k, CPU)
        masked = masked_module.masked_plan(8, seqlen_k, CPU, "auto", None, None)
        assert masked.num_warps == masked_warps
        assert masked == dataclasses.replace(plain, num_warps=masked_warps)
    assert plan_softmax(8, 16384, CPU).num_warps == 8
