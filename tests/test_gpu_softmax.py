"""Softmax on the GPU (``pytest -m gpu``): every regime against float64, outputs poisoned, past 2^31 elements.

Fresh random inputs, references in float64, outputs allocated from memory filled
with NaN first (``poison``), so an element a kernel forgets to write fails. The
regimes (``flashlite.softmax.plan``): fused tiles of several rows or one, rows
read twice (REREAD), rows over a thread-block cluster (Hopper), rows shared by
resident programs (cooperative launches: a GPU alone runs them), with streamed
heads, online whole and split, rows of odd length read in frames; the backward's
own (tiles kept, read twice, shared, online). Where a test forces a regime it
checks with the plan functions that the plan is that regime, and with
``launched`` that its kernel ran (no silent fallback to another). Regimes are
planned for a GPU of 132 multiprocessors (H100, H200). Errors are absolute for
outputs at most 1, relative to the largest value for gradients and log-sum-exps."""

from __future__ import annotations

import pytest
import torch
import triton

import flashlite
from flashlite.core import runtime
from flashlite.core.partials import BOTH_PASSES, FINAL_PASS, PARTIAL_PASS
from flashlite.softmax import api, backward, cluster, fused, online, plan as softmax_plan, shared_rows, tuning

from .utils import need_memory, poison

pytestmark = pytest.mark.gpu

# Absolute error of an output of at most 1 against float64: fp32 accumulation, then one rounding to the dtype.
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}
# Gradients: relative to the largest one (about 1 / n_cols: an absolute bound would pass zeros).
GRAD_TOL = {dtype: 4 * tol for dtype, tol in TOL.items()}
# Log-sum-exps of rows scaled by 10 are about 60, where a bf16 ulp is 0.25: relative.
LSE_TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 8e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # fp16 where its own conversions matter


