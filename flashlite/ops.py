"""flashlite's public ops as PyTorch custom ops, so that ``torch.compile(fullgraph=True)`` traces them.

Dynamo cannot trace into a Triton launch from the host code of an op module
(nor into ``torch.autograd.Function``s that launch kernels), so while compiling
the public functions hand their checked arguments to the ops registered here,
each of which the graph keeps as one opaque node:

* ``flashlite::softmax(x, dim, algorithm, dtype)`` and ``flashlite::logsumexp(x, dim)``;
* ``flashlite::masked_softmax(x, mask, scale, causal, dim, algorithm)``;
* ``flashlite::flash_attention(q, k, v, causal, scale, attn_mask, num_splits, cache_seqlens, softcap, window,
  alibi, sinks) -> (o, lse, row_stats)`` (row_stats: what the backward of an additive mask needs,
  ``attention.forward_for_backward``; empty otherwise);

and, for their gradients, ``flashlite::softmax_backward``,
``flashlite::masked_softmax_backward`` and ``flashlite::flash_attention_backward``.
Each op's implementation calls the same launchers as the eager path (or the
same PyTorch fallback on devices the kernels do not run on), its fake
implementation returns empty tensors of the real outputs' shapes, dtypes *and
strides* (inductor plans its buffers from them), and ``register_autograd``
wires forward to backward. Eager calls never come here: the public functions
route to ``torch.ops.flashlite`` only under ``torch.compiler.is_compiling()``,
after validating their arguments.

Differences from the eager path, all while compiling: ``flash_attention``
always writes the log-sum-exp (the op cannot know whether a gradient will be
asked for; it costs one fp32 store per query row); the split-K/V path still has
no backward, and a graph that needs one fails when it is compiled rather than
when backward runs. Ops need torch >= 2.4 (``torch.library.custom_op``).
"""

from __future__ import annotations

import torch

from .attention.api import SPLIT_HAS_NO_BACKWARD, forward_for_backward, unit_stride_head_dim
from .attention.backward import attention_backward
from .attention.plan import output_like
from .attention.reference import attention_torch
from .attention.split_kv import auto_num_splits, split_kv_forward
from .core.masking import broadcast_mask
from .core.runtime import runs_kernels
from .masked_softmax import forward_keys_last, masked_softmax_backward, masked_softmax_torch
from .softmax.api import as_rows, from_rows, logsumexp_grad, logsumexp_rows, reduced_shape, softmax_rows
from .softmax.backward import softmax_backward
from .softmax.plan import plan_softmax


