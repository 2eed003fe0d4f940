"""``flashlite.softmax`` and ``flashlite.logsumexp``: argument checks, routing to the kernels, the ops and autograd.

``softmax_forward`` runs a plan (``flashlite.softmax.plan``) on rows viewed as
(n_rows, n_cols); ``softmax`` and ``logsumexp`` view any tensor that way along
``dim`` and back. A repeated call (same shape, strides, dtypes, ``dim``,
algorithm, device and address modulo 16) replays the first one's launch
(``_REPEATS``): the host cost decides small softmaxes.
"""

from __future__ import annotations

import torch

from ..core.checks import check_dim, check_float_dtype
from ..core.partials import SLOTS_ALIGN, zeroed_slots
from ..core.runtime import compiled_launcher, is_compiling, launch, record_residency, runs_kernels
from .backward import softmax_backward
from .cluster import cluster_launch, launch_cluster, softmax_cluster_kernel
from .frames import aligned_frame, frame_in_storage, rows_output
from .fused import fused_launch, softmax_fused_kernel
from .online import launch_online, softmax_online_kernel
from .plan import (
    ALGORITHMS, SoftmaxPlan, input_frame, output_lead, plan_backward, plan_rows, plan_softmax, shares_rows_on_chip,
)
from .shared_rows import launch_shared_rows, shared_rows_launch, softmax_shared_rows_kernel
from . import tuning


def _check_args(x: torch.Tensor, dim: int, algorithm: str) -> int:
    """Validate ``x``, ``dim`` and ``algorithm``; return ``dim`` made non-negative."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_float_dtype("x", x)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    return check_dim(dim, x.dim())


def as_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """View ``x`` as (rows, n) with the softmax dim last; copies only if that dim's stride is not 1
    or the other dims cannot be flattened into one row stride. A 2-D ``x`` over its last dim is
    returned as is (the common case: no tensor op on the host path)."""
    last = x.dim() - 1
    if dim == last and x.dim() == 2 and (x.stride(1) == 1 or x.shape[1] <= 1):
        return x
    if x.dim() == 0:
        moved = x.reshape(1)
    else:
        moved = x if dim == last else x.movedim(dim, -1)
    n = moved.shape[-1]
    if moved.stride(-1) != 1 and n > 1:
        moved = moved.contiguous()
    try:
        return moved.view(-1, n)
    except RuntimeError:
        return moved.reshape(-1, n)  # leading dims not collapsible: one copy


def from_rows(rows: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    """Undo ``as_rows`` for an output of the same shape as ``like``."""
    if like.dim() == 0:
        return rows.reshape(())
    if dim == like.dim() - 1:
        return rows if like.dim() == 2 else rows.view(like.shape)
    return rows.view(like.movedim(dim, -1).shape).movedim(-1, dim)


def softmax_forward(
    x2d: torch.Tensor, out_dtype: torch.dtype, plan: SoftmaxPlan, write_y: bool = True, write_lse: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Softmax (and/or log-sum-exp) of each row of ``x2d`` (n_rows, n_cols), column stride 1 or not.

    With ``plan.vec_cols > 1`` the kernels read the rows in frames (``row_frame``)
    and write ``y`` through its frame (``rows_output``), which starts as far
    past a 16-byte boundary as ``x2d``.
    """
    n_rows, n_cols = x2d.shape
    y, y_frame = rows_output(n_rows, n_cols, out_dtype, x2d.device, output_lead(x2d, plan)) if write_y else (None, None)
    lse = torch.empty((n_rows,), dtype=torch.float32, device=x2d.device) if write_lse else None
    y_arg = y_frame if y is not None else x2d  # else a pointer the kernel never writes through
    lse_arg = lse if lse is not None else x2d
    if plan.shares_rows:
        if launch_shared_rows(x2d, y_arg, lse_arg, plan, write_y, write_lse):
            return y, lse
        # The row's parts cannot all be resident: stream the rows, in the same frames.
        plan = plan_softmax(n_rows, n_cols, x2d.device, "online", vec_cols=plan.vec_cols)
    if plan.algorithm == "cluster":
        launch_cluster(x2d, y_arg, lse_arg, plan, write_y, write_lse)
    elif plan.algorithm == "fused":
        grid, args, meta, residency_key = fused_launch(x2d, y_arg, lse_arg, out_dtype, plan, write_y, write_lse)
        compiled = launch(softmax_fused_kernel, grid, args, **meta)
        if residency_key is not None:
            record_residency(residency_key, compiled, plan.num_warps, x2d.device)
    else:
        split = plan.n_splits > 1  # partial states only between the two launches of split rows
        part_m = torch.empty(n_rows * plan.n_splits, dtype=torch.float32, device=x2d.device) if split else None
        part_d = torch.empty(n_rows * plan.n_splits, dtype=torch.float32, device=x2d.device) if split else None
        x_arg, base_lead = input_frame(x2d, plan)
        args = (x_arg, y_arg, lse_arg, part_m, part_d, n_rows, n_cols, plan.n_splits, plan.cols_per_split, base_lead,
                x2d.stride(0), x2d.stride(1), n_cols)
        launch_online(softmax_online_kernel, plan, n_rows, x2d.device, args,
                      NUM_STAGES=tuning.ONLINE_NUM_STAGES, VEC_COLS=plan.vec_cols, WRITE_Y=write_y, WRITE_LSE=write_lse)
    return y, lse