def assert_softmax_close(y: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    """max |y - ref| <= tol, with NaN exactly where the reference has NaN."""
    y = y.double()
    assert torch.equal(y.isnan(), ref.isnan()), f"{what}: NaN where the reference has none, or the other way"
    err = (y - ref).nan_to_num(0.0).abs().max().item()
    assert err <= tol, f"{what}: max error {err:.2e} > {tol:.0e}"


def assert_relative(actual: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    """max |actual - ref| <= tol * max |ref| (NaN fails)."""
    err = ((actual.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= tol, f"{what}: max error {err:.2e} of the largest value > {tol:.0e}"


def softmax_grad64(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The float64 gradient of softmax(x) over the last dim for the incoming ``dy``."""
    x64 = x.detach().double().requires_grad_()
    (dx,) = torch.autograd.grad(torch.softmax(x64, -1), x64, dy.double())
    return dx


def check_logsumexp(x: torch.Tensor, what: str = "") -> None:
    """flashlite.logsumexp of the rows of ``x`` against float64, relative."""
    ref = torch.logsumexp(x.double(), -1)
    err = ((flashlite.logsumexp(x).double() - ref) / ref).abs().max().item()
    assert err <= LSE_TOL[x.dtype], f"logsumexp {what}: relative error {err:.2e} > {LSE_TOL[x.dtype]:.0e}"


def regime(p: softmax_plan.SoftmaxPlan) -> str:
    """A plan's regime: fused (tiles held on chip), reread, cluster (rows over a thread-block cluster), shared
    (rows over resident programs), shared heads (parts that stream a head too), online, online split."""
    if p.algorithm in ("cluster", "online"):
        return "online split" if p.algorithm == "online" and p.n_splits > 1 else p.algorithm
    if p.shares_rows:
        return "shared heads" if p.head_cols else "shared"
    return "reread" if p.reread else "fused"


def forward_label(x2d: torch.Tensor, out_dtype: torch.dtype, algorithm: str) -> str:
    """The regime flashlite's forward plans for ``x2d``, with how it reads the rows: " framed" (odd rows, from
    the first 16-byte boundary in each), " unaligned" (one element a load)."""
    p = softmax_plan.plan_rows(x2d, out_dtype, algorithm)
    return regime(p) + (" framed" if p.vec_cols > 1 else " unaligned" if p.vec_cols == 0 else "")


def backward_label(fwd: softmax_plan.SoftmaxPlan, y2d: torch.Tensor, dy2d: torch.Tensor) -> str:
    """The regime of the backward after a forward under ``fwd`` (y2d its output), " framed" as above."""
    p = softmax_plan.plan_backward(fwd, *y2d.shape, y2d.element_size(), y2d.device)
    return regime(p) + (" framed" if softmax_plan.backward_vectors(y2d, dy2d, y2d.dtype, p) > 1 else "")


@pytest.fixture
def launched(monkeypatch):
    """The softmax kernels launched while the test runs: a list of (kernel, options) the test may clear."""
    calls = []
    real = runtime.launch

    def spy(kernel, grid, args, **options):
        calls.append((kernel, options))
        return real(kernel, grid, args, **options)

    for module in (runtime, api, cluster, shared_rows, online, backward):  # each calls the launch it imported
        monkeypatch.setattr(module, "launch", spy)
    return calls


def assert_launched(calls: list, label: str, forward: bool) -> None:
    """The kernels in ``calls`` are the regime ``label``'s, and only they: no fallback to another regime."""
    name = label.split(" framed")[0].split(" unaligned")[0]
    kernels = {k for k, _ in calls}
    if name in ("fused", "reread"):
        kernel = fused.softmax_fused_kernel if forward else backward.softmax_bwd_fused_kernel
        assert kernels == {kernel}, f"{label}: launched {kernels}"
        assert all(o["REREAD"] == (name == "reread") for _, o in calls)
    elif name == "cluster":
        kernel = cluster.softmax_cluster_kernel if forward else cluster.softmax_bwd_cluster_kernel
        assert kernels == {kernel}, f"{label}: launched {kernels}"
        assert all(o["num_ctas"] == o["CTAS"] > 1 for _, o in calls)
    elif name.startswith("shared"):
        kernel = shared_rows.softmax_shared_rows_kernel if forward else backward.softmax_bwd_shared_rows_kernel
        assert kernels == {kernel}, f"{label}: launched {kernels} (the row's programs could not all be resident?)"
        assert all(o["launch_cooperative_grid"] for _, o in calls)
        if forward:
            assert all(o["HAS_HEAD"] == (name == "shared heads") for _, o in calls)
    else:
        kernel = online.softmax_online_kernel if forward else backward.softmax_bwd_online_kernel
        assert kernels == {kernel}, f"{label}: launched {kernels}"
        passes = [o["PASS"] for _, o in calls]
        assert passes == ([PARTIAL_PASS.value, FINAL_PASS.value] if name == "online split" else [BOTH_PASSES.value])
    if "framed" in label:
        assert all(o["VEC_COLS"] > 1 for _, o in calls)


# Every regime, forward and backward, on a GPU of 132 multiprocessors (H100, H200):
# (shape, dtype, algorithm, forward regime, backward regime).
REGIMES = [
    ((37, 100), torch.float32, "auto", "fused", "fused"),  # short rows, several a tile; the backward keeps it
    ((64, 3001), torch.bfloat16, "auto", "fused framed", "fused framed"),  # a row a tile, odd: read in frames
    ((3, 16384), torch.float16, "auto", "fused", "reread"),  # the backward loads y and dy twice past 8192 columns
    ((5, 16385), torch.float32, "auto", "fused framed", "reread framed"),
    ((1100, 65536), torch.bfloat16, "auto", "cluster", "reread"),  # many rows of 65536: a cluster a row
    ((600, 30000), torch.float16, "auto", "cluster", "reread"),  # columns past the row's end, in the last CTA
    ((540, 100_000), torch.float32, "auto", "cluster", "cluster"),  # 8 CTAs, the last one past the row's end
    ((5, 200_000), torch.float32, "auto", "shared", "shared"),  # longer than a program holds: shared rows
    ((3, 100_003), torch.bfloat16, "auto", "shared framed", "shared framed"),
    ((300, 262144), torch.float32, "auto", "shared heads", "shared"),  # fp32 waves: each part streams a head
    ((1, 1 << 24), torch.bfloat16, "auto", "shared heads", "online split"),  # longer than the programs hold
    ((3, 5_000_001), torch.float32, "auto", "shared heads framed", "online split framed"),
    ((4096, 50257), torch.bfloat16, "online", "online framed", "online framed"),  # streamed, whole rows
    ((2, 3_000_000), torch.float32, "online", "online split", "online split"),  # few rows: split
    ((5, 1_000_003), torch.float16, "online", "online split framed", "online split framed"),
]


@pytest.mark.parametrize("shape,dtype,algorithm,fwd_regime,bwd_regime", REGIMES,
                         ids=[f"{s[0]}x{s[1]}-{str(d)[6:]}-{a}" for s, d, a, _, _ in REGIMES])
def test_every_regime(shape, dtype, algorithm, fwd_regime, bwd_regime, launched):
    x = (torch.randn(*shape, device="cuda", dtype=dtype) * 3).requires_grad_()
    assert forward_label(x, dtype, algorithm) == fwd_regime
    poison()
    launched.clear()
    y = flashlite.softmax(x, algorithm=algorithm)
    assert_launched(launched, fwd_regime, forward=True)
    assert_softmax_close(y, torch.softmax(x.detach().double(), -1), TOL[dtype], fwd_regime)
    dy = torch.randn_like(y)
    assert backward_label(softmax_plan.plan_rows(x, dtype, algorithm), y, dy) == bwd_regime
    poison()
    launched.clear()
    (dx,) = torch.autograd.grad(y, x, dy)
    assert_launched(launched, bwd_regime, forward=False)
    assert_relative(dx, softmax_grad64(x, dy), GRAD_TOL[dtype], f"backward {bwd_regime}")


def test_unaligned_rows_shared(launched):
    # A strided view of odd rows (row stride 150000, length 100003): neither aligned nor in a frame, read one
    # element a load in the unaligned tiles; its backward (y, dy contiguous) in frames.
    wide = torch.randn(3, 150_000, device="cuda") * 3
    x = wide[:, :100_003].requires_grad_()
    assert forward_label(x, x.dtype, "auto") == "shared unaligned"
    poison()
    y = flashlite.softmax(x)
    assert_launched(launched, "shared unaligned", forward=True)
    assert_softmax_close(y, torch.softmax(x.detach().double(), -1), TOL[x.dtype])
    dy = torch.randn_like(y)
    assert backward_label(softmax_plan.plan_rows(x, x.dtype), y, dy) == "shared framed"
    launched.clear()
    (dx,) = torch.autograd.grad(y, x, dy)
    assert_launched(launched, "shared framed", forward=False)
    assert_relative(dx, softmax_grad64(x, dy), GRAD_TOL[x.dtype])


# (shape, dtypes): every algorithm on each; fp16 (bf16's kernels in another dtype) on a few.
FORWARD_CASES = [
    ((1, 1), DTYPES),
    ((37, 100), DTYPES),  # short rows: several a tile
    ((4096, 257), DTYPES[:2]),
    ((3, 16384), DTYPES[:2]),  # a row a program, aligned
    ((5, 16385), DTYPES),  # ... odd: in frames
    ((7, 100_003), DTYPES),  # shared rows, in frames
    ((4096, 50257), DTYPES[:2]),  # shared rows in waves (a GPT-2 vocabulary)
    ((5, 1_000_003), DTYPES[:2]),  # shared rows with heads, in frames
    ((1, (1 << 24) - 1), DTYPES[:2]),  # one row longer than the resident programs hold: each part streams a head
    ((3, 5_000_001), DTYPES[:2]),
]
FORWARD_PARAMS = [(shape, dtype) for shape, dtypes in FORWARD_CASES for dtype in dtypes]


@pytest.mark.parametrize("shape,dtype", FORWARD_PARAMS, ids=[f"{s[0]}x{s[1]}-{str(d)[6:]}" for s, d in FORWARD_PARAMS])
def test_forward_every_algorithm(shape, dtype):
    x = torch.randn(*shape, device="cuda", dtype=dtype) * 3
    ref = torch.softmax(x.double(), -1)
    for algorithm in ("auto", "fused", "online"):  # "fused" on a GPU: rows of any length, shared past one program
        poison()
        y = flashlite.softmax(x, algorithm=algorithm)
        assert_softmax_close(y, ref, TOL[dtype], f"{algorithm} ({forward_label(x, dtype, algorithm)})")


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=lambda d: str(d)[6:])
def test_backward(dtype):
    # Rows on chip and streamed, of lengths that are multiples of 16 and odd ones (read in frames), rows
    # shared by resident programs (in parts that end inside the row, that fill it, framed, in waves), a
    # 3-D tensor, and dy a strided view.
    for shape in ((64, 3000), (64, 3001), (37, 30001), (16, 32768), (64, 20000), (300, 65536), (3, 200_000),
                  (3, 200_003), (5, 7, 1001)):
        x = torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        poison()
        (dx,) = torch.autograd.grad(flashlite.softmax(x), x, dy)
        rows = dy.view(-1, shape[-1])  # laid out as y: contiguous, from a fresh allocation
        fwd = softmax_plan.plan_rows(x.detach().view(-1, shape[-1]), dtype)
        assert_relative(dx, softmax_grad64(x, dy), GRAD_TOL[dtype], f"{shape} ({backward_label(fwd, rows, rows)})")
    x = torch.randn(40, 3001, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(40, 3100, device="cuda", dtype=dtype)[:, :3001]
    (dx,) = torch.autograd.grad(flashlite.softmax(x), x, dy)
    assert_relative(dx, softmax_grad64(x, dy), GRAD_TOL[dtype], "dy a strided view")


# The backward over a cluster, whatever tuning.BWD_CLUSTER holds: (shape, dtype, CTAs, warps a CTA).
BACKWARD_CLUSTERS = [
    ((128, 131072), torch.bfloat16, 8, 8),
    ((64, 65536), torch.float32, 4, 16),
    ((33, 100_000), torch.float16, 8, 16),  # the last CTA past the row's end
    ((70, 32768), torch.bfloat16, 2, 8),
]


@pytest.mark.parametrize("shape,dtype,ctas,warps", BACKWARD_CLUSTERS,
                         ids=[f"{s[0]}x{s[1]}-{str(d)[6:]}-c{c}w{w}" for s, d, c, w in BACKWARD_CLUSTERS])
def test_backward_cluster(shape, dtype, ctas, warps, launched, monkeypatch):
    # Rows over a thread-block cluster, their parts' sums traded through distributed shared memory: through
    # autograd (dy as y), then the kernel alone with dy a view of its own strides (a row stride past the row, then
    # a column stride 3).
    tile = triton.next_power_of_2(shape[1])
    monkeypatch.setattr(tuning, "BWD_CLUSTER", {dtype.itemsize: {tile: (ctas, warps)}})
    api.clear_plans()
    try:
        x = (torch.randn(*shape, device="cuda", dtype=dtype) * 3).requires_grad_()
        y = flashlite.softmax(x)
        dy = torch.randn_like(y)
        assert backward_label(softmax_plan.plan_rows(x, dtype), y, dy) == "cluster"
        poison()
        launched.clear()
        (dx,) = torch.autograd.grad(y, x, dy)
        assert_launched(launched, "cluster", forward=False)
        assert all(o["CTAS"] == ctas and o["num_warps"] == warps for _, o in launched)
        ref = softmax_grad64(x, dy)
        assert_relative(dx, ref, GRAD_TOL[dtype], f"cluster backward {ctas}x{warps}")
        p = softmax_plan.plan_backward(softmax_plan.plan_rows(x, dtype), *shape, x.element_size(), x.device)
        wide = torch.randn(shape[0], shape[1] + 48, device="cuda", dtype=dtype)
        wide[:, :shape[1]] = dy
        cols = torch.randn(shape[1], 3 * shape[0], device="cuda", dtype=dtype)
        cols[:, ::3] = dy.t()
        for view in (wide[:, :shape[1]], cols[:, ::3].t()):
            poison()
            launched.clear()
            dx = backward.softmax_backward(y.detach(), view, dtype, p)
            assert_launched(launched, "cluster", forward=False)
            assert_relative(dx, ref, GRAD_TOL[dtype], f"cluster backward, dy strides {view.stride()}")
    finally:
        api.clear_plans()


# Cluster shapes, whatever tuning.CLUSTER holds: (shape, dtype, CTAs, warps a CTA).
FORCED_CLUSTERS = [
    ((300, 32768), torch.bfloat16, 2, 16),
    ((257, 65536), torch.bfloat16, 4, 8),
    ((129, 131072), torch.float32, 8, 8),
    ((70, 100_000), torch.float16, 8, 4),  # the last CTA past the row's end
]


@pytest.mark.parametrize("shape,dtype,ctas,warps", FORCED_CLUSTERS,
                         ids=[f"{s[0]}x{s[1]}-{str(d)[6:]}-c{c}w{w}" for s, d, c, w in FORCED_CLUSTERS])
def test_cluster_shapes(shape, dtype, ctas, warps, launched):
    # Both cluster kernels on the CTAs and warps given, forward (y and the log-sum-exp at once) and backward, against
    # float64, twice: the states and sums pushed through distributed shared memory merge in one order, so the
    # second run gives the same bits. A CTA's part wholly -inf in one row, the maximum in another's last CTA.
    part = triton.next_power_of_2(shape[1]) // ctas
    plan = softmax_plan.SoftmaxPlan("cluster", 1, part, warps, ctas, part)
    x = torch.randn(*shape, device="cuda", dtype=dtype) * 3
    x[0, :part] = float("-inf")
    x[1, -1] = 40.0
    dy = torch.randn_like(x)
    lse_ref = torch.logsumexp(x.double(), -1)
    runs = []
    for _ in range(2):
        poison()
        y, lse, dx = torch.empty_like(x), torch.empty(shape[0], device="cuda"), torch.empty_like(x)  # NaN
        launched.clear()
        cluster.launch_cluster(x, y, lse, plan, True, True)
        cluster.launch_backward_cluster(y, dy, dx, plan)
        assert [(o["CTAS"], o["num_warps"]) for _, o in launched] == [(ctas, warps)] * 2
        assert_softmax_close(y, torch.softmax(x.double(), -1), TOL[dtype], "cluster")
        assert_relative(dx, softmax_grad64(x, dy), GRAD_TOL[dtype], "cluster backward")
        assert ((lse.double() - lse_ref).abs() <= LSE_TOL[dtype] * lse_ref.abs().clamp_min(1)).all()
        runs.append((y, lse, dx))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=lambda d: str(d)[6:])
def test_logsumexp(dtype):
    check_logsumexp(torch.randn(6, 70_000, device="cuda", dtype=dtype) * 10, "shared rows")  # about 60
    check_logsumexp(torch.randn(9, 70_001, device="cuda", dtype=dtype) * 3, "odd rows")
    check_logsumexp(torch.randn(4096, 300, device="cuda", dtype=dtype) * 10, "fused tiles")
    check_logsumexp(torch.randn(3, 3_000_000, device="cuda", dtype=dtype) * 10, "rows with heads")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("n_cols", [65536, 40000])
def test_read_twice_special_rows(n_cols, dtype, monkeypatch):
    # Many 16-bit rows of up to 65536 read twice, a program a row (65536; 40000 fills too little of the tile
    # and is shared instead), as on a GPU without clusters: special rows and large magnitudes; errors relative
    # to each row's largest value.
    monkeypatch.setattr(softmax_plan, "clusters_supported", lambda device: False)
    api.clear_plans()
    try:
        _check_read_twice_special_rows(n_cols, dtype)
    finally:
        api.clear_plans()  # no reread plan left cached for the tests after this one


def _check_read_twice_special_rows(n_cols: int, dtype: torch.dtype) -> None:
    x = torch.randn(1100, n_cols, device="cuda", dtype=dtype) * 3
    assert forward_label(x, dtype, "auto") == ("reread" if n_cols == 65536 else "shared")
    x[0] = float("-inf")  # NaN, as torch
    x[1, 50] = float("nan")
    x[2, -1] = 60.0  # the maximum in the last column, in the high half
    x[3, :32768] = float("-inf")  # an empty low half
    x[4] = x[4] * 3000  # about +-1e4
    poison()
    y, ref = flashlite.softmax(x).double(), torch.softmax(x.double(), -1)
    assert torch.equal(y.isnan(), ref.isnan())
    rel = (y - ref).nan_to_num(0.0).abs().amax(-1) / ref.nan_to_num(0.0).abs().amax(-1).clamp_min(1e-30)
    assert rel.max().item() <= 8e-3
    check_logsumexp(x[5:] * 10, "read twice")


@pytest.mark.parametrize("shape,dtype", [((1100, 65536), torch.bfloat16), ((600, 30000), torch.float16),
                                         ((540, 131072), torch.float32), ((540, 100_000), torch.float32)],
                         ids=["1100x65536-bf16", "600x30000-fp16", "540x131072-fp32", "540x100000-fp32"])
def test_cluster_special_rows(shape, dtype):
    # Rows over a thread-block cluster: a CTA's part wholly -inf (its weights 0, not NaN), a row of -inf (NaN, as
    # torch), a row with NaN and one with +inf (NaN rows), the maximum in the last column, rows far from 0 and of
    # large magnitude, an output dtype of its own, the log-sum-exp (of the special rows too); poisoned outputs.
    n_rows, n_cols = shape
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=dtype) * 3
    assert forward_label(x, dtype, "auto") == "cluster"
    part = softmax_plan.plan_rows(x, dtype).block_n
    x[0, :part] = float("-inf")  # the first CTA's part
    x[1, part:] = float("-inf")  # every part but the first
    x[2] = float("-inf")
    x[3, 50] = float("nan")
    x[4, -1] = float("inf")
    x[5, -1] = 60.0
    x[6] = x[6] * 3000
    x[7] = x[7] - 300
    ref = torch.softmax(x.double(), -1)
    for out_dtype in (dtype, torch.float32):
        poison()
        y = flashlite.softmax(x, dtype=out_dtype)
        assert y.dtype == out_dtype
        y = y.double()
        assert torch.equal(y.isnan(), ref.isnan())
        rel = (y - ref).nan_to_num(0.0).abs().amax(-1) / ref.nan_to_num(0.0).abs().amax(-1).clamp_min(1e-30)
        assert rel.max().item() <= (8e-3 if out_dtype != torch.float32 else 2e-5), out_dtype
        assert (y[0, :part] == 0).all() and (y[1, part:] == 0).all()
    check_logsumexp(x[8:] * 10, "cluster")
    lse, lse_ref = flashlite.logsumexp(x).double(), torch.logsumexp(x.double(), -1)
    assert torch.equal(lse[:8].isnan(), lse_ref[:8].isnan()) and torch.equal(lse[:8].isinf(), lse_ref[:8].isinf())
    finite = lse_ref[:8].isfinite()
    assert ((lse[:8] - lse_ref[:8])[finite].abs() <= LSE_TOL[dtype] * lse_ref[:8][finite].abs().clamp_min(1)).all()


def test_cluster_rows_of_views():
    # The cluster kernel on an aligned strided view (row stride past the row's length) reads the rows in place;
    # rows that start 3 elements past a 16-byte boundary are read in frames instead (shared rows), same answers.
    wide = torch.randn(1100, 65536 + 16, device="cuda", dtype=torch.bfloat16) * 3
    view = wide[:, :65536]
    assert forward_label(view, view.dtype, "auto") == "cluster"
    base = torch.randn(1100 * 65536 + 3, device="cuda", dtype=torch.bfloat16) * 3
    unaligned = base[3:].view(1100, 65536)
    assert forward_label(unaligned, unaligned.dtype, "auto") != "cluster"
    for x in (view, unaligned):
        poison()
        label = forward_label(x, x.dtype, "auto")
        assert_softmax_close(flashlite.softmax(x), torch.softmax(x.double(), -1), TOL[x.dtype], label)


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=lambda d: str(d)[6:])
def test_shared_rows_special_values(dtype):
    # Rows shared by resident programs: parts that hold nothing, a row of -inf (NaN, as torch), NaN in one
    # part (the whole row NaN), the maximum in the last part; heads streamed twice with empty heads and the
    # maximum at the end.
    x = torch.randn(5, 200_000, device="cuda", dtype=dtype) * 3
    assert forward_label(x, dtype, "auto").startswith("shared")
    x[0, :100_000] = float("-inf")
    x[1] = float("-inf")
    x[2, 150_000] = float("nan")
    x[3] = torch.linspace(-30, 30, 200_000, device="cuda")
    poison()
    assert_softmax_close(flashlite.softmax(x), torch.softmax(x.double(), -1), TOL[dtype], "parts")
    x = torch.randn(2, 9_000_000, device="cuda", dtype=dtype) * 3
    assert forward_label(x, dtype, "auto") == "shared heads"
    x[0, :4_000_000] = float("-inf")
    x[1, 8_999_000] = 40.0
    poison()
    assert_softmax_close(flashlite.softmax(x), torch.softmax(x.double(), -1), TOL[dtype], "heads")


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=lambda d: str(d)[6:])
def test_unaligned_bases_and_repeated_calls(dtype):
    # Bases past a 16-byte boundary (rows read from the first boundary in each, the output as far past one),
    # twice each, in the input dtype and in fp32: the second call repeats the first one's launch (its fast
    # path must be ready); then odd rows to fp32.
    for n_rows, n_cols, skip in ((3, 100_003, 1), (4096, 50257, 5), (64, 65536, 3)):
        x = torch.randn(n_rows * n_cols + skip, device="cuda", dtype=dtype)[skip:].view(n_rows, n_cols).mul_(3)
        assert x.data_ptr() % 16
        ref = torch.softmax(x.double(), -1)
        for out_dtype in dict.fromkeys((dtype, torch.float32)):
            for call in ("first", "second"):
                poison()
                y = flashlite.softmax(x, dtype=out_dtype)
                what = (f"({n_rows}, {n_cols}) +{skip} -> {out_dtype}, {call} call "
                        f"({forward_label(x, out_dtype, 'auto')})")
                assert y.dtype == out_dtype
                assert_softmax_close(y, ref, TOL[out_dtype], what)
            assert api._REPEATS.get(api.repeat_key(x, 1, out_dtype, "auto")) is not None, f"{what}: no fast path"
        check_logsumexp(x, f"base {skip} elements past")
    x = torch.randn(9, 70_001, device="cuda", dtype=dtype) * 3
    poison()
    assert_softmax_close(flashlite.softmax(x, dtype=torch.float32), torch.softmax(x.double(), -1), TOL[torch.float32])


