"""Masking, defined once: which (query, key) positions count, and how a bias is added.

Both the masked softmax and the attention kernels call these helpers on a tile
of logits ``s`` ``[BLOCK_M, BLOCK_N]`` whose rows are queries ``q_idx`` and
columns keys ``k_idx``:

* bounds: keys at or past ``seqlen_k`` never count;
* score modifiers (``modify_scores``; ``modified_scores_scaled`` gives the same logits as ``c · x`` for kernels
  that fold a factor into the exponential), applied to the scaled scores before the rest, in this order: logit
  softcapping (``soft_cap``, Gemma-2's ``c · tanh(s / c)``), then ALiBi (``add_alibi``, ``s - slope · |i +
  offset - j|``);
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

Score modifiers travel through the attention kernels as two tuples: the run-time values
``mods = (softcap, alibi, window_left, window_right)`` and the constexpr switches
``MODS = (HAS_SOFTCAP, FAST_TANH, HAS_ALIBI, HAS_WINDOW)``; ``softcap`` and ``alibi`` (the slope) in the units
of the kernel's logits, unused unless switched on.

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
def range_part(part: tl.constexpr, start, full_start, full_end, stop):
    """``(first, last)`` of part ``part`` of a range cut as ``key_ranges`` / ``query_ranges`` cut it: 0 is
    ``[start, full_start)`` (masked), 1 ``[full_start, full_end)`` (whole tiles), 2 ``[full_end, stop)`` (masked).
    Kernels walk the three in a ``static_range(3)``, the middle one unmasked (``MASKED = part != 1``)."""
    first, last = full_end, stop
    if part == 0:
        first, last = start, full_start
    if part == 1:
        first, last = full_start, full_end
    return first, last


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
def tanh_approx(x):
    """``tanh(x)`` by the GPU's one-instruction approximation (``tanh.approx.f32``, relative error about 2^-11, the
    one FlashAttention uses for softcapping): one special-function op a value instead of ``soft_cap``'s exact
    formula's three. CUDA only (inline PTX: the interpreter cannot run it)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def tanh(x, FAST_TANH: tl.constexpr = False):
    """``tanh(x)``: with ``FAST_TANH`` (fp16/bf16 on a GPU) ``tanh_approx``; else through one ``exp2`` and an
    approximate division (``tl.fdiv``, 2 ulp: the IEEE one costs several instructions a score),
    ``1 - 2 / (2^(2 log2(e) x) + 1)``, exact in the limits (+-1 when the power overflows or vanishes)."""
    if FAST_TANH:
        return tanh_approx(x)
    return 1.0 - tl.fdiv(2.0, tl.exp2(x * TWO_LOG2E) + 1.0)


@triton.jit
def soft_cap(s, cap, FAST_TANH: tl.constexpr = False):
    """Logits ``s`` squashed into ``(-cap, cap)``: ``cap · tanh(s / cap)`` (Gemma-2's logit softcapping).

    ``s`` and ``cap`` in the same units (the ratio is what tanh sees, so natural-log or base-2 logits both
    work). Applied before the masks, which then set hidden logits to ``-inf``.
    """
    return cap * tanh(s * (1.0 / cap), FAST_TANH)


@triton.jit
def add_alibi(s, rows, cols_start, cols, seqlen_q, seqlen_k, slope, KEYS_ON_ROWS: tl.constexpr = False):
    """``s - slope · |i + offset - j|`` (ALiBi, FlashAttention's definition: the distance to the bottom-right
    aligned diagonal) on ``[M, N]`` logits whose rows are queries ``rows`` and columns keys ``cols_start + cols``
    (with ``KEYS_ON_ROWS``, rows are keys and columns queries). ``cols`` are the tile's column offsets
    (``arange(0, N)``), ``slope`` in the logits' units: a scalar, or a ``[M, 1]`` column when the rows belong to
    several heads.

    The distance is ``|r - c|`` with ``r`` the row's position relative to the tile's first column (one integer
    subtraction and conversion a row) and ``c`` the column offsets as fp32 (constants: built once, not a
    conversion a score), so a score costs one subtraction and one fused multiply-add. Exact while positions
    stay below 2^24; past that the distance rounds as the bias itself does.
    """
    if KEYS_ON_ROWS:  # columns are queries: |cols_start + c + offset - key|
        relative = rows - causal_offset(seqlen_q, seqlen_k) - cols_start
    else:  # columns are keys: |query + offset - cols_start - c|
        relative = rows + causal_offset(seqlen_q, seqlen_k) - cols_start
    distance = tl.abs(relative.to(tl.float32)[:, None] - cols.to(tl.float32)[None, :])
    return s - slope * distance


@triton.jit
def modify_scores(s, rows, cols_start, cols, seqlen_q, seqlen_k, mods, MODS: tl.constexpr,
                  KEYS_ON_ROWS: tl.constexpr = False):
    """The scaled scores ``s`` under the call's score modifiers (``mods``/``MODS``, module docstring): softcap,
    then ALiBi (positions as ``add_alibi`` takes them). Returns ``(s, t)``: ``t = tanh(s / softcap)`` under a
    softcap (the backward's ``1 - t²``), else the unmodified ``s`` (unused)."""
    softcap, alibi, window_left, window_right = mods
    HAS_SOFTCAP: tl.constexpr = MODS[0]
    FAST_TANH: tl.constexpr = MODS[1]
    HAS_ALIBI: tl.constexpr = MODS[2]
    t = s
    if HAS_SOFTCAP:
        s = soft_cap(s, softcap, FAST_TANH)
        t = s * (1.0 / softcap)
    if HAS_ALIBI:
        s = add_alibi(s, rows, cols_start, cols, seqlen_q, seqlen_k, alibi, KEYS_ON_ROWS)
    return s, t


@triton.jit
def modified_scores_scaled(s, qk_scale, rows, cols_start, cols, seqlen_q, seqlen_k, mods, MODS: tl.constexpr):
    """``(x, c)``: the raw fp32 scores ``s`` (queries on rows) under the score modifiers as ``x`` with logits
    ``c · x``, ``c > 0`` (``qk_scale > 0`` required), so that ``online_update_scaled(m, d, x, c)`` folds ``c`` into
    the exponential as it folds the plain scale: a softcap is ``x = tanh(s · qk_scale / softcap)``,
    ``c = softcap``; ALiBi subtracts ``slope / c · |i + offset - j|`` from ``x``. One multiply-add fewer a score
    than ``modify_scores`` on scaled logits (and with a softcap, two multiplies fewer). Masks may set ``x`` to
    ``-inf`` afterwards."""
    softcap, alibi, window_left, window_right = mods
    HAS_SOFTCAP: tl.constexpr = MODS[0]
    FAST_TANH: tl.constexpr = MODS[1]
    HAS_ALIBI: tl.constexpr = MODS[2]
    x = s
    c = qk_scale
    if HAS_SOFTCAP:
        x = tanh(s * (qk_scale / softcap), FAST_TANH)
        c = softcap
    if HAS_ALIBI:
        x = add_alibi(x, rows, cols_start, cols, seqlen_q, seqlen_k, alibi / c)
    return x, c


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
