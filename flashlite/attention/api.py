"""``flashlite.flash_attention``: the interface. Argument checks, the call's route, one custom op and its autograd.

One op serves eager and compiled code: ``flashlite::flash_attention`` (forward: ``(o, lse, row_stats)``) and
``flashlite::flash_attention_backward``, each a ``torch.library`` custom op with its fake (meta)
implementation, and one autograd rule (``_save_for_backward``, ``_gradients``) registered on the op.
``flash_attention`` checks its arguments and finds the call's ``route.Route`` (planned at a signature's first
call, kept by ``call_key``); while ``torch.compile`` traces, it calls the op, whose implementation finds the
route again from the op's arguments (``op_route``). Eager calls run the op's implementation directly, under
``_Attention`` when a gradient is needed: an ``autograd.Function`` that applies the same rule. The
dispatcher costs 10–16 µs a call on the host (a custom op with autograd against a Function, measured on the
CI machine), which a short training call cannot afford (``bench/call_path.py``).
"""

from __future__ import annotations

import math

import torch

from ..core.checks import (
    check_alibi_slopes, check_cu_seqlens, check_flag, check_float_dtype, check_scale, check_sinks, check_softcap,
    check_window_size,
)
from ..core.masking import broadcast_mask
from ..core.runtime import is_compiling, runs_kernels
from .plan import alibi_view, output_like, visibility
from .route import SPLIT_HAS_NO_BACKWARD, Route, attention_forward
from .split_kv import auto_num_splits, check_split_args
from .tuning import MAX_HEAD_DIM, MIN_HEAD_DIM

__all__ = ["flash_attention", "flash_attention_varlen", "attention_forward", "clear_routes", "SPLIT_HAS_NO_BACKWARD"]


def check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
) -> tuple[torch.Tensor | None, bool]:
    """Validate q, k, v (and the mask) with errors naming the argument; return the mask broadcast to (B, H, Lq, Lk).
    v's head dim (Dv) may differ from q and k's."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seqlen, head_dim), got shape {tuple(t.shape)}")
        check_float_dtype(name, t)
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}: all inputs must be on one device")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}: q, k and v must share a dtype")
    batch, n_heads, seqlen_q, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch sizes differ: q {batch}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"head dims differ: q {head_dim}, k {k.shape[3]} (q and k must share theirs; v may differ)")
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} is not supported: q/k head_dim must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    if not MIN_HEAD_DIM <= v.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"v head dim {v.shape[3]} is not supported: it must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same heads and seqlen, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[1] == 0 or n_heads % k.shape[1]:
        raise ValueError(f"q heads ({n_heads}) must be a multiple of k/v heads ({k.shape[1]}) for grouped-query attention")
    if attn_mask is None:
        return None, False
    if isinstance(attn_mask, torch.Tensor) and attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but q is on {q.device}")
    return broadcast_mask(attn_mask, (batch, n_heads, seqlen_q, k.shape[2]), "attn_mask")


def unit_stride_head_dim(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its head dim has stride 1 (any other strides are fine), else one contiguous copy."""
    return t if t.stride(3) == 1 or t.shape[3] == 1 else t.contiguous()


# ----------------------------------------------------------------------------- routes by signature


# Routes kept, up to this many signatures (then forgotten all at once).
ROUTES_KEPT = 256


_ROUTES: dict = {}


def clear_routes() -> None:
    """Forget every planned route, after changing a tuning constant or a ``FLASHLITE_*`` switch (tests and
    benchmarks do)."""
    _ROUTES.clear()


def _keep(key: tuple, route: Route) -> None:
    if len(_ROUTES) >= ROUTES_KEPT:
        _ROUTES.clear()
    _ROUTES[key] = route


def _tensor_key(t: torch.Tensor | None) -> tuple | None:
    """What a route reads off an optional tensor argument: None, or its type, shape, strides, dtype, device and
    address modulo 16 (Triton compiles apart for 16-byte alignment)."""
    if t is None:
        return None
    return (type(t), t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def call_key(q, k, v, causal, scale, attn_mask, window_size, softcap, alibi_slopes, sinks, return_lse, num_splits,
             cache_seqlens, training) -> tuple | None:
    """The signature under which ``flash_attention`` keeps an eager call's route, or None (not kept: checked and
    planned every time).

    Kept: plain tensors that flashlite's kernels run, arguments of the exact types the checks accept (``bool``
    flags, a ``float`` or None scale and softcap, an ``int`` or None ``num_splits``, a tuple of two ints or
    None for the window) and ``cache_seqlens`` None or on a GPU (on CPU its values are checked every call).
    Everything the checks and the route read is in the key: the tensors' shapes, strides, dtypes, devices and
    addresses modulo 16 (``_tensor_key``), the options' values, and whether a gradient is needed.
    """
    if (type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor
            or type(causal) is not bool or type(return_lse) is not bool
            or (scale is not None and type(scale) is not float) or (num_splits is not None and type(num_splits) is not int)
            or (softcap is not None and type(softcap) is not float)
            or (window_size is not None and (type(window_size) is not tuple or len(window_size) != 2
                                             or type(window_size[0]) is not int or type(window_size[1]) is not int))
            or (cache_seqlens is not None and (type(cache_seqlens) is not torch.Tensor or not cache_seqlens.is_cuda))
            or not runs_kernels(q)):
        return None
    for t in (attn_mask, alibi_slopes, sinks):
        if t is not None and not isinstance(t, torch.Tensor):
            return None
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16,
            causal, scale, return_lse, num_splits, softcap, window_size, training, _tensor_key(attn_mask),
            _tensor_key(alibi_slopes), _tensor_key(sinks), _tensor_key(cache_seqlens))