def test_repeated_calls_take_the_fast_path():
    # A call with a signature seen before repeats the first call's launch: the second call of each must find
    # that launch ready and agree with float64, for misaligned x and another output dtype too.
    base = torch.randn(4096 * 256 + 8, device="cuda")
    cases = [(torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16), None),
             (torch.randn(2, 8, 100, 1000, device="cuda", dtype=torch.float16), None),
             (torch.randn(4096, 5000, device="cuda"), None),
             (torch.randn(64, 300, device="cuda", dtype=torch.bfloat16), torch.float32),
             (base[1:1 + 4096 * 256].view(4096, 256), None),  # 4 bytes past 16-byte alignment
             (base[4:4 + 4096 * 256].view(4096, 256), None),
             (torch.randn(3, 100_003, device="cuda"), None),  # shared rows, the last part ragged
             (torch.randn(16, 1 << 20, device="cuda", dtype=torch.bfloat16), None),  # one wave with heads
             (torch.randn(1100, 57344, device="cuda", dtype=torch.bfloat16), None),  # over clusters, part past the end
             (torch.randn(1100, 65536, device="cuda", dtype=torch.bfloat16), torch.float32),  # over clusters
             (torch.randn(1, 1 << 24, device="cuda"), None)]  # a row longer than the resident programs hold
    for x, out_dtype in cases:
        ref = torch.softmax(x.double(), -1)
        for call in ("first", "repeat"):
            poison()
            y = flashlite.softmax(x, dtype=out_dtype)
            what = f"{call} call {tuple(x.shape)} {x.dtype} -> {out_dtype} ptr % 16 = {x.data_ptr() % 16}"
            assert api._REPEATS.get(api.repeat_key(x, x.dim() - 1, out_dtype or x.dtype, "auto")) is not None, what
            assert y.dtype == (out_dtype or x.dtype), what
            assert_softmax_close(y, ref, TOL[x.dtype], what)