def _softmax_as_rows(x: torch.Tensor, dim: int, out_dtype: torch.dtype, algorithm: str) -> tuple:
    """``(y2d, plan)``: the softmax of ``x`` viewed as rows along ``dim``, and the plan it ran with."""
    x2d = as_rows(x, dim)
    plan = plan_rows(x2d, out_dtype, algorithm)
    y2d, _ = softmax_forward(x2d, out_dtype, plan)
    return y2d, plan


def softmax_rows(x: torch.Tensor, dim: int, out_dtype: torch.dtype, algorithm: str = "auto") -> torch.Tensor:
    """Softmax of checked, non-empty ``x`` along ``dim`` (made non-negative) on the kernels, without autograd."""
    y2d, _ = _softmax_as_rows(x, dim, out_dtype, algorithm)
    return from_rows(y2d, x, dim)


def reduced_shape(x: torch.Tensor, dim: int) -> tuple:
    """``x``'s shape without ``dim`` (``()`` for a 0-d ``x``): the shape of a reduction over ``dim``."""
    return tuple(x.shape[:dim] + x.shape[dim + 1:]) if x.dim() > 0 else ()


def logsumexp_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Log-sum-exp of checked, non-empty ``x`` along ``dim`` (made non-negative) on the kernels, in ``x``'s dtype."""
    x2d = as_rows(x, dim)
    plan = plan_rows(x2d, x.dtype)
    _, lse = softmax_forward(x2d, x.dtype, plan, write_y=False, write_lse=True)
    return lse.to(x.dtype).view(reduced_shape(x, dim))


def logsumexp_grad(x: torch.Tensor, lse: torch.Tensor, y: torch.Tensor, g: torch.Tensor, dim: int) -> torch.Tensor:
    """The gradient of ``lse = logsumexp(x, dim)`` from ``y = softmax(x, dim)`` (fp32) and the incoming ``g``:
    ``g · softmax(x)``, in x's dtype. A row whose LSE is ``+inf`` gets ``torch.logsumexp``'s ``g · e^(x - lse)``
    instead: NaN at its ``+inf`` entries, 0 elsewhere (where softmax is NaN throughout)."""
    if x.dim() > 0:
        g, lse = g.unsqueeze(dim), lse.unsqueeze(dim)
    y = torch.where(torch.isposinf(lse), torch.exp(x.float() - lse.float()), y)
    return (y * g).to(x.dtype)


# ----------------------------------------------------------------------------- the ops and their autograd rules
#
# One op per public function, for eager and compiled code alike: ``flashlite::softmax``,
# ``flashlite::logsumexp`` and ``flashlite::softmax_backward``, each a torch.library custom op with its fake
# implementation and one autograd rule (``_softmax_setup``/``_softmax_gradient``, ``_logsumexp_setup``/
# ``_logsumexp_gradient``). While torch.compile traces, the public functions call the ops; eager calls run the
# same implementations, under ``_Softmax``/``_LogSumExp`` when a gradient is needed (autograd.Functions that
# apply the same rules), without the dispatcher's host cost (attention.api's docstring has the figure).