def _empty_rows_layout(x: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor of ``x``'s shape laid out as the launchers return it: contiguous with ``dim`` last,
    then moved back (``from_rows``)."""
    if x.dim() == 0:
        return torch.empty((), dtype=dtype, device=x.device)
    return torch.empty(x.movedim(dim, -1).shape, dtype=dtype, device=x.device).movedim(-1, dim)


def _softmax_grad_torch(y: torch.Tensor, dy: torch.Tensor, dim: int, scale: float, masked: bool) -> torch.Tensor:
    """``scale * y * (dy - sum(dy * y))`` along ``dim`` in fp32: the backward of both softmaxes off the kernels;
    ``masked`` gives hidden positions (``y = 0``) exactly 0, as the masked softmax's kernel does."""
    y, dy = y.float(), dy.float()
    dx = scale * y * (dy - (dy * y).sum(dim, keepdim=True))
    return torch.where(y == 0, 0.0, dx) if masked else dx


# ----------------------------------------------------------------------------- softmax


@torch.library.custom_op("flashlite::softmax", mutates_args=(),
                         schema="(Tensor x, int dim, str algorithm, ScalarType dtype) -> Tensor")
def _softmax(x: torch.Tensor, dim: int, algorithm: str, dtype: torch.dtype) -> torch.Tensor:
    if x.numel() == 0 or not runs_kernels(x):
        return _empty_rows_layout(x, dim, dtype).copy_(torch.softmax(x.float(), dim))
    y = softmax_rows(x, dim, dtype, algorithm)
    # Rows read from an unaligned base come out as far past a 16-byte boundary (softmax.rows_output);
    # the fake below promises a fresh tensor, which compiled code may take as aligned.
    return y.clone() if y.storage_offset() else y


@_softmax.register_fake
def _(x, dim, algorithm, dtype):
    return _empty_rows_layout(x, dim, dtype)


@torch.library.custom_op("flashlite::softmax_backward", mutates_args=(),
                         schema="(Tensor y, Tensor dy, int dim, str algorithm, ScalarType dx_dtype) -> Tensor")
def _softmax_bwd(y: torch.Tensor, dy: torch.Tensor, dim: int, algorithm: str, dx_dtype: torch.dtype) -> torch.Tensor:
    if y.numel() == 0 or not runs_kernels(y):
        return _empty_rows_layout(y, dim, dx_dtype).copy_(_softmax_grad_torch(y, dy, dim, 1.0, False))
    y2d = as_rows(y, dim).contiguous()  # (rows, n): the kernel reads y with row stride n
    dy2d = as_rows(dy, dim)
    dx2d = softmax_backward(y2d, dy2d, dx_dtype, plan_softmax(y2d.shape[0], y2d.shape[1], y.device, algorithm,
                                                                   shared_rows=y.dtype))
    return from_rows(dx2d, y, dim)


@_softmax_bwd.register_fake
def _(y, dy, dim, algorithm, dx_dtype):
    return _empty_rows_layout(y, dim, dx_dtype)


def _softmax_setup(ctx, inputs, output) -> None:
    x, ctx.dim, ctx.algorithm, _ = inputs
    ctx.x_dtype = x.dtype
    ctx.save_for_backward(output)


def _softmax_grad(ctx, dy):
    (y,) = ctx.saved_tensors
    return torch.ops.flashlite.softmax_backward(y, dy, ctx.dim, ctx.algorithm, ctx.x_dtype), None, None, None


_softmax.register_autograd(_softmax_grad, setup_context=_softmax_setup)


@torch.library.custom_op("flashlite::logsumexp", mutates_args=(), schema="(Tensor x, int dim) -> Tensor")
def _logsumexp(x: torch.Tensor, dim: int) -> torch.Tensor:
    if x.numel() == 0 or not runs_kernels(x):
        return torch.logsumexp(x.float(), dim).to(x.dtype).contiguous()
    return logsumexp_rows(x, dim)


@_logsumexp.register_fake
def _(x, dim):
    return x.new_empty(reduced_shape(x, dim))


def _logsumexp_setup(ctx, inputs, output) -> None:
    x, ctx.dim = inputs
    ctx.save_for_backward(x, output)


def _logsumexp_grad(ctx, g):
    x, lse = ctx.saved_tensors
    y = torch.ops.flashlite.softmax(x, ctx.dim, "auto", torch.float32)  # d lse / dx = softmax(x)
    return logsumexp_grad(x, lse, y, g, ctx.dim), None


_logsumexp.register_autograd(_logsumexp_grad, setup_context=_logsumexp_setup)


# ----------------------------------------------------------------------------- masked softmax


@torch.library.custom_op(
    "flashlite::masked_softmax", mutates_args=(),
    schema="(Tensor x, Tensor? mask, float scale, bool causal, int dim, str algorithm) -> Tensor",
)
def _masked_softmax(x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool, dim: int,
                    algorithm: str) -> torch.Tensor:
    if x.numel() == 0 or not runs_kernels(x):
        out = _empty_rows_layout(x, dim, x.dtype)
        return out if x.numel() == 0 else out.copy_(masked_softmax_torch(x, mask, scale, causal, dim))
    mask_view = None if mask is None else broadcast_mask(mask, x.shape)[0]
    return forward_keys_last(x, mask_view, scale, causal, dim, algorithm).movedim(-1, dim)


@_masked_softmax.register_fake
def _(x, mask, scale, causal, dim, algorithm):
    return _empty_rows_layout(x, dim, x.dtype)


@torch.library.custom_op(
    "flashlite::masked_softmax_backward", mutates_args=(),
    schema="(Tensor y, Tensor dy, float scale, bool causal, int dim, str algorithm, ScalarType dx_dtype) -> Tensor",
)
def _masked_softmax_bwd(y: torch.Tensor, dy: torch.Tensor, scale: float, causal: bool, dim: int, algorithm: str,
                        dx_dtype: torch.dtype) -> torch.Tensor:
    if y.numel() == 0 or not runs_kernels(y):
        return _empty_rows_layout(y, dim, dx_dtype).copy_(_softmax_grad_torch(y, dy, dim, scale, True))
    y_keys_last = y.movedim(dim, -1).contiguous()  # (..., Lq, Lk), as the forward wrote it
    seqlen_q = y_keys_last.shape[-2] if y.dim() > 1 else 1
    dy2d = as_rows(dy, dim)  # (rows, Lk)
    dx2d = masked_softmax_backward(y_keys_last.view(dy2d.shape), dy2d, seqlen_q, scale, causal, dx_dtype, algorithm)
    return from_rows(dx2d, y, dim)


@_masked_softmax_bwd.register_fake
def _(y, dy, scale, causal, dim, algorithm, dx_dtype):
    return _empty_rows_layout(y, dim, dx_dtype)


def _masked_softmax_setup(ctx, inputs, output) -> None:
    _, mask, ctx.scale, ctx.causal, ctx.dim, ctx.algorithm = inputs
    ctx.mask_shape, ctx.mask_dtype = (None, None) if mask is None else (mask.shape, mask.dtype)
    ctx.save_for_backward(output)


def _masked_softmax_grad(ctx, dy):
    (y,) = ctx.saved_tensors
    backward = torch.ops.flashlite.masked_softmax_backward
    dx = dmask = None
    if ctx.needs_input_grad[1]:
        # d/d(bias) is the unscaled softmax gradient: one pass in fp32 with scale 1, then scaled for x.
        g = backward(y, dy, 1.0, ctx.causal, ctx.dim, ctx.algorithm, torch.float32)
        dmask = g.sum_to_size(ctx.mask_shape).to(ctx.mask_dtype)
        if ctx.needs_input_grad[0]:
            dx = (g * ctx.scale).to(y.dtype)
    elif ctx.needs_input_grad[0]:
        dx = backward(y, dy, ctx.scale, ctx.causal, ctx.dim, ctx.algorithm, y.dtype)
    return dx, dmask, None, None, None, None


_masked_softmax.register_autograd(_masked_softmax_grad, setup_context=_masked_softmax_setup)


# ----------------------------------------------------------------------------- flash attention


def _attention_mask(
    attn_mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
) -> tuple[torch.Tensor | None, bool]:
    """``attn_mask`` viewed as the kernels read it: broadcast to (B, H, Lq, Lk), bool as uint8."""
    if attn_mask is None:
        return None, False
    return broadcast_mask(attn_mask, (*q.shape[:3], k.shape[2]), "attn_mask")


def _keeps_row_stats(attn_mask: torch.Tensor | None, num_splits: int | None, cache_seqlens) -> bool:
    """True when the op's forward keeps what an additive mask's backward needs (``forward_for_backward``)."""
    split = num_splits not in (None, 1) or cache_seqlens is not None
    return attn_mask is not None and attn_mask.dtype != torch.bool and not split


@torch.library.custom_op(
    "flashlite::flash_attention", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, bool causal, float scale, Tensor? attn_mask, int? num_splits, "
           "Tensor? cache_seqlens, float? softcap=None, int[]? window=None, Tensor? alibi=None, "
           "Tensor? sinks=None) -> (Tensor, Tensor, Tensor)",
)
def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                     attn_mask: torch.Tensor | None, num_splits: int | None,
                     cache_seqlens: torch.Tensor | None, softcap: float | None = None,
                     window: list[int] | None = None, alibi: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    window = None if window is None else tuple(window)  # attention.plan.visibility's (left, right)
    variants = dict(softcap=softcap, window=window, alibi=alibi, sinks=sinks)
    q, k, v = (unit_stride_head_dim(t) for t in (q, k, v))
    batch, n_heads, seqlen_q, _ = q.shape
    row_stats = None
    if not runs_kernels(q) or batch * n_heads * seqlen_q == 0 or k.shape[2] == 0:
        o, lse = attention_torch(q, k, v, causal, scale, attn_mask, cache_seqlens, **variants)
        o, lse = output_like(q, v.shape[3]).copy_(o), lse.contiguous()
    else:
        mask, mask_is_bool = _attention_mask(attn_mask, q, k)
        if num_splits is None:
            num_splits = auto_num_splits(q, k, mask)
        if num_splits == 1 and cache_seqlens is None:
            o, lse, row_stats = forward_for_backward(q, k, v, causal, scale, mask, mask_is_bool, **variants)
        else:
            o, lse = split_kv_forward(q, k, v, causal, scale, mask, mask_is_bool, True, num_splits, cache_seqlens,
                                      **variants)
    # The fake's contract, whatever path ran: (2, B, H, Lq) under an additive mask, else empty.
    if not _keeps_row_stats(attn_mask, num_splits, cache_seqlens):
        row_stats = q.new_empty((0,), dtype=torch.float32)
    elif row_stats is None:  # (lse, 0): the PyTorch path's backward does not read it
        row_stats = torch.stack([lse, torch.zeros_like(lse)])
    return o, lse, row_stats


@_flash_attention.register_fake
def _(q, k, v, causal, scale, attn_mask, num_splits, cache_seqlens, softcap=None, window=None, alibi=None,
      sinks=None):
    o = output_like(unit_stride_head_dim(q), v.shape[3])  # q's memory order, as attention_forward allocates it
    keeps = _keeps_row_stats(attn_mask, num_splits, cache_seqlens)
    row_stats = q.new_empty((2, *q.shape[:3]) if keeps else (0,), dtype=torch.float32)
    return o, q.new_empty(q.shape[:3], dtype=torch.float32), row_stats  # lse (B, H, Lq)


@torch.library.custom_op(
    "flashlite::flash_attention_backward", mutates_args=(),
    schema="(Tensor do, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor row_stats, "
           "bool causal, float scale, Tensor? attn_mask, bool mask_needs_grad, float? softcap=None, "
           "int[]? window=None, Tensor? alibi=None, Tensor? sinks=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _flash_attention_bwd(
    do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    o: torch.Tensor, lse: torch.Tensor, row_stats: torch.Tensor, causal: bool, scale: float,
    attn_mask: torch.Tensor | None, mask_needs_grad: bool, softcap: float | None = None,
    window: list[int] | None = None, alibi: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dmask, dsinks)``; dmask is the fp32 gradient of ``attn_mask`` in its shape, or empty when not
    asked; dsinks the sinks' (empty without them). ``row_stats`` is empty or the forward's ``(m, log d)``."""
    window = None if window is None else tuple(window)
    do, q, k, v, o = (unit_stride_head_dim(t) for t in (do, q, k, v, o))
    batch, n_heads, seqlen_q, _ = q.shape
    if not runs_kernels(q) or batch * n_heads * seqlen_q == 0 or k.shape[2] == 0:
        return _attention_grads_torch(do, dlse, q, k, v, causal, scale, attn_mask, mask_needs_grad, softcap, window,
                                      alibi, sinks)
    mask, mask_is_bool = _attention_mask(attn_mask, q, k)
    dq, dk, dv, ds, dsinks = attention_backward(do, q, k, v, o, lse, dlse, causal, scale, mask, mask_is_bool,
                                                mask_needs_grad=mask_needs_grad,
                                                row_stats=row_stats if row_stats.numel() else None, softcap=softcap,
                                                window=window, alibi=alibi, sinks=sinks)
    return dq, dk, dv, _mask_grad(ds, attn_mask, q.device), _sinks_grad(dsinks, q.device)


def _attention_grads_torch(do, dlse, q, k, v, causal, scale, attn_mask, mask_needs_grad, softcap, window, alibi,
                           sinks):
    """The gradients of the PyTorch path by ``torch.func.vjp`` (plain autograd does not record below the
    dispatcher's autograd layer, where op implementations run)."""
    def attend(q, k, v, bias, sink_logits):
        return attention_torch(q, k, v, causal, scale, bias if mask_needs_grad else attn_mask, softcap=softcap,
                               window=window, alibi=alibi, sinks=sinks if sinks is None else sink_logits)

    bias = attn_mask if mask_needs_grad else q.new_empty((0,))
    sink_logits = sinks if sinks is not None else q.new_empty((0,))
    (o, lse), vjp = torch.func.vjp(attend, q, k, v, bias, sink_logits)
    dlse = torch.zeros_like(lse) if dlse is None else dlse.to(lse.dtype)
    dq, dk, dv, dbias, dsinks = vjp((do.to(o.dtype), dlse))
    grads = [torch.empty_like(t).copy_(g) for t, g in ((q, dq), (k, dk), (v, dv))]
    return (*grads, _mask_grad(dbias if mask_needs_grad else None, attn_mask, q.device),
            _sinks_grad(dsinks if sinks is not None else None, q.device))


def _mask_grad(dmask: torch.Tensor | None, attn_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The fp32 gradient of ``attn_mask`` summed to its shape (contiguous), or an empty tensor when none is asked."""
    if dmask is None:
        return torch.empty((0,), dtype=torch.float32, device=device)
    return dmask.sum_to_size(attn_mask.shape).float().contiguous()


def _sinks_grad(dsinks: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The sinks' gradient as a fresh fp32 tensor, or an empty one without sinks."""
    if dsinks is None:
        return torch.empty((0,), dtype=torch.float32, device=device)
    return dsinks.float().clone()


@_flash_attention_bwd.register_fake
def _(do, dlse, q, k, v, o, lse, row_stats, causal, scale, attn_mask, mask_needs_grad, softcap=None, window=None,
      alibi=None, sinks=None):
    dq, dk, dv = (torch.empty_like(unit_stride_head_dim(t)) for t in (q, k, v))
    dmask = q.new_empty(attn_mask.shape if mask_needs_grad else (0,), dtype=torch.float32)
    return dq, dk, dv, dmask, q.new_empty(sinks.shape if sinks is not None else (0,), dtype=torch.float32)


def _flash_attention_setup(ctx, inputs, output) -> None:
    (q, k, v, ctx.causal, ctx.scale, attn_mask, num_splits, cache_seqlens, ctx.softcap, ctx.window, alibi,
     sinks) = inputs
    ctx.split = num_splits not in (None, 1) or cache_seqlens is not None
    ctx.sinks_dtype = None if sinks is None else sinks.dtype
    ctx.save_for_backward(q, k, v, *output, attn_mask, alibi, sinks)


def _flash_attention_grad(ctx, do, dlse, _drow_stats):
    if ctx.split:
        raise NotImplementedError(SPLIT_HAS_NO_BACKWARD)
    q, k, v, o, lse, row_stats, attn_mask, alibi, sinks = ctx.saved_tensors
    mask_needs_grad = ctx.needs_input_grad[5]
    dq, dk, dv, ds, dsinks = torch.ops.flashlite.flash_attention_backward(
        do, dlse, q, k, v, o, lse, row_stats, ctx.causal, ctx.scale, attn_mask, mask_needs_grad, ctx.softcap,
        ctx.window, alibi, sinks)
    dmask = ds.to(attn_mask.dtype) if mask_needs_grad else None
    dsinks = dsinks.to(ctx.sinks_dtype) if ctx.sinks_dtype is not None else None
    return dq, dk, dv, None, None, dmask, None, None, None, None, None, dsinks


_flash_attention.register_autograd(_flash_attention_grad, setup_context=_flash_attention_setup)
