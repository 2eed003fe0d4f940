"""Split-K/V attention (FlashDecoding): one query tile's keys spread over several programs, merged by the core.

Decoding attends a few queries (Lq = 1..16) to a long cache (Lk up to 1M). The
forward kernel runs one program per (batch, head, query tile): at Lq = 1 that
is B·H programs, a few dozen on a GPU of 132 multiprocessors, each streaming
its whole cache alone. Here the key range of every row tile is cut into
``num_splits`` parts, each run by its own program with the forward kernel's
K/V loop ``attend_kv_tiles``, and a second, small kernel merges the parts with
the online-softmax core. Two passes:

1. ``_split_kv_kernel``, one program per (batch, head group, row tile, split),
   writes a *partial state* per (split, batch, head, query) row, in fp32: the
   running maximum ``m`` (base-2 units), the denominator ``d`` and the
   **unnormalised** accumulator ``acc = Σ e^(s - m) v``. A split that sees no
   key (all masked, past its row tile's causal end or past the cache length)
   writes the empty state ``(-inf, 0)`` with ``acc = 0``.
2. ``_merge_splits_kernel`` folds the splits of each row together with the
   core's ``merge_partial_accumulators`` (up to ``MERGE_TILE_PARTS`` splits at
   once: ``merge_states``, each ``acc`` weighted by ``rescale_factor``, 0 for an
   empty split, so never NaN) and ``merge_accumulators`` between such blocks;
   then each head's attention sink, if any, joins as one more state
   (``finish_rows``: once a row's splits are merged, not in every split), and
   ``O = acc / d`` (``normalize``: zeros for a row no split saw) and
   ``LSE = state_logsumexp(m, d)``.
Keeping ``(m, d, acc)`` rather than ``(O, lse)`` makes pass 2 literally the
core's merge of two states, with no division or logarithm in pass 1.

Key split. For a row tile whose keys end at ``key_end`` (Lk, the cache length
``cache_seqlens[b]``, or the tile's causal or window end) there are
``T = cdiv(key_end, BLOCK_N)`` key tiles (under a sliding window, counted from the
tile of the window's first key); split ``s`` takes tiles
``[s·c, (s+1)·c)`` with ``c = cdiv(T, num_splits)``, so boundaries are multiples
of BLOCK_N as ``attend_kv_tiles`` needs. Example: key_end = 300, BLOCK_N = 64:
T = 5; with 4 splits c = 2, the splits take keys [0, 128), [128, 256),
[256, 300) and nothing (empty). The split size is computed per batch element,
so a short cache in the batch does not take a long one's split size.

GQA packing. When the G = H / H_kv query heads of one K/V head differ only by
their queries (no mask, or a mask with stride 0 over heads) and Lq is small,
one program packs the G·Lq rows of the group into its Q tile, head-major: row
``r`` is query ``r % Lq`` of head ``h_kv·G + r // Lq``. Each K/V tile is then
read once per group instead of once per query head. Example: H = 32,
H_kv = 8, Lq = 1: 4 rows of a 16-row tile and 8 programs per batch element and
split instead of 32, a quarter of the K/V traffic. Causal alignment and masks
only look at the query position ``r % Lq``.

Caches. With ``cache_seqlens``, batch element ``b`` attends keys
``[0, cache_seqlens[b])`` of its (H_kv, L_max, D) cache: keys past it are never
read and causal is aligned bottom-right against ``cache_seqlens[b]``. The
lengths stay on the device (no host sync); the kernel clamps them to
``[0, L_max]``, and the host checks them only where that is free (CPU).

Paged caches. K/V may live in pages of ``page_size`` keys, (num_blocks, H_kv, page_size, D), with a (B,
max_blocks) block table: key ``j`` of element ``b`` is row ``j % page_size`` of page ``block_table[b, j //
page_size]`` (vLLM's and FlashAttention's ``block_table``). A key tile inside one page finds it with one
lookup; with pages smaller than a tile each row finds its own (``core.tiles.load_paged_tile``), so the tiles stay
as wide as a contiguous cache's (``paging_mode``). Page numbers are clamped to the cache. The table's load is
one more level of Triton's software pipeline, so a one-wave grid runs paged calls on more stages, and pages of 64
keys on tiles of 64 (``paged_config``).

Limits: K/V through pointer loads (no TMA descriptors yet), one fixed tile
config per head dim (``split_config``; paged caches ``paged_config``), no backward pass. Offsets that scale
with the batch, heads or the cache length are 64-bit.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from ..core.masking import key_ranges
from ..core.online_softmax import (
    empty_state, merge_accumulators, merge_partial_accumulators, normalize, state_logsumexp,
)
from ..core.runtime import compiled_launcher, device_info, launch
from .forward import PAGED_NONE, PAGED_ROWS, PAGED_TILES, alibi_slope, attend_key_range, finish_rows, positive_scale
from .plan import (
    default_config, head_dim_padded, kernel_switches, logit_units, output_like, qk_scale_for, variant_args,
)
from .tuning import AttentionConfig


@triton.jit
def _packed_rows(row_start, n_rows, seqlen_q, head_base, BLOCK_M: tl.constexpr):
    """Heads, query positions and validity of the packed rows ``[row_start, row_start + BLOCK_M)`` (64-bit).

    Row ``r`` is query ``r % seqlen_q`` of head ``head_base + r // seqlen_q``.
    Rows at or past ``n_rows`` are padding: not valid, and given query position
    ``seqlen_q`` so that ``apply_masks`` treats them as out of bounds.
    Example: seqlen_q = 3, two heads from head_base = 4, BLOCK_M = 8: rows 0..5
    are (head, query) (4, 0) (4, 1) (4, 2) (5, 0) (5, 1) (5, 2); rows 6, 7 are padding.
    """
    rows = tl.cast(row_start, tl.int64) + tl.arange(0, BLOCK_M)
    valid = rows < n_rows
    heads = head_base + rows // seqlen_q
    q_idx = tl.where(valid, rows % seqlen_q, seqlen_q)
    return heads, q_idx, valid


@triton.jit
def _partials(part_ptr, n_splits, n_out_rows):
    """The three arrays of the partial states in one fp32 buffer: m and d, (n_splits, n_out_rows) each, then acc."""
    n_part = tl.cast(n_splits, tl.int64) * n_out_rows
    return part_ptr, part_ptr + n_part, part_ptr + 2 * n_part


@triton.jit
def _split_kv_kernel(
    q_ptr, k_ptr, v_ptr, alibi_ptr, cache_seqlens_ptr, part_ptr,
    mask, paging, q_strides, k_strides, v_strides, stride_alibi_b, stride_cache_seqlens,
    n_heads, kv_group, heads_per_program, n_groups, n_splits, n_out_rows, sizes, qk_scale, variants,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIMS: tl.constexpr, MASKING: tl.constexpr, UNITS: tl.constexpr,
    HAS_CACHE_SEQLENS: tl.constexpr, DOTS: tl.constexpr, MODS: tl.constexpr, PAGED: tl.constexpr = 0,
):
    # Axis 0: (batch, head group, row tile), row tile fastest; axis 1: the split. Arguments grouped as the
    # forward kernel's (forward's module docstring).
    seqlen_q, seqlen_k, head_dim, head_dim_v = sizes
    softcap, window_left, window_right = variants
    HEAD_DIM_PADDED: tl.constexpr = DIMS[0]
    HEAD_DIM_V_PADDED: tl.constexpr = DIMS[1]
    EVEN_D: tl.constexpr = DIMS[2]
    EVEN_DV: tl.constexpr = DIMS[3]
    IS_CAUSAL: tl.constexpr = MASKING[0]
    HAS_MASK: tl.constexpr = MASKING[1]
    HAS_ALIBI: tl.constexpr = MODS[2]
    HAS_WINDOW: tl.constexpr = MODS[3]
    n_rows = heads_per_program * seqlen_q
    n_row_tiles = tl.cdiv(n_rows, BLOCK_M)
    row_tile = tl.program_id(0) % n_row_tiles
    batch_group = tl.program_id(0) // n_row_tiles
    b = batch_group // n_groups
    head_base = (batch_group % n_groups) * heads_per_program
    h_kv = head_base // kv_group
    split = tl.program_id(1)
    b64 = tl.cast(b, tl.int64)
    if HAS_CACHE_SEQLENS:  # this element's used length; clamped so that a bad value cannot read past the cache
        used = tl.load(cache_seqlens_ptr + b64 * stride_cache_seqlens).to(tl.int32)
        seqlen_k = tl.minimum(tl.maximum(used, 0), seqlen_k)

    heads, q_idx, valid = _packed_rows(row_tile * BLOCK_M, n_rows, seqlen_q, head_base, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_ok = dims < head_dim
    q_ptrs = q_ptr + b64 * q_strides[0] + heads[:, None] * q_strides[1] + q_idx[:, None] * q_strides[2] + dims[None, :]
    q = tl.load(q_ptrs, mask=valid[:, None] & dim_ok[None, :], other=0.0)
    q, tile_scale = positive_scale(q, qk_scale)  # scores scaled in fp32, as in the forward kernel
    k_src = k_ptr + b64 * k_strides[0] + tl.cast(h_kv, tl.int64) * k_strides[1]
    v_src = v_ptr + b64 * v_strides[0] + tl.cast(h_kv, tl.int64) * v_strides[1]
    pages = None
    if PAGED != 0:  # a paged cache: this element's row of the block table (attend_kv_tiles' pages)
        table_ptr, stride_table_b, page_size, stride_k_page, stride_v_page, last_block = paging
        pages = (table_ptr + b64 * stride_table_b, page_size, stride_k_page, stride_v_page, last_block)
    mask_bh = (mask[0], mask[3], mask[4])
    if HAS_MASK:  # packed rows share head_base's mask: the host packs only masks with stride 0 over heads
        mask_bh = (mask[0] + b64 * mask[1] + tl.cast(head_base, tl.int64) * mask[2], mask[3], mask[4])
    # The score modifiers (core.masking); packed rows each take their own head's ALiBi slope, as a column.
    alibi = alibi_slope(alibi_ptr, stride_alibi_b, b64, tl.where(valid, heads, head_base), UNITS, HAS_ALIBI)
    if HAS_ALIBI:
        alibi = alibi[:, None]
    mods = (softcap, alibi, window_left, window_right)

    # The tile's keys: [key_begin, key_end), of which [full_start, full_end) seen whole by every row.
    key_begin, full_start, full_end, key_end = key_ranges(
        tl.min(q_idx, axis=0), tl.max(tl.where(valid, q_idx, 0), axis=0), seqlen_q, seqlen_k, BLOCK_N, IS_CAUSAL,
        HAS_MASK, window_left, window_right, HAS_WINDOW)
    # This split's share of those key tiles (module docstring): [key_start, key_stop), each part of the tile's
    # cut clipped to it (an empty split has key_stop < key_start).
    tiles_per_split = tl.cdiv(tl.cdiv(key_end, BLOCK_N) - key_begin // BLOCK_N, n_splits)
    key_start = key_begin + split * tiles_per_split * BLOCK_N
    key_stop = tl.minimum(key_start + tiles_per_split * BLOCK_N, key_end)
    split_full_start = tl.maximum(key_start, tl.minimum(full_start, key_stop))
    split_full_end = tl.maximum(split_full_start, tl.minimum(full_end, key_stop))

    m, d = empty_state(BLOCK_M)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PADDED], tl.float32)
    acc, m, d = attend_key_range(
        acc, m, d, q, q_idx, tile_scale, k_src, v_src, k_strides[2], v_strides[2],
        (key_start, split_full_start, split_full_end, key_stop), (seqlen_q, seqlen_k, head_dim, head_dim_v),
        mask_bh, mods, pages, (BLOCK_N, HEAD_DIM_PADDED, HEAD_DIM_V_PADDED, EVEN_D, EVEN_DV),
        MASKING, UNITS, USE_TMA=False, DOTS=DOTS, MODS=MODS, PAGED=PAGED,
    )

    # Partials are (n_splits, B, H, Lq) rows; acc rows are HEAD_DIM_V_PADDED wide (no column mask needed).
    part_m_ptr, part_d_ptr, part_acc_ptr = _partials(part_ptr, n_splits, n_out_rows)
    part_rows = tl.cast(split, tl.int64) * n_out_rows + (b64 * n_heads + heads) * seqlen_q + q_idx
    tl.store(part_m_ptr + part_rows, m, mask=valid)
    tl.store(part_d_ptr + part_rows, d, mask=valid)
    dims_v = tl.arange(0, HEAD_DIM_V_PADDED)
    tl.store(part_acc_ptr + part_rows[:, None] * HEAD_DIM_V_PADDED + dims_v[None, :], acc, mask=valid[:, None])


@triton.jit
def _merge_splits_kernel(
    part_ptr, o_ptr, lse_ptr, sinks_ptr,
    stride_ob, stride_oh, stride_om,
    n_heads, seqlen_q, n_out_rows, n_splits, head_dim_v,
    BLOCK_ROWS: tl.constexpr, SPLITS_BLOCK: tl.constexpr, HEAD_DIM_V_PADDED: tl.constexpr, EVEN_DV: tl.constexpr,
    UNITS: tl.constexpr, WRITE_LSE: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    # The partial maxima are in the split kernel's UNITS (plan.logit_units). Each head's sink, once the splits
    # are merged (finish_rows): every split saw part of the keys, the sink is one more state of the whole row.
    # Rows are (batch, head, query) flattened, as the split kernel wrote them. SPLITS_BLOCK splits of each row
    # are loaded at once and merged in one step (not one split after another: a chain of dependent loads).
    part_m_ptr, part_d_ptr, part_acc_ptr = _partials(part_ptr, n_splits, n_out_rows)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_out_rows
    dims = tl.arange(0, HEAD_DIM_V_PADDED)
    m, d = empty_state(BLOCK_ROWS)
    acc = tl.zeros([BLOCK_ROWS, HEAD_DIM_V_PADDED], tl.float32)
    for first in range(0, n_splits, SPLITS_BLOCK):
        splits = first + tl.arange(0, SPLITS_BLOCK)
        ok = row_ok[:, None] & (splits < n_splits)[None, :]
        part_rows = splits.to(tl.int64)[None, :] * n_out_rows + rows[:, None]  # [BLOCK_ROWS, SPLITS_BLOCK]
        m_split = tl.load(part_m_ptr + part_rows, mask=ok, other=float("-inf"))
        d_split = tl.load(part_d_ptr + part_rows, mask=ok, other=0.0)
        acc_split = tl.load(part_acc_ptr + part_rows[:, :, None] * HEAD_DIM_V_PADDED + dims[None, None, :],
                            mask=ok[:, :, None], other=0.0)
        m_block, d_block, acc_block = merge_partial_accumulators(m_split, d_split, acc_split, UNITS)
        m, d, acc = merge_accumulators(m, d, acc, m_block, d_block, acc_block, UNITS)

    query = rows % seqlen_q
    head = rows // seqlen_q % n_heads
    batch = rows // seqlen_q // n_heads
    acc, m, d = finish_rows(acc, m, d, sinks_ptr, head, UNITS, HAS_SINKS)
    if WRITE_LSE:
        tl.store(lse_ptr + rows, state_logsumexp(m, d, UNITS), mask=row_ok)
    o = normalize(acc, d, True)  # rows no split saw (d = 0) give zeros
    o_ptrs = o_ptr + batch[:, None] * stride_ob + head[:, None] * stride_oh + query[:, None] * stride_om + dims[None, :]
    ok = row_ok[:, None]
    if not EVEN_DV:
        ok = ok & (dims < head_dim_v)[None, :]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- host side


# Partial states one program of the merge kernel loads at once: (rows) x (splits of a row), up to 16 x 256 fp32
# accumulators (16 KB). A decode step has few rows (B·H·Lq), so small blocks keep several programs busy.
MERGE_TILE_PARTS = 16


# Pack a K/V head's query heads into one tile up to this Lq: decoding and
# speculative decoding; longer query blocks fill their tiles on their own.
PACK_MAX_SEQLEN_Q = 64


# The smallest M of a tensor-core dot, and the row tile past it.
SPLIT_BLOCK_M_SMALL, SPLIT_BLOCK_M_LARGE = 16, 64


# The automatic rule (``splits_for``): decoding tiles (at most SPLIT_BLOCK_M_SMALL packed rows) from
# SPLIT_MIN_SEQLEN_K keys on always split (the forward kernel packs no GQA group), into as many splits as keep
# the grid within SPLIT_TARGET_PROGRAMS_PER_SM programs a multiprocessor (one wave: a few programs past it make
# a second wave that costs nearly a whole one), at least SPLIT_MIN_DECODE_SPLITS; longer query
# blocks split only while the forward's grid would leave multiprocessors idle (SPLIT_BELOW_PROGRAMS_PER_SM);
# each split keeps at least SPLIT_MIN_KEYS keys, and there are at most SPLIT_MAX.
# H200 2026-11-26, `python bench/decode.py --tune`; bench/results/h200/TUNING.md#decode-splits.
SPLIT_AUTOMATIC = True


SPLIT_BELOW_PROGRAMS_PER_SM = 1.0


SPLIT_MIN_SEQLEN_K = 4096


SPLIT_TARGET_PROGRAMS_PER_SM = 1.0


SPLIT_MIN_DECODE_SPLITS = 2


SPLIT_MIN_KEYS = 512


SPLIT_MAX = 128


# Splits are grid axis 1, which CUDA caps at 65535 programs: forced num_splits is clamped to it.
MAX_GRID_SPLITS = 65535


# Paged caches (``paged_config``), in a grid of one wave (at most a program a multiprocessor, none to hide another's
# latency). Triton's software pipeliner makes the block table's load a pipelined load of its own, ahead of the K/V
# tile whose address it gives, and splits ``num_stages`` between the two: PAGED_ONE_WAVE_STAGES = 5 keep two K/V
# tiles in flight, as a contiguous cache's 3 do. Pages that hold whole tiles of PAGED_SMALL_BLOCK_N keys but not
# whole tiles of the config's (pages of 64 against tiles of 128) take the smaller tiles: one lookup a tile instead
# of one a row. In a grid of several waves both measured slower and the config stays. H200 2026-12-01,
# `python bench/varlen.py --part paged-tune`; bench/results/h200/TUNING.md#paged-kv.
PAGED_ONE_WAVE_STAGES = 5


PAGED_SMALL_BLOCK_N = 64


# Keys a tile of every paged call on CUDA (None: the rule above); bench/varlen.py's tune forces it.
PAGED_BLOCK_N = None


def split_config(n_rows: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> AttentionConfig:
    """Tiles of the split kernel for row tiles of ``n_rows`` packed rows (the interpreter: the forward's config).

    Not tuned on the GPU (only the split count was timed): a 16-row tile when the rows fit (decoding),
    BLOCK_N 128 up to D = 128 (a 128 x 128 bf16 K or V tile is 32 KB; 3 stages of both
    fit Hopper's shared memory), 64 above.
    """
    if device.type != "cuda":
        return default_config(head_dim, dtype, device)
    block_m = SPLIT_BLOCK_M_SMALL if n_rows <= SPLIT_BLOCK_M_SMALL else SPLIT_BLOCK_M_LARGE
    if dtype == torch.float32:  # IEEE dots on the FMA units, as the forward's fp32 table
        return AttentionConfig(block_m, 32 if head_dim <= 128 else 16, 4, 1)
    return AttentionConfig(block_m, 128 if head_dim <= 128 else 64, 4, 3)


def heads_per_program(n_heads: int, n_kv_heads: int, seqlen_q: int, mask: torch.Tensor | None) -> int:
    """How many query heads one program packs into its rows: the whole GQA group, or 1.

    Packing needs the group's rows to share their mask (``mask`` broadcast to
    (B, H, Lq, Lk) with stride 0 over heads) and a small Lq (``PACK_MAX_SEQLEN_Q``).
    """
    group = n_heads // n_kv_heads
    if group == 1 or seqlen_q > PACK_MAX_SEQLEN_Q or (mask is not None and mask.stride(1) != 0):
        return 1
    return group


def _plan(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
          head_dim_v: int | None = None) -> tuple[int, AttentionConfig, int]:
    """``(heads_per_program, config, programs per split)`` of a split launch (tiles for the wider of D and Dv)."""
    batch, n_heads, seqlen_q, head_dim = q.shape
    pack = heads_per_program(n_heads, k.shape[1], seqlen_q, mask)
    config = split_config(pack * seqlen_q, max(head_dim, head_dim_v or head_dim), q.dtype, q.device)
    return pack, config, triton.cdiv(pack * seqlen_q, config.block_m) * batch * (n_heads // pack)


def auto_num_splits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> int:
    """The automatic ``num_splits`` of ``flash_attention`` (1: the forward kernel); see the rule above.

    Always 1 off CUDA (the interpreter keeps the forward kernel unless asked), and
    while ``SPLIT_AUTOMATIC`` is off.
    With ``cache_seqlens`` the rule sees L_max: the lengths are not read on the host.
    """
    if not q.is_cuda or not SPLIT_AUTOMATIC or k.shape[2] < SPLIT_MIN_SEQLEN_K:  # the rule's first test, before any work
        return 1
    batch, n_heads, seqlen_q, head_dim = q.shape
    forward_programs = triton.cdiv(seqlen_q, default_config(head_dim, q.dtype, q.device).block_m) * batch * n_heads
    pack, _, split_programs = _plan(q, k, mask)
    decoding = pack * seqlen_q <= SPLIT_BLOCK_M_SMALL
    return splits_for(forward_programs, split_programs, decoding, k.shape[2], device_info(q.device).num_sms)


def splits_for(forward_programs: int, split_programs: int, decoding: bool, seqlen_k: int, n_sms: int) -> int:
    """The automatic rule on numbers: the forward's grid, the split kernel's programs per split, whether its
    row tile is a decoding one (at most ``SPLIT_BLOCK_M_SMALL`` packed rows), Lk, multiprocessors."""
    if seqlen_k < SPLIT_MIN_SEQLEN_K:
        return 1
    if not decoding and forward_programs >= SPLIT_BELOW_PROGRAMS_PER_SM * n_sms:
        return 1
    splits = math.floor(SPLIT_TARGET_PROGRAMS_PER_SM * n_sms / split_programs)  # one wave: never past it
    if decoding:
        splits = max(splits, SPLIT_MIN_DECODE_SPLITS)
    return max(1, min(splits, triton.cdiv(seqlen_k, SPLIT_MIN_KEYS), SPLIT_MAX))


def check_split_args(
    num_splits: int | None, cache_seqlens: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
) -> None:
    """Validate ``num_splits`` and ``cache_seqlens`` with errors naming the argument.

    The values of ``cache_seqlens`` are checked against [0, Lk] on CPU only; on
    CUDA that would cost a device sync every decoding step (the kernel clamps them).
    """
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int):
            raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1 (or None for automatic), got {num_splits}")
    if cache_seqlens is None:
        return
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be a torch.Tensor or None, got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cache_seqlens must be int32 or int64, got {cache_seqlens.dtype}")
    if tuple(cache_seqlens.shape) != (q.shape[0],):
        raise ValueError(f"cache_seqlens must have shape (B,) = ({q.shape[0]},), got {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != q.device:
        raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {q.device}")
    if cache_seqlens.device.type == "cpu" and cache_seqlens.numel():
        low, high = int(cache_seqlens.min()), int(cache_seqlens.max())
        if low < 0 or high > k.shape[2]:
            raise ValueError(f"cache_seqlens must lie in [0, Lk] = [0, {k.shape[2]}], got values from {low} to {high}")


def paged_config(config: AttentionConfig, page_size: int, programs: int, n_sms: int) -> AttentionConfig:
    """``config`` (fp16/bf16, head dims up to 128: K/V tiles of 128 keys) for a cache of pages of ``page_size``
    keys on CUDA, whose split grid has ``programs`` programs. When they fit in one wave (at most one a
    multiprocessor): ``PAGED_ONE_WAVE_STAGES`` stages, and tiles of ``PAGED_SMALL_BLOCK_N`` keys where the pages
    hold whole tiles of those but not of ``config``'s (unless ``PAGED_BLOCK_N`` forces the tiles). Else, and for
    fp32's single stage (IEEE dots on the FMA units), ``config`` itself (with ``PAGED_BLOCK_N``'s tiles if set)."""
    block_n = PAGED_BLOCK_N or config.block_n
    if programs > n_sms or config.num_stages == 1:
        return dataclasses.replace(config, block_n=block_n)
    if PAGED_BLOCK_N is None and page_size % block_n and page_size % PAGED_SMALL_BLOCK_N == 0:
        block_n = PAGED_SMALL_BLOCK_N
    return dataclasses.replace(config, num_stages=PAGED_ONE_WAVE_STAGES, block_n=block_n)


def paging_mode(page_size: int | None, block_n: int) -> int:
    """``attend_kv_tiles``' ``PAGED`` for pages of ``page_size`` keys (None: a contiguous cache) and key tiles of
    ``block_n``: one lookup a tile where a tile fits a page, else one a row. H200, bench/varlen.py --part paged
    (bench/results/h200/TUNING.md#paged-kv): a row's lookup cost 0.60-0.74x of the contiguous speed at one to
    eight sequences whatever the page, a tile's 0.77-0.89x with pages of 256 and 0.22-0.38x with pages of 16
    (tiles of 16 keys)."""
    if page_size is None:
        return PAGED_NONE
    return PAGED_TILES if page_size % block_n == 0 else PAGED_ROWS


class SplitLaunch:
    """The two launches of split-K/V attention for one call signature, planned once and repeated at little host cost.

    Built from checked (B, H, L, D) tensors whose head dim has stride 1 (as
    ``attention_forward``; v's head dim Dv may differ from D) and the call's options; ``num_splits`` (>= 1) is
    clamped to the number of key tiles, ``config`` forces the tiles (default
    ``split_config``). ``has_alibi`` and ``has_sinks`` say whether calls bring ALiBi slopes ((B, H),
    ``plan.alibi_view``) and sinks ((H,)). Calling it runs split-K/V attention on tensors of the
    signature it was built for (the same shapes, strides, dtypes, devices and
    16-byte alignments; ``flash_attention`` keys its repeated calls so):
    everything derived from the signature (tiles, grids, strides, constexprs)
    was computed here, and after the first call each kernel is launched
    through ``compiled_launcher``, skipping Triton's argument binding. A call
    allocates its output, its LSE and one fp32 workspace for the partial states.
    """

    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
        scale: float, mask_is_bool: bool, write_lse: bool, num_splits: int, has_cache_seqlens: bool,
        config: AttentionConfig | None = None, softcap: float | None = None, window: tuple[int, int] | None = None,
        has_alibi: bool = False, has_sinks: bool = False, paged: tuple[int, int] | None = None,
    ):
        batch, n_heads, seqlen_q, head_dim = q.shape
        seqlen_k, head_dim_v = k.shape[2], v.shape[3]
        self.page_size = None
        if paged is not None:  # k, v: (num_blocks, H_kv, page_size, ·) pages of (B, max_blocks) block tables
            self.page_size, max_blocks = paged
            seqlen_k = self.page_size * max_blocks
        hd_pad, dv_pad = head_dim_padded(head_dim), head_dim_padded(head_dim_v)
        pack, default, programs = _plan(q, k, mask, head_dim_v)
        if config is not None:
            programs = triton.cdiv(pack * seqlen_q, config.block_m) * batch * (n_heads // pack)
        def clamped_splits(block_n: int) -> int:
            return max(1, min(num_splits, triton.cdiv(seqlen_k, block_n), MAX_GRID_SPLITS))

        if config is None and paged is not None and q.is_cuda and max(head_dim, head_dim_v) <= 128:
            config = paged_config(default, self.page_size, programs * clamped_splits(default.block_n),
                                  device_info(q.device).num_sms)
        config = config or default
        self.num_splits = clamped_splits(config.block_n)
        n_out_rows = batch * n_heads * seqlen_q
        additive = mask is not None and not mask_is_bool
        self.head_dim_v = head_dim_v
        self.workspace_size = self.num_splits * n_out_rows * (dv_pad + 2)  # m, d and acc (module docstring)
        self.lse_shape = (batch, n_heads, seqlen_q) if write_lse else None
        self.split_grid = (programs, self.num_splits)
        variant_scalars, variant_meta = variant_args(q, additive, softcap, window, has_alibi, has_sinks,
                                                     seqlen_q, seqlen_k)
        self.split_sizes = (  # the split kernel's arguments after the pointers and strides
            n_heads, n_heads // k.shape[1], pack, n_heads // pack, self.num_splits, n_out_rows,
            (seqlen_q, seqlen_k, head_dim, head_dim_v), qk_scale_for(scale, additive), variant_scalars,
        )
        self.split_meta = dict(
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, HAS_CACHE_SEQLENS=has_cache_seqlens,
            PAGED=paging_mode(self.page_size, config.block_n),
            **kernel_switches(q, causal, mask, mask_is_bool, head_dim, head_dim_v, variant_meta),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        splits_block = min(triton.next_power_of_2(self.num_splits), MERGE_TILE_PARTS)
        self.merge_grid = (triton.cdiv(n_out_rows, MERGE_TILE_PARTS // splits_block),)
        self.merge_scalars = (n_heads, seqlen_q, n_out_rows, self.num_splits, head_dim_v)
        self.merge_meta = dict(
            BLOCK_ROWS=MERGE_TILE_PARTS // splits_block, SPLITS_BLOCK=splits_block, HEAD_DIM_V_PADDED=dv_pad,
            EVEN_DV=head_dim_v == dv_pad, UNITS=logit_units(additive), WRITE_LSE=write_lse,
            HAS_SINKS=variant_meta["HAS_SINKS"], num_warps=4,
        )
        self._repeat_split = self._repeat_merge = None

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
        cache_seqlens: torch.Tensor | None = None, alibi: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(o, lse)`` like ``attention_forward``, for tensors of the signature this launch was built for (a
        paged cache with its (B, max_blocks) int32 ``block_table``)."""
        part = torch.empty((self.workspace_size,), dtype=torch.float32, device=q.device)
        o = output_like(q, self.head_dim_v)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device) if self.lse_shape else None
        k_strides, v_strides, paging = k.stride()[:3], v.stride()[:3], None
        if self.page_size is not None:  # pages found through the table, not by batch element
            k_strides, v_strides = (0, *k_strides[1:]), (0, *v_strides[1:])
            paging = (block_table, block_table.stride(0), self.page_size, k.stride(0), v.stride(0), k.shape[0] - 1)
        split_args = (
            q, k, v, alibi, cache_seqlens, part, (mask, *(mask.stride() if mask is not None else (0, 0, 0, 0))),
            paging, q.stride()[:3], k_strides, v_strides, alibi.stride(0) if alibi is not None else 0,
            cache_seqlens.stride(0) if cache_seqlens is not None else 0, *self.split_sizes,
        )
        merge_args = (part, o, lse if lse is not None else part, sinks, *o.stride()[:3], *self.merge_scalars)
        if self._repeat_split is not None:
            self._repeat_split(split_args)
            self._repeat_merge(merge_args)
            return o, lse
        launch(_split_kv_kernel, self.split_grid, split_args, **self.split_meta)
        launch(_merge_splits_kernel, self.merge_grid, merge_args, **self.merge_meta)
        repeat_split = compiled_launcher(_split_kv_kernel, self.split_grid, split_args, **self.split_meta)
        repeat_merge = compiled_launcher(_merge_splits_kernel, self.merge_grid, merge_args, **self.merge_meta)
        if repeat_split is not None and repeat_merge is not None:
            self._repeat_split, self._repeat_merge = repeat_split, repeat_merge
        return o, lse


def split_kv_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
    mask: torch.Tensor | None, mask_is_bool: bool, write_lse: bool,
    num_splits: int, cache_seqlens: torch.Tensor | None = None, config: AttentionConfig | None = None,
    softcap: float | None = None, window: tuple[int, int] | None = None, alibi: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Split-K/V attention on checked (B, H, L, D) tensors whose head dim has stride 1 (as ``attention_forward``).

    ``num_splits`` (>= 1) is clamped to the number of key tiles; ``cache_seqlens``
    (B,) int32/int64 or None limits each batch element's keys. ``config`` forces
    the tiles (default ``split_config``). The variants as ``attention_forward`` takes them. Returns ``(o, lse)``
    like ``attention_forward``. One ``SplitLaunch``, planned and run once.
    """
    plan = SplitLaunch(q, k, v, mask, causal, scale, mask_is_bool, write_lse, num_splits, cache_seqlens is not None,
                       config, softcap, window, alibi is not None, sinks is not None)
    return plan(q, k, v, mask, cache_seqlens, alibi, sinks)
