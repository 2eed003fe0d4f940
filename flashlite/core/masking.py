"""Masking, defined once: which (query, key) positions count, and how a bias is added.

Both the masked softmax and the attention kernels call these helpers on a tile
of logits ``s`` ``[BLOCK_M, BLOCK_N]`` whose rows are queries ``q_idx`` and
columns keys ``k_idx``:

* bounds: keys at or past ``seqlen_k`` never count;
* logit softcapping (``soft_cap``), applied to the scaled scores before the rest;
* causal, aligned bottom-right (FlashAttention >= 2.1,
  ``torch.nn.attention.bias.causal_lower_right``): query ``i`` sees key ``j``
  iff ``j <= i + (seqlen_k - seqlen_q)``. With ``seqlen_q = seqlen_k`` it is the
  usual lower triangle; with ``seqlen_q < seqlen_k`` the last query sees every
  key; a query with ``i + seqlen_k - seqlen_q < 0`` sees none (its row is empty);
* a sliding window (``window_left``, ``window_right``, FlashAttention's ``window_size``), aligned
  as causal: query ``i`` sees key ``j`` iff ``i + offset - left <= j <= i + offset + right``
  (``offset = seqlen_k - seqlen_q``). Causal is the window ``(unbounded, 0)``; callers fold a
  causal call with a window into the window alone (``right = 0``), and pass an unbounded side as
  ``seqlen_q + seqlen_k`` (``flashlite.attention.plan.window_bounds``);
* a boolean mask (nonzero = keep, as in ``scaled_dot_product_attention``) or an
  additive float mask, read through strides so that a broadcast mask (stride 0
  on broadcast dims) is never expanded in memory.

Positions that do not count become ``-inf``; the online-softmax core then gives
them weight 0, and a row with none left has ``d = 0``.

Units: an additive mask is in natural-log units and is added to logits as
``bias · BIAS_TO_UNITS``. Every caller adds it to natural-log logits (``1.0``):
attention keeps the logits of a call with an additive mask in natural-log units,
so that a bias of any finite size stays finite.
"""

import triton
import triton.language as tl


@triton.jit
def causal_offset(seqlen_q, seqlen_k):
    """How far the causal diagonal is shifted right: query ``i`` sees keys ``j <= i + offset``."""
    return seqlen_k - seqlen_q


@triton.jit
def causal_key_end(q_last, seqlen_q, seqlen_k):
    """One past the last key that query ``q_last`` (the last row of a tile) can see; clamped to ``[0, seqlen_k]``.

    Keys from here on are masked for the whole tile, so kernels neither read nor
    compute them. Example: seqlen_q = 4, seqlen_k = 6, offset 2: query 0 sees keys
    0..2, so a tile whose last query is 0 stops at key 3.
    """
    return tl.minimum(tl.maximum(q_last + causal_offset(seqlen_q, seqlen_k) + 1, 0), seqlen_k)


@triton.jit
def clamp_position(position, length):
    """``position`` (a key, or a query in ``query_ranges``) clamped to ``[0, length]``."""
    return tl.minimum(tl.maximum(position, 0), length)


