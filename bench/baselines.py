"""Textbook softmax kernels flashlite is measured against (the seeds' designs: one program per row).

Kept here, not in the package: they are baselines, written plainly.
"""

import torch
import triton
import triton.language as tl

from flashlite.cli import naive_softmax  # noqa: F401  the five-op PyTorch softmax (seed 002), the demo's first stage


@triton.jit
def _row_fused_kernel(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + row * stride_y + cols, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def _row_online_kernel(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    m = float("-inf")
    d = 0.0
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, (tl.exp(x - m) / d).to(y_ptr.dtype.element_ty), mask=cols < n_cols)


def textbook_fused_softmax(x: torch.Tensor) -> torch.Tensor:
    """One program per row, the whole row in one block (seed 001); None past 65536 columns."""
    n_rows, n_cols = x.shape
    y = torch.empty_like(x)
    block = triton.next_power_of_2(n_cols)
    _row_fused_kernel[(n_rows,)](x, y, n_cols, x.stride(0), y.stride(0), BLOCK_N=block, num_warps=8 if block > 2048 else 4)
    return y


def textbook_online_softmax(x: torch.Tensor) -> torch.Tensor:
    """One program per row, two passes over blocks of 1024 (seed 004)."""
    n_rows, n_cols = x.shape
    y = torch.empty_like(x)
    _row_online_kernel[(n_rows,)](x, y, n_cols, x.stride(0), y.stride(0), BLOCK_N=1024, num_warps=4)
    return y