def test_shared_row_slots_streams_and_graphs():
    # Shared-row slots are not zeroed between launches (core.partials.zeroed_slots): launches of few and many
    # slots in turn, a second stream, and a captured CUDA graph replayed on new data between eager calls.
    few = torch.randn(2, 3_000_000, device="cuda")
    many = torch.randn(4096, 40_000, device="cuda", dtype=torch.bfloat16)
    assert forward_label(few, few.dtype, "auto").startswith("shared")
    assert forward_label(many, many.dtype, "auto").startswith("shared")
    side = torch.cuda.Stream()
    for turn in range(3):
        for x in (few, many, few):
            assert_softmax_close(flashlite.softmax(x), torch.softmax(x.double(), -1), TOL[x.dtype], f"turn {turn}")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y_side = flashlite.softmax(many)
        y_main = flashlite.softmax(few)
        torch.cuda.current_stream().wait_stream(side)
        for x, y in ((many, y_side), (few, y_main)):
            assert_softmax_close(y, torch.softmax(x.double(), -1), TOL[x.dtype], f"turn {turn}, two streams")
    static = torch.randn(16, 1 << 20, device="cuda")
    graph_stream = torch.cuda.Stream()
    graph_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(graph_stream):
        flashlite.softmax(static)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(graph_stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = flashlite.softmax(static)
    for turn in range(3):
        static.copy_(torch.randn_like(static) * (turn + 1))
        graph.replay()
        flashlite.softmax(few)  # an eager launch between replays
        assert_softmax_close(y_graph, torch.softmax(static.double(), -1), TOL[torch.float32], f"replay {turn}")


@pytest.mark.parametrize("shape", [(16, 1 << 20), (1, 1 << 24)], ids=["16x1M", "1x16M"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_shared_rows_are_deterministic(shape, dtype):
    # The parts of a row merge in a fixed order: 20 repeats give the same bits.
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    first = flashlite.softmax(x)
    differ = sum(not torch.equal(flashlite.softmax(x), first) for _ in range(20))
    assert differ == 0, f"{differ} of 20 repeats differ"


def test_every_dim():
    x = torch.randn(8, 9, 300, device="cuda")
    for dim in range(3):
        assert_softmax_close(flashlite.softmax(x, dim=dim), torch.softmax(x.double(), dim), TOL[torch.float32],
                             f"dim {dim}")


# More than 2^31 elements: 64-bit offsets. (shape, algorithm, dtype); the last rows against float64 (relative to
# their largest value, about 1 / n_cols: bf16 rounding is 4e-3 of it), every row's sum (forward: 1; backward: 0)
# and finiteness (poisoned outputs).
HUGE_TOL = {torch.bfloat16: 8e-3, torch.float32: 2e-5}
HUGE = [  # (shape, algorithm, dtype, the forward's regime)
    ((2**31 // 8192 + 1, 8192), "auto", torch.bfloat16, "fused"),  # a row a tile; backward read twice
    ((2**31 // 4095 + 1, 4095), "auto", torch.bfloat16, "fused framed"),  # the backward keeps its tiles
    ((2**31 // 30001 + 1, 30001), "auto", torch.bfloat16, "fused framed"),  # backward read twice, in frames
    ((2**31 // 32768 + 1, 32768), "auto", torch.bfloat16, "cluster"),  # clusters of 2 CTAs
    ((2**31 // 50257 + 1, 50257), "online", torch.bfloat16, "online framed"),  # streamed whole rows
    ((2**31 // 50257 + 1, 50257), "auto", torch.bfloat16, "shared framed"),
    ((2**31 // 65536 + 1, 65536), "auto", torch.bfloat16, "cluster"),  # the backward read twice
    ((2**31 // 2**24 + 1, 2**24), "auto", torch.bfloat16, "shared heads"),  # backward online split
    ((2**31 // 65536 + 1, 65536), "auto", torch.float32, "cluster"),  # backward over a cluster too: 8.6 GB each
]


@pytest.mark.parametrize("shape,algorithm,dtype,fwd_regime", HUGE,
                         ids=[f"{s[0]}x{s[1]}-{a}-{str(d)[6:]}" for s, a, d, _ in HUGE])
def test_more_than_2_31_elements(shape, algorithm, dtype, fwd_regime):
    n_bytes = shape[0] * shape[1] * dtype.itemsize
    need_memory(5 * n_bytes)  # x, y, dy, dx and a poisoned block
    x = torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_()
    assert x.numel() > 2**31
    label = forward_label(x, dtype, algorithm)
    assert label == fwd_regime
    poison(n_bytes)
    y = flashlite.softmax(x, algorithm=algorithm)
    row_sums = y.detach().sum(-1, dtype=torch.float32)
    sum_tol = 1e-2 if dtype != torch.float32 else 1e-4
    assert bool(torch.isfinite(y).all()), f"{label}: an element not finite (never written?)"
    assert (row_sums - 1).abs().max().item() <= sum_tol, f"{label}: a row does not sum to 1"
    tail = torch.softmax(x[-3:].detach().double(), -1)
    assert_relative(y[-3:], tail, HUGE_TOL[dtype], f"{label}, last rows")
    dy = torch.randn_like(y)
    bwd_label = backward_label(softmax_plan.plan_rows(x, dtype, algorithm), y, dy)
    poison(n_bytes)
    (dx,) = torch.autograd.grad(y, x, dy)
    del x
    assert bool(torch.isfinite(dx).all()), f"backward {bwd_label}: an element not finite (never written?)"
    assert dx.sum(-1, dtype=torch.float32).abs().max().item() <= 2 * sum_tol, f"backward {bwd_label}: a row sum"
    yd, dyd = y[-3:].detach().double(), dy[-3:].double()
    ref = yd * (dyd - (yd * dyd).sum(-1, keepdim=True))
    assert_relative(dx[-3:], ref, HUGE_TOL[dtype], f"backward {bwd_label}, last rows")

