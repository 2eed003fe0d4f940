"""Softmax streamed in blocks: one program a row, two passes, any row length.

The online kernel of the write-ups this project grew from: pass 1 folds block after
block into the running state ``(m, d)``, each block rescaling what was summed
under an older maximum by ``alpha = e^(m_old - m_new)``; pass 2 reads the row
again and writes ``y = e^(x - m) / d``. The row is read twice, but no row is
too long.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.checks import check_kernel_tensor
from ..core.online_softmax import LOG2E, empty_state, final_weights, online_update
from ..core.runtime import launch

BLOCK_N = 1024  # columns a block
NUM_WARPS = 4


@triton.jit
def online_softmax_kernel(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    m, d = empty_state(1)
    for start in range(0, n_cols, BLOCK_N):  # pass 1: the row's state, block by block
        cols = start + tl.arange(0, BLOCK_N)[None, :]
        x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m, d, _, _ = online_update(m, d, x, LOG2E)
    for start in range(0, n_cols, BLOCK_N):  # pass 2: each block's weights under the final state
        cols = start + tl.arange(0, BLOCK_N)[None, :]
        x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        y = final_weights(x, m, d, LOG2E, False)
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=cols < n_cols)


def online_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax of ``x`` along its last dim (fp32/fp16/bf16, any leading shape, any row length), one program a row."""
    check_kernel_tensor("x", x)
    n_cols = x.shape[-1] if x.dim() else 1
    x2d = x.reshape(-1, n_cols).contiguous()
    y = torch.empty_like(x2d)
    if x2d.numel():
        launch(online_softmax_kernel, (x2d.shape[0],), (x2d, y, n_cols, x2d.stride(0), y.stride(0)),
               BLOCK_N=min(BLOCK_N, triton.next_power_of_2(n_cols)), num_warps=NUM_WARPS)
    return y.view(x.shape)
