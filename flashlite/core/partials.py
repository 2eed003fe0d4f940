"""Partial states shared between programs: the parts of one row, computed by different programs, merged.

Two ways a row's parts meet:

* Two launches (split rows of the online kernels): the first launch writes each
  part's partial state, the second merges a row's partials and normalises its
  part. ``work_item`` numbers the (row, part) items, and the passes are
  ``PARTIAL_PASS`` and ``FINAL_PASS`` (``BOTH_PASSES`` when a program owns a
  whole row).
* One cooperative launch (a row held on chip by resident programs): each
  program publishes its part's state into an int64 slot and waits for the
  row's other parts (``share_partial_states``; plain sums, the softmax
  backward's, with ``share_partial_sums``). A state is packed into one int64
  (``pack_state``), so that value and "ready" flag are one store; slots must
  read 0 when the launch starts, which ``zeroed_slots`` arranges without a
  memset launch.

The merge itself is the core's (``flashlite.core.online_softmax``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .online_softmax import merge_partial_states
from .triton_compat import current_stream

# ----------------------------------------------------------------------------- two launches

# Pass numbers of the online kernels.
BOTH_PASSES = tl.constexpr(0)  # one program owns a whole row: statistics, then normalise
PARTIAL_PASS = tl.constexpr(1)  # split rows, first launch: each program publishes the partial of its chunk
FINAL_PASS = tl.constexpr(2)  # split rows, second launch: merge the row's partials, then normalise the chunk


@triton.jit
def work_item(item, n_items, n_splits, cols_per_split, n_cols, PASS: tl.constexpr):
    """Row and column range ``[col_start, col_end)`` of work item ``item`` = row * n_splits + split.

    The ``FINAL_PASS`` launch walks the items backwards: what the first launch
    read last is still in L2.
    """
    if PASS == FINAL_PASS:
        item = n_items - 1 - item
    item = tl.cast(item, tl.int64)
    row = item // n_splits
    col_start = (item % n_splits) * cols_per_split
    col_end = tl.minimum(col_start + cols_per_split, n_cols)
    return row, col_start, col_end


@triton.jit
def clear_slots(clear_ptr, n_clear, CLEAR_BLOCK: tl.constexpr):
    """Zero slots ``[0, n_clear)`` of ``clear_ptr``, spread over the programs: the next launch publishes there."""
    for start in tl.range(tl.program_id(0) * CLEAR_BLOCK, n_clear, tl.num_programs(0) * CLEAR_BLOCK):
        offsets = start + tl.arange(0, CLEAR_BLOCK)
        tl.store(clear_ptr + offsets, tl.zeros([CLEAR_BLOCK], tl.int64), mask=offsets < n_clear)


# ----------------------------------------------------------------------------- one cooperative launch


@triton.jit
def pack_state(m, d):
    """``(m, d)`` as one int64 (m's bits high, d's low), so a state is published by one store.

    A packed state is never 0: that would be ``m = +0.0`` with ``d = +0.0``, but
    a state with a finite maximum has ``d >= 1`` (its largest value counts
    ``e^0``), and an empty one has ``m = -inf``. So 0 marks "not published yet".
    """
    m_bits = m.to(tl.uint32, bitcast=True).to(tl.uint64)
    d_bits = d.to(tl.uint32, bitcast=True).to(tl.uint64)
    return ((m_bits << 32) | d_bits).to(tl.int64, bitcast=True)


@triton.jit
def unpack_state(packed):
    """The ``(m, d)`` of states packed by ``pack_state``."""
    bits = packed.to(tl.uint64, bitcast=True)
    m = (bits >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
    d = bits.to(tl.uint32).to(tl.float32, bitcast=True)
    return m, d


@triton.jit
def _published_slots(slot_ptr, n_parts, PARTS_POW2: tl.constexpr):
    """Wait until each row's ``n_parts`` int64 slots at ``slot_ptr`` ``[ROWS]`` are published (none 0);
    return them ``[ROWS, PARTS_POW2]`` and which of the columns are the row's (``[1, PARTS_POW2]``; padding loads 1)."""
    parts = tl.arange(0, PARTS_POW2)[None, :]
    slots = slot_ptr[:, None] + parts
    in_row = parts < n_parts
    packed = tl.load(slots, mask=in_row, other=1, volatile=True)
    while tl.min(tl.min(tl.where(packed == 0, 0, 1), axis=1), axis=0) == 0:
        packed = tl.load(slots, mask=in_row, other=1, volatile=True)
    return packed, in_row


