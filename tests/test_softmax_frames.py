"""Rows that start unaligned (odd lengths, bases past a 16-byte boundary), read in frames by the one-row fused
tiles, the online kernels and both backward kernels (softmax._row_frame), against float64 torch."""


import pytest
import torch

from flashlite.softmax import frames, plan as softmax_plan
from flashlite.softmax.api import softmax_forward
from flashlite.softmax.backward import softmax_backward
from flashlite.softmax.plan import plan_softmax

from .utils import assert_close, randn, softmax_grad_ref, softmax_ref

CPU = torch.device("cpu")
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3}


def rows_at(n_rows: int, n_cols: int, skip: int, dtype: torch.dtype, scale: float = 3.0) -> torch.Tensor:
    """A contiguous (n_rows, n_cols) tensor whose first element lies ``skip`` elements past an aligned one."""
    return randn(n_rows * n_cols + skip, dtype=dtype, scale=scale)[skip:].view(n_rows, n_cols)



def test_plans_read_odd_rows_in_frames():
    x = rows_at(3, 2049, 0, torch.float32)
    fused = softmax_plan.plan_rows(x, torch.float32, "fused")
    assert (fused.block_m, fused.vec_cols) == (1, 4)  # one row a tile: frames
    assert softmax_plan.plan_rows(x, torch.bfloat16, "fused").vec_cols == 8  # the output's vectors too
    assert softmax_plan.plan_rows(rows_at(64, 1000, 0, torch.float32), torch.float32, "fused").vec_cols == 1  # tiles of rows
    assert softmax_plan.plan_rows(rows_at(3, 2048, 0, torch.float32), torch.float32, "fused").vec_cols == 1  # aligned
    online = plan_softmax(3, 2049, CPU, "online", block_n=4, vec_cols=8)
    assert online.vec_cols == 8 and online.block_n == 8  # chunks of whole vectors (_body_end)
    assert softmax_plan.output_lead(rows_at(3, 2049, 3, torch.float32), fused) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_rows,n_cols,skip", [(3, 2049, 0), (2, 4095, 3), (4, 2051, 1), (1, 3001, 5)])
def test_fused_one_row_tiles_in_frames(dtype, n_rows, n_cols, skip):
    x = rows_at(n_rows, n_cols, skip, dtype)
    plan = softmax_plan.plan_rows(x, dtype, "fused")
    assert plan.block_m == 1 and plan.vec_cols == 16 // x.element_size()
    y, lse = softmax_forward(x, dtype, plan, write_lse=True)
    assert y.data_ptr() % 16 == x.data_ptr() % 16  # the output as far past a boundary as x
    assert_close(y, softmax_ref(x), atol=TOL[dtype], rtol=0)
    assert_close(lse, torch.logsumexp(x.double(), -1), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_cols,skip,block_n,n_splits", [(301, 0, 16, 1), (301, 3, 16, 4), (77, 1, 8, 3),
                                                          (5, 2, 8, 1), (3, 7, 8, 1)])
def test_online_in_frames(dtype, n_cols, skip, block_n, n_splits):
    # Rows inside one vector (5 or 3 columns), the last chunk past the frame's whole vectors, split rows.
    x = rows_at(4, n_cols, skip, dtype)
    vec = frames.row_vectors(x, dtype)
    assert vec > 1
    plan = plan_softmax(4, n_cols, CPU, "online", block_n=block_n, n_splits=n_splits, vec_cols=vec)
    y, lse = softmax_forward(x, dtype, plan, write_lse=True)
    assert_close(y, softmax_ref(x), atol=TOL[dtype], rtol=0)
    assert_close(lse, torch.logsumexp(x.double(), -1), atol=1e-4, rtol=1e-5)


def test_frames_keep_special_rows():
    x = rows_at(4, 2049, 1, torch.float32)
    x[0, :3] = float("-inf")  # the row's first edge
    x[1] = float("-inf")  # NaN, as torch
    x[2, 2048] = float("nan")  # NaN in the last edge: the whole row NaN
    x[3, 2047] = 50.0  # the maximum in the last edge
    ref = softmax_ref(x)
    for plan in (softmax_plan.plan_rows(x, torch.float32, "fused"),
                 plan_softmax(4, 2049, CPU, "online", block_n=256, n_splits=3, vec_cols=4)):
        y, _ = softmax_forward(x, torch.float32, plan)
        assert torch.equal(y.isnan(), ref.isnan())
        assert_close(y.nan_to_num(0.0), ref.nan_to_num(0.0))


def test_backward_vectors():
    plan = softmax_plan.SoftmaxPlan("fused", 1, 4096, 4)
    y, dy = randn(3, 2049), randn(3, 2049)
    assert softmax_plan.backward_vectors(y, dy, torch.float32, plan) == 4
    assert softmax_plan.backward_vectors(y.bfloat16(), dy.bfloat16(), torch.float32, plan) == 8
    assert softmax_plan.backward_vectors(randn(3, 2048), randn(3, 2048), torch.float32, plan) == 1  # aligned rows
    assert softmax_plan.backward_vectors(y, dy, torch.float32, softmax_plan.SoftmaxPlan("fused", 4, 1024, 4)) == 1  # tiles of rows
    assert softmax_plan.backward_vectors(y, randn(3, 2100)[:, :2049], torch.float32, plan) == 1  # dy's rows start elsewhere
    assert softmax_plan.backward_vectors(rows_at(3, 2049, 1, torch.float32), dy, torch.float32, plan) == 1  # y's base


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("algorithm,n_cols", [("fused", 2049), ("fused", 4095), ("online", 301), ("online", 3)])
def test_backward_in_frames(dtype, algorithm, n_cols):
    y = softmax_ref(randn(3, n_cols, scale=3.0)).to(dtype)
    dy = randn(3, n_cols, dtype=dtype)
    if algorithm == "fused":
        plan = plan_softmax(3, n_cols, CPU, "fused")
    else:
        plan = plan_softmax(3, n_cols, CPU, "online", block_n=16, n_splits=1 if n_cols < 16 else 3)
    assert softmax_plan.backward_vectors(y, dy, dtype, plan) > 1
    dx = softmax_backward(y, dy, dtype, plan)
    ref = softmax_grad_ref(y, dy)
    assert_close(dx, ref, atol=4 * TOL[dtype] * ref.abs().max().item() + 1e-7, rtol=0)


@pytest.mark.parametrize("algorithm", ["fused", "online"])
def test_backward_of_odd_rows_as_they_come(algorithm):
    # dy a strided view, y from an unaligned base: no frames (backward_vectors 1), one element a load.
    n_cols = 2049 if algorithm == "fused" else 301
    y = softmax_ref(rows_at(3, n_cols, 1, torch.float32)).float()
    y = rows_at(3, n_cols, 1, torch.float32).copy_(y)
    dy = randn(3, n_cols + 30)[:, :n_cols]
    plan = plan_softmax(3, n_cols, CPU, algorithm, **({"block_n": 16, "n_splits": 2} if algorithm == "online" else {}))
    assert softmax_plan.backward_vectors(y, dy, torch.float32, plan) == 1
    assert_close(softmax_backward(y, dy, torch.float32, plan), softmax_grad_ref(y, dy), atol=1e-6, rtol=0)
