"""``flashlite.flash_attention``: argument checks, routing between the kernels, autograd.

``attention_forward`` sends a checked call to the Hopper kernel
(``forward_hopper``) where it applies, else to the ``triton.language`` kernel
(``forward``); decoding calls (``num_splits``, ``cache_seqlens``) go to
``split_kv``; training calls keep what the backward (``backward``) needs
(``forward_for_backward``). Tensors the kernels do not run on take
``reference``.
"""

from __future__ import annotations

import math

import torch

from ..core.checks import (
    check_alibi_slopes, check_flag, check_float_dtype, check_scale, check_sinks, check_softcap, check_window_size,
)
from ..core.masking import broadcast_mask
from ..core.runtime import is_compiling, runs_kernels
from .backward import attention_backward
from .forward import attention_forward_tl
from .forward_hopper import attention_forward_hopper, wgmma_eligible
from .reference import attention_torch
from .split_kv import SplitLaunch, auto_num_splits, check_split_args
from .plan import alibi_view, visibility
from .tuning import AttentionConfig, MAX_HEAD_DIM, MIN_HEAD_DIM


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
    mask: torch.Tensor | None, mask_is_bool: bool, write_lse: bool, config: AttentionConfig | None = None,
    *, row_stats: torch.Tensor | None = None, softcap: float | None = None, window: tuple[int, int] | None = None,
    alibi: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward of checked (B, H, L, D) tensors whose head dim has stride 1, on the kernel that serves it.

    ``mask`` is broadcast to (B, H, Lq, Lk) already (``broadcast_mask``). ``config``
    forces the ``triton.language`` kernel (``forward``) and its tiles (tests use
    small ones to cover the multi-tile paths). Without it, calls the Hopper kernel
    takes (``wgmma_eligible``) go there; the rest run ``forward``. For the backward
    of an additive mask ``row_stats``, a (2, B, H, Lq) fp32 tensor, is filled with
    each row's ``(m, log d)``. The variants: ``softcap`` (Gemma-2's logit softcapping), ``window`` (a sliding
    window as ``plan.visibility`` gives it, causal folded in), ``alibi`` ((B, H) fp32 slopes,
    ``plan.alibi_view``), ``sinks`` ((H,)); None for each that is not used.
    Returns ``(o, lse)``: o (B, H, Lq, Dv) in q's dtype, lse (B, H, Lq) fp32 natural-log, or None.
    """
    if config is None and row_stats is None and wgmma_eligible(q, k, v, mask is not None, scale):
        return attention_forward_hopper(q, k, v, causal, scale, write_lse, window=window, softcap=softcap,
                                        alibi=alibi, sinks=sinks)
    return attention_forward_tl(q, k, v, causal, scale, mask, mask_is_bool, write_lse, config, row_stats=row_stats,
                                softcap=softcap, window=window, alibi=alibi, sinks=sinks)


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


SPLIT_HAS_NO_BACKWARD = (
    "flashlite.flash_attention has no backward pass for split-K/V attention (num_splits > 1 or "
    "cache_seqlens given); call it with num_splits=1 and without cache_seqlens to train"
)


# Routes of repeated inference calls (``repeat_key``), kept up to this many signatures.
ROUTES_KEPT = 256


_ROUTES: dict = {}


def repeat_key(q, k, v, causal, scale, attn_mask, return_lse, num_splits, cache_seqlens, softcap=None,
               window_size=None, alibi_slopes=None, sinks=None) -> tuple | None:
    """The signature under which ``_ROUTES`` keeps the route of an inference call, or None (not kept).

    Kept: eager calls on plain tensors that flashlite's kernels run, no mask, no
    gradient to record, arguments of the exact types the checks accept
    (``bool`` flags, a ``float`` or None scale, an ``int`` or None ``num_splits``)
    and ``cache_seqlens`` None or on a GPU (on CPU its values are checked every
    call). Everything the checks and the plan read is in the key: shapes,
    strides, dtypes, devices, addresses modulo 16, and the options' values; of ``alibi_slopes`` and
    ``sinks`` (tensors passed to each call's kernels) what their checks read.
    """
    if (attn_mask is not None or type(q) is not torch.Tensor or type(k) is not torch.Tensor
            or type(v) is not torch.Tensor or type(causal) is not bool or type(return_lse) is not bool
            or (scale is not None and type(scale) is not float) or (num_splits is not None and type(num_splits) is not int)
            or (softcap is not None and type(softcap) is not float)
            or (window_size is not None and (type(window_size) is not tuple or len(window_size) != 2
                                             or any(type(side) is not int for side in window_size)))
            or is_compiling() or not runs_kernels(q)):
        return None
    tensors = []
    for t in (alibi_slopes, sinks):
        if t is not None:
            if type(t) is not torch.Tensor:
                return None
            tensors.append((t.dtype, t.shape, t.device))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        return None
    lengths = None
    if cache_seqlens is not None:
        if type(cache_seqlens) is not torch.Tensor or not cache_seqlens.is_cuda:
            return None
        lengths = (cache_seqlens.dtype, cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.device,
                   cache_seqlens.data_ptr() % 16)
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16,
            causal, scale, return_lse, num_splits, lengths, softcap, window_size, alibi_slopes is None, sinks is None,
            *tensors)


def forward_route(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, mask_is_bool: bool, causal: bool,
    scale: float, write_lse: bool, num_splits: int, has_cache_seqlens: bool, softcap: float | None = None,
    window: tuple[int, int] | None = None, has_alibi: bool = False, has_sinks: bool = False,
):
    """``f(q, k, v, mask, cache_seqlens, alibi, sinks) -> (o, lse)``: the forward of a call of this signature,
    planned once: split-K/V (``SplitLaunch``) for ``num_splits`` > 1 or a cache with lengths, else
    ``attention_forward``. ``alibi`` is ``plan.alibi_view``'s (B, H)."""
    if num_splits == 1 and not has_cache_seqlens:
        def forward(q, k, v, mask, cache_seqlens, alibi, sinks):
            return attention_forward(q, k, v, causal, scale, mask, mask_is_bool, write_lse, softcap=softcap,
                                     window=window, alibi=alibi, sinks=sinks)
        return forward
    return SplitLaunch(q, k, v, mask, causal, scale, mask_is_bool, write_lse, num_splits, has_cache_seqlens,
                       softcap=softcap, window=window, has_alibi=has_alibi, has_sinks=has_sinks)


def clear_routes() -> None:
    """Forget the routes of repeated calls, after changing a tuning constant (tests and benchmarks do)."""
    _ROUTES.clear()


def forward_for_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, mask: torch.Tensor | None,
    mask_is_bool: bool, softcap: float | None = None, window: tuple[int, int] | None = None,
    alibi: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(o, lse, row_stats)``: the forward a backward will follow.

    Without an additive mask ``row_stats`` is None: the backward recomputes P
    from the LSE. Under one, each row's ``(m, log d)`` is kept apart
    (``row_stats``, (2, B, H, Lq)): a bias of -1e9 leaves no room for ``log d``
    in the LSE's fp32, and P recomputed from it would sum to the key count.
    """
    variants = dict(softcap=softcap, window=window, alibi=alibi, sinks=sinks)
    if mask is None or mask_is_bool:
        o, lse = attention_forward(q, k, v, causal, scale, mask, mask_is_bool, True, **variants)
        return o, lse, None
    row_stats = torch.empty((2, *q.shape[:3]), dtype=torch.float32, device=q.device)
    o, _ = attention_forward(q, k, v, causal, scale, mask, mask_is_bool, False, row_stats=row_stats, **variants)
    return o, row_stats[0] + row_stats[1], row_stats


class _FlashAttention(torch.autograd.Function):
    """``(o, lse)`` of ``flash_attention``; differentiable in q, k, v, an additive mask, the sinks and through lse
    (backward: ``flashlite.attention.backward``, not for the split-K/V path). ``attn_mask`` is the user's mask,
    ``mask`` its (B, H, Lq, Lk) view: the mask's gradient is summed to ``attn_mask``'s shape in fp32, before
    it is rounded to its dtype (rounding each of its Lk terms first would leave their rounding in the sum)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, attn_mask, mask, mask_is_bool, write_lse, num_splits, cache_seqlens,
                softcap, window, alibi, sinks):
        ctx.split = num_splits != 1 or cache_seqlens is not None
        if ctx.split:
            route = forward_route(q, k, v, mask, mask_is_bool, causal, scale, write_lse, num_splits,
                                  cache_seqlens is not None, softcap, window, alibi is not None, sinks is not None)
            return route(q, k, v, mask, cache_seqlens, alibi, sinks)
        o, lse, row_stats = forward_for_backward(q, k, v, causal, scale, mask, mask_is_bool, softcap, window, alibi,
                                                 sinks)
        ctx.save_for_backward(q, k, v, o, lse, row_stats, mask, alibi, sinks)
        ctx.causal, ctx.scale, ctx.mask_is_bool, ctx.softcap, ctx.window = causal, scale, mask_is_bool, softcap, window
        ctx.mask_shape = None if attn_mask is None else attn_mask.shape
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        if ctx.split:
            raise NotImplementedError(SPLIT_HAS_NO_BACKWARD)
        q, k, v, o, lse, row_stats, mask, alibi, sinks = ctx.saved_tensors
        dq, dk, dv, dmask, dsinks = attention_backward(
            unit_stride_head_dim(do), q, k, v, o, lse, dlse, ctx.causal, ctx.scale, mask, ctx.mask_is_bool,
            mask_needs_grad=ctx.needs_input_grad[5], row_stats=row_stats, softcap=ctx.softcap, window=ctx.window,
            alibi=alibi, sinks=sinks,
        )
        if dmask is not None:
            dmask = dmask.sum_to_size(ctx.mask_shape).to(mask.dtype)
        return dq, dk, dv, None, None, dmask, None, None, None, None, None, None, None, None, dsinks


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    causal: bool = False, scale: float | None = None, attn_mask: torch.Tensor | None = None,
    window_size: tuple[int, int] | None = None, softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None, return_lse: bool = False,
    num_splits: int | None = None, cache_seqlens: torch.Tensor | None = None,
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

    Returns:
        ``o`` (B, H, Lq, Dv) in q's dtype (its (B, H, L) dims in q's memory order), or
        ``(o, lse)`` with ``lse`` (B, H, Lq) float32 natural-log. A query row that
        sees no key at all gives zeros and ``lse = -inf`` (the sink, with sinks).

    Decoding (Lq = 1..16 against a long cache) is what ``cache_seqlens`` and
    ``num_splits`` are for. A repeated inference call without a mask (the same
    shapes, strides, dtypes, devices, 16-byte alignments and options as an
    earlier one) skips the checks and the plan: it replays the route planned at
    its first call (``repeat_key``), a decoding step's host cost.

    fp16/bf16 compute in fp32 with P rounded to the input dtype, like
    FlashAttention; fp32 uses IEEE fp32 dots (slow, accurate to ~1e-6).

    Differentiable (``flashlite.attention.backward``, FlashAttention-2 style; on a
    GPU two passes, bitwise repeatable, see ``attention_backward``): gradients of q, k, v (dk/dv summed over each GQA group), of
    a float ``attn_mask`` that requires grad (summed over its broadcast dims;
    this materialises one (B, H, Lq, Lk) fp32 buffer), and through the returned
    ``lse``, and of ``sinks``. A boolean mask has no gradient. The split-K/V path (``num_splits``
    > 1, ``cache_seqlens``) has no backward: it raises NotImplementedError. CPU
    tensors run the Triton kernels through the interpreter under
    ``TRITON_INTERPRET=1``, else a PyTorch fp32 path (plain autograd) that
    materialises the scores.
    """
    key = repeat_key(q, k, v, causal, scale, attn_mask, return_lse, num_splits, cache_seqlens, softcap, window_size,
                     alibi_slopes, sinks)
    route = _ROUTES.get(key) if key is not None else None
    if route is not None:  # a repeated inference call: checked and planned when first seen
        o, lse = route(q, k, v, None, cache_seqlens, alibi_view(alibi_slopes, q.shape[0]),
                       None if sinks is None else sinks.contiguous())
        return (o, lse) if return_lse else o
    mask, mask_is_bool = check_inputs(q, k, v, attn_mask)
    causal, return_lse = check_flag("causal", causal), check_flag("return_lse", return_lse)
    check_split_args(num_splits, cache_seqlens, q, k)
    check_alibi_slopes(alibi_slopes, q)
    check_sinks(sinks, q)
    batch, n_heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    scale = check_scale(scale, 1.0 / math.sqrt(head_dim))
    softcap = check_softcap(softcap)
    causal, window = visibility(causal, check_window_size(window_size))
    alibi = alibi_view(alibi_slopes, batch)
    sinks = None if sinks is None else sinks.contiguous()  # the kernels read one per head (differentiable)
    if is_compiling():  # one node of the graph (flashlite.ops); training keeps the forward kernel, as below
        grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, attn_mask, sinks) if t is not None)
        splits = 1 if num_splits is None and grads else num_splits
        o, lse, _ = torch.ops.flashlite.flash_attention(q, k, v, causal, scale, attn_mask, splits, cache_seqlens,
                                                        softcap, None if window is None else list(window), alibi,
                                                        sinks)
        return (o, lse) if return_lse else o
    if not runs_kernels(q):
        o, lse = attention_torch(q, k, v, causal, scale, attn_mask, cache_seqlens, softcap, window, alibi, sinks)
    elif batch * n_heads * seqlen_q == 0 or seqlen_k == 0:  # nothing to launch; no key means empty rows
        # Zeros that stay in the autograd graph (gradient 0 for q), whatever q holds (NaN included); the LSE is the
        # sink's where there is one.
        o = torch.where(torch.zeros_like(q[..., :1], dtype=torch.bool), q[..., :1], 0.0).expand(
            *q.shape[:3], v.shape[3]).contiguous()
        lse = torch.full((batch, n_heads, seqlen_q), float("-inf"), dtype=torch.float32, device=q.device)
        if sinks is not None:
            lse = sinks.float().view(1, -1, 1).expand(batch, n_heads, seqlen_q).contiguous()
    else:
        inputs = (q, k, v)
        q, k, v = (unit_stride_head_dim(t) for t in inputs)
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (q, k, v, attn_mask, sinks) if t is not None)
        if num_splits is None:  # training keeps the forward kernel: the split path has no backward
            num_splits = 1 if needs_grad else auto_num_splits(q, k, mask)
        if needs_grad:
            o, lse = _FlashAttention.apply(q, k, v, causal, scale, attn_mask, mask, mask_is_bool, return_lse,
                                           num_splits, cache_seqlens, softcap, window, alibi, sinks)
        else:  # inference: no autograd node to build (its host cost shows on short calls)
            route = forward_route(q, k, v, mask, mask_is_bool, causal, scale, return_lse, num_splits,
                                  cache_seqlens is not None, softcap, window, alibi is not None, sinks is not None)
            o, lse = route(q, k, v, mask, cache_seqlens, alibi, sinks)
            # Kept for repeats when the key says so (no mask, among others) and the inputs were used in place.
            if key is not None and all(a is b for a, b in zip((q, k, v), inputs)):
                if len(_ROUTES) >= ROUTES_KEPT:
                    _ROUTES.clear()
                _ROUTES[key] = route
    return (o, lse) if return_lse else o