@triton.jit
def key_ranges(q_first, q_last, seqlen_q, seqlen_k,
               BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
               window_left=0, window_right=0, HAS_WINDOW: tl.constexpr = False):
    """``(key_start, full_start, full_end, key_end)`` for a tile of queries ``q_first..q_last``.

    Keys ``[full_start, full_end)`` (whole ``BLOCK_N`` tiles) count for every row, so need no mask
    arithmetic; ``[key_start, full_start)`` and ``[full_end, key_end)`` count for some rows; keys outside
    ``[key_start, key_end)`` for none, and are never read. ``key_start``, ``full_start`` and ``full_end`` are
    multiples of ``BLOCK_N``. Without a window ``key_start = full_start = 0``. With a user mask
    (``HAS_MASK``) every tile is masked: ``full_start = full_end = key_start``.

    Window example: BLOCK_N = 4, seqlen_q = seqlen_k = 16, window (3, 0), queries 8..11: query 8 sees keys
    5..8, query 11 keys 8..11. key_start = 4 (the tile of key 5), full keys are those every row sees, 8..8,
    no whole tile: full_start = 8, full_end = max(8, 8) = 8; key_end = 12. Tiles [4, 8) and [8, 12) masked.
    """
    offset = causal_offset(seqlen_q, seqlen_k)
    if HAS_WINDOW:
        key_start = clamp_position(q_first + offset - window_left, seqlen_k) // BLOCK_N * BLOCK_N
        key_end = clamp_position(q_last + offset + window_right + 1, seqlen_k)
        full_start = tl.cdiv(clamp_position(q_last + offset - window_left, seqlen_k), BLOCK_N) * BLOCK_N
        full_end = clamp_position(q_first + offset + window_right + 1, seqlen_k) // BLOCK_N * BLOCK_N
        full_end = tl.maximum(full_end, full_start)  # no whole tile: both masked parts meet at full_start
    elif IS_CAUSAL:
        key_start = 0
        full_start = 0
        key_end = causal_key_end(q_last, seqlen_q, seqlen_k)
        full_end = causal_key_end(q_first, seqlen_q, seqlen_k) // BLOCK_N * BLOCK_N
    else:
        key_start = 0
        full_start = 0
        key_end = seqlen_k
        full_end = seqlen_k // BLOCK_N * BLOCK_N
    if HAS_MASK:  # the user's mask is read on every tile
        full_start = key_start
        full_end = key_start
    return key_start, full_start, full_end, key_end


@triton.jit
def query_ranges(k_first, k_last, seqlen_q, seqlen_k,
                 BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr, window_left=0, window_right=0,
                 HAS_WINDOW: tl.constexpr = False):
    """``(query_start, full_start, full_end, query_end)`` for a tile of keys ``k_first..k_last``: the
    transpose of ``key_ranges`` (the attention backward's dK/dV kernel walks query tiles).

    Query tiles ``[full_start, full_end)`` see every key of the tile; ``[query_start, full_start)`` and
    ``[full_end, query_end)`` some; the rest none. Starts are multiples of ``BLOCK_M``; without a window
    ``full_end = query_end = seqlen_q`` (rows past it load as zeros and add nothing). Under causal key
    ``j`` is seen by queries ``i >= j - offset``; under a window by ``j - offset - right <= i <= j - offset
    + left``.
    """
    offset = causal_offset(seqlen_q, seqlen_k)
    if HAS_WINDOW:
        query_start = clamp_position(k_first - offset - window_right, seqlen_q) // BLOCK_M * BLOCK_M
        query_end = clamp_position(k_last - offset + window_left + 1, seqlen_q)
        full_start = tl.cdiv(clamp_position(k_last - offset - window_right, seqlen_q), BLOCK_M) * BLOCK_M
        full_end = clamp_position(k_first - offset + window_left + 1, seqlen_q) // BLOCK_M * BLOCK_M
        full_end = tl.maximum(full_end, full_start)
    elif IS_CAUSAL:
        query_start = clamp_position(k_first - offset, seqlen_q) // BLOCK_M * BLOCK_M
        full_start = tl.cdiv(clamp_position(k_last - offset, seqlen_q), BLOCK_M) * BLOCK_M
        full_end = seqlen_q
        query_end = seqlen_q
    else:
        query_start = 0
        full_start = 0
        full_end = seqlen_q
        query_end = seqlen_q
    return query_start, full_start, full_end, query_end


