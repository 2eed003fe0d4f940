"""Long rows over a thread-block cluster (Hopper): each CTA of a row's cluster holds its part on chip.

A row of ``CTAS * PART`` columns is split over the ``CTAS`` CTAs of one cluster
(Gluon layouts whose CTA bases split the row's parts). Each CTA folds its part
into a state ``(m, d)`` and keeps the part's weights ``e^(x - m)``, one
exponential an element; the CTAs publish their states to global memory, meet at
the cluster's barrier (CUDA schedules a cluster's CTAs together, so none waits
for one that is not running), merge the row's states and rescale their held
weights by ``e^(m - m_row) / d_row``: one read and one write, as the shared-row
kernel, without its cooperative launch or its waits on flags. Triton 3.6 lowers
neither a reduction nor a layout conversion across CTAs (3.9 does both, through
distributed shared memory), so the states go through global memory (L2, 8 bytes
a part) and the barrier is inline PTX. The plan takes this kernel on Hopper GPUs
(``plan.clusters_supported``) for many aligned rows of ``tuning.CLUSTER_CTAS``'s
lengths.
"""

from __future__ import annotations

import functools

import torch

from ..core.online_softmax import LOG2E, merge_partial_states, normalize, online_update, rescale_factor, state_logsumexp
from ..core.runtime import launch
from .plan import SoftmaxPlan

try:  # Gluon: Triton >= 3.5 (the GPU image has 3.6, CI 3.9)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - older Triton: the plan never takes this kernel (clusters_supported)
    gluon = None


if gluon is not None:

    @gluon.jit
    def cluster_barrier(token):
        """Every thread of every CTA of the cluster waits here for all the others. Release and acquire at cluster
        scope order the global stores before it against the loads after it; it returns 0 (of ``token``'s shape),
        which the loads after it add to their offsets, so that nothing is moved above it."""
        return gl.inline_asm_elementwise(
            "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n\tmov.u32 $0, 0;",
            "=r,r", [token], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def softmax_cluster_kernel(
        x_ptr, y_ptr, lse_ptr, states_ptr, n_cols, stride_xm, stride_ym,
        PART: gl.constexpr, CTAS: gl.constexpr, ROW_LAYOUT: gl.constexpr, STATE_LAYOUT: gl.constexpr,
        EVEN: gl.constexpr, WRITE_Y: gl.constexpr, WRITE_LSE: gl.constexpr,
    ):
        # A cluster a row. ROW_LAYOUT spreads a [CTAS, PART] tile over the cluster, CTA i holding part i (its
        # CTA bases split dim 0); STATE_LAYOUT gives every CTA all CTAS states. states_ptr: (rows, 2, CTAS) fp32.
        row = gl.program_id(0).to(gl.int64)
        part = gl.arange(0, CTAS, layout=gl.SliceLayout(1, ROW_LAYOUT))
        cols = part[:, None] * PART + gl.arange(0, PART, layout=gl.SliceLayout(0, ROW_LAYOUT))[None, :]
        x_row = x_ptr + row * stride_xm
        if EVEN:
            x = gl.load(x_row + cols).to(gl.float32)
        else:
            x = gl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(gl.float32)
        m_empty = gl.full([CTAS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, ROW_LAYOUT))
        m, d, p, _ = online_update(m_empty, gl.zeros_like(m_empty), x, LOG2E)
        states = states_ptr + row * (2 * CTAS)
        gl.store(states + part, m)
        gl.store(states + CTAS + part, d)
        every = gl.arange(0, CTAS, layout=STATE_LAYOUT) + cluster_barrier(n_cols)
        # L2, not L1: the other CTAs' states were written from other multiprocessors.
        m_row, d_row = merge_partial_states(gl.load(states + every, cache_modifier=".cg"),
                                            gl.load(states + CTAS + every, cache_modifier=".cg"), LOG2E, 0)
        if WRITE_LSE:
            gl.store(lse_ptr + row, state_logsumexp(m_row, d_row, LOG2E))  # the same value from every CTA
        if WRITE_Y:
            y = normalize(p * rescale_factor(m, m_row, LOG2E)[:, None], gl.zeros_like(m) + d_row, False)
            y_row = y_ptr + row * stride_ym
            if EVEN:
                gl.store(y_row + cols, y.to(y_ptr.dtype.element_ty))
            else:
                gl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < n_cols)

