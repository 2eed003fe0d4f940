"""The forward's read-twice regime (REREAD): many 16-bit rows a little too long for one program to hold take a
program each that reads its row twice, first in two halves for the state (m, d), then whole for y
(softmax.FWD_REREAD_MAX_COLS). Its plans on a stand-in H100, and its kernel through the interpreter at small sizes."""


import pytest
import torch

from flashlite.softmax import api, backward, frames, plan as softmax_plan, tuning

from .utils import H100, assert_close, randn, softmax_grad_ref, softmax_ref

GPU = torch.device("cuda", 0)  # a stand-in: only plans are made for it
CPU = torch.device("cpu")


def test_read_twice_plans(monkeypatch):
    # Aligned 16-bit rows of 32769..65536 columns that fill at least FWD_REREAD_MIN_FILL of their tile, in at
    # least FWD_REREAD_MIN_WAVES waves of one program a multiprocessor; everything else keeps its plan. On a GPU
    # without thread-block clusters: Hopper's take such rows over clusters (test_softmax_cluster.py).
    monkeypatch.setattr(softmax_plan, "shares_rows_on_chip", lambda device: device.type == "cuda")
    monkeypatch.setattr(softmax_plan, "clusters_supported", lambda device: False)
    monkeypatch.setattr(softmax_plan, "device_info", lambda device: H100)
    api.clear_plans()
    try:
        reread = softmax_plan.SoftmaxPlan("fused", 1, 65536, tuning.FWD_REREAD_WARPS, reread=True)
        for dtype in (torch.bfloat16, torch.float16):
            assert softmax_plan.plan_softmax(4096, 65536, GPU, shared_rows=dtype) == reread
            assert softmax_plan.plan_softmax(4096, 65536, GPU, "fused", shared_rows=dtype) == reread
        assert softmax_plan.plan_softmax(4096, 49168, GPU, shared_rows=torch.bfloat16) == reread  # 75% of the tile
        min_rows = tuning.FWD_REREAD_MIN_WAVES * H100.num_sms
        assert softmax_plan.plan_softmax(min_rows, 65536, GPU, shared_rows=torch.bfloat16) == reread
        others = [
            softmax_plan.plan_softmax(4096, 65536, GPU, shared_rows=torch.float32),  # fp32 spilled read twice: shared rows
            softmax_plan.plan_softmax(4096, 40000, GPU, shared_rows=torch.bfloat16),  # 61% of the tile
            softmax_plan.plan_softmax(min_rows - 1, 65536, GPU, shared_rows=torch.bfloat16),  # too few rows
            softmax_plan.plan_softmax(4096, 65536, GPU, shared_rows=torch.bfloat16, vec_cols=8),  # in frames (spilled)
            softmax_plan.plan_softmax(4096, 65536, GPU, shared_rows=torch.bfloat16, vec_cols=0),  # one element a load
            softmax_plan.plan_softmax(4096, 65536, GPU, shared_rows=torch.bfloat16, n_splits=4),  # parts forced
            softmax_plan.plan_softmax(4096, 131072, GPU, shared_rows=torch.bfloat16),  # longer than the tile read twice
        ]
        assert all(plan.shares_rows and not plan.reread for plan in others)
        assert not softmax_plan.plan_softmax(4096, 32768, GPU, shared_rows=torch.bfloat16).reread  # held by one program
        assert softmax_plan.plan_softmax(4096, 65536, GPU, "online", shared_rows=torch.bfloat16).algorithm == "online"
        assert softmax_plan.plan_softmax(4096, 65536, GPU).algorithm == "online"  # masked softmax: no such regime
        assert softmax_plan.plan_softmax(4096, 65536, CPU, shared_rows=torch.bfloat16).algorithm == "online"  # interpreter
        # Its backward: a program a row loading y and dy twice, as after the shared rows it replaces.
        assert softmax_plan.plan_backward(reread, 4096, 65536, 2, GPU) == softmax_plan.SoftmaxPlan("fused", 1, 65536, 32, reread=True)
    finally:
        api.clear_plans()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "n_cols,block_n,skip",
    [
        (64, 64, 0),  # the row fills both halves
        (48, 64, 0),  # the high half ragged
        (16, 64, 0),  # the high half empty
        (61, 64, 1),  # read in frames (a base one element past a boundary): edges held, the halves masked at hi
    ],
)
def test_read_twice_kernel(dtype, n_cols, block_n, skip):
    # Special rows: all -inf (NaN, as torch), NaN in the high half, the maximum in the last column, an empty
    # low half (the whole row where the high half is empty), large magnitudes; then the log-sum-exp alone (one
    # read) and the backward of such a forward (y and dy loaded twice too).
    n_rows = 7
    x = randn(n_rows * n_cols + skip, dtype=dtype, scale=3.0)[skip:].view(n_rows, n_cols)
    x[0] = float("-inf")
    x[1, n_cols - 2] = float("nan")
    x[2, -1] = 40.0
    x[3, : min(n_cols, block_n // 2)] = float("-inf")
    x[4] = x[4] * 3000
    plan = softmax_plan.SoftmaxPlan("fused", 1, block_n, 2, vec_cols=max(frames.row_vectors(x, dtype), 1), reread=True)
    assert (plan.vec_cols > 1) == bool(skip)
    y, lse = api.softmax_forward(x, dtype, plan, write_lse=True)
    assert_close(y, softmax_ref(x))
    assert_close(lse, torch.logsumexp(x.double(), -1), atol=1e-5, rtol=1e-5)
    _, lse_alone = api.softmax_forward(x, dtype, plan, write_y=False, write_lse=True)
    assert torch.equal(lse_alone.nan_to_num(), lse.nan_to_num())
    dy = randn(n_rows, n_cols, dtype=dtype)
    dx = backward.softmax_backward(y, dy, dtype, plan)
    assert_close(dx, softmax_grad_ref(y, dy), atol=2e-2 if dtype == torch.bfloat16 else 2e-3)