@triton.jit
def apply_masks(
    s, q_idx, k_idx, seqlen_q, seqlen_k,
    mask_ptr, stride_mask_q, stride_mask_k,
    IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
    BIAS_TO_UNITS: tl.constexpr, MASK_PER_KEY: tl.constexpr = False, KEYS_ON_ROWS: tl.constexpr = False,
    window_left=0, window_right=0, HAS_WINDOW: tl.constexpr = False,
):
    """Logits ``s`` with every position that does not count set to ``-inf`` and the bias added.

    ``s`` is ``[M, N]`` (queries ``q_idx`` on rows, keys ``k_idx`` across), or
    with ``KEYS_ON_ROWS`` its transpose ``[N, M]`` (the attention backward's
    dK/dV kernel works in that orientation).
    With ``HAS_WINDOW``, keys outside the sliding window of each query are hidden too.
    ``mask_ptr`` points at the mask of this (batch, head), already offset by the
    caller; ``stride_mask_q``/``stride_mask_k`` are 0 on broadcast dims.
    With ``MASK_PER_KEY`` (``stride_mask_q == 0``: a key-padding mask such as
    ``(B, 1, 1, Lk)``) every query reads the same mask row, so it is loaded
    once along the key axis and broadcast instead of gathered ``M`` times.
    """
    if KEYS_ON_ROWS:
        q_grid = q_idx[None, :]
        k_grid = k_idx[:, None]
    else:
        q_grid = q_idx[:, None]
        k_grid = k_idx[None, :]
    k_ok = k_grid < seqlen_k
    keep = k_ok & (q_grid < seqlen_q)
    if IS_CAUSAL:
        keep = keep & (k_grid <= q_grid + causal_offset(seqlen_q, seqlen_k))
    if HAS_WINDOW:
        diagonal = q_grid + causal_offset(seqlen_q, seqlen_k)
        keep = keep & (k_grid >= diagonal - window_left) & (k_grid <= diagonal + window_right)
    if HAS_MASK:
        # 64-bit: a mask stored keys-outermost (e.g. an (Lk, Lq) tensor transposed) has key strides near 2^31.
        key_offsets = k_grid.to(tl.int64) * stride_mask_k
        if MASK_PER_KEY:
            mask_ptrs = mask_ptr + key_offsets
            load_ok = k_ok
        else:
            mask_ptrs = mask_ptr + q_grid * stride_mask_q + key_offsets
            load_ok = keep
        if MASK_IS_BOOL:
            keep = keep & (tl.load(mask_ptrs, mask=load_ok, other=0) != 0)
        else:
            s = s + tl.load(mask_ptrs, mask=load_ok, other=0.0).to(tl.float32) * BIAS_TO_UNITS
    return tl.where(keep, s, float("-inf"))


# 2·log2(e): tanh(x) = 1 - 2 / (2^(x · 2·log2(e)) + 1).
TWO_LOG2E = tl.constexpr(2.8853900817779268)


@triton.jit
def soft_cap(s, cap):
    """Logits ``s`` squashed into ``(-cap, cap)``: ``cap · tanh(s / cap)`` (Gemma-2's logit softcapping).

    ``s`` and ``cap`` in the same units (the ratio is what tanh sees, so natural-log or base-2 logits both
    work). tanh through one ``exp2`` and an approximate division (``tl.fdiv``, 2 ulp: the IEEE one costs
    several instructions a score): ``1 - 2 / (2^(2 log2(e) x) + 1)``, exact in the limits (+-1 when the
    power overflows or vanishes). Applied before the masks, which then set hidden logits to ``-inf``.
    """
    return cap - tl.fdiv(2.0 * cap, tl.exp2(s * (TWO_LOG2E / cap)) + 1.0)


# ----------------------------------------------------------------------------- host side

import torch  # noqa: E402  (host helpers below the jit ones, as in every op module)


def broadcast_mask(mask: torch.Tensor, shape: tuple, name: str = "mask") -> tuple[torch.Tensor, bool]:
    """Check ``mask`` and view it broadcast to ``shape`` (stride 0 on broadcast dims, no copy).

    Returns ``(view, is_bool)``; a boolean mask is viewed as uint8 (nonzero = keep)
    so kernels load it as bytes. Raises a ValueError/TypeError naming ``name``.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
    is_bool = mask.dtype == torch.bool
    if not is_bool and mask.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{name} must be bool (True = keep) or float32/float16/bfloat16 (added), got {mask.dtype}")
    try:
        view = torch.broadcast_to(mask, shape)
    except RuntimeError:
        raise ValueError(f"{name} of shape {tuple(mask.shape)} does not broadcast to {tuple(shape)}") from None
    return (view.view(torch.uint8) if is_bool else view), is_bool
