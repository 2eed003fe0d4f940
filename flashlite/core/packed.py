"""Packed (variable-length) batches: where one sequence's rows lie in a batch packed along the tokens.

A packed batch keeps B sequences of different lengths end to end, FlashAttention's ``cu_seqlens`` convention:
sequence ``b`` owns rows ``[cu_seqlens[b], cu_seqlens[b + 1])`` of a (total, H, D) tensor. The attention
kernels see such a tensor as (1, H, total, D) with a batch stride of 0 and number their programs by one
flattened schedule of every sequence's tiles (``tile_sequence``: no program spent on a tile past a sequence's
end, beyond one a sequence); ``sequence_bounds`` turns a sequence number into its first rows and lengths, read
from the device (no host synchronisation), and into where its rows' statistics (LSE, δ) lie. Example:
``cu_seqlens_q = [0, 3, 3, 8]`` packs lengths 3, 0 and 5; sequence 2's queries are rows 3..7.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sequence_bounds(seqs, b, n_heads, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """``(q_row0, k_row0, seqlen_q, seqlen_k, stats_row0, stats_head_stride)`` of sequence ``b``: its first
    query and key rows (64-bit), its lengths, and where its rows' statistics lie (row ``i`` of query head ``h``
    at ``stats_row0 + h · stats_head_stride + i``).

    Dense batches (``VARLEN`` off): rows from 0, the call's lengths, statistics (B, H, Lq) contiguous.
    Packed (``VARLEN``): ``seqs = (cu_seqlens_q, cu_seqlens_k, total_q, total_k)`` and statistics (H, total_q),
    FlashAttention's varlen LSE layout; the ``seqlen_q``/``seqlen_k`` given (the longest, which size the
    grids) are replaced by the sequence's. Offsets are clamped to ``[0, total]`` and each end to at least its
    start, so that offsets the host could not check (on a GPU) never reach past the tensors.
    """
    q_row0 = tl.cast(b, tl.int64) * 0  # (not tl.zeros: Gluon kernels call this too, and want its layout)
    k_row0 = q_row0
    stats_head_stride = tl.cast(seqlen_q, tl.int64)
    stats_row0 = tl.cast(b, tl.int64) * n_heads * seqlen_q
    if VARLEN:
        cu_seqlens_q, cu_seqlens_k, total_q, total_k = seqs
        q_row0, seqlen_q = _rows_of(cu_seqlens_q, b, total_q)
        k_row0, seqlen_k = _rows_of(cu_seqlens_k, b, total_k)
        stats_head_stride = tl.cast(total_q, tl.int64)
        stats_row0 = q_row0
    return q_row0, k_row0, seqlen_q, seqlen_k, stats_row0, stats_head_stride


@triton.jit
def tile_sequence(number, cu_seqlens, n_seqs, seq, ROWS: tl.constexpr):
    """``(b, start)`` of tile ``number`` of a packed batch's flattened schedule of tiles of ``ROWS`` rows: sequence
    ``b``'s tile whose rows start at ``start``, which may lie at or past the sequence's end (a number with no tile).

    The schedule: sequence ``b``'s tiles take the numbers from ``cu_seqlens[b] // ROWS + b`` on. Those starts rise
    by at least ``cdiv(length, ROWS)`` from one sequence to the next (the ``+ b`` pays for a tile cut by a multiple
    of ROWS), so every tile has a number of its own below ``total // ROWS + n_seqs``, and at most one number a
    sequence has no tile. Example, ROWS = 128, lengths 300, 0, 100: starts 0, 3, 4; numbers 0-2 are sequence 0's
    tiles, 3 is sequence 1's (empty), 4 sequence 2's, 5 no one's.

    ``b`` is the count of sequences whose first number is at most ``number``, less one, counted ``len(seq)``
    starts a load (``seq``: ``0 .. SEQ_BLOCK - 1``, a ``tl.arange``, or a ``gl.arange`` in a Gluon kernel's
    layout): one load for a batch of up to SEQ_BLOCK sequences, no chain of dependent loads as a binary search
    would take. A number before the first start (``cu_seqlens[0] > 0``, not a valid batch) gets a negative
    ``start``."""
    SEQ_BLOCK: tl.constexpr = seq.shape[0]
    count = 0
    for first in range(0, n_seqs, SEQ_BLOCK):
        idx = first + seq
        starts = tl.load(cu_seqlens + idx, mask=idx < n_seqs, other=0) // ROWS + idx
        count += tl.sum(((starts <= number) & (idx < n_seqs)).to(tl.int32), axis=0)
    b = tl.maximum(count - 1, 0)
    start = (number - (tl.load(cu_seqlens + b) // ROWS + b)) * ROWS
    return b, start


@triton.jit
def _rows_of(cu_seqlens, b, total):
    """``(first row (64-bit), length)`` of sequence ``b``, clamped inside ``[0, total]``."""
    start = tl.minimum(tl.maximum(tl.load(cu_seqlens + b), 0), total)
    end = tl.minimum(tl.maximum(tl.load(cu_seqlens + b + 1), start), total)
    return start.to(tl.int64), end - start
