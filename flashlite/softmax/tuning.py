"""The softmax kernels' tuning tables: tile sizes, warps and thresholds, as data (``plan`` reads them).

Each constant says what it sets and why, and carries one provenance line: the
machine and date of the measurement, the command that reproduces it, and its
section in ``bench/results/h200/TUNING.md`` (``TUNING.md#...`` below), which
holds the figures, the alternatives measured and the dead ends. The tables are
read through this module (``tuning.FUSED_MAX_COLS``) so that a tuning run can
set them.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton.language as tl


# What a program of a shared row fetches of its next part before waiting for the other parts of this one.
PREFETCH_NONE = tl.constexpr(0)


PREFETCH_L2 = tl.constexpr(1)  # the next part's columns into L2: no registers held


# Largest row the fused kernel holds on chip. The row lives in registers as fp32 whatever the input dtype:
# 32768 values over 16 warps are 64 registers a thread; twice that spills.
# H100 2026-11-23, python bench/softmax.py --tune fused; TUNING.md#fused-max-cols
FUSED_MAX_COLS = 32768


# Elements in one fused tile when rows are short: 16 rows of 256, 4 of 1024, ...
# H100 2026-11-23, python bench/softmax.py --tune fused; TUNING.md#fused-tile-elems
FUSED_TILE_ELEMS = 4096


# Rows of at most FUSED_SHORT_MAX_COLS take smaller tiles: more programs and more loads in flight, where
# the kernel is latency-bound.
# H100 2026-11-23, python bench/softmax.py --tune short (bench/results/h100/softmax_short_rows_tune.log); TUNING.md#short-rows
FUSED_SHORT_MAX_COLS, FUSED_SHORT_TILE_ELEMS = 512, 1024


# Elements a thread of the fused kernel holds; sets num_warps from the tile size (at least 4, at most 16).
# Tiles of up to 8192 elements get 4 warps either way; wider rows run half the warps that 32 would give.
# H100 2026-11-25, no committed script; TUNING.md#fused-elems-per-thread
FUSED_ELEMS_PER_THREAD = 64


# Tiles wider than this get one program each instead of a persistent grid (the persistent grid leads at
# 1024 columns, one program a tile from 8192).
# H100 2026-11-23, python bench/softmax.py --tune grid (bench/results/h100/softmax_grid_tune.log); TUNING.md#fused-grid
FUSED_PERSISTENT_MAX_COLS = 2048


# Online kernels: whole rows (many rows) in blocks of 4096 over 16 warps; split rows (few rows) in blocks of
# 2048 over 4 warps.
# H100 2026-11-23, python bench/softmax.py --tune online; TUNING.md#online-blocks
ONLINE_BLOCK_N, ONLINE_NUM_WARPS = 4096, 16


# H100 2026-11-23, python bench/softmax.py --tune online; TUNING.md#online-blocks
SPLIT_BLOCK_N, SPLIT_NUM_WARPS = 2048, 4


# Loads in flight in the streaming loops (software pipelining of `tl.range`).
# H100 2026-11-23, python bench/softmax.py --tune online; TUNING.md#online-blocks
ONLINE_NUM_STAGES = 3


# Rows are split across programs until there are this many work items per multiprocessor ...
# H100 2026-11-23, no committed script; TUNING.md#online-splits
ONLINE_ITEMS_PER_SM = 4


# ... but only while there are fewer rows than this many per multiprocessor (more rows fill the GPU as whole
# rows, and splitting them only lost speed) ...
# H100 2026-11-23, no committed script; TUNING.md#online-splits
ONLINE_SPLIT_BELOW_ROWS_PER_SM = 0.5


# ... and never into chunks shorter than this many blocks.
# Not measured: set with the first online kernel, 2026-11-23; TUNING.md#online-splits
ONLINE_MIN_BLOCKS_PER_SPLIT = 4


@dataclass(frozen=True)
class SharedRowTile:
    """How the programs of a shared row are shaped, for one input element size."""

    cols: int  # columns a program holds on chip (BLOCK_N)
    num_warps: int
    programs_per_sm: int  # resident at once
    prefetch: int  # what a program fetches of its next row's part while the parts wait: PREFETCH_NONE / _L2
    head_block: int  # columns of one streamed head block (HEAD_BLOCK_N)
    head_group: int = 1  # columns of a head block that keep one state (HEAD_GROUP_N): 1, a state per lane
    wave_head: int = 0  # many rows in waves (SHARED_WAVE_TILES): columns of head each part streams before its held ones
    head_eviction: str = ""  # L2 eviction hint of the head loads: "" (none) or "evict_last"


# Shared rows, by element size. fp32: 16384 columns on 4 warps, two programs a multiprocessor (at 255
# registers one's loads overlap the other's wait, so no prefetch). bf16: 32768 columns on 16 warps, one
# program a multiprocessor, the next part asked into L2 while the parts wait; its heads keep a state per
# 16-byte group of 8 columns (head_group 8, fewer instructions a value; fp32 keeps one a lane). Head blocks
# of 4096 (fp32) and 8192 (bf16) columns.
# H100 2026-11-24, python bench/softmax.py --tune shared (bench/results/h100/softmax_shared_tune.log); TUNING.md#shared-tiles
SHARED_TILES = {
    4: SharedRowTile(16384, 4, 2, PREFETCH_NONE.value, 4096),
    2: SharedRowTile(32768, 16, 1, PREFETCH_L2.value, 8192, head_group=8),
}


# Many rows taken in plain waves of held parts (more parts than the resident programs hold, and no wave of
# heads fits L2: fp32 4096 x 65536, say; 16-bit rows of up to 65536 are read twice, FWD_REREAD_MAX_COLS)
# get tiles of their own. fp32 parts hold 16384 columns after streaming a head as long, so half as many
# parts of a row wait for each other (the plan drops the head for rows read in frames). bf16 parts hold 16384 columns over 4 warps, two a multiprocessor, the next part asked
# into L2 (the 32768-column tile left a third of its columns empty on rows of 40000).
# H100 2026-11-25, no committed script; H200 2026-11-26 bench/refinements.py (wave tiles kept, the wave heads'
# evict_last dropped: under 3%); TUNING.md#wave-tiles
SHARED_WAVE_TILES = {
    4: SharedRowTile(16384, 4, 2, PREFETCH_NONE.value, 4096, wave_head=16384),
    2: SharedRowTile(16384, 4, 2, PREFETCH_L2.value, 8192, head_group=8),
}


# Rows neither aligned nor in a frame that aligns them (row_vectors() = 0: a strided view with an odd row
# length) are read one element a load, each element with its own 64-bit address: the tiles above spill
# there, these narrower ones do not. Their heads load evict_last, as they were measured.
# H100 2026-11-24, no committed script; TUNING.md#unaligned-tiles
SHARED_TILES_UNALIGNED = {
    4: SharedRowTile(8192, 4, 2, PREFETCH_NONE.value, 2048, head_eviction="evict_last"),
    2: SharedRowTile(8192, 8, 1, PREFETCH_L2.value, 8192, head_eviction="evict_last"),
}


# More than the resident programs hold at once is still taken in one read of memory where L2 allows: every
# program streams a head of its part (blocks of head_block columns, two in flight in two buffers taken in
# turn) before the columns it holds, and reads the head again, last block first, once the row's state is
# known. Heads serve a row longer than all resident programs hold, and few rows that would take several
# waves of resident programs (a read, a wait, a write each): those go in at most SHARED_MAX_HEAD_WAVES
# waves, as few as keep one wave's heads within SHARED_HEADS_L2_FRACTION of L2. Head loads carry no eviction
# hint (SharedRowTile.head_eviction "") except those of the wave and unaligned tiles.
# H100 2026-11-24, python bench/softmax.py --tune shared (bench/results/h100/softmax_shared_tune.log); TUNING.md#heads
SHARED_HEADS_L2_FRACTION = 0.5


# H100 2026-11-24, python bench/softmax.py --tune shared (bench/results/h100/softmax_shared_tune.log); TUNING.md#heads
SHARED_MAX_HEAD_WAVES = 2


# Many 16-bit rows a little too long for one program to hold take a program each that reads its row twice
# (REREAD: evict_last for (m, d), then evict_first for y, found again in L1 or L2), as the backward's wide
# rows do (BWD_TILES): nothing is held across the reduction and no program waits for another. Only
# 16-bit rows (an fp32 row of 65536 spills), only aligned ones (rows read in frames spill), only while the
# rows make at least FWD_REREAD_MIN_WAVES waves of one program a multiprocessor and fill at least
# FWD_REREAD_MIN_FILL of the tile; rows the fused kernel holds stay held.
# H100 2026-11-25, python bench/softmax.py --tune reread (bench/results/h100/softmax_reread_tune.log); TUNING.md#reread
FWD_REREAD_MAX_COLS = {2: 65536}  # by element size: the longest row so read (none for fp32)


# H100 2026-11-25, python bench/softmax.py --tune reread (bench/results/h100/softmax_reread_tune.log); TUNING.md#reread
FWD_REREAD_WARPS = 32


# H100 2026-11-25, python bench/softmax.py --tune reread (bench/results/h100/softmax_reread_tune.log); TUNING.md#reread
FWD_REREAD_MIN_WAVES = 5  # ... while the rows make at least this many waves of one program a multiprocessor


# H100 2026-11-25, python bench/softmax.py --tune reread (bench/results/h100/softmax_reread_tune.log); TUNING.md#reread
FWD_REREAD_MIN_FILL = 0.75  # ... and fill at least this much of the tile


# Rows over a thread-block cluster (Hopper, flashlite.softmax.cluster): by element size, then the row's length
# rounded up to a power of two, (CTAs, warps a CTA) of the cluster that holds one row (64-128 columns a thread).
# They take many aligned rows that fill at least CLUSTER_MIN_FILL of the tile (as REREAD's), at least
# CLUSTER_MIN_ROWS_PER_SM a multiprocessor, before the fused, read-twice and shared-row plans. GB/s, the plan
# without clusters -> the entry (quack 0.6.5 in the same process): bf16 4096 x 32768 3166 -> 3754 (4005),
# 4096 x 65536 3198 -> 3640 (4148), 1024 x 131072 2811 -> 3428 (3984); fp32 4096 x 65536 3493 -> 4047 (4111),
# 1024 x 131072 3297 -> 3927 (3830). Not taken: fp32 rows of 32768 (fused 4059-4069, best cluster 4084), bf16
# rows of 16384 (fused 3663-3687, best cluster 3580-3582 on 2 x 4).
# H200 2026-12-04, python bench/softmax.py --tune cluster --cols 32768 65536 131072
# (h200/softmax_cluster_push_tune.log); TUNING.md#cluster-exchange
CLUSTER: dict[int, dict[int, tuple[int, int]]] = {2: {32768: (2, 8), 65536: (4, 8), 131072: (8, 8)},
                                                   4: {65536: (4, 4), 131072: (8, 4)}}


# 64 and 128 rows of 131072 (0.48 and 0.97 a multiprocessor) gained over the shared rows (whose speed is bimodal
# between runs): bf16 687-1896 -> 2040, 992-1095 -> 2567-2605; fp32 835-852 -> 1876-2320 (8 x 4), 1676-2853 ->
# 3035. Fewer rows not measured. H200 2026-12-04, python bench/softmax.py --tune cluster --cols 16384 131072
# (h200/softmax_cluster_rows_tune.log); TUNING.md#cluster-exchange
CLUSTER_MIN_ROWS_PER_SM = 0.45


# Not measured apart: REREAD's bound, taken for the same reason (a tile filled that little wastes CTAs).
CLUSTER_MIN_FILL = 0.75


# The backward's rows over a cluster (flashlite.softmax.cluster, softmax_bwd_cluster_kernel): by element size, then
# the row's length rounded up to a power of two, (CTAs, warps a CTA) of the cluster that holds one row's y and dy.
# Rows of a multiple of 16 columns filling CLUSTER_MIN_FILL of the tile take it before every other backward plan.
# GB/s, the plan before -> the entry: fp32 4096 x 65536 3936 -> 4270, 256 x 65536 3160 -> 3560, 1024 x 131072
# 3690 -> 3931, 128 x 131072 3150 -> 3207; bf16 128 x 131072 1722-2606 (shared rows, bimodal) -> 2515 both rounds
# (1024 x 131072 3360 -> 3328, kept for the steady figure). Not taken: bf16 rows of 32768 and 65536, read twice
# by one program at 4050-4176 against at most 3724 over a cluster.
# H200 2026-12-03, python bench/softmax_backward.py --tune cluster (h200/softmax_backward_cluster_tune.log);
# TUNING.md#backward-cluster. The sums pushed through distributed shared memory since (2026-12-04,
# h200/softmax_backward_cluster_push_tune.log): the entries +2-13%, still the best of the tune's shapes.
BWD_CLUSTER: dict[int, dict[int, tuple[int, int]]] = {4: {65536: (8, 4), 131072: (8, 8)}, 2: {131072: (4, 16)}}


# Slots each program of a shared-row launch zeroes in one turn of clear_slots.
# Not measured: set with the slot buffers, 2026-11-24; TUNING.md#zeroed-slots
SLOTS_CLEAR_BLOCK = 256


@dataclass(frozen=True)
class BackwardTiles:
    """How the backward (``plan_backward``) holds rows on chip, for one element size of y."""

    fused_max_cols: int  # longest row one program takes (y and dy loaded twice from BWD_REREAD_MIN_COLS on)
    shared_cols: int  # longer rows: columns each resident program holds of a shared row (y and dy held)
    shared_warps: int
    prefetch: int  # what a shared program fetches of its next row's part while the parts wait


# The backward reads two values a column (y and dy) where the forward reads one, so wide rows do not fit
# a program's registers. Rows of up to fused_max_cols take a program each that loads y and dy twice
# (BWD_REREAD_MIN_COLS, BWD_REREAD_WARPS); longer rows are shared by resident programs that hold
# shared_cols columns of y and dy each (_softmax_bwd_shared_rows_kernel), 16-bit ones asking the next
# row's part into L2 while the parts meet.
# H100 2026-11-25, no committed script (recheck: bench/refinements.py --only backward); TUNING.md#backward-tiles
BWD_TILES = {
    4: BackwardTiles(32768, 8192, 4, PREFETCH_NONE.value),
    2: BackwardTiles(65536, 8192, 4, PREFETCH_L2.value),
}


# Shared backward rows read in frames (odd lengths) ask the next row's part into L2 whatever their dtype.
# H100 2026-11-25, no committed script; TUNING.md#backward-tiles
BWD_FRAMED_PREFETCH = PREFETCH_L2.value


# The backward of short rows, by element size the (shortest, longest) row tile measured to gain: tiles of
# BWD_SHORT_TILE_ELEMS elements on BWD_SHORT_WARPS warps, a program a tile (no persistent grid), instead of the
# forward's tiles on its persistent grid. GB/s, the forward's tiles -> these: fp32 4096 x 256 404-465 -> 1136-1586
# (8 rows), 4096 x 1024 2016-2875 (bimodal) -> 2951-2990; bf16 4096 x 1024 2081-2086 -> 2228-2241. Not taken:
# bf16 rows of 256 (886-890 -> 855). Rows of 2048-4096 columns were not measured.
# H200 2026-12-03, python bench/softmax_backward.py --tune short (h200/softmax_backward_short_tune.log);
# TUNING.md#backward-short
BWD_SHORT_TILES = {4: (256, 1024), 2: (1024, 1024)}
BWD_SHORT_TILE_ELEMS, BWD_SHORT_WARPS = 2048, 2


# Rows of BWD_REREAD_MIN_COLS columns and more load y and dy twice (evict_last for sum(dy * y), evict_first
# for dx) on BWD_REREAD_WARPS warps; shorter rows keep the forward's tiles, y and dy held.
# H100 2026-11-25, no committed script (recheck: bench/refinements.py --only backward); TUNING.md#backward-tiles
BWD_REREAD_MIN_COLS, BWD_REREAD_WARPS = 8192, 32
