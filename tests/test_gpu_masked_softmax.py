"""Masked softmax on the GPU (``pytest -m gpu``): masks, causal alignments, regimes, gradients, past 2^31 scores.

Fresh random scores, the float64 reference of tests/utils.py (on CPU copies),
outputs poisoned before the kernels write them. Each case must be within the
dtype's absolute tolerance, have NaN only where the reference has, and be
exactly 0 wherever the reference is (masked positions, empty rows). Each case
names the regime it is meant for (``flashlite.softmax.plan.plan_softmax``, the
planner masked softmax shares: fused tiles, online whole rows, online split
rows), checked before it runs.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from flashlite import masked_softmax
from flashlite.core.masking import broadcast_mask
from flashlite.masked_softmax import batch_layout
from flashlite.softmax import plan as softmax_plan

from .test_gpu_softmax import TOL
from .utils import masked_softmax_ref, need_memory, poison

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def masked_regime(x: torch.Tensor, mask: torch.Tensor | None, algorithm: str) -> str:
    """The regime masked_softmax plans for scores ``x`` (..., Lq, Lk): fused, online or online split. Leading dims
    that do not merge (``batch_layout``) are launched one outer index at a time, on the last two."""
    sizes, _, _ = batch_layout(x, None if mask is None else broadcast_mask(mask, x.shape)[0])
    seqlen_q, seqlen_k = x.shape[-2:]
    p = softmax_plan.plan_softmax(sizes[-2] * sizes[-1] * seqlen_q, seqlen_k, x.device, algorithm)
    if p.algorithm == "online":
        return "online split" if p.n_splits > 1 else "online"
    return p.algorithm


def assert_masked_close(y: torch.Tensor, ref: torch.Tensor, atol: float, what: str) -> None:
    """Max error within ``atol``, no NaN the reference lacks, exact zeros where the reference is 0."""
    y = y.detach().double().cpu()
    assert not (torch.isnan(y) & ~torch.isnan(ref)).any(), f"{what}: NaN where the reference has none"
    assert not ((ref == 0) & (y != 0)).any(), f"{what}: nonzero where masked (or in an empty row)"
    err = (y - ref).abs().nan_to_num(nan=float("inf")).max().item() if y.numel() else 0.0
    assert err <= atol, f"{what}: max error {err:.2e} > {atol:.0e}"


def rand_mask(shape, keep: float = 0.7) -> torch.Tensor:
    return torch.rand(shape, device="cuda") < keep


# (name, scores shape, mask maker or None, causal, scale, algorithm, regime)
CASES = [
    ("causal Lq = Lk", (2, 4, 257, 257), None, True, 1.0, "auto", "fused"),
    ("causal Lq < Lk", (2, 4, 100, 1000), None, True, 0.125, "auto", "fused"),
    ("causal Lq > Lk (empty rows)", (2, 4, 300, 129), None, True, 1.0, "auto", "fused"),
    ("key padding", (3, 4, 64, 1000), lambda s: rand_mask((s[0], 1, 1, s[3])), False, 0.5, "auto", "fused"),
    ("key padding + causal", (3, 4, 512, 512), lambda s: rand_mask((s[0], 1, 1, s[3])), True, 0.5, "auto", "fused"),
    ("full bool, fully masked rows", (2, 3, 128, 333), lambda s: rand_mask(s, 0.02), False, 1.0, "auto", "fused"),
    ("(Lq, Lk) float bias + causal", (2, 4, 200, 300), lambda s: torch.randn(s[2:], device="cuda") * 2, True, 0.3,
     "auto", "fused"),
    # Leading dims that do not merge with the mask's: one launch per outer index.
    ("per-head bias, 3 leading dims", (2, 3, 2, 64, 100), lambda s: torch.randn((2, 1, 2, 1, 100), device="cuda"),
     False, 1.0, "auto", "fused"),
    ("long rows, few: split", (1, 2, 3, 100_003), lambda s: rand_mask((1, 1, 1, s[3])), True, 1.0, "auto",
     "online split"),
    ("long rows, many, on chip", (1, 4, 64, 20_000), lambda s: rand_mask((s[0], 1, 1, s[3])), True, 1.0, "auto",
     "fused"),
    ("long rows, many, streamed", (1, 1, 128, 40_000), lambda s: rand_mask((s[0], 1, 1, s[3])), True, 1.0, "auto",
     "online"),
    ("online forced", (2, 4, 333, 5000), lambda s: rand_mask((s[0], 1, s[2], s[3])), True, 1.0, "online", "online"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name,shape,make_mask,causal,scale,algorithm,regime", CASES, ids=[c[0] for c in CASES])
def test_masked_softmax(name, shape, make_mask, causal, scale, algorithm, regime, dtype):
    x = torch.randn(shape, device="cuda", dtype=dtype) * 3
    mask = make_mask(shape) if make_mask else None
    assert masked_regime(x, mask, algorithm) == regime
    poison()
    y = masked_softmax(x, mask, scale=scale, causal=causal, algorithm=algorithm)
    ref = masked_softmax_ref(x.cpu(), None if mask is None else mask.cpu(), scale, causal)
    assert_masked_close(y, ref, TOL[dtype], f"{name} {tuple(shape)}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape,regime", [((2, 4, 300, 700), "fused"), ((1, 2, 4, 70_000), "online split")],
                         ids=["on chip", "long rows"])
def test_masked_softmax_backward(shape, regime, dtype):
    # dx and the gradient of a per-head bias (summed over the batch and queries), causal, scaled.
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    bias = torch.randn(shape[1], 1, shape[3], device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(shape, device="cuda", dtype=dtype)
    assert masked_regime(x, bias, "auto") == regime
    poison()
    dx, dbias = torch.autograd.grad(masked_softmax(x, bias, scale=0.7, causal=True), (x, bias), dy)
    x64 = x.detach().cpu().double().requires_grad_()
    b64 = bias.detach().cpu().double().requires_grad_()
    rx, rb = torch.autograd.grad(masked_softmax_ref(x64, b64, 0.7, True), (x64, b64), dy.cpu().double())
    assert_masked_close(dx, rx, 4 * TOL[dtype], "dx")
    # The bias gradient sums B x Lq terms: its tolerance is relative to its size.
    assert_masked_close(dbias, rb, 4 * TOL[dtype] * max(1.0, rb.abs().max().item()), "dbias")


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=lambda d: str(d)[6:])
def test_repeated_calls_replay_their_launches(dtype):
    # A second call of a signature replays the planned launches (core.runtime.PersistentLaunch) with its own
    # tensors and scale: fresh data, another scale, poisoned memory, a NaN row (the hidden-zero kernel's), and
    # the backward; each must find its replay ready and agree with float64.
    masked_module = importlib.import_module("flashlite.masked_softmax")
    shape = (2, 4, 200, 1000)
    cases = [(None, True), (lambda: rand_mask((shape[0], 1, 1, shape[3])), False),
             (lambda: torch.randn(shape[2:], device="cuda"), True)]
    for make_mask, causal in cases:
        for call, scale in (("first", 0.5), ("repeat", 2.0), ("repeat", 0.125)):
            x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
            with torch.no_grad():
                x[1, 2, 7] = float("nan")  # its hidden positions still exactly 0
            mask = None if make_mask is None else make_mask()
            poison()
            y = masked_softmax(x, mask, scale=scale, causal=causal)
            what = f"{call} call, mask {None if mask is None else tuple(mask.shape)}, causal {causal}"
            ref = masked_softmax_ref(x.detach().cpu(), None if mask is None else mask.cpu(), scale, causal)
            finite = torch.isfinite(ref).all(-1)  # every row but the NaN one
            assert_masked_close(y.detach().cpu()[finite], ref[finite], TOL[dtype], what)
            nan_row, nan_ref = y.detach().cpu()[1, 2, 7].double(), ref[1, 2, 7]
            assert torch.equal(nan_row.isnan(), nan_ref.isnan()), f"{what}: the NaN row's NaN positions"
            assert bool((nan_row[nan_ref == 0] == 0).all()), f"{what}: the NaN row's hidden positions not 0"
            dy = torch.randn_like(y)
            poison()
            (dx,) = torch.autograd.grad(y, x, dy)
            yd, dyd = ref.double(), dy.cpu().double()
            dref = scale * yd * (dyd - (yd * dyd).nan_to_num().sum(-1, keepdim=True))
            assert_masked_close(dx.detach().cpu()[finite], dref[finite], 4 * TOL[dtype], f"{what}, backward")
            assert bool((dx.detach().cpu()[1, 2, 7][nan_ref == 0] == 0).all()), f"{what}: backward, NaN row"
    planned = list(masked_module._CALLS.values())
    assert planned and all(c.forward is None or c.forward._run is not None for c in planned
                           if hasattr(c, "forward")), "a planned forward has no replay"
    assert all(c.backward is None or c.backward._run is not None for c in planned
               if hasattr(c, "backward")), "a planned backward has no replay"


def test_more_than_2_31_scores():
    # 64-bit row offsets: (1, 33, 8192, 8192) bf16 scores under causal and key padding, forward and backward;
    # the last rows of the last head against float64, every row's sum (1, or 0 for a row that sees no key) and
    # finiteness (the outputs were poisoned).
    b, h, length = 1, 33, 8192
    n_bytes = b * h * length * length * 2
    need_memory(5 * n_bytes)  # x, y, dy, dx and a poisoned block
    x = torch.randn(b, h, length, length, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert x.numel() > 2**31
    pad = rand_mask((b, 1, 1, length), 0.8)
    assert masked_regime(x, pad, "auto") == "fused"
    poison(n_bytes)
    y = masked_softmax(x, pad, causal=True)
    assert bool(torch.isfinite(y).all()), "an element not finite (never written?)"
    sums = y.detach().sum(-1, dtype=torch.float32)
    assert bool(((sums - 1).abs() <= 1e-2).logical_or(sums == 0).all()), "a row sums neither to 1 nor to 0"
    # Lq = 4 keeps the bottom-right diagonal: the last four queries of the full (8192, 8192) rows.
    tail = masked_softmax_ref(x.detach()[:, -1:, -4:].cpu(), pad.cpu(), None, True)
    assert_masked_close(y[:, -1:, -4:], tail, TOL[torch.bfloat16], "last rows")
    dy = torch.randn_like(y)
    poison(n_bytes)
    (dx,) = torch.autograd.grad(y, x, dy)
    del x
    assert bool(torch.isfinite(dx).all()), "backward: an element not finite (never written?)"
    yd, dyd = y.detach()[:, -1:, -4:].double(), dy[:, -1:, -4:].double()
    ref = (yd * (dyd - (yd * dyd).sum(-1, keepdim=True))).cpu()
    assert_masked_close(dx[:, -1:, -4:], ref, 4 * TOL[torch.bfloat16] * ref.abs().max().item(), "backward, last rows")