@triton.jit
def share_partial_states(slot_ptr, part, n_parts, m, d, PARTS_POW2: tl.constexpr, LOG2_PER_UNIT: tl.constexpr):
    """Publish this program's partial states, wait for the other parts of each row, return the merged states.

    ``slot_ptr`` ``[ROWS]`` points at each row's ``n_parts`` int64 slots, zeroed
    before the launch; this program owns part ``part``. It stores its packed
    state ``(m, d)`` (one store: value and "ready" flag at once), then re-reads
    the row's slots until none is 0, and merges them.

    Every program of a row waits for the others, so all of them must be resident
    on the device at once (a cooperative launch); Triton's interpreter runs
    programs one after another, so there a row has one part unless the others
    were published beforehand.
    """
    tl.store(slot_ptr + part, pack_state(m, d))
    packed, in_row = _published_slots(slot_ptr, n_parts, PARTS_POW2)
    part_m, part_d = unpack_state(packed)
    part_m = tl.where(in_row, part_m, float("-inf"))  # padding slots: the empty state, neutral in the merge
    part_d = tl.where(in_row, part_d, 0.0)
    return merge_partial_states(part_m, part_d, LOG2_PER_UNIT)


@triton.jit
def pack_sum(value):
    """A float32 ``value`` as one int64 that is never 0 (its bits low, a 1 above them): published by one store,
    as ``pack_state`` publishes a state, whatever the value (0.0 and -0.0 included)."""
    bits = value.to(tl.uint32, bitcast=True).to(tl.uint64)
    ready = tl.full(bits.shape, 1, tl.uint64) << 32
    return (ready | bits).to(tl.int64, bitcast=True)


@triton.jit
def unpack_sum(packed):
    """The float32 of a value packed by ``pack_sum``."""
    return packed.to(tl.uint64, bitcast=True).to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def share_partial_sums(slot_ptr, part, n_parts, value, PARTS_POW2: tl.constexpr):
    """``share_partial_states`` for plain sums: publish this program's partial sums ``value`` ``[ROWS]``, wait for
    the other parts of each row, return the rows' totals (every part adds the slots in the same order, so all
    of a row's programs get the same total). The softmax backward shares ``sum(dy * y)`` this way."""
    tl.store(slot_ptr + part, pack_sum(value))
    packed, in_row = _published_slots(slot_ptr, n_parts, PARTS_POW2)
    return tl.sum(tl.where(in_row, unpack_sum(packed), 0.0), axis=1)


# ----------------------------------------------------------------------------- slots zeroed in advance (host)

# Programs that wait for each other trade flags through int64 slots that must read 0 ("not yet")
# when their launch starts. Zeroing fresh slots before every launch would cost a memset launch of
# its own (TUNING.md#zeroed-slots). Instead each (device, stream) keeps a pair of buffers: a launch
# publishes into one and zeroes the whole other one, which the previous launch on that stream
# published into and the next one publishes into. Launches on one stream run in order, so the
# buffer a launch publishes into was zeroed by the one before it (or allocated zeroed).
SLOTS_ALIGN = 16  # capacities are multiples of this: every launch's n_clear specializes alike (0 too)


@dataclass
class _SlotPair:
    buffers: torch.Tensor  # (2, capacity) int64
    publish: int = 0  # the row of ``buffers`` the next launch publishes into


_SLOT_PAIRS: dict = {}


_SLOTS_LOCK = threading.Lock()


def zeroed_slots(device: torch.device, n_slots: int, launch_fn):
    """Call ``launch_fn(slots, clear, n_clear)`` with ``n_slots`` zeroed int64 slots, where the kernel
    launched must zero ``clear[:n_clear]``; returns what ``launch_fn`` returns (False: nothing launched).

    On the current stream of ``device``, from its pair of buffers (see above). While
    a CUDA graph is being captured the slots are fresh and zeroed by a captured
    memset (``n_clear`` 0), since every replay repeats the same arguments. The lock
    keeps the choice of buffer and the launch together when threads share a stream.
    """
    if torch.cuda.is_current_stream_capturing():
        slots = torch.zeros(max(n_slots, 1), dtype=torch.int64, device=device)
        return launch_fn(slots, slots, 0)
    key = (device.index, current_stream(device.index))
    with _SLOTS_LOCK:
        pair = _SLOT_PAIRS.get(key)
        if pair is None or pair.buffers.shape[1] < n_slots:
            capacity = triton.cdiv(max(n_slots, 1), SLOTS_ALIGN) * SLOTS_ALIGN
            pair = _SLOT_PAIRS[key] = _SlotPair(torch.zeros((2, capacity), dtype=torch.int64, device=device))
        launched = launch_fn(pair.buffers[pair.publish], pair.buffers[1 - pair.publish], pair.buffers.shape[1])
        if launched is not False:
            pair.publish = 1 - pair.publish
        return launched