def op_route(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
             cache_seqlens: torch.Tensor | None, alibi: torch.Tensor | None, sinks: torch.Tensor | None,
             causal: bool, scale: float, softcap: float | None, window: list[int] | None, num_splits: int | None,
             write_lse: bool, training: bool, cu_seqlens_q: torch.Tensor | None = None,
             cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
             block_table: torch.Tensor | None = None) -> tuple[Route, torch.Tensor | None]:
    """``(route, mask)`` of a call of the op from its (checked) arguments, and the mask broadcast as the kernels
    read it. Routes are kept by the op's signature, as ``call_key`` keeps the eager calls'."""
    mask, mask_is_bool = _mask_view(attn_mask, q, k)
    key = ("op", q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.device,
           q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16, causal, scale, softcap,
           None if window is None else tuple(window), num_splits, write_lse, training, _tensor_key(attn_mask),
           _tensor_key(alibi), _tensor_key(sinks), _tensor_key(cache_seqlens), _tensor_key(cu_seqlens_q),
           _tensor_key(cu_seqlens_k), max_seqlen_q, max_seqlen_k, _tensor_key(block_table))
    route = _ROUTES.get(key)
    if route is None:
        varlen = None if cu_seqlens_q is None else (cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k)
        paged = None if block_table is None else (k.shape[2], block_table.shape[1])
        if num_splits is None:
            num_splits = auto_num_splits(q, logical_cache(k, block_table, q.shape[0]), mask) if runs_kernels(q) else 1
        route = Route(q, k, v, mask, mask_is_bool, causal, scale, softcap, None if window is None else tuple(window),
                      alibi is not None, sinks is not None, write_lse, training, num_splits, cache_seqlens is not None,
                      varlen, paged)
        _keep(key, route)
    return route, mask


