"""Softmax with the row held on chip: one program a row, the row one block, its state one update of the empty state.

The fused kernel of the write-ups this project grew from: one read of ``x`` and one
write of ``y``, where PyTorch's five-op softmax reads and writes the tensor
several times. A row must fit one program: up to ``MAX_COLS`` elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.checks import check_kernel_tensor
from ..core.online_softmax import LOG2E, empty_state, normalize, online_update
from ..core.runtime import launch

MAX_COLS = 65536  # a row as one fp32 block: 65536 values over 16 warps are 128 registers a thread
NUM_WARPS = 16


@triton.jit
def fused_softmax_kernel(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)[None, :]  # [1, BLOCK_N]: one row, the core's [ROWS, COLS] layout
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
    m, d = empty_state(1)
    m, d, p, _ = online_update(m, d, x, LOG2E)  # the whole row at once: m = max x, p = e^(x - m), d = sum p
    tl.store(y_ptr + row * stride_y + cols, normalize(p, d, False).to(y_ptr.dtype.element_ty), mask=ok)


def fused_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax of ``x`` along its last dim (fp32/fp16/bf16, any leading shape), one program a row.

    Raises ValueError for rows longer than ``MAX_COLS`` (``flashlite.softmax`` takes any length).
    """
    check_kernel_tensor("x", x)
    n_cols = x.shape[-1] if x.dim() else 1
    if n_cols > MAX_COLS:
        raise ValueError(f"x has rows of {n_cols} elements: the textbook fused kernel holds at most {MAX_COLS}")
    x2d = x.reshape(-1, n_cols).contiguous()
    y = torch.empty_like(x2d)
    if x2d.numel():
        launch(fused_softmax_kernel, (x2d.shape[0],), (x2d, y, n_cols, x2d.stride(0), y.stride(0)),
               BLOCK_N=triton.next_power_of_2(n_cols), num_warps=NUM_WARPS)
    return y.view(x.shape)