def empty_rows_layout(x: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor of ``x``'s shape laid out as the launchers return it: contiguous with ``dim`` last,
    then moved back (``from_rows``)."""
    if x.dim() == 0:
        return torch.empty((), dtype=dtype, device=x.device)
    return torch.empty(x.movedim(dim, -1).shape, dtype=dtype, device=x.device).movedim(-1, dim)


def softmax_grad_torch(y: torch.Tensor, dy: torch.Tensor, dim: int, scale: float, masked: bool) -> torch.Tensor:
    """``scale * y * (dy - sum(dy * y))`` along ``dim`` in fp32: the backward of both softmaxes off the kernels;
    ``masked`` gives hidden positions (``y = 0``) exactly 0, as the masked softmax's kernel does."""
    y, dy = y.float(), dy.float()
    dx = scale * y * (dy - (dy * y).sum(dim, keepdim=True))
    return torch.where(y == 0, 0.0, dx) if masked else dx


def _softmax_impl(x: torch.Tensor, dim: int, algorithm: str, dtype: torch.dtype) -> torch.Tensor:
    if x.numel() == 0 or not runs_kernels(x):
        return empty_rows_layout(x, dim, dtype).copy_(torch.softmax(x.float(), dim))
    return softmax_rows(x, dim, dtype, algorithm)


@torch.library.custom_op("flashlite::softmax", mutates_args=(),
                         schema="(Tensor x, int dim, str algorithm, ScalarType dtype) -> Tensor")
def _softmax_op(x: torch.Tensor, dim: int, algorithm: str, dtype: torch.dtype) -> torch.Tensor:
    y = _softmax_impl(x, dim, algorithm, dtype)
    # Rows read from an unaligned base come out as far past a 16-byte boundary (frames.rows_output); the fake
    # below promises a fresh tensor, which compiled code may take as aligned.
    return y.clone() if y.storage_offset() else y


@_softmax_op.register_fake
def _(x, dim, algorithm, dtype):
    return empty_rows_layout(x, dim, dtype)


def _softmax_backward_impl(y: torch.Tensor, dy: torch.Tensor, dim: int, algorithm: str,
                           dx_dtype: torch.dtype) -> torch.Tensor:
    if y.numel() == 0 or not runs_kernels(y):
        return empty_rows_layout(y, dim, dx_dtype).copy_(softmax_grad_torch(y, dy, dim, 1.0, False))
    y2d = as_rows(y, dim).contiguous()  # (rows, n): the kernel reads y with row stride n
    dy2d = as_rows(dy, dim)
    dx2d = softmax_backward(y2d, dy2d, dx_dtype, plan_softmax(y2d.shape[0], y2d.shape[1], y.device, algorithm,
                                                                   shared_rows=y.dtype))
    return from_rows(dx2d, y, dim)


@torch.library.custom_op("flashlite::softmax_backward", mutates_args=(),
                         schema="(Tensor y, Tensor dy, int dim, str algorithm, ScalarType dx_dtype) -> Tensor")
def _softmax_backward_op(y: torch.Tensor, dy: torch.Tensor, dim: int, algorithm: str,
                         dx_dtype: torch.dtype) -> torch.Tensor:
    return _softmax_backward_impl(y, dy, dim, algorithm, dx_dtype)


@_softmax_backward_op.register_fake
def _(y, dy, dim, algorithm, dx_dtype):
    return empty_rows_layout(y, dim, dx_dtype)


def _softmax_setup(ctx, inputs, output) -> None:
    x, ctx.dim, ctx.algorithm, _ = inputs
    ctx.x_dtype = x.dtype
    ctx.save_for_backward(output)


def _softmax_gradient(ctx, dy, run_backward) -> tuple:
    """``(dx, None, None, None)``; ``run_backward``: the backward op, or its implementation (eager)."""
    (y,) = ctx.saved_tensors
    return run_backward(y, dy, ctx.dim, ctx.algorithm, ctx.x_dtype), None, None, None


_softmax_op.register_autograd(lambda ctx, dy: _softmax_gradient(ctx, dy, torch.ops.flashlite.softmax_backward),
                              setup_context=_softmax_setup)


class _Softmax(torch.autograd.Function):
    """The softmax op's eager fast path: its implementation and autograd rule, without the dispatcher."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, algorithm: str, out_dtype: torch.dtype) -> torch.Tensor:
        y = _softmax_impl(x, dim, algorithm, out_dtype)
        _softmax_setup(ctx, (x, dim, algorithm, out_dtype), y)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return _softmax_gradient(ctx, dy, _softmax_backward_impl)


def _logsumexp_impl(x: torch.Tensor, dim: int) -> torch.Tensor:
    if x.numel() == 0 or not runs_kernels(x):
        return torch.logsumexp(x.float(), dim).to(x.dtype).contiguous()
    return logsumexp_rows(x, dim)


@torch.library.custom_op("flashlite::logsumexp", mutates_args=(), schema="(Tensor x, int dim) -> Tensor")
def _logsumexp_op(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _logsumexp_impl(x, dim)


@_logsumexp_op.register_fake
def _(x, dim):
    return x.new_empty(reduced_shape(x, dim))


def _logsumexp_setup(ctx, inputs, output) -> None:
    x, ctx.dim = inputs
    ctx.save_for_backward(x, output)


def _logsumexp_gradient(ctx, g, run_softmax) -> tuple:
    """``(dx, None)``: ``g · softmax(x)``, the softmax by ``run_softmax`` (the op, or its implementation)."""
    x, lse = ctx.saved_tensors
    y = run_softmax(x, ctx.dim, "auto", torch.float32)  # d lse / dx = softmax(x)
    return logsumexp_grad(x, lse, y, g, ctx.dim), None


_logsumexp_op.register_autograd(lambda ctx, g: _logsumexp_gradient(ctx, g, torch.ops.flashlite.softmax),
                                setup_context=_logsumexp_setup)


class _LogSumExp(torch.autograd.Function):
    """The logsumexp op's eager fast path (as ``_Softmax``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int) -> torch.Tensor:
        lse = _logsumexp_impl(x, dim)
        _logsumexp_setup(ctx, (x, dim), lse)
        return lse

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _logsumexp_gradient(ctx, g, lambda x, dim, algorithm, dtype: _Softmax.apply(x, dim, algorithm, dtype))


def softmax(x: torch.Tensor, dim: int = -1, *, algorithm: str = "auto", dtype: torch.dtype | None = None) -> torch.Tensor:
    """Softmax of ``x`` along ``dim``, like ``torch.softmax``, on flashlite's Triton kernels.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape; strided views are read
            in place when ``dim`` has stride 1.
        dim: the dimension to normalise over.
        algorithm: ``"fused"`` (row on chip: up to ``tuning.FUSED_MAX_COLS`` in one
            program; on Hopper, many rows of 32K-128K columns over the CTAs of a
            thread-block cluster each; on other GPUs, many 16-bit rows of up to
            65536 a program each, read twice; longer rows across resident
            programs, each part streaming a head twice where the row is longer
            than they hold; streamed as by ``"online"`` where a launch cannot
            keep them resident),
            ``"online"`` (blocked two-pass, any length, long rows split across
            programs), or ``"auto"`` (fused while the row fits, online after).
        dtype: output dtype (float32/float16/bfloat16); default ``x.dtype``.
            Accumulation is always fp32.

    Returns:
        A tensor of ``x``'s shape. NaN in a row gives NaN for the row; a row of
        ``-inf`` gives NaN, as in ``torch.softmax``. Differentiable.

    CPU tensors run the kernels through Triton's interpreter under
    ``TRITON_INTERPRET=1``, else ``torch.softmax`` in fp32.
    """
    dim = _check_args(x, dim, algorithm)
    out_dtype = x.dtype if dtype is None else dtype
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {out_dtype}")
    if is_compiling():  # one node of the graph: the op
        return torch.ops.flashlite.softmax(x, dim, algorithm, out_dtype)
    if torch.is_grad_enabled() and x.requires_grad:
        return _Softmax.apply(x, dim, algorithm, out_dtype)
    if x.numel() == 0 or not runs_kernels(x):
        return _softmax_impl(x, dim, algorithm, out_dtype)
    key = repeat_key(x, dim, out_dtype, algorithm)
    repeat = _REPEATS.get(key, _UNSEEN)
    if repeat is _UNSEEN:
        y = softmax_rows(x, dim, out_dtype, algorithm)
        if len(_REPEATS) >= REPEATS_KEPT:
            _REPEATS.clear()
        _REPEATS[key] = _repeat_launch(x, dim, out_dtype, algorithm)
        return y
    return softmax_rows(x, dim, out_dtype, algorithm) if repeat is None else repeat(x)


# Repeated calls: a second call with the same shape, strides, dtypes, dim, algorithm, device and
# address of x modulo 16 repeats the first one's launch directly, when that was one launch of the
# fused, cluster or shared-row kernel on a contiguous x over its last dim: the host cost decides small
# softmaxes, whose kernels run for microseconds, and the general path's checks and planning cost
# about twice the host time of the repeated launch (TUNING.md#repeat-launch). None: the general
# path serves the call.
_REPEATS: dict = {}


_UNSEEN = object()


REPEATS_KEPT = 4096  # signatures remembered before the cache starts over


def repeat_key(x: torch.Tensor, dim: int, out_dtype: torch.dtype, algorithm: str) -> tuple:
    """The signature under which ``_REPEATS`` keeps the launch of a softmax of ``x`` (``dim`` non-negative)."""
    return (x.shape, x.stride(), x.dtype, out_dtype, dim, algorithm, x.device,
            torch.cuda.current_device() if x.is_cuda else None, x.data_ptr() % 16)


def clear_plans() -> None:
    """Forget every softmax plan and repeated launch, after changing this module's tile constants.

    ``plan_softmax.cache_clear()`` alone would leave the launches that repeated
    calls replay (``_REPEATS``), made with the old constants.
    """
    plan_softmax.cache_clear()
    plan_backward.cache_clear()
    _REPEATS.clear()


def _repeat_launch(x: torch.Tensor, dim: int, out_dtype: torch.dtype, algorithm: str):
    """``f(x) -> y``: the launch the general path just made for ``x``, for tensors of the same signature; or None."""
    if dim != x.dim() - 1 or not x.is_contiguous():
        return None
    n_cols = x.shape[-1]
    x2d = x.view(-1, n_cols)
    plan = plan_rows(x2d, out_dtype, algorithm)
    y_like = torch.empty((1,), dtype=out_dtype, device=x.device)  # the output's dtype and alignment
    n_slots = 0
    lead = output_lead(x2d, plan)  # rows in frames from an unaligned base: x[1:] of odd rows (the key holds data_ptr % 16)
    if plan.shares_rows:
        if not shares_rows_on_chip(x.device):
            return None
        n_slots = x2d.shape[0] * plan.n_splits
        slots_like = torch.empty((SLOTS_ALIGN,), dtype=torch.int64, device=x.device)
        shared = shared_rows_launch(x2d, y_like, x2d, (slots_like, slots_like, SLOTS_ALIGN), plan, True, False)
        if shared is None:
            return None
        kernel, (grid, args, meta) = softmax_shared_rows_kernel, shared
        sizes = args[6:]
    elif plan.algorithm == "fused":
        kernel = softmax_fused_kernel
        grid, args, meta, _ = fused_launch(x2d, y_like, x2d, out_dtype, plan, True, False)
        sizes = args[3:]
    elif plan.algorithm == "cluster":
        kernel = softmax_cluster_kernel
        grid, args, meta = cluster_launch(x2d, y_like, x2d, plan, True, False)
        sizes = args[3:]
    else:
        return None
    run = compiled_launcher(kernel, grid, args, **meta)
    if run is None:
        return None

    def repeat(x: torch.Tensor) -> torch.Tensor:
        # The kernels read pointers only: x and y stand for their (rows, n_cols) views.
        if lead:
            if not frame_in_storage(x):  # a storage that starts unaligned (from DLPack, say): no frame
                return softmax_rows(x, x.dim() - 1, out_dtype, algorithm)
            y, y_arg = rows_output(x.numel() // n_cols, n_cols, out_dtype, x.device, lead)
            y, x_arg = y.view(x.shape), aligned_frame(x)[0]
        else:
            y = y_arg = torch.empty_like(x, dtype=out_dtype)  # contiguous, as x
            x_arg = x
        if n_slots:
            zeroed_slots(x.device, n_slots,
                         lambda slots, clear, n_clear: run((x_arg, y_arg, x, slots, clear, n_clear, *sizes)))
        else:
            run((x_arg, y_arg, x, *sizes))
        return y

    return repeat


def logsumexp(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``log(sum(exp(x), dim))`` from the online-softmax core's final state, ``m + log d``.

    Args:
        x: float32, float16 or bfloat16 tensor; ``dim`` must be in range.
        dim: the dimension reduced (removed from the result).

    Returns:
        A tensor of ``x``'s dtype without ``dim``: ``-inf`` for a row of ``-inf``,
        NaN for a row with NaN, like ``torch.logsumexp``. Differentiable
        (the gradient is ``softmax(x)``). This is the quantity attention returns as LSE.
    """
    dim = _check_args(x, dim, "auto")
    if is_compiling():  # one node of the graph: the op
        return torch.ops.flashlite.logsumexp(x, dim)
    if torch.is_grad_enabled() and x.requires_grad:
        return _LogSumExp.apply(x, dim)
    return _logsumexp_impl(x, dim)