def _mask_view(attn_mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """``attn_mask`` viewed as the kernels read it: broadcast to (B, H, Lq, Lk), bool as uint8."""
    if attn_mask is None:
        return None, False
    return broadcast_mask(attn_mask, (*q.shape[:3], k.shape[2]), "attn_mask")


# ----------------------------------------------------------------------------- the op and its autograd rule


@torch.library.custom_op(
    "flashlite::flash_attention", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? cache_seqlens, Tensor? alibi, Tensor? sinks, "
           "bool causal, float scale, float? softcap, int[]? window, int? num_splits, bool write_lse, "
           "bool training, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, int max_seqlen_q=0, "
           "int max_seqlen_k=0, Tensor? block_table=None) -> (Tensor, Tensor, Tensor)",
)
def _flash_attention_op(q, k, v, attn_mask, cache_seqlens, alibi, sinks, causal, scale, softcap, window, num_splits,
                        write_lse, training, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                        block_table=None):
    """``(o, lse, row_stats)`` (``Route.forward``'s; an LSE not written and row_stats not kept are empty). A
    packed batch (``flash_attention_varlen``) comes as (1, H, total, D) tensors with its ``cu_seqlens``."""
    seqs = _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    route, mask = op_route(q, k, v, attn_mask, cache_seqlens, alibi, sinks, causal, scale, softcap, window,
                           num_splits, write_lse, training, *seqs, block_table)
    o, lse, row_stats = route.forward(q, k, v, mask, cache_seqlens, alibi, sinks, _seqs(seqs), block_table)
    empty = q.new_empty((0,), dtype=torch.float32)  # an output not written (outputs may not alias each other)
    return o, lse if lse is not None else empty, row_stats if row_stats is not None else empty.clone()


def _keeps_row_stats(attn_mask, num_splits, cache_seqlens, training) -> bool:
    """``Route.keeps_row_stats`` from the op's arguments (the fake's outputs depend on it)."""
    split = num_splits not in (None, 1) or cache_seqlens is not None
    return training and attn_mask is not None and attn_mask.dtype != torch.bool and not split


def _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple:
    """The op's packed-batch arguments as one tuple (``op_route``'s last four)."""
    return cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k


def _seqs(packed: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(cu_seqlens_q, cu_seqlens_k)`` of a packed batch, as ``Route`` takes them, or None."""
    return None if packed[0] is None else packed[:2]


@_flash_attention_op.register_fake
def _(q, k, v, attn_mask, cache_seqlens, alibi, sinks, causal, scale, softcap, window, num_splits, write_lse,
      training, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, block_table=None):
    o = output_like(q, v.shape[3])  # q's memory order, as the launches allocate it
    lse = q.new_empty(q.shape[:3] if write_lse or training else (0,), dtype=torch.float32)
    keeps = _keeps_row_stats(attn_mask, num_splits, cache_seqlens, training)
    return o, lse, q.new_empty((2, *q.shape[:3]) if keeps else (0,), dtype=torch.float32)


@torch.library.custom_op(
    "flashlite::flash_attention_backward", mutates_args=(),
    schema="(Tensor do, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor row_stats, "
           "Tensor? attn_mask, Tensor? cache_seqlens, Tensor? alibi, Tensor? sinks, bool causal, float scale, "
           "float? softcap, int[]? window, int? num_splits, bool write_lse, bool training, "
           "bool mask_needs_grad, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, int max_seqlen_q=0, "
           "int max_seqlen_k=0, Tensor? block_table=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _flash_attention_backward_op(do, dlse, q, k, v, o, lse, row_stats, attn_mask, cache_seqlens, alibi, sinks,
                                 causal, scale, softcap, window, num_splits, write_lse, training, mask_needs_grad,
                                 cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                                 block_table=None):
    """``(dq, dk, dv, dmask, dsinks)``: dmask the fp32 gradient of ``attn_mask`` in its shape (empty when not
    asked), dsinks fp32 (empty without sinks). The route is the forward's (``op_route``)."""
    seqs = _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    route, _ = op_route(q, k, v, attn_mask, cache_seqlens, alibi, sinks, causal, scale, softcap, window,
                        num_splits, write_lse, training, *seqs, block_table)
    grads = _route_backward(route, do, dlse, q, k, v, o, lse, row_stats if row_stats.numel() else None, attn_mask,
                            alibi, sinks, mask_needs_grad, _seqs(seqs))
    dq, dk, dv, dmask, dsinks = (g.clone() if g is not None and g._base is not None else g for g in grads)
    empty = q.new_empty((0,), dtype=torch.float32)  # a gradient not asked for (outputs may not alias each other)
    dmask = dmask.float().contiguous() if dmask is not None else empty
    return dq, dk, dv, dmask, dsinks.float().clone() if dsinks is not None else empty.clone()


@_flash_attention_backward_op.register_fake
def _(do, dlse, q, k, v, o, lse, row_stats, attn_mask, cache_seqlens, alibi, sinks, causal, scale, softcap,
      window, num_splits, write_lse, training, mask_needs_grad, cu_seqlens_q=None, cu_seqlens_k=None,
      max_seqlen_q=0, max_seqlen_k=0, block_table=None):
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    dmask = q.new_empty(attn_mask.shape if mask_needs_grad else (0,), dtype=torch.float32)
    return dq, dk, dv, dmask, q.new_empty(sinks.shape if sinks is not None else (0,), dtype=torch.float32)


def _route_backward(route: Route, do, dlse, q, k, v, o, lse, row_stats, attn_mask, alibi, sinks,
                    mask_needs_grad: bool, seqs: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple:
    """``Route.backward`` of a call from its saved tensors and the user's ``attn_mask``, the mask's gradient summed
    to that mask's shape (in fp32: rounding each of its broadcast terms first would leave their rounding in the
    sum). What the op's backward and the eager path both run."""
    mask = _mask_view(attn_mask, q, k)[0]
    dq, dk, dv, dmask, dsinks = route.backward(unit_stride_head_dim(do), dlse, q, k, v, o, lse, row_stats, mask,
                                               alibi, sinks, mask_needs_grad, seqs)
    if dmask is not None:
        dmask = dmask.sum_to_size(attn_mask.shape)
    return dq, dk, dv, dmask, dsinks


def _save_for_backward(ctx, q, k, v, attn_mask, alibi, sinks, o, lse, row_stats, mask_index: int) -> None:
    """The autograd rule's forward half: what the backward reads. ``mask_index``: ``attn_mask``'s position among
    the inputs (its ``needs_input_grad``)."""
    ctx.save_for_backward(q, k, v, o, lse, row_stats, attn_mask, alibi, sinks)
    ctx.mask_index = mask_index


def _gradients(ctx, do, dlse, run_backward) -> tuple:
    """The autograd rule's backward half: ``(dq, dk, dv, dmask, dsinks)`` in the inputs' dtypes and shapes (None
    where no gradient is asked), from ``run_backward(do, dlse, q, k, v, o, lse, row_stats, attn_mask, alibi,
    sinks, mask_needs_grad)``: the op's backward, or its implementation (eager)."""
    q, k, v, o, lse, row_stats, attn_mask, alibi, sinks = ctx.saved_tensors
    mask_needs_grad = attn_mask is not None and ctx.needs_input_grad[ctx.mask_index]
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv, dmask, dsinks = run_backward(do, dlse, q, k, v, o, lse, row_stats, attn_mask, alibi, sinks,
                                             mask_needs_grad)
    dmask = dmask.to(attn_mask.dtype) if mask_needs_grad else None
    dsinks = dsinks.to(sinks.dtype) if sinks is not None else None
    return dq, dk, dv, dmask, dsinks


def _setup_op(ctx, inputs, output) -> None:
    (q, k, v, attn_mask, cache_seqlens, alibi, sinks, *options) = inputs
    ctx.op_options = (cache_seqlens, *options[:7])  # causal .. training
    ctx.packed = tuple(options[7:])
    _save_for_backward(ctx, q, k, v, attn_mask, alibi, sinks, *output, mask_index=3)


def _op_gradients(ctx, do, dlse, _drow_stats):
    def run(do, dlse, q, k, v, o, lse, row_stats, attn_mask, alibi, sinks, mask_needs_grad):
        cache_seqlens, *options = ctx.op_options
        return torch.ops.flashlite.flash_attention_backward(
            do, dlse, q, k, v, o, lse, row_stats, attn_mask, cache_seqlens, alibi, sinks, *options, mask_needs_grad,
            *ctx.packed)

    dq, dk, dv, dmask, dsinks = _gradients(ctx, do, dlse, run)
    return (dq, dk, dv, dmask, None, None, dsinks, None, None, None, None, None, None, None,
            *(None,) * len(ctx.packed))


_flash_attention_op.register_autograd(_op_gradients, setup_context=_setup_op)


class _Attention(torch.autograd.Function):
    """The op's eager fast path: its implementation (``Route.forward``) and autograd rule, without the dispatcher."""

    @staticmethod
    def forward(ctx, route, q, k, v, attn_mask, mask, cache_seqlens, alibi, sinks, seqs=None):
        ctx.set_materialize_grads(False)
        o, lse, row_stats = route.forward(q, k, v, mask, cache_seqlens, alibi, sinks, seqs)
        ctx.route, ctx.seqs = route, seqs
        _save_for_backward(ctx, q, k, v, attn_mask, alibi, sinks, o, lse, row_stats, mask_index=4)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        route = ctx.route
        dq, dk, dv, dmask, dsinks = _gradients(ctx, do, dlse, lambda *args: _route_backward(route, *args, ctx.seqs))
        return None, dq, dk, dv, dmask, None, None, None, dsinks, None


# ----------------------------------------------------------------------------- the public function


def check_paged_cache(q, k_cache, v_cache, block_table, cache_seqlens, attn_mask) -> None:
    """Validate a paged KV cache (errors name the argument): ``block_table`` int32 (B, max_blocks) on q's device,
    k_cache/v_cache (num_blocks, H_kv, page_size, ·) with a page size that is a multiple of 16, ``cache_seqlens``
    given, no ``attn_mask``. On the CPU the page numbers are checked to lie in [0, num_blocks) too (on a GPU the
    kernel clamps them: no host synchronisation)."""
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be an int32 tensor, got {type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0]:
        raise ValueError(f"block_table must be (B, max_blocks) with B = {q.shape[0]}, got {tuple(block_table.shape)}")
    if block_table.device != q.device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}")
    if block_table.stride(1) != 1 and block_table.shape[1] > 1:
        raise ValueError(f"block_table's rows must be contiguous (stride 1 along max_blocks), got strides "
                         f"{block_table.stride()}")
    if cache_seqlens is None:
        raise ValueError("block_table needs cache_seqlens: the number of valid keys of each sequence")
    if attn_mask is not None:
        raise ValueError("attn_mask is not supported with block_table (a paged cache)")
    for name, t in (("k", k_cache), ("v", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D paged cache (num_blocks, H_kv, page_size, head_dim) with "
                             f"block_table, got {getattr(t, 'shape', type(t).__name__)}")
    if k_cache.shape[0] < 1 or k_cache.shape[0] != v_cache.shape[0] or k_cache.shape[2] != v_cache.shape[2]:
        raise ValueError(f"k and v must hold the same pages (num_blocks >= 1, one page size), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape[2] % 16:
        raise ValueError(f"the page size (k's dim 2) must be a multiple of 16, got {k_cache.shape[2]}")
    if not block_table.is_cuda and block_table.numel() and not is_compiling():
        low, high = int(block_table.min()), int(block_table.max())
        if low < 0 or high >= k_cache.shape[0]:
            raise ValueError(f"block_table values must lie in [0, num_blocks) = [0, {k_cache.shape[0]}), got "
                             f"values from {low} to {high}")


def logical_cache(k: torch.Tensor, block_table: torch.Tensor | None, batch: int) -> torch.Tensor:
    """``k`` itself, or for a paged cache a tensor without memory of the (B, H_kv, max_blocks · page_size, D)
    cache it stands for (what the split planner and the checks read: shapes)."""
    if block_table is None:
        return k
    return torch.empty((batch, k.shape[1], block_table.shape[1] * k.shape[2], k.shape[3]), device="meta")


def _check_call(q, k, v, causal, scale, attn_mask, window_size, softcap, alibi_slopes, sinks, return_lse,
                num_splits, cache_seqlens, block_table=None):
    """Every argument checked (errors name the argument), returned normalised: ``(mask, mask_is_bool, causal,
    scale, softcap, window, return_lse)``."""
    if block_table is not None:  # a paged cache: checked, then as one page per sequence for the rest
        check_paged_cache(q, k, v, block_table, cache_seqlens, attn_mask)
        k, v = (t[:1].expand(q.shape[0], -1, -1, -1) for t in (k, v))
    mask, mask_is_bool = check_inputs(q, k, v, attn_mask)
    causal, return_lse = check_flag("causal", causal), check_flag("return_lse", return_lse)
    check_split_args(num_splits, cache_seqlens, q, logical_cache(k, block_table, q.shape[0]))
    check_alibi_slopes(alibi_slopes, q)
    check_sinks(sinks, q)
    scale = check_scale(scale, 1.0 / math.sqrt(q.shape[3]))
    softcap = check_softcap(softcap)
    causal, window = visibility(causal, check_window_size(window_size))
    return mask, mask_is_bool, causal, scale, softcap, window, return_lse


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    causal: bool = False, scale: float | None = None, attn_mask: torch.Tensor | None = None,
    window_size: tuple[int, int] | None = None, softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None, return_lse: bool = False,
    num_splits: int | None = None, cache_seqlens: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention ``softmax(q kᵀ · scale + mask) v``, tile by tile, without materialising the scores.

    With ``s = scale · q·k``, in this order: ``softcap``, then ``alibi_slopes``, then ``attn_mask``, then
    the visibility (``causal``, ``window_size``); ``sinks`` add one logit to each row's softmax.

    Args:
        q: (B, H, Lq, D) float16, bfloat16 or float32. Any strides with the head
            dim contiguous are read in place (views of a packed qkv projection, a
            (B, L, H, D) tensor transposed); otherwise one copy is made.
        k: (B, H_kv, Lk, D), same dtype and device; ``H % H_kv == 0``. Query
            head ``h`` attends to K/V head ``h // (H // H_kv)`` (GQA/MQA, as
            ``scaled_dot_product_attention(enable_gqa=True)``), without copying K/V.
            D from 16 to 256, any value (non-powers of two are padded on chip).
            Lq and Lk are independent and any length. With ``cache_seqlens``, k and v
            are a preallocated cache of L_max = Lk positions.
        v: (B, H_kv, Lk, Dv): a head dim of its own, Dv from 16 to 256 (MLA's 192/128);
            the output has it.
        causal: query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq`` (``Lk`` is
            ``cache_seqlens[b]`` when given): the causal mask
            aligned bottom-right, as ``flashlite.masked_softmax`` and FlashAttention
            >= 2.1 (not ``scaled_dot_product_attention(is_causal=True)``, which is
            top-left aligned when Lq != Lk).
        scale: multiplies the scores; default ``1 / sqrt(D)``.
        attn_mask: broadcastable to (B, H, Lq, Lk). Boolean (True = keep) or float
            (added to the scaled scores, natural-log units). Broadcast dims are never
            expanded; a key-padding mask (B, 1, 1, Lk) is read once per key tile.
            A bias of any finite size is exact (``torch.finfo(dtype).min`` hides
            a row as SDPA does: it averages the row's values), gradients too.
        window_size: None, or ``(left, right)``, ints >= -1 (-1: unbounded on that
            side): a sliding window, FlashAttention's ``window_size``. Query ``i`` sees
            key ``j`` iff ``i + Lk - Lq - left <= j <= i + Lk - Lq + right`` (``Lk`` is
            ``cache_seqlens[b]`` when given); with ``causal`` a key must pass both.
            Key tiles outside the window are never read: the work is proportional to
            the visible pairs. Every path, backward and decoding included. No gradient.
        softcap: None, or a float > 0: the scaled scores become
            ``softcap · tanh(s / softcap)`` (Gemma-2's logit softcapping), on every path,
            backward included. On a GPU, fp16/bf16 take tanh from the hardware's
            approximation (relative error ~2^-11, as FlashAttention).
        alibi_slopes: None, or float32 (H,) or (B, H): ALiBi, ``s - slope · |i + Lk - Lq - j|``
            (FlashAttention's definition; ``Lk`` is ``cache_seqlens[b]`` when given), after the
            softcap, on every path. No gradient (the slopes are constants).
        sinks: None, or (H,) floating point (may require grad): attention sinks, one
            extra logit per head whose value vector is zeros. Each row's softmax runs
            over its visible scores and ``sinks[h]``; the returned LSE includes the sink;
            a row that sees no key gives zeros (and ``lse = sinks[h]``). Every kernel
            merges the sink into its rows' final state; differentiable in the sinks.
        return_lse: also return the log-sum-exp of each row's scaled, masked scores.
        num_splits: split-K/V decoding (``flashlite.attention.split_kv``, FlashDecoding):
            each query tile's keys are cut into this many parts, run by separate
            programs and merged. None (default) chooses (``split_kv.auto_num_splits``,
            a rule measured on an H200): on CUDA, with Lk >= 4096, decoding shapes (at
            most 16 query rows per K/V head, GQA heads packed) take the split
            kernel with up to one program per multiprocessor (one wave; at least
            2 splits); longer query blocks split only when the forward's grid would
            leave multiprocessors idle. Training (inputs that require grad) never
            splits. 1 never splits; n > 1 forces n splits, clamped to the number of
            key tiles (and to 65535, CUDA's grid limit). The result means the same
            either way.
        cache_seqlens: None, or (B,) int32/int64 on q's device: batch element ``b``
            attends keys ``[0, cache_seqlens[b])`` of k and v only (a KV cache filled
            up to there, read in place without a copy). Values must lie in [0, Lk]
            (checked on CPU; on CUDA they are clamped, to avoid a host sync).
        block_table: None, or int32 (B, max_blocks) on q's device: k and v are then a paged cache,
            (num_blocks, H_kv, page_size, D) (any strides with the head dim contiguous: FlashAttention's
            (num_blocks, page_size, H_kv, D) passes as ``k_cache.transpose(1, 2)``), key ``j`` of sequence
            ``b`` in page ``block_table[b, j // page_size]`` at row ``j % page_size``; page sizes any
            multiple of 16; ``cache_seqlens`` required, no ``attn_mask``. Split-K/V decoding (Lq = 1, or
            chunked prefill with ``causal``), every variant; inference only (no gradient), as FlashAttention.

    Returns:
        ``o`` (B, H, Lq, Dv) in q's dtype (its (B, H, L) dims in q's memory order), or
        ``(o, lse)`` with ``lse`` (B, H, Lq) float32 natural-log. A query row that
        sees no key at all gives zeros and ``lse = -inf`` (the sink, with sinks).

    Decoding (Lq = 1..16 against a long cache) is what ``cache_seqlens`` and
    ``num_splits`` are for. A repeated call (the same shapes, strides, dtypes,
    devices, 16-byte alignments, options and need for gradients as an earlier
    one) skips the checks and the planning: it replays the route planned at its
    first call (``route.Route``, kept by ``call_key``), forward and backward.

    fp16/bf16 compute in fp32 with P rounded to the input dtype, like
    FlashAttention; fp32 uses IEEE fp32 dots (slow, accurate to ~1e-6).

    Differentiable (``flashlite.attention.backward``, FlashAttention-2 style: two
    passes, bitwise repeatable): gradients of q, k, v (dk/dv summed over each GQA group), of
    a float ``attn_mask`` that requires grad (summed over its broadcast dims;
    this materialises one (B, H, Lq, Lk) fp32 buffer), and through the returned
    ``lse``, and of ``sinks``. A boolean mask has no gradient. The split-K/V path (``num_splits``
    > 1, ``cache_seqlens``) has no backward: it raises NotImplementedError. CPU
    tensors run the Triton kernels through the interpreter under
    ``TRITON_INTERPRET=1``, else a PyTorch fp32 path that materialises the
    scores. Eager and compiled calls run one op (``torch.ops.flashlite.flash_attention``,
    its backward ``flash_attention_backward``); eager calls reach its implementation
    and autograd rule through ``_Attention``, without the dispatcher's host cost.
    """
    training = torch.is_grad_enabled() and (
        getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False) or getattr(v, "requires_grad", False)
        or getattr(attn_mask, "requires_grad", False) or getattr(sinks, "requires_grad", False))
    if block_table is not None and training:
        raise ValueError("block_table (a paged cache) is for inference: call it without gradients (no_grad)")
    if is_compiling():
        return _compiled_call(q, k, v, causal, scale, attn_mask, window_size, softcap, alibi_slopes, sinks,
                              return_lse, num_splits, cache_seqlens, training, block_table)
    key = call_key(q, k, v, causal, scale, attn_mask, window_size, softcap, alibi_slopes, sinks, return_lse,
                   num_splits, cache_seqlens, training)
    if key is not None and block_table is not None:
        key = (*key, _tensor_key(block_table)) if block_table.is_cuda else None  # on CPU: checked every call
    route = _ROUTES.get(key) if key is not None else None
    if route is None:  # checked and planned once per signature (a kept key holds return_lse as a bool)
        mask, mask_is_bool, causal_, scale_, softcap_, window, return_lse = _check_call(
            q, k, v, causal, scale, attn_mask, window_size, softcap, alibi_slopes, sinks, return_lse, num_splits,
            cache_seqlens, block_table)
        qu, ku, vu = (unit_stride_head_dim(t) for t in (q, k, v))
        if num_splits is None:  # training keeps the forward kernel: the split path has no backward
            num_splits = (1 if training or not runs_kernels(q)
                          else auto_num_splits(qu, logical_cache(ku, block_table, q.shape[0]), mask))
        paged = None if block_table is None else (k.shape[2], block_table.shape[1])
        route = Route(qu, ku, vu, mask, mask_is_bool, causal_, scale_, softcap_, window, alibi_slopes is not None,
                      sinks is not None, return_lse, training, num_splits, cache_seqlens is not None, paged=paged)
        if key is not None:
            _keep(key, route)
    q, k, v = unit_stride_head_dim(q), unit_stride_head_dim(k), unit_stride_head_dim(v)
    mask = None if attn_mask is None else _mask_view(attn_mask, q, k)[0]
    alibi = None if alibi_slopes is None else alibi_view(alibi_slopes, q.shape[0])
    if sinks is not None:
        sinks = sinks.contiguous()  # the kernels read one per head (differentiable)
    if training:
        o, lse = _Attention.apply(route, q, k, v, attn_mask, mask, cache_seqlens, alibi, sinks)
    else:  # inference: no autograd node to build
        o, lse, _ = route.forward(q, k, v, mask, cache_seqlens, alibi, sinks, block_table=block_table)
    return (o, lse) if return_lse else o


def _compiled_call(q, k, v, causal, scale, attn_mask, window_size, softcap, alibi_slopes, sinks, return_lse,
                   num_splits, cache_seqlens, training, block_table):
    """``flash_attention`` while ``torch.compile`` traces: checked, then one node of the graph (the op)."""
    _, _, causal, scale, softcap, window, return_lse = _check_call(
        q, k, v, causal, scale, attn_mask, window_size, softcap, alibi_slopes, sinks, return_lse, num_splits,
        cache_seqlens, block_table)
    q, k, v = (unit_stride_head_dim(t) for t in (q, k, v))
    if num_splits is None and training:
        num_splits = 1
    alibi = alibi_view(alibi_slopes, q.shape[0])
    sinks = None if sinks is None else sinks.contiguous()
    o, lse, _ = torch.ops.flashlite.flash_attention(
        q, k, v, attn_mask, cache_seqlens, alibi, sinks, causal, scale, softcap,
        None if window is None else list(window), num_splits, return_lse, training, block_table=block_table)
    return (o, lse) if return_lse else o


# ----------------------------------------------------------------------------- packed (variable-length) batches


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> int:
    """Validate ``flash_attention_varlen``'s packed layout (errors name the argument); return the number of
    sequences. On the CPU the offsets are checked too (from 0, non-decreasing, ending at the total, no sequence
    longer than ``max_seqlen``), except while ``torch.compile`` traces; on a GPU they are not read (that would
    wait for the device): the kernels clamp them to the tensors, so bad offsets give wrong (or unwritten) rows,
    never reads or writes outside them."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total_tokens, heads, head_dim), got shape {tuple(t.shape)}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_cu_seqlens(name, cu)
        if cu.stride(0) != 1 and cu.shape[0] > 1:
            raise ValueError(f"{name} must be contiguous (the kernels read it as an array), got stride {cu.stride()}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k give different batch sizes: {cu_seqlens_q.shape[0] - 1} "
                         f"and {cu_seqlens_k.shape[0] - 1} sequences")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if type(value) is not int or value < 0:
            raise TypeError(f"{name} must be a non-negative int, got {value!r}")
    if not q.is_cuda and not is_compiling():  # values read on the host: not while tracing
        for name, cu, total, longest in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                         ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
            lengths = cu.diff()
            if cu[0] != 0 or cu[-1] != total or bool((lengths < 0).any()):
                raise ValueError(f"{name} must rise from 0 to the total number of rows ({total}), got "
                                 f"{cu.tolist()}")
            if lengths.numel() and int(lengths.max()) > longest:
                name_max = "max_seqlen_q" if name == "cu_seqlens_q" else "max_seqlen_k"
                raise ValueError(f"{name_max} ({longest}) is shorter than the longest sequence of {name} "
                                 f"({int(lengths.max())})")
    return cu_seqlens_q.shape[0] - 1


def flash_attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False, scale: float | None = None,
    window_size: tuple[int, int] | None = None, softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None, return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a packed batch of sequences of different lengths (FlashAttention's varlen convention):
    per sequence exactly ``flash_attention`` on that sequence, no pair across two sequences, no padding.

    Args:
        q: (total_q, H, D); k: (total_k, H_kv, D); v: (total_k, H_kv, Dv). Any strides with the head dim
            contiguous are read in place (views of a packed (total, H·D) projection).
        cu_seqlens_q, cu_seqlens_k: int32 (B + 1,) on q's device: sequence ``b`` owns query rows
            ``[cu_seqlens_q[b], cu_seqlens_q[b + 1])`` and key rows likewise. Sequences of length 0 are allowed.
            The kernels read them on the device (no host synchronisation); on the CPU they are checked.
        max_seqlen_q, max_seqlen_k: ints, at least the longest sequence (they size the kernels' grids).
        causal, scale, window_size, softcap, sinks: as ``flash_attention``, within each sequence (causal
            aligned bottom-right in each).
        alibi_slopes: float32 (H,) or (B, H).
        return_lse: also return the LSE, (H, total_q) float32 natural-log.

    Returns:
        ``o`` (total_q, H, Dv) in q's dtype, or ``(o, lse)``. Rows of a sequence without keys are 0 (LSE
        ``-inf``, or the sink). Differentiable in q, k, v, sinks and through the LSE (the two-pass backward,
        deterministic). Runs on one flattened schedule of every sequence's tiles (``core.packed``): on Hopper
        the Hopper (Gluon) kernels where they apply, else (and under ``FLASHLITE_HOPPER_VARLEN=0``,
        ``plan.hopper_varlen_enabled``) the ``triton.language`` ones; CPU tensors without ``TRITON_INTERPRET=1``
        take the PyTorch path, one sequence at a time.
    """
    training = torch.is_grad_enabled() and (
        getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False) or getattr(v, "requires_grad", False)
        or getattr(sinks, "requires_grad", False))
    key = None  # a repeated call replays its route; offsets on the CPU are checked every call
    if (not is_compiling() and type(cu_seqlens_q) is torch.Tensor and type(cu_seqlens_k) is torch.Tensor
            and cu_seqlens_q.is_cuda and cu_seqlens_k.is_cuda and type(max_seqlen_q) is int
            and type(max_seqlen_k) is int):
        key = call_key(q, k, v, causal, scale, None, window_size, softcap, alibi_slopes, sinks, return_lse, 1, None,
                       training)
        if key is not None:
            key = ("varlen", *key, max_seqlen_q, max_seqlen_k, _tensor_key(cu_seqlens_q), _tensor_key(cu_seqlens_k))
    route = _ROUTES.get(key) if key is not None else None
    n_seqs = cu_seqlens_q.shape[0] - 1 if route is not None else check_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    q4, k4, v4 = (unit_stride_head_dim(t.unsqueeze(0).transpose(1, 2)) for t in (q, k, v))  # core.packed's view
    if route is None:
        _, _, causal, scale, softcap, window, return_lse = _check_call(
            q4, k4, v4, causal, scale, None, window_size, softcap, None, sinks, return_lse, 1, None)
        check_alibi_slopes(alibi_slopes, q4, batch=n_seqs)
    alibi = alibi_view(alibi_slopes, n_seqs)
    sinks = None if sinks is None else sinks.contiguous()
    if is_compiling():
        o, lse, _ = torch.ops.flashlite.flash_attention(
            q4, k4, v4, None, None, alibi, sinks, causal, scale, softcap, None if window is None else list(window),
            1, return_lse, training, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    else:
        if route is None:
            route, _ = op_route(q4, k4, v4, None, None, alibi, sinks, causal, scale, softcap, window, 1, return_lse,
                                training, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            if key is not None:
                _keep(key, route)
        seqs = (cu_seqlens_q, cu_seqlens_k)
        if training:
            o, lse = _Attention.apply(route, q4, k4, v4, None, None, None, alibi, sinks, seqs)
        else:
            o, lse, _ = route.forward(q4, k4, v4, None, None, alibi, sinks, seqs)
    # squeeze, not o[0]: a select's gradient is a zero-filled copy of the whole (1, H, total, Dv) tensor
    o = o.squeeze(0).transpose(0, 1)
    return (o, lse.squeeze(0)) if return_lse else o
