"""Gluon building blocks of the Hopper kernels (``forward_hopper``, ``backward_hopper``): TMA copies into rings
of shared-memory slots completed on mbarriers, and the host's TMA descriptors.

A ring holds ``KV_STAGES`` slots of K (or V) tiles; tile ``t`` goes to slot ``t % KV_STAGES`` and its mbarrier
completes phase ``(t // KV_STAGES) & 1`` when the copy lands (``issue_kv_load``, ``wait_kv``). The kernels pass a
ring as one tuple ``(descs, slots, ready, free)``: per column part of the head dim, the TMA descriptor of its
[1, 1, BLOCK_N, width] boxes and its ``[KV_STAGES, 1, 1, BLOCK_N, width]`` slots (``descs`` and ``slots`` are
tuples of one entry a part, usually one part: the whole padded head dim), and per slot the mbarrier a landed copy
completes (``ready``; it counts the bytes of every part) and the one its readers release it on (``free``;
``ready`` again where the readers refill the slot themselves). A head dim split into parts (``plan.head_dim_parts``:
192 = 128 + 64) is loaded part by part, each part's columns starting where the previous part's end (the copy's
column coordinate), so that no product runs on zero-filled padding. Tile sizes are read from the descriptors and
the slots, not passed. Gluon is Triton's lower-level language (``triton.experimental.gluon``, Triton >= 3.5);
without it ``gluon`` is None and the ``triton.language`` kernels serve every call.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

try:  # Gluon: Triton >= 3.5 (the GPU image has 3.6)
    from triton import constexpr_function
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    # TMA copies: 3.6 names them async_copy_*, 3.9 only async_load / async_store.
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # A barrier of the program's threads: thread_barrier in 3.6, barrier in 3.9.
    thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
except ImportError:  # pragma: no cover - older Triton: the triton.language kernel serves every call
    gluon = None

from ..core.packed import sequence_bounds
from ..core.tiles import descriptor_strides
from ..core.triton_compat import descriptor_template, gluon_tma_add, new_descriptor
from .plan import packed_tile, query_tile

# TMA reductions (cp.reduce.async.bulk.tensor .add): Triton 3.9's async_atomic_add, or 3.6's op (triton_compat).
tma_add = gluon_tma_add()
# wgmma is Hopper's own instruction (compute capability 9.0 exactly; Blackwell has tcgen05 instead).
WGMMA_CAPABILITY = (9, 0)
# Descriptors the kernels take of each tensor: one a column part (``plan.head_dim_parts``: at most two).
MAX_COLUMN_PARTS = 2
# Rows ``zero_rows_past`` clears at a time (a swizzle pattern's rows: 8, at most 128-byte rows, divide it).
ZERO_ROWS = tl.constexpr(16)


if gluon is not None:

    # (Compile-time sums: a value assigned in a jit function becomes a run-time one, and mbarrier.expect takes a
    # constant.)
    @constexpr_function
    def boxes_nbytes(descs):
        """Bytes of one box of every column part of the descriptors ``descs`` (what one tile's copies bring)."""
        return sum(desc.block_type.nbytes for desc in descs)

    @constexpr_function
    def part_start(descs, part):
        """The first column of part ``part`` of a head dim split into the boxes of ``descs``, in order."""
        return sum(desc.block_type.shape[3] for desc in list(descs)[:part])

    @gluon.jit
    def load_boxes(descs, start, bar, boxes, pred=True):
        """Start the TMA copies of the boxes at ``start = (b, h, row)`` of every column part of ``descs`` into
        ``boxes`` (one shared-memory box a part), all completing on ``bar``, which expects their bytes; part
        ``i``'s columns start where part ``i - 1``'s end (its column offset is the copy's coordinate). ``pred``:
        whether to copy at all."""
        mbarrier.expect(bar, boxes_nbytes(descs), pred=pred)
        copy_boxes(descs, start, bar, boxes, pred)

    @gluon.jit
    def copy_boxes(descs, start, bar, boxes, pred=True):
        """``load_boxes``' copies without the ``expect``: for a barrier that also counts other tensors' boxes
        (its one ``mbarrier.expect`` then sums their ``boxes_nbytes``)."""
        b, h, row = start
        for i in gl.static_range(len(descs)):
            tma_load(descs[i], [b, h, row, part_start(descs, i)], bar, boxes[i], pred=pred)

    @gluon.jit
    def issue_kv_load(ring, tile, source):
        """Start the TMA copies of K (or V) tile ``tile`` (every column part) into its slot of ``ring``, if the
        tile exists; ``source = (b, h_kv, key_start, n_tiles)``: tile ``t`` holds keys from ``key_start + t ·
        BLOCK_N`` of batch ``b``, K/V head ``h_kv``, and tiles ``n_tiles`` on do not exist."""
        descs, slots, ready, free = ring
        b, h_kv, key_start, n_tiles = source
        BLOCK_N: gl.constexpr = descs[0].block_type.shape[2]
        KV_STAGES: gl.constexpr = slots[0].type.shape[0]
        slot = tile % KV_STAGES
        exists = tile < n_tiles
        bar = ready.index(slot)
        load_boxes(descs, (b, h_kv, key_start + tile * BLOCK_N), bar, slot_boxes(slots, slot), pred=exists)

    @gluon.jit
    def slot_boxes(slots, slot):
        """Slot ``slot`` of a ring's ``slots`` (``KV_STAGES`` boxes of each column part): its box of every part."""
        boxes = ()
        for i in gl.static_range(len(slots)):
            boxes = boxes + (slots[i].index(slot),)
        return boxes

    @gluon.jit
    def box_views(boxes):
        """Each [1, 1, rows, width] shared-memory box of ``boxes`` (a tuple, one a column part) as a [rows, width]
        view: the operands of the products."""
        views = ()
        for i in gl.static_range(len(boxes)):
            views = views + (boxes[i].reshape([boxes[i].type.shape[2], boxes[i].type.shape[3]]),)
        return views

    @gluon.jit
    def store_boxes(descs, start, boxes):
        """Start the TMA stores of ``boxes`` (shared memory, one a column part, written and fenced by the caller)
        at ``start = (b, h, row)`` of ``descs``' tensor, each part at its own first column, clipped to L and the
        head dim by the copies; the caller waits for them (``tma.store_wait``)."""
        b, h, row = start
        for i in gl.static_range(len(descs)):
            tma_store(descs[i], [b, h, row, part_start(descs, i)], boxes[i])

    # ---------------------------------------------- packed batches: one flattened schedule of every sequence's tiles

    @gluon.jit
    def packed_program(pid, cu_seqlens, n_seqs, total, ROWS: gl.constexpr, REVERSE: gl.constexpr,
                       SEQ_BLOCK: gl.constexpr, NUM_WARPS: gl.constexpr):
        """``(head, b, start)`` of program ``pid`` of a packed batch's schedule of tiles of ``ROWS`` rows of
        ``cu_seqlens``' sequences (``total`` rows in all): ``plan.packed_tile``'s, its sequence search over
        ``SEQ_BLOCK`` starts a load spread over the program's ``NUM_WARPS`` warps."""
        seq = gl.arange(0, SEQ_BLOCK, layout=gl.BlockedLayout([1], [32], [NUM_WARPS], [0]))
        return packed_tile(pid, cu_seqlens, n_seqs, total, seq, ROWS, REVERSE)

    @gluon.jit
    def query_program(pid, packed, n_heads, seqlen_q, seqlen_k, ROWS: gl.constexpr, IS_CAUSAL: gl.constexpr,
                      SEQ_BLOCK: gl.constexpr, NUM_WARPS: gl.constexpr):
        """Program ``pid``'s ``ROWS`` query rows (the forward kernels', the backward's dQ kernel's): ``(b, h,
        m_start, (q_row0, k_row0), (seqlen_q, seqlen_k), stats_row)``: batch (or sequence) ``b``, head ``h``, its
        first row's position ``m_start``, where the sequence's query and key rows start in the tensors (0 in a
        dense batch; int32, TMA's coordinates), its lengths, and where its head's statistics row (LSE, δ) starts
        (``core.packed.sequence_bounds``).

        Dense (``SEQ_BLOCK`` 0, ``packed`` None): tiles numbered by ``plan.query_tile``. A packed batch,
        ``packed = (cu_seqlens_q, cu_seqlens_k, n_seqs, out, stride_h, stride_l, width)`` (the output's pointer,
        strides and true head dim, for ``store_rows``) with ``seqlen_q``/``_k`` the totals: ``packed_program``'s
        schedule over the query tiles (``core.packed.tile_sequence``); a number with no tile gets ``m_start =
        seqlen_q = 0`` (nothing to read, nothing to store)."""
        VARLEN: gl.constexpr = SEQ_BLOCK > 0
        seqs = None
        if VARLEN:
            seqs = (packed[0], packed[1], seqlen_q, seqlen_k)
            h, b, m_start = packed_program(pid, packed[0], packed[2], seqlen_q, ROWS, IS_CAUSAL, SEQ_BLOCK, NUM_WARPS)
        else:
            bh, m_start = query_tile(pid, gl.cdiv(seqlen_q, ROWS), ROWS, IS_CAUSAL)
            b = bh // n_heads
            h = bh % n_heads
        m_start, row0s, lengths, stats = tile_bounds(seqs, b, n_heads, seqlen_q, seqlen_k, m_start, False, VARLEN)
        stats_row0, stats_head_stride = stats
        return b, h, m_start, row0s, lengths, stats_row0 + h.to(gl.int64) * stats_head_stride

    @gluon.jit
    def tile_bounds(seqs, b, n_heads, seqlen_q, seqlen_k, start, KEYS: gl.constexpr, VARLEN: gl.constexpr):
        """Sequence ``b``'s bounds for a tile whose rows (its queries', or under ``KEYS`` its keys') start at
        ``start``: ``(start, (q_row0, k_row0), (seqlen_q, seqlen_k), (stats_row0, stats_head_stride))``, the row
        starts int32 (TMA's coordinates), as ``core.packed.sequence_bounds`` gives them. In a packed batch a
        number of the schedule with no tile (``start`` outside the sequence's rows) becomes an empty tile: its
        ``start`` and its rows' length 0, so that it reads and stores nothing."""
        q_row0, k_row0, seqlen_q, seqlen_k, stats_row0, stats_head_stride = sequence_bounds(
            seqs, b, n_heads, seqlen_q, seqlen_k, VARLEN)
        if VARLEN:
            if KEYS:
                live = ((start >= 0) & (start < seqlen_k)).to(gl.int32)
                seqlen_k = seqlen_k * live
            else:
                live = ((start >= 0) & (start < seqlen_q)).to(gl.int32)
                seqlen_q = seqlen_q * live
            start = start * live
        return (start, (q_row0.to(gl.int32), k_row0.to(gl.int32)), (seqlen_q, seqlen_k),
                (stats_row0, stats_head_stride))

    @gluon.jit
    def batch_coordinate(b, SEQ_BLOCK: gl.constexpr):
        """The batch coordinate of batch ``b``'s tiles in the (B, H, L, D) tensors: ``b``, or 0 in a packed batch
        (``SEQ_BLOCK`` > 0), whose tensors are (1, H, total, D)."""
        if SEQ_BLOCK > 0:
            b = b * 0
        return b

    @gluon.jit
    def store_rows(outs, descs, rows, out, start):
        """Store each column part of a tile (``outs``, registers in the output's dtype; the parts' columns as
        ``descs`` split them) by pointer: row ``i`` of the tile to row ``rows[0][i]`` of head ``start[0]``'s
        sequence whose first row is ``start[1]``, in ``out = (pointer, stride_h, stride_l, width)`` (the packed
        output, its head and row strides, the true head dim), those with ``rows[0] < rows[1]`` only (``rows =
        (idx, length)``). A packed batch's tile cut by its sequence's end goes out so: a TMA box would write the
        next sequence's rows."""
        idx, length = rows
        pointer, stride_h, stride_l, width = out
        head, row0 = start
        base = pointer + head.to(gl.int64) * stride_h + row0.to(gl.int64) * stride_l
        for i in gl.static_range(len(outs)):  # (each part's layout its own: no constexpr name for it)
            row = gl.convert_layout(idx, gl.SliceLayout(1, outs[i].type.layout)).to(gl.int64)
            cols = part_start(descs, i) + gl.arange(0, outs[i].shape[1], layout=gl.SliceLayout(0, outs[i].type.layout))
            gl.store(base + row[:, None] * stride_l + cols[None, :], outs[i],
                     mask=(row < length)[:, None] & (cols < width)[None, :])

    @gluon.jit
    def zero_rows_past(tiles, valid, NUM_WARPS: gl.constexpr):
        """Zero the rows from ``valid`` on of each [rows, width] shared-memory tile of ``tiles`` (a tuple, one a
        column part), then make the writes visible to the tensor cores' reads and wait for the ``NUM_WARPS`` warps
        that write them. A packed batch's tile cut by its sequence's end holds the next sequence's rows (or rows
        past the last one's, which nothing writes): their weights (P, dS) are exactly 0, set so by the masks or by
        their states, but 0 · inf and 0 · NaN are NaN, so they are cleared before a product reads them. Warps that
        share a tile may each clear it: they write the same bytes. The rows go ``ZERO_ROWS`` at a time, only the
        chunks that reach ``valid``: those past it take zeros, the one it cuts is read, selected and written back (a
        chunk, not the tile, passes through registers). ``tiles`` may hold several tensors' tiles of the same rows
        (Q's and dO's)."""
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [NUM_WARPS, 1], [1, 0])
        ROWS: gl.constexpr = tiles[0].type.shape[0]  # (every tile of the tuple has the same rows)
        for i in gl.static_range(len(tiles)):
            for first in gl.static_range(0, ROWS, ZERO_ROWS):
                chunk = tiles[i].slice(first, ZERO_ROWS)
                if first >= valid:
                    chunk.store(gl.full([ZERO_ROWS, chunk.type.shape[1]], 0.0, chunk.dtype, layout=layout))
                elif first + ZERO_ROWS > valid:
                    t = chunk.load(layout)
                    rows = first + gl.arange(0, ZERO_ROWS, layout=gl.SliceLayout(1, layout))
                    chunk.store(gl.where(rows[:, None] < valid, t, gl.zeros_like(t)))
        fence_async_shared()
        thread_barrier()

    @gluon.jit
    def wait_kv(ring, tile):
        """Wait for K (or V) tile ``tile`` of ``ring`` and return its slot as [BLOCK_N, width] views, one a column
        part (a tuple)."""
        descs, slots, ready, free = ring
        KV_STAGES: gl.constexpr = slots[0].type.shape[0]
        slot = tile % KV_STAGES
        mbarrier.wait(ready.index(slot), (tile // KV_STAGES) & 1)
        return box_views(slot_boxes(slots, slot))


    # ------------------------------------------------ column parts: a head dim as a sum of power-of-two widths
    #
    # The Hopper kernels load Q/K's head dim, and V/O's on its own, in one or more column parts
    # (``plan.head_dim_parts``: usually one, the padded head dim; 192 = 128 + 64 and 160 = 128 + 32 unless
    # FLASHLITE_HEAD_SPLIT=0). A tile is then a tuple of one box a part, a product contracting over the head dim
    # a sum of one wgmma a part chained on one accumulator (``sum_of_products``), and an accumulator whose columns
    # are the head dim one accumulator a part (``zero_accumulators``, ``accumulate_products``). With one part
    # each helper compiles to the code of a single tile.

    @gluon.jit
    def descriptor_parts(first, second):
        """A tensor's column parts as a tuple: ``(first,)``, or ``(first, second)`` when its head dim is split
        (``second`` is None otherwise). The kernels' descriptor arguments come so, one a part."""
        parts = (first,)
        if second is not None:
            parts = (first, second)
        return parts

    @gluon.jit
    def tile_boxes(descs):
        """One shared-memory box for a tile of each column part of ``descs``, a tuple."""
        boxes = ()
        for i in gl.static_range(len(descs)):
            boxes = boxes + (gl.allocate_shared_memory(descs[i].dtype, descs[i].block_type.shape, descs[i].layout),)
        return boxes

    @gluon.jit
    def ring_slots(descs, STAGES: gl.constexpr):
        """The slots of a ring: ``STAGES`` boxes of each column part of ``descs``, a tuple of one
        ``[STAGES, 1, 1, rows, width]`` buffer a part."""
        slots = ()
        for i in gl.static_range(len(descs)):
            slots = slots + (gl.allocate_shared_memory(descs[i].dtype, [STAGES] + descs[i].block_type.shape,
                                                       descs[i].layout),)
        return slots

    @gluon.jit
    def zero_accumulators(descs, ROWS: gl.constexpr, ROW_WARPS: gl.constexpr, COL_WARPS: gl.constexpr = 1):
        """fp32 accumulators at zero, one [ROWS, width] a column part of ``descs`` (the width of its boxes), each in
        the register layout of its own wgmma: ``ROW_WARPS`` warps along the rows (16 rows a warp) times
        ``COL_WARPS`` warpgroups splitting the columns (instruction width: the part's over ``COL_WARPS``)."""
        accs = ()
        for i in gl.static_range(len(descs)):
            # (gl.full, a builtin, takes the part's width as a plain int; gl.zeros would want a constexpr)
            accs = accs + (gl.full([ROWS, descs[i].block_type.shape[3]], 0.0, gl.float32,
                                   layout=gl.NVMMADistributedLayout(
                                       version=[3, 0], warps_per_cta=[ROW_WARPS, COL_WARPS],
                                       instr_shape=[16, descs[i].block_type.shape[3] // COL_WARPS, 16])),)
        return accs

    @gluon.jit
    def sum_of_products(a_ops, b_tiles, zero):
        """Start ``Σ_i A_i B_iᵀ`` over the column parts of a head dim (async): ``A_i`` a register or shared-memory
        operand, ``B_i`` a [rows, width] shared-memory view; the first product from ``zero`` (its layout: the
        result's), each next one added to it by the tensor cores (no wait between them). Returns the last
        product's token: the products are one wgmma group a part, the sum complete when the last is."""
        acc = warpgroup_mma(a_ops[0], b_tiles[0].permute((1, 0)), zero, use_acc=False, is_async=True)
        for i in gl.static_range(1, len(b_tiles)):
            acc = warpgroup_mma(a_ops[i], b_tiles[i].permute((1, 0)), acc, is_async=True)
        return acc

    @gluon.jit
    def register_operands(a, accs):
        """``a`` (registers, the operand dtype) laid out as the first operand of each accumulator of ``accs``'
        wgmma, a tuple (the same registers: a wgmma's register operand does not depend on the product's width)."""
        ops = ()
        for i in gl.static_range(len(accs)):
            ops = ops + (gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=accs[i].type.layout,
                                                                  k_width=2)),)
        return ops

    @gluon.jit
    def accumulate_products(a_ops, b_tiles, accs):
        """Start ``C_i += A_i B_i`` for each column part ``i`` of the accumulators ``accs`` (async), ``B_i`` a
        [k, width] shared-memory view, ``A_i`` the first operand (``register_operands``', or one shared-memory
        view repeated): their tokens, a tuple, one wgmma group a part."""
        tokens = ()
        for i in gl.static_range(len(accs)):
            tokens = tokens + (warpgroup_mma(a_ops[i], b_tiles[i], accs[i], is_async=True),)
        return tokens

    @gluon.jit
    def wait_products(tokens):
        """Wait for every product in flight and return the accumulators of ``tokens`` (``accumulate_products``'),
        a tuple."""
        done = warpgroup_mma_wait(0, deps=tokens)
        if len(tokens) == 1:  # (one dependency comes back as itself, not in a tuple)
            done = (done,)
        return done


def wgmma_available() -> bool:
    """True when this Triton has Gluon's Hopper API (the GPU image's 3.6 and CI's 3.9 do)."""
    return gluon is not None


@functools.lru_cache(maxsize=None)
def box_layout(box: tuple, dtype: torch.dtype):
    """The shared-memory layout (swizzled for TMA and wgmma) of one [1, 1, rows, head_dim] box."""
    element = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(box), element)


def gluon_descriptor(t: torch.Tensor, block_rows: int, head_dim: int):
    """A (B, H, L, D) TMA descriptor of ``t`` loading [1, 1, block_rows, head_dim] boxes (zeros past L and D).

    ``head_dim`` is the box's width: the padded head dim, or one column part of it (``plan.head_dim_parts``;
    where a part's columns start is a coordinate of each copy, not part of the descriptor).

    Filled in directly: the dataclass's own checks (alignment, box shape) cost host time on every
    call, four descriptors a call, and ``wgmma_eligible`` / the fixed configs already ensure them
    (TUNING.md#host-cost).
    """
    box = (1, 1, block_rows, head_dim)
    return new_descriptor(GluonTensorDescriptor, base=t, shape=list(t.shape), strides=descriptor_strides(t),
                          block_shape=list(box), layout=box_layout(box, t.dtype), padding="zero")


def part_descriptors(specs: tuple) -> tuple:
    """A kernel's TMA descriptor arguments (``gluon_descriptor``) for ``specs``, ``(tensor, rows, parts)`` each
    (``parts``: the widths of its column parts): the boxes of every tensor's first column part, then of every
    one's second part, or None where its head dim is one part (``MAX_COLUMN_PARTS`` descriptors a tensor). Where
    a part's columns start is a coordinate of each copy, not part of the descriptor."""
    return tuple(gluon_descriptor(t, rows, parts[i]) if i < len(parts) else None
                 for i in range(MAX_COLUMN_PARTS) for t, rows, parts in specs)


def part_templates(specs: tuple) -> tuple:
    """``part_descriptors``' as templates (``descriptor_template``; None stays None), planned once a call
    signature and bound to each call's tensors by ``core.runtime.TmaLaunch`` (``bind_descriptors``' order)."""
    return tuple(None if d is None else descriptor_template(d) for d in part_descriptors(specs))
