"""Long rows over a thread-block cluster (Hopper): each CTA of a row's cluster holds its part on chip.

A row of ``CTAS * PART`` columns is split over the ``CTAS`` CTAs of one cluster
(Gluon layouts whose CTA bases split the row's parts). Each CTA folds its part
into a state ``(m, d)`` and keeps the part's weights ``e^(x - m)``, one
exponential an element; it pushes its state into every CTA's shared memory
(distributed shared memory), the CTAs meet at the cluster's barrier (CUDA
schedules a cluster's CTAs together, so none waits for one that is not running),
merge the row's states and rescale their held weights by ``e^(m - m_row) /
d_row``: one read and one write, as the shared-row kernel, without its
cooperative launch, its waits on flags or a round trip to L2. Triton 3.6 lowers
neither a reduction nor a layout conversion across CTAs (3.9 does both), so the
exchange and the barriers are inline PTX. The plan takes this kernel on Hopper
GPUs (``plan.clusters_supported``) for many aligned rows of ``tuning.CLUSTER``'s
lengths. The backward's kernel holds a row's y and dy so, and its CTAs trade
their parts of ``sum(dy * y)`` (``tuning.BWD_CLUSTER``).
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


def _push_asm(values: int) -> str:
    """``cluster_push``'s PTX for ``values`` (1 or 2) fp32 values ``$3`` (and ``$4``): thread i maps the address
    ``$1`` to CTA i's shared memory and stores there, threads below ``$2`` (the cluster's CTAs) only."""
    store = "st.shared::cluster.v2.f32 [%fl_at], {$3, $4}" if values == 2 else "st.shared::cluster.f32 [%fl_at], $3"
    return ("{\n\t.reg .b32 %fl_at;\n\t.reg .pred %fl_pushes;"
            "\n\tmov.u32 %fl_at, %tid.x;\n\tsetp.lt.u32 %fl_pushes, %fl_at, $2;"
            "\n\t@%fl_pushes mapa.shared::cluster.u32 %fl_at, $1, %fl_at;"
            f"\n\t@%fl_pushes {store};\n\tmov.u32 $0, 0;\n\t}}")


if gluon is not None:
    # cluster_push's two stores, one and two values a thread (a constexpr: the kernels read it at compile time).
    PUSH_ONE_ASM = gl.constexpr(_push_asm(1))
    PUSH_TWO_ASM = gl.constexpr(_push_asm(2))

    @gluon.jit
    def cluster_barrier(token):
        """Every thread of every CTA of the cluster waits here for all the others. Release and acquire at cluster
        scope order the pushes before it (``cluster_push``) against the reads of the slots after it; it returns 0
        (of ``token``'s shape), which the reads add to their addresses, so that nothing is moved above it."""
        return gl.inline_asm_elementwise(
            "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n\tmov.u32 $0, 0;",
            "=r,r", [token], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def cluster_arrive(token):
        """This CTA's arrival at the cluster barrier that ``cluster_push`` waits on (relaxed: it says only that the CTA
        runs, so that its slots may be written); early in the kernel, so that the wait costs nothing."""
        gl.inline_asm_elementwise("barrier.cluster.arrive.relaxed.aligned;\n\tmov.u32 $0, 0;", "=r,r", [token],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def cluster_slots(token):
        """This CTA's exchange slots, 16 fp32 values of its shared memory (2 a CTA of a cluster of up to 8), as their
        shared-memory address (of ``token``'s shape, 0 added)."""
        return gl.inline_asm_elementwise(
            "{\n\t.shared .align 16 .f32 fl_slots[16];\n\tmov.u32 $0, fl_slots;\n\t}", "=r,r", [token],
            dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def cluster_push(at, values, CTAS: gl.constexpr):
        """Store ``values`` (a tuple of one or two fp32 tensors, one element a thread: this CTA's) at address ``at`` of
        every CTA's slots (``cluster_slots`` plus this CTA's place) through distributed shared memory, thread i to
        CTA i, once every CTA of the cluster runs (``cluster_arrive``). ``cluster_barrier`` after it orders the
        pushes before the reads of the slots (``cluster_slot``)."""
        ctas = at * 0 + CTAS
        gl.inline_asm_elementwise("barrier.cluster.wait.aligned;\n\tmov.u32 $0, 0;", "=r,r", [at],
                                  dtype=gl.int32, is_pure=False, pack=1)
        if len(values) == 2:
            gl.inline_asm_elementwise(PUSH_TWO_ASM, "=r,r,r,f,f", [at, ctas, values[0], values[1]], dtype=gl.int32,
                                      is_pure=False, pack=1)
        else:
            gl.inline_asm_elementwise(PUSH_ONE_ASM, "=r,r,r,f", [at, ctas, values[0]], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def cluster_slot(at, VALUES: gl.constexpr):
        """The ``VALUES`` (1 or 2) fp32 values at address ``at`` of this CTA's slots (what a CTA pushed there,
        ``cluster_push``), from its own shared memory: a tuple of fp32 tensors of ``at``'s shape."""
        if VALUES == 2:
            return gl.inline_asm_elementwise("ld.shared.v2.f32 {$0, $1}, [$2];", "=f,=f,r", [at],
                                             dtype=(gl.float32, gl.float32), is_pure=False, pack=1)
        else:
            return gl.inline_asm_elementwise("ld.shared.f32 $0, [$1];", "=f,r", [at], dtype=(gl.float32,),
                                             is_pure=False, pack=1)

    @gluon.jit
    def softmax_cluster_kernel(
        x_ptr, y_ptr, lse_ptr, n_cols, stride_xm, stride_ym,
        PART: gl.constexpr, CTAS: gl.constexpr, ROW_LAYOUT: gl.constexpr, STATE_LAYOUT: gl.constexpr,
        EVEN: gl.constexpr, WRITE_Y: gl.constexpr, WRITE_LSE: gl.constexpr,
    ):
        # A cluster a row. ROW_LAYOUT spreads a [CTAS, PART] tile over the cluster, CTA i holding part i (its
        # CTA bases split dim 0); STATE_LAYOUT gives every CTA all CTAS states.
        gl.static_assert(CTAS <= 8, "cluster_slots holds the states of 8 CTAs")
        row = gl.program_id(0).to(gl.int64)
        part = gl.arange(0, CTAS, layout=gl.SliceLayout(1, ROW_LAYOUT))
        cluster_arrive(n_cols)  # early: the arrival that says this CTA runs, long before the push waits on it
        cols = part[:, None] * PART + gl.arange(0, PART, layout=gl.SliceLayout(0, ROW_LAYOUT))[None, :]
        x_row = x_ptr + row * stride_xm
        if EVEN:
            x = gl.load(x_row + cols).to(gl.float32)
        else:
            x = gl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(gl.float32)
        m_empty = gl.full([CTAS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, ROW_LAYOUT))
        m, d, p, _ = online_update(m_empty, gl.zeros_like(m_empty), x, LOG2E)
        slots = cluster_slots(n_cols)
        cluster_push(slots + part * 8, (m, d), CTAS)  # CTA i's state into slot i of every CTA
        every = gl.arange(0, CTAS, layout=STATE_LAYOUT) + cluster_barrier(n_cols)
        m_every, d_every = cluster_slot(slots + every * 8, 2)
        m_row, d_row = merge_partial_states(m_every, d_every, LOG2E, 0)  # one order: every CTA the same state
        if WRITE_LSE:
            gl.store(lse_ptr + row, state_logsumexp(m_row, d_row, LOG2E))  # the same value from every CTA
        if WRITE_Y:
            y = normalize(p * rescale_factor(m, m_row, LOG2E)[:, None], gl.zeros_like(m) + d_row, False)
            y_row = y_ptr + row * stride_ym
            if EVEN:
                gl.store(y_row + cols, y.to(y_ptr.dtype.element_ty))
            else:
                gl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < n_cols)

    @gluon.jit
    def softmax_bwd_cluster_kernel(
        y_ptr, dy_ptr, dx_ptr, n_cols, stride_ym, stride_dym, stride_dyn, stride_dxm,
        PART: gl.constexpr, CTAS: gl.constexpr, ROW_LAYOUT: gl.constexpr, STATE_LAYOUT: gl.constexpr,
        EVEN: gl.constexpr,
    ):
        # The backward, dx = y * (dy - sum(dy * y)), of a row over a cluster, laid out as softmax_cluster_kernel:
        # CTA i holds part i of y and dy, pushes its part's sum into slot i of every CTA and, past the barrier, adds
        # the row's CTAS sums in one order (every CTA the same value, every run the same).
        gl.static_assert(CTAS <= 8, "cluster_slots holds the sums of 8 CTAs")
        row = gl.program_id(0).to(gl.int64)
        part = gl.arange(0, CTAS, layout=gl.SliceLayout(1, ROW_LAYOUT))
        cluster_arrive(n_cols)
        cols = part[:, None] * PART + gl.arange(0, PART, layout=gl.SliceLayout(0, ROW_LAYOUT))[None, :]
        y_row = y_ptr + row * stride_ym
        dy_at = dy_ptr + row * stride_dym + cols.to(gl.int64) * stride_dyn  # a strided view's can pass 2^31
        if EVEN:
            y = gl.load(y_row + cols).to(gl.float32)
            dy = gl.load(dy_at).to(gl.float32)
        else:
            y = gl.load(y_row + cols, mask=cols < n_cols, other=0.0).to(gl.float32)
            dy = gl.load(dy_at, mask=cols < n_cols, other=0.0).to(gl.float32)
        slots = cluster_slots(n_cols)
        cluster_push(slots + part * 8, (gl.sum(y * dy, axis=1),), CTAS)
        every = gl.arange(0, CTAS, layout=STATE_LAYOUT) + cluster_barrier(n_cols)
        dot = gl.sum(cluster_slot(slots + every * 8, 1)[0], axis=0)
        dx = (y * (dy - dot)).to(dx_ptr.dtype.element_ty)
        dx_row = dx_ptr + row * stride_dxm
        if EVEN:
            gl.store(dx_row + cols, dx)
        else:
            gl.store(dx_row + cols, dx, mask=cols < n_cols)

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
    (``plan.n_splits`` CTAs a row, ``plan.block_n`` columns each): a cluster a row."""
    n_rows, n_cols = x2d.shape
    ctas = plan.n_splits
    row_layout, state_layout = cluster_layouts(ctas, plan.num_warps, 16 // x2d.element_size())
    args = (x2d, y_arg, lse_arg, n_cols, x2d.stride(0), n_cols)
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


def backward_cluster_launch(y2d: torch.Tensor, dy2d: torch.Tensor, dx: torch.Tensor, plan: SoftmaxPlan) -> tuple:
    """``(grid, args, meta)`` of the backward cluster kernel's launch on rows ``y2d`` (contiguous), ``dy2d`` (any
    row-strided view) into ``dx`` (contiguous) under ``plan`` (``plan.n_splits`` CTAs a row, ``plan.block_n``
    columns each): a cluster a row."""
    n_rows, n_cols = y2d.shape
    ctas = plan.n_splits
    row_layout, state_layout = cluster_layouts(ctas, plan.num_warps, 16 // y2d.element_size())
    args = (y2d, dy2d, dx, n_cols, y2d.stride(0), dy2d.stride(0), dy2d.stride(1), dx.stride(0))
    meta = dict(PART=plan.block_n, CTAS=ctas, ROW_LAYOUT=row_layout, STATE_LAYOUT=state_layout,
                EVEN=n_cols == ctas * plan.block_n, num_warps=plan.num_warps, num_ctas=ctas)
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
    data = mangle_type(torch.empty(1, dtype=dtype))
    if backward:
        kernel, ints = softmax_bwd_cluster_kernel, ("n_cols", "stride_ym", "stride_dym", "stride_dxm")
        types = {"y_ptr": data, "dy_ptr": data, "dx_ptr": data}
        constants["stride_dyn"] = 1  # as Triton specializes a unit stride
    else:
        kernel, ints = softmax_cluster_kernel, ("n_cols", "stride_xm", "stride_ym")
        types = {"x_ptr": data, "y_ptr": data, "lse_ptr": "*fp32"}
        constants.update(WRITE_Y=write_y, WRITE_LSE=write_lse)
    names = kernel.arg_names
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in names}
    aligned = tuple(i for i, name in enumerate(names) if name in types or name in ints)
    return triton.compile(gluon_source(kernel, signature, constants, aligned),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_ctas": ctas})
