"""Tiles laid from a sequence's end (``core.packed.end_aligned``, ``end_aligned_query_ranges``), which the Hopper
dK/dV kernel takes for packed batches under ``FLASHLITE_DKDV_END_ALIGNED=1``, checked through the interpreter
against every (query, key) pair: the key tiles cover the keys once, each key tile's query range holds every
query that sees one of its keys, the query tiles it calls full hold no hidden pair and no row outside the
sequence, and under causal only the diagonal's key tiles meet a query tile cut by the sequence's start.
"""

import itertools

import pytest
import torch
import triton
import triton.language as tl

from flashlite.attention.plan import window_bounds
from flashlite.core.packed import end_aligned, end_aligned_query_ranges

from .utils import visible_pairs


@triton.jit
def _key_tile_ranges_kernel(out, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    tile = tl.program_id(0)
    n_start = end_aligned(tile * BLOCK_N, seqlen_k, BLOCK_N)
    query_start, full_start, full_end, query_end = end_aligned_query_ranges(
        n_start, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL, window_left, window_right, HAS_WINDOW)
    row = out + tile * 5
    tl.store(row, n_start)
    tl.store(row + 1, query_start)
    tl.store(row + 2, full_start)
    tl.store(row + 3, full_end)
    tl.store(row + 4, query_end)


def key_tile_ranges(seqlen_q, seqlen_k, block_m, block_n, causal, window):
    """``(n_start, query_start, full_start, full_end, query_end)`` of each key tile, as the kernel computes them."""
    n_tiles = triton.cdiv(seqlen_k, block_n)
    out = torch.full((n_tiles, 5), -(2**30), dtype=torch.int32)
    left, right = window_bounds(window, seqlen_q, seqlen_k)
    _key_tile_ranges_kernel[(n_tiles,)](out, seqlen_q, seqlen_k, left, right, BLOCK_M=block_m, BLOCK_N=block_n,
                                        IS_CAUSAL=causal, HAS_WINDOW=window is not None)
    return out.tolist()


LENGTHS = [1, 15, 16, 17, 40, 64, 100]
TILES = [(16, 16), (16, 32), (32, 16), (64, 64)]
MODES = [(False, None), (True, None), (False, (5, 0)), (False, (20, 3)), (False, (-1, 7)), (False, (33, -1))]


@pytest.mark.parametrize("block_m, block_n", TILES)
@pytest.mark.parametrize("causal, window", MODES)
def test_end_aligned_tiles_cover_every_pair_once(block_m, block_n, causal, window):
    for seqlen_q, seqlen_k in itertools.product(LENGTHS, LENGTHS):
        case = (seqlen_q, seqlen_k)
        seen = visible_pairs(seqlen_q, seqlen_k, causal, window)
        shift = seqlen_q - triton.cdiv(seqlen_q, block_m) * block_m
        covered = torch.zeros(seqlen_k, dtype=torch.int32)
        meets_cut_tile = []
        for n_start, query_start, full_start, full_end, query_end in key_tile_ranges(
                seqlen_q, seqlen_k, block_m, block_n, causal, window):
            assert -block_n < n_start <= seqlen_k - block_n, case
            keys = range(max(n_start, 0), n_start + block_n)
            covered[keys.start:keys.stop] += 1
            assert shift <= query_start <= full_start <= full_end and query_start <= query_end <= seqlen_q, case
            assert (query_start - shift) % block_m == (full_start - shift) % block_m == 0, case
            assert (full_end - shift) % block_m == 0, case
            tiles = range(query_start, query_start + triton.cdiv(query_end - query_start, block_m) * block_m, block_m)
            rows = torch.zeros(seqlen_q, dtype=torch.bool)
            for start in tiles:
                rows[max(start, 0):start + block_m] = True
                if full_start <= start < full_end:  # unmasked: whole, inside the sequence, every pair seen
                    assert 0 <= start and start + block_m <= seqlen_q, (case, start)
                    assert seen[start:start + block_m, keys.start:keys.stop].all(), (case, start)
            # Every query that sees one of the tile's keys is in a visited query tile.
            assert not (seen[:, keys.start:keys.stop].any(dim=1) & ~rows).any(), case
            if shift < 0 and tiles and tiles[0] == shift:
                meets_cut_tile.append(n_start)
        assert (covered == 1).all(), case
        if causal and window is None and block_n % block_m == 0 and seqlen_q == seqlen_k:
            # The cut query tile (rows shift..shift + BLOCK_M - 1) meets only the key tile on its diagonal.
            assert len(meets_cut_tile) <= 1, (case, meets_cut_tile)