else:  # pragma: no cover
    softmax_cluster_kernel = None


@functools.lru_cache(maxsize=None)
def cluster_layouts(ctas: int, num_warps: int, vec: int) -> tuple:
    """``(ROW_LAYOUT, STATE_LAYOUT)`` of ``softmax_cluster_kernel`` for a cluster of ``ctas`` (a power of two) CTAs of
    ``num_warps`` warps, ``vec`` columns (16 bytes) a thread's load."""
    bits = range(ctas.bit_length() - 1)
    row = gl.BlockedLayout([1, vec], [1, 32], [1, num_warps], [1, 0], [[1 << i, 0] for i in bits])
    state = gl.BlockedLayout([1], [32], [num_warps], [0], [[0] for _ in bits])  # CTA bases 0: every CTA all
    return row, state


def cluster_launch(
    x2d: torch.Tensor, y_arg: torch.Tensor, lse_arg: torch.Tensor, plan: SoftmaxPlan, write_y: bool, write_lse: bool,
) -> tuple:
    """``(grid, args, meta)`` of the cluster kernel's launch for the aligned rows of ``x2d`` under ``plan``
    (``plan.n_splits`` CTAs a row, ``plan.block_n`` columns each): a cluster a row, and the rows' states."""
    n_rows, n_cols = x2d.shape
    ctas = plan.n_splits
    states = torch.empty((n_rows, 2, ctas), dtype=torch.float32, device=x2d.device)
    row_layout, state_layout = cluster_layouts(ctas, plan.num_warps, 16 // x2d.element_size())
    args = (x2d, y_arg, lse_arg, states, n_cols, x2d.stride(0), n_cols)
    meta = dict(PART=plan.block_n, CTAS=ctas, ROW_LAYOUT=row_layout, STATE_LAYOUT=state_layout,
                EVEN=n_cols == ctas * plan.block_n, WRITE_Y=write_y, WRITE_LSE=write_lse, num_warps=plan.num_warps,
                num_ctas=ctas)
    return (n_rows,), args, meta


def launch_cluster(
    x2d: torch.Tensor, y_arg: torch.Tensor, lse_arg: torch.Tensor, plan: SoftmaxPlan, write_y: bool, write_lse: bool,
) -> None:
    """Run the cluster kernel on the rows of ``x2d`` under ``plan`` (``cluster_launch``)."""
    grid, args, meta = cluster_launch(x2d, y_arg, lse_arg, plan, write_y, write_lse)
    launch(softmax_cluster_kernel, grid, args, **meta)


def build_for_sm90(ctas: int, part: int, num_warps: int, dtype: torch.dtype = torch.bfloat16, even: bool = True,
                   write_y: bool = True, write_lse: bool = False) -> "triton.compiler.CompiledKernel":
    """The cluster kernel for rows of ``ctas * part`` columns of ``dtype`` (``even``: exactly that many), built for
    sm_90 on any machine, no GPU needed, with the argument types and alignments a launch on aligned rows gives:
    Triton's compiled kernel, whose ``asm["ptx"]`` the CPU build tests read."""
    import triton
    from triton.backends.compiler import GPUTarget

    from ..core.triton_compat import gluon_source, mangle_type

    row_layout, state_layout = cluster_layouts(ctas, num_warps, 16 // dtype.itemsize)
    constants = dict(PART=part, CTAS=ctas, ROW_LAYOUT=row_layout, STATE_LAYOUT=state_layout, EVEN=even,
                     WRITE_Y=write_y, WRITE_LSE=write_lse)
    types = {"x_ptr": mangle_type(torch.empty(1, dtype=dtype)), "y_ptr": mangle_type(torch.empty(1, dtype=dtype)),
             "lse_ptr": "*fp32", "states_ptr": "*fp32"}
    names = softmax_cluster_kernel.arg_names
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in names}
    aligned = tuple(i for i, name in enumerate(names) if name in types or name in ("n_cols", "stride_xm", "stride_ym"))
    return triton.compile(gluon_source(softmax_cluster_kernel, signature, constants, aligned),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_ctas": ctas})
