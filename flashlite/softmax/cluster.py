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
lengths. The backward's kernel holds a row's y and dy so, and its CTAs trade
their parts of ``sum(dy * y)`` (``tuning.BWD_CLUSTER``).
"""

from __future__ import annotations

import functools

import torch

from ..core.online_softmax import (
    LOG2E, merge_partial_states, merge_states, normalize, online_update, rescale_factor, state_logsumexp,
)
from ..core.runtime import launch
from . import tuning
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
    def cluster_publish(values):
        """Put this CTA's ``values`` (a tuple of one or two fp32 tensors holding one element a thread: the CTA's) in
        a slot of its shared memory and meet the cluster at a barrier (release and acquire at cluster scope: every
        CTA's slot written before any is read). Returns the slot's address in this CTA's shared memory."""
        if len(values) == 2:
            return gl.inline_asm_elementwise(
                "{\n\t.shared .align 8 .f32 fl_slot[2];\n\tmov.u32 $0, fl_slot;\n\tst.shared.v2.f32 [$0], {$1, $2};"
                "\n\tbarrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n\t}",
                "=r,f,f", values, dtype=gl.int32, is_pure=False, pack=1)
        else:
            return gl.inline_asm_elementwise(
                "{\n\t.shared .align 4 .f32 fl_slot[1];\n\tmov.u32 $0, fl_slot;\n\tst.shared.f32 [$0], $1;"
                "\n\tbarrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n\t}",
                "=r,f", values, dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def cluster_peer(slot, rank, VALUES: gl.constexpr):
        """The ``VALUES`` (1 or 2) values that CTA ``rank`` of the cluster published at ``slot``
        (``cluster_publish``), read through distributed shared memory: a tuple of fp32 tensors of ``slot``'s shape."""
        peer = slot * 0 + rank
        if VALUES == 2:
            return gl.inline_asm_elementwise(
                "{\n\t.reg .b32 %fl_at;\n\tmapa.shared::cluster.u32 %fl_at, $2, $3;"
                "\n\tld.shared::cluster.v2.f32 {$0, $1}, [%fl_at];\n\t}",
                "=f,=f,r,r", [slot, peer], dtype=(gl.float32, gl.float32), is_pure=False, pack=1)
        else:
            return gl.inline_asm_elementwise(
                "{\n\t.reg .b32 %fl_at;\n\tmapa.shared::cluster.u32 %fl_at, $1, $2;"
                "\n\tld.shared::cluster.f32 $0, [%fl_at];\n\t}",
                "=f,r,r", [slot, peer], dtype=(gl.float32,), is_pure=False, pack=1)

    @gluon.jit
    def cluster_read_all(token):
        """Tell the cluster this CTA has read its peers' slots (``token``: a value computed from what it read, so that
        this comes after the reads); ``cluster_exit_wait`` takes what it returns."""
        return gl.inline_asm_elementwise("barrier.cluster.arrive.release.aligned;\n\tmov.u32 $0, 0;", "=r,f", [token],
                                         dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def cluster_exit_wait(token):
        """Wait until every CTA of the cluster has read its peers' slots (``cluster_read_all``'s ``token``), so that
        no CTA's shared memory goes away while another reads it; the kernel's last step."""
        gl.inline_asm_elementwise("barrier.cluster.wait.aligned;\n\tmov.u32 $0, $1;", "=r,r", [token],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def softmax_cluster_kernel(
        x_ptr, y_ptr, lse_ptr, states_ptr, n_cols, stride_xm, stride_ym,
        PART: gl.constexpr, CTAS: gl.constexpr, ROW_LAYOUT: gl.constexpr, STATE_LAYOUT: gl.constexpr,
        EVEN: gl.constexpr, WRITE_Y: gl.constexpr, WRITE_LSE: gl.constexpr,
        DSMEM: gl.constexpr,
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
        if not DSMEM:
            states = states_ptr + row * (2 * CTAS)
            gl.store(states + part, m)
            gl.store(states + CTAS + part, d)
            every = gl.arange(0, CTAS, layout=STATE_LAYOUT) + cluster_barrier(n_cols)
            # L2, not L1: the other CTAs' states were written from other multiprocessors.
            m_row, d_row = merge_partial_states(gl.load(states + every, cache_modifier=".cg"),
                                                gl.load(states + CTAS + every, cache_modifier=".cg"), LOG2E, 0)
        else:
            slot = cluster_publish((m, d))
            m_row, d_row = cluster_peer(slot, 0, 2)
            for rank in gl.static_range(1, CTAS):  # one order, so every CTA merges the same state
                m_peer, d_peer = cluster_peer(slot, rank, 2)
                m_row, d_row = merge_states(m_row, d_row, m_peer, d_peer, LOG2E)
            read = cluster_read_all(d_row)
        if WRITE_LSE:
            gl.store(lse_ptr + row + 0 * part, state_logsumexp(m_row, d_row, LOG2E))  # the same value from every CTA
        if WRITE_Y:
            y = normalize(p * rescale_factor(m, m_row, LOG2E)[:, None], gl.zeros_like(m) + d_row, False)
            y_row = y_ptr + row * stride_ym
            if EVEN:
                gl.store(y_row + cols, y.to(y_ptr.dtype.element_ty))
            else:
                gl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < n_cols)
        if DSMEM:
            cluster_exit_wait(read)

    @gluon.jit
    def softmax_bwd_cluster_kernel(
        y_ptr, dy_ptr, dx_ptr, sums_ptr, n_cols, stride_ym, stride_dym, stride_dyn, stride_dxm,
        PART: gl.constexpr, CTAS: gl.constexpr, ROW_LAYOUT: gl.constexpr, STATE_LAYOUT: gl.constexpr,
        EVEN: gl.constexpr, DSMEM: gl.constexpr,
    ):
        # The backward, dx = y * (dy - sum(dy * y)), of a row over a cluster, laid out as softmax_cluster_kernel:
        # CTA i holds part i of y and dy, publishes its part's sum and, past the barrier, adds the row's CTAS
        # sums in one order (every CTA the same value, every run the same). sums_ptr: (rows, CTAS) fp32.
        row = gl.program_id(0).to(gl.int64)
        part = gl.arange(0, CTAS, layout=gl.SliceLayout(1, ROW_LAYOUT))
        cols = part[:, None] * PART + gl.arange(0, PART, layout=gl.SliceLayout(0, ROW_LAYOUT))[None, :]
        y_row = y_ptr + row * stride_ym
        dy_at = dy_ptr + row * stride_dym + cols.to(gl.int64) * stride_dyn  # a strided view's can pass 2^31
        if EVEN:
            y = gl.load(y_row + cols).to(gl.float32)
            dy = gl.load(dy_at).to(gl.float32)
        else:
            y = gl.load(y_row + cols, mask=cols < n_cols, other=0.0).to(gl.float32)
            dy = gl.load(dy_at, mask=cols < n_cols, other=0.0).to(gl.float32)
        if not DSMEM:
            sums = sums_ptr + row * CTAS
            gl.store(sums + part, gl.sum(y * dy, axis=1))
            every = gl.arange(0, CTAS, layout=STATE_LAYOUT) + cluster_barrier(n_cols)
            dot = gl.sum(gl.load(sums + every, cache_modifier=".cg"), axis=0)  # L2: written by other multiprocessors
        else:
            slot = cluster_publish((gl.sum(y * dy, axis=1),))
            dot = cluster_peer(slot, 0, 1)[0]
            for rank in gl.static_range(1, CTAS):  # one order: every CTA the same value
                dot = dot + cluster_peer(slot, rank, 1)[0]
            read = cluster_read_all(dot)
            dot = dot[:, None]
        dx = (y * (dy - dot)).to(dx_ptr.dtype.element_ty)
        dx_row = dx_ptr + row * stride_dxm
        if EVEN:
            gl.store(dx_row + cols, dx)
        else:
            gl.store(dx_row + cols, dx, mask=cols < n_cols)
        if DSMEM:
            cluster_exit_wait(read)

else:  # pragma: no cover
    softmax_cluster_kernel = softmax_bwd_cluster_kernel = None


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
    meta["DSMEM"] = tuning.CLUSTER_EXCHANGE == "dsmem"
    return (n_rows,), args, meta


def launch_cluster(
    x2d: torch.Tensor, y_arg: torch.Tensor, lse_arg: torch.Tensor, plan: SoftmaxPlan, write_y: bool, write_lse: bool,
) -> None:
    """Run the cluster kernel on the rows of ``x2d`` under ``plan`` (``cluster_launch``)."""
    grid, args, meta = cluster_launch(x2d, y_arg, lse_arg, plan, write_y, write_lse)
    launch(softmax_cluster_kernel, grid, args, **meta)


def backward_cluster_launch(y2d: torch.Tensor, dy2d: torch.Tensor, dx: torch.Tensor, plan: SoftmaxPlan) -> tuple:
    """``(grid, args, meta)`` of the backward cluster kernel's launch on rows ``y2d`` (contiguous), ``dy2d`` (any
    row-strided view) into ``dx`` (contiguous) under ``plan`` (``plan.n_splits`` CTAs a row, ``plan.block_n``
    columns each): a cluster a row, and the rows' partial sums."""
    n_rows, n_cols = y2d.shape
    ctas = plan.n_splits
    sums = torch.empty((n_rows, ctas), dtype=torch.float32, device=y2d.device)
    row_layout, state_layout = cluster_layouts(ctas, plan.num_warps, 16 // y2d.element_size())
    args = (y2d, dy2d, dx, sums, n_cols, y2d.stride(0), dy2d.stride(0), dy2d.stride(1), dx.stride(0))
    meta = dict(PART=plan.block_n, CTAS=ctas, ROW_LAYOUT=row_layout, STATE_LAYOUT=state_layout,
                EVEN=n_cols == ctas * plan.block_n, num_warps=plan.num_warps, num_ctas=ctas)
    meta["DSMEM"] = tuning.CLUSTER_EXCHANGE == "dsmem"
    return (n_rows,), args, meta


def launch_backward_cluster(y2d: torch.Tensor, dy2d: torch.Tensor, dx: torch.Tensor, plan: SoftmaxPlan) -> None:
    """Run the backward cluster kernel on the rows of ``y2d`` and ``dy2d`` into ``dx`` (``backward_cluster_launch``)."""
    grid, args, meta = backward_cluster_launch(y2d, dy2d, dx, plan)
    launch(softmax_bwd_cluster_kernel, grid, args, **meta)


def build_for_sm90(ctas: int, part: int, num_warps: int, dtype: torch.dtype = torch.bfloat16, even: bool = True,
                   write_y: bool = True, write_lse: bool = False,
                   backward: bool = False) -> "triton.compiler.CompiledKernel":
    """The cluster kernel (``backward``: the backward's) for rows of ``ctas * part`` columns of ``dtype`` (``even``:
    exactly that many), built for sm_90 on any machine, no GPU needed, with the argument types and alignments a
    launch on aligned rows gives (dy's column stride 1): Triton's compiled kernel, whose ``asm["ptx"]`` the CPU
    build tests read."""
    import triton
    from triton.backends.compiler import GPUTarget

    from ..core.triton_compat import gluon_source, mangle_type

    row_layout, state_layout = cluster_layouts(ctas, num_warps, 16 // dtype.itemsize)
    constants = dict(PART=part, CTAS=ctas, ROW_LAYOUT=row_layout, STATE_LAYOUT=state_layout, EVEN=even)
    constants["DSMEM"] = tuning.CLUSTER_EXCHANGE == "dsmem"
    data = mangle_type(torch.empty(1, dtype=dtype))
    if backward:
        kernel, ints = softmax_bwd_cluster_kernel, ("n_cols", "stride_ym", "stride_dym", "stride_dxm")
        types = {"y_ptr": data, "dy_ptr": data, "dx_ptr": data, "sums_ptr": "*fp32"}
        constants["stride_dyn"] = 1  # as Triton specializes a unit stride
    else:
        kernel, ints = softmax_cluster_kernel, ("n_cols", "stride_xm", "stride_ym")
        types = {"x_ptr": data, "y_ptr": data, "lse_ptr": "*fp32", "states_ptr": "*fp32"}
        constants.update(WRITE_Y=write_y, WRITE_LSE=write_lse)
    names = kernel.arg_names
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in names}
    aligned = tuple(i for i, name in enumerate(names) if name in types or name in ints)
    return triton.compile(gluon_source(kernel, signature, constants, aligned),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_ctas": ctas})
