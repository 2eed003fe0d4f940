"""The softmax backward's plans (softmax.plan_backward) and its shared-row kernel, whose resident programs hold a
row of y and dy between them and trade the partial sums of dy * y (online_softmax.share_partial_sums)."""

import dataclasses
import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from flashlite.softmax import api, backward, plan as softmax_plan, tuning
from flashlite.core import runtime as _runtime
from flashlite.core.partials import pack_sum, unpack_sum

from .utils import H100, assert_close, randn, softmax_grad_ref, softmax_ref

GPU = torch.device("cuda", 0)  # a stand-in: only plans are made for it
CPU = torch.device("cpu")



@triton.jit
def _sum_round_trip_kernel(value_ptr, packed_ptr, value_out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    packed = pack_sum(tl.load(value_ptr + offs))
    tl.store(packed_ptr + offs, packed)
    tl.store(value_out_ptr + offs, unpack_sum(packed))


def _host_packed_sums(values: torch.Tensor) -> torch.Tensor:
    """pack_sum on the host: the float32 bits low, a 1 above them, as int64."""
    bits = values.float().numpy().view(np.uint32).astype(np.uint64) | np.uint64(1 << 32)
    return torch.from_numpy(bits.view(np.int64).copy())


def test_packed_sums_round_trip_and_are_never_zero():
    values = torch.tensor([0.0, -0.0, 1.5, -3e-8, float("inf"), float("-inf"), float("nan"), 1e30])
    packed, out = torch.empty(8, dtype=torch.int64), torch.empty(8)
    _sum_round_trip_kernel[(1,)](values, packed, out, N=8)
    assert torch.equal(out.view(torch.int32), values.view(torch.int32))  # bit for bit, -0.0 and NaN included
    assert torch.equal(packed, _host_packed_sums(values))
    assert (packed != 0).all()  # 0 is "not published yet": 0.0 must not pack to it


def _part_sums(y: torch.Tensor, dy: torch.Tensor, block_n: int, n_parts: int, vec_cols: int) -> torch.Tensor:
    """float64 sum(dy * y) of each part of each row, as the kernel splits rows: part p holds columns
    [p * block_n, (p + 1) * block_n) of the row's frame, part 0 also the edges outside its whole vectors."""
    n_rows, n_cols = y.shape
    sums = torch.zeros(n_rows, n_parts, dtype=torch.float64)
    for r in range(n_rows):
        pre = (vec_cols - r * n_cols % vec_cols) % vec_cols if vec_cols > 1 else 0
        hi = max(n_cols - pre, 0) // vec_cols * vec_cols if vec_cols > 1 else n_cols
        for p in range(n_parts):
            cols = [pre + c for c in range(p * block_n, min((p + 1) * block_n, hi))]
            if p == 0:
                cols += [c for c in range(n_cols) if c < pre or c >= pre + hi]
            sums[r, p] = (y[r, cols].double() * dy[r, cols].double()).sum()
    return sums


@pytest.mark.parametrize(
    "dtype,n_cols,vec_cols",
    [
        (torch.float32, 64, 1),  # every part inside the row: no masks (EVEN_COLS)
        (torch.float32, 50, 1),  # the last part ragged (2 columns)
        (torch.bfloat16, 61, 8),  # rows read in frames: each starts elsewhere in a vector, part 0 takes the edges
        (torch.float32, 61, 4),
        (torch.float32, 9, 4),  # rows shorter than two vectors: some have no whole vector at all
    ],
)
def test_shared_rows_backward_kernel_with_the_other_parts_published(dtype, n_cols, vec_cols):
    # As for the forward's shared-row kernel: the interpreter runs programs one at a time, so the row's other
    # parts are published beforehand (float64 sums of their columns); each program still publishes its own
    # sum, waits for the row's slots, adds them and writes its part of dx. Three rows a program (row_step 1).
    n_rows, block_n = 3, 16
    n_parts = max(math.ceil(n_cols / block_n), 1)
    y = softmax_ref(randn(n_rows, n_cols, scale=3.0)).to(dtype)
    dy = randn(n_rows, n_cols, dtype=dtype)
    slots = _host_packed_sums(_part_sums(y, dy, block_n, n_parts, vec_cols).flatten())
    slots[0] = 0  # the first program publishes its own slot before waiting
    dx = torch.full((n_rows, n_cols), float("nan"), dtype=dtype)
    clear = torch.randint(1, 1 << 40, (21,))  # what an earlier launch published: zeroed for the next one
    with _runtime.quiet_interpreter():  # the test's own launch: as flashlite's
        backward.softmax_bwd_shared_rows_kernel[(n_parts,)](
            y, dy, dx, slots, clear, 19, n_rows, n_cols, n_parts, n_cols, dy.stride(0), dy.stride(1), n_cols,
            BLOCK_N=block_n, PARTS_POW2=triton.next_power_of_2(n_parts), PREFETCH=tuning.PREFETCH_NONE, VEC_COLS=vec_cols,
            EVEN_COLS=vec_cols == 1 and n_cols == n_parts * block_n, CLEAR_BLOCK=8,
        )
    tol = 2e-6 if dtype == torch.float32 else 8e-3
    ref = softmax_grad_ref(y, dy)
    assert (dx.double() - ref).abs().max() <= tol * ref.abs().max()
    assert slots[0] != 0 and (clear[:19] == 0).all() and (clear[19:] != 0).all()


def test_backward_plans(monkeypatch):
    # On a (stand-in) H100: rows of 8192 columns and more take a program each that loads y and dy twice, up to
    # 32768 fp32 / 65536 16-bit columns; longer rows are shared by resident programs of BWD_TILES columns;
    # shorter ones keep the forward's tiles; online stays online; rows of more parts than multiprocessors stream.
    monkeypatch.setattr(softmax_plan, "shares_rows_on_chip", lambda device: device.type == "cuda")
    monkeypatch.setattr(softmax_plan, "device_info", lambda device: H100)
    monkeypatch.setattr(softmax_plan, "clusters_supported", lambda device: False)  # forwards as without clusters
    api.clear_plans()
    try:
        def plans(n_rows, n_cols, dtype, algorithm="auto", device=GPU, vec_cols=1):
            forward = softmax_plan.plan_softmax(n_rows, n_cols, device, algorithm, shared_rows=dtype, vec_cols=vec_cols)
            return forward, softmax_plan.plan_backward(forward, n_rows, n_cols, dtype.itemsize, device)

        for n_cols in (2000, 4000, 4096):  # tiles of several rows, and one-row tiles of fewer than 8192 columns
            fwd, bwd = plans(4096, n_cols, torch.float32)
            assert bwd == fwd and not bwd.reread
        # Rows of BWD_SHORT_TILES's lengths (fp32 256-1024, bf16 1024 as it stands): tiles of BWD_SHORT_TILE_ELEMS on
        # BWD_SHORT_WARPS warps, no more rows than there are (rounded up to a power of two); others keep the forward's.
        short = tuning.BWD_SHORT_TILE_ELEMS
        for n_rows, n_cols, rows in ((4096, 256, short // 256), (4096, 1000, short // 1024), (3, 256, 4), (1, 1024, 1)):
            assert plans(n_rows, n_cols, torch.float32)[1] == softmax_plan.SoftmaxPlan(
                "fused", rows, triton.next_power_of_2(n_cols), tuning.BWD_SHORT_WARPS)
        assert plans(1, 1001, torch.bfloat16, vec_cols=8)[1].vec_cols == 8  # one row a tile: still in frames
        assert plans(4096, 1024, torch.bfloat16)[1].num_warps == tuning.BWD_SHORT_WARPS
        for n_cols, dtype in ((256, torch.bfloat16), (128, torch.float32), (2048, torch.float32)):
            fwd, bwd = plans(4096, n_cols, dtype)
            assert bwd == fwd
        reread = softmax_plan.SoftmaxPlan("fused", 1, 32768, 32, reread=True)
        assert plans(4096, 32768, torch.float32)[1] == reread
        assert plans(4096, 20000, torch.float32)[1] == reread and plans(4096, 5000, torch.float32)[1].block_n == 8192
        assert plans(4096, 20000, torch.float32, "fused")[1] == reread
        assert plans(4096, 8192, torch.bfloat16)[1] == softmax_plan.SoftmaxPlan("fused", 1, 8192, 32, reread=True)
        fwd, bwd = plans(4096, 50257, torch.bfloat16, vec_cols=8)  # in frames, shared by the forward; a program a row here
        assert fwd.shares_rows and bwd == softmax_plan.SoftmaxPlan("fused", 1, 65536, 32, reread=True)
        fwd, bwd = plans(4096, 65536, torch.float32)  # fp32 past 32768: parts of 8192 columns, held
        assert (bwd.algorithm, bwd.block_n, bwd.n_splits, bwd.num_warps, bwd.prefetch) == ("fused", 8192, 8, 4, 0)
        assert bwd.shares_rows and bwd.cols_per_split == 8192 and bwd.head_cols == 0 and not bwd.reread
        _, bwd = plans(4096, 40000, torch.float32)  # 5 parts of 8000 -> 8192, the last one ragged
        assert (bwd.block_n, bwd.n_splits) == (8192, 5)
        _, bwd = plans(128, 1 << 17, torch.bfloat16)  # 16-bit parts ask the next row's part into L2
        assert (bwd.block_n, bwd.n_splits, bwd.num_warps, bwd.prefetch) == (8192, 16, 4, tuning.PREFETCH_L2.value)
        _, bwd = plans(16, 1 << 20, torch.float32)  # 128 parts: one program a multiprocessor still holds them
        assert (bwd.n_splits, bwd.shares_rows) == (128, True)
        _, bwd = plans(4, 1 << 22, torch.float32)  # 512 parts: more than the multiprocessors; streamed
        assert bwd == softmax_plan.plan_softmax(4, 1 << 22, GPU, "online")
        fwd, bwd = plans(4096, 65536, torch.float32, "online")
        assert bwd == fwd
        assert plans(4096, 32768, torch.float32, device=CPU)[1] == reread  # the interpreter too
        assert plans(4, 65536, torch.float32, device=CPU)[1].algorithm == "online"  # it shares no rows
    finally:
        api.clear_plans()


@pytest.mark.parametrize(
    "dtype,n_rows,n_cols,skip",
    [
        (torch.float32, 3, 100, 0),  # one tile a row, masked past the row
        (torch.bfloat16, 2, 64, 0),
        (torch.float32, 3, 61, 0),  # rows read in frames: the edges held, the whole vectors loaded twice
        (torch.bfloat16, 3, 61, 3),  # dy from a base 3 elements past a boundary: no frames, one element a load
    ],
)
def test_fused_backward_loading_y_and_dy_twice(dtype, n_rows, n_cols, skip):
    # The plan of wide rows (BWD_REREAD_MIN_COLS and more) at a size the interpreter runs: REREAD loads y and dy
    # once for sum(dy * y) and again for dx.
    plan = softmax_plan.SoftmaxPlan("fused", 1, triton.next_power_of_2(n_cols), 4, reread=True)
    y = softmax_ref(randn(n_rows, n_cols, scale=3.0)).to(dtype)
    dy = randn(n_rows * n_cols + skip, dtype=dtype)[skip:].view(n_rows, n_cols)
    assert softmax_plan.plan_backward(plan, n_rows, n_cols, y.element_size(), CPU) == plan  # runs as given
    assert softmax_plan.backward_vectors(y, dy, dtype, plan) == (1 if skip or n_cols % 16 == 0 else 16 // y.element_size())
    dx = backward.softmax_backward(y, dy, dtype, plan)
    ref = softmax_grad_ref(y, dy)
    tol = 2e-6 if dtype == torch.float32 else 8e-3
    assert (dx.double() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("n_cols", [40, 37])  # rows of whole vectors, and rows read in frames
def test_shared_rows_backward_falls_back_to_streaming_where_programs_cannot_wait(monkeypatch, n_cols):
    # A shared backward plan that cannot launch (the interpreter: a row's programs would wait for each other
    # forever) streams the rows instead, with the right answer.
    shared = softmax_plan.SoftmaxPlan("fused", 1, 16, 4, 3, 16)
    monkeypatch.setattr(softmax_plan, "plan_backward", lambda plan, *args: shared)
    y = softmax_ref(randn(5, n_cols, scale=3.0)).float()
    dy = randn(5, n_cols)
    assert_close(backward.softmax_backward(y, dy, torch.float32, dataclasses.replace(shared, n_splits=9)), softmax_grad_ref(y, dy))
