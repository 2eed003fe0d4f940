"""How a softmax call runs: its regime and tile sizes (``SoftmaxPlan``), from the tables of ``tuning``.

* fused: a tile of rows held on chip; rows longer than one program holds are
  shared by resident programs (``shares_rows``), or read twice by a program each
  (``reread``); past what the resident programs hold, each part streams a head.
* cluster (Hopper): many long rows, each over the CTAs of a thread-block
  cluster that hold its parts (``flashlite.softmax.cluster``).
* online: rows streamed in blocks; split across programs when rows are few.

Plans are pure functions of shapes, the device's properties and the tables, and
cached (the host cost of a call matters for small tensors); ``clear_plans``
(``flashlite.softmax.api``) forgets them after a table changes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import triton

from ..core.runtime import cooperative_launch_supported, device_info
from ..core.triton_compat import gluon_available
from . import tuning
from .frames import aligned_frame, frame_lead, row_vectors
from .tuning import SharedRowTile


ALGORITHMS = ("auto", "fused", "online")


@dataclass(frozen=True)
class SoftmaxPlan:
    """How one softmax call runs: the regime and its tile sizes."""

    algorithm: str  # "fused", "online" or "cluster" (a fused row over a thread-block cluster: n_splits CTAs)
    block_m: int
    block_n: int
    num_warps: int
    n_splits: int = 1  # programs sharing one row: online chunks, (fused) parts held at once, (cluster) CTAs
    cols_per_split: int = 0
    head_cols: int = 0  # fused with shared rows: columns of each part streamed twice before the block_n held
    prefetch: int = 0  # fused with shared rows: PREFETCH_NONE or PREFETCH_L2 (the next part into L2)
    head_block: int = 0  # fused with shared rows and heads: columns of one streamed head block
    head_group: int = 1  # fused with shared rows and heads: columns of a head block that keep one state
    head_eviction: str = ""  # fused with shared rows and heads: L2 eviction hint of the head loads
    vec_cols: int = 1  # row_vectors() of the rows planned for (> 1: read in the frame of row_frame; 0: shared
    # rows take the unaligned tiles). Fused tiles of several rows keep 1.
    reread: bool = False  # fused, a row a program: its tile loaded twice, not held across the reduction (REREAD)

    @property
    def shares_rows(self) -> bool:
        """True if resident programs share rows (the shared-row kernel): parts, or a part with a head."""
        return self.algorithm == "fused" and (self.n_splits > 1 or self.head_cols > 0)


def shares_rows_on_chip(device: torch.device) -> bool:
    """True if rows longer than one program's tile can be spread over resident programs on ``device``.

    Needs a GPU (the interpreter runs programs one at a time, so they cannot wait
    for each other) and a Triton with cooperative launches.
    """
    return device.type == "cuda" and cooperative_launch_supported()


def clusters_supported(device: torch.device) -> bool:
    """True if ``device`` runs the cluster kernel (``flashlite.softmax.cluster``): a Hopper GPU (where it was measured;
    later GPUs launch clusters too, but keep the plans measured there) and a Triton with Gluon; never the
    interpreter, whose device is the CPU."""
    return device.type == "cuda" and device_info(device).capability[0] == 9 and gluon_available()


def fused_warps(tile_elems: int, elems_per_thread: int | None = None, fewest: int = 4) -> int:
    """Warps of a fused program holding ``tile_elems`` elements, ``elems_per_thread`` a thread (default
    ``tuning.FUSED_ELEMS_PER_THREAD``, read at the call: bench/softmax.py --tune sets it): ``fewest`` to 16."""
    return min(16, max(fewest, tile_elems // (32 * (elems_per_thread or tuning.FUSED_ELEMS_PER_THREAD))))


@functools.lru_cache(maxsize=4096)
def plan_softmax(
    n_rows: int, n_cols: int, device: torch.device, algorithm: str = "auto",
    block_n: int | None = None, n_splits: int | None = None, shared_rows: torch.dtype | None = None,
    vec_cols: int = 1,
) -> SoftmaxPlan:
    """Choose the regime and tile sizes for a (n_rows, n_cols) softmax; ``block_n``/``n_splits`` force them (tests).

    With ``shared_rows``, the input dtype (softmax only: masked softmax has no
    shared-row kernel), rows past ``tuning.FUSED_MAX_COLS`` stay fused, spread over
    programs that hold ``tuning.SHARED_TILES`` columns each, while
    ``shares_rows_on_chip(device)`` and the parts fit the device; first, on Hopper,
    many aligned rows of ``tuning.CLUSTER``'s lengths go over a thread-block
    cluster each (``_plan_cluster``). Cached: the host cost of a call decides
    small softmaxes, which run for microseconds.
    """
    shared = shared_rows is not None and algorithm in ("auto", "fused") and shares_rows_on_chip(device)
    if shared and block_n is None and n_splits is None:
        cluster = _plan_cluster(n_rows, n_cols, device, shared_rows.itemsize, vec_cols)
        if cluster is not None:
            return cluster
    if n_cols > tuning.FUSED_MAX_COLS and shared:
        reread = _plan_reread(n_rows, n_cols, device, shared_rows.itemsize, n_splits, vec_cols)
        if reread is not None:
            return reread
        return _plan_shared_rows(n_rows, n_cols, device, shared_rows.itemsize, n_splits, vec_cols)
    if algorithm == "auto":
        algorithm = "fused" if n_cols <= tuning.FUSED_MAX_COLS else "online"
    if algorithm == "fused":
        if n_cols > tuning.FUSED_MAX_COLS:
            raise ValueError(
                f"algorithm='fused' holds rows of at most {tuning.FUSED_MAX_COLS} elements on chip here "
                f"(longer ones only on a GPU, across programs), got {n_cols}; use algorithm='online' or 'auto'"
            )
        bn = triton.next_power_of_2(n_cols)
        tile = tuning.FUSED_SHORT_TILE_ELEMS if bn <= tuning.FUSED_SHORT_MAX_COLS else tuning.FUSED_TILE_ELEMS
        bm = max(1, min(tile // bn, triton.next_power_of_2(n_rows)))
        # Frames for one-row tiles only: rows short enough to share a tile run as fast one element a load
        # as aligned ones, and lost speed in frames (TUNING.md#frames).
        return SoftmaxPlan("fused", bm, bn, fused_warps(bm * bn), vec_cols=max(vec_cols, 1) if bm == 1 else 1)

    if n_splits is None:
        n_sms = device_info(device).num_sms
        wanted = math.ceil(tuning.ONLINE_ITEMS_PER_SM * n_sms / n_rows) if n_rows < tuning.ONLINE_SPLIT_BELOW_ROWS_PER_SM * n_sms else 1
        n_splits = max(1, min(wanted, n_cols // (tuning.ONLINE_MIN_BLOCKS_PER_SPLIT * (block_n or tuning.SPLIT_BLOCK_N))))
    bn, warps = (tuning.ONLINE_BLOCK_N, tuning.ONLINE_NUM_WARPS) if n_splits == 1 else (tuning.SPLIT_BLOCK_N, tuning.SPLIT_NUM_WARPS)
    bn = max(block_n or min(bn, triton.next_power_of_2(n_cols)), vec_cols)  # chunks of whole vectors (body_end)
    # Chunks are whole blocks, so only the row's last chunk has a ragged end.
    cols_per_split = triton.cdiv(triton.cdiv(n_cols, n_splits), bn) * bn
    n_splits = triton.cdiv(n_cols, cols_per_split)
    return SoftmaxPlan("online", 1, bn, warps, n_splits, cols_per_split, vec_cols=max(vec_cols, 1))


def plan_rows(x2d: torch.Tensor, out_dtype: torch.dtype, algorithm: str = "auto") -> SoftmaxPlan:
    """``plan_softmax`` for a softmax of the rows of ``x2d`` written in ``out_dtype``: shared rows planned
    for how the kernel reads them (``row_vectors``)."""
    return plan_softmax(x2d.shape[0], x2d.shape[1], x2d.device, algorithm, shared_rows=x2d.dtype,
                        vec_cols=row_vectors(x2d, out_dtype))


def _plan_cluster(n_rows: int, n_cols: int, device: torch.device, itemsize: int, vec_cols: int) -> SoftmaxPlan | None:
    """A row over a thread-block cluster (``tuning.CLUSTER``: its CTAs, each holding ``block_n`` columns, and their
    warps) for many aligned rows (``vec_cols`` 1) that fill most of their tile, where ``device`` launches clusters;
    else None."""
    tile = triton.next_power_of_2(n_cols)  # the row's, over the cluster
    entry = tuning.CLUSTER.get(itemsize, {}).get(tile)
    if entry is None or vec_cols != 1 or n_cols < tuning.CLUSTER_MIN_FILL * tile or not clusters_supported(device):
        return None
    if n_rows < tuning.CLUSTER_MIN_ROWS_PER_SM * device_info(device).num_sms:
        return None
    ctas, warps = entry
    return SoftmaxPlan("cluster", 1, tile // ctas, warps, ctas, tile // ctas)


def _plan_reread(
    n_rows: int, n_cols: int, device: torch.device, itemsize: int, n_splits: int | None, vec_cols: int,
) -> SoftmaxPlan | None:
    """A program a row that reads it twice (``tuning.FWD_REREAD_MAX_COLS``), for many aligned rows (``vec_cols`` 1); else
    None. Rows read in frames or one element a load keep the shared rows' tiles (read twice, they spilled)."""
    block_n = triton.next_power_of_2(n_cols)
    if n_splits is not None or vec_cols != 1 or block_n > tuning.FWD_REREAD_MAX_COLS.get(itemsize, 0):
        return None
    many_rows = n_rows >= tuning.FWD_REREAD_MIN_WAVES * device_info(device).num_sms
    fills_tile = n_cols >= tuning.FWD_REREAD_MIN_FILL * block_n
    return SoftmaxPlan("fused", 1, block_n, tuning.FWD_REREAD_WARPS, reread=True) if many_rows and fills_tile else None


def _plan_shared_rows(
    n_rows: int, n_cols: int, device: torch.device, itemsize: int, n_splits: int | None, vec_cols: int,
) -> SoftmaxPlan:
    """Rows held by resident programs, ``tuning.SHARED_TILES[itemsize]`` columns each: a row in as many parts
    as it needs, in waves of as many rows as the programs hold; or in parts that also stream a head,
    when one row is longer than all programs hold, or when few rows would otherwise take several
    waves and one or two waves' heads fit L2 (tuning.SHARED_MAX_HEAD_WAVES, tuning.SHARED_HEADS_L2_FRACTION).
    Rows left to plain waves of parts take ``tuning.SHARED_WAVE_TILES`` (fp32 parts there stream a head too,
    unless read in frames). ``vec_cols`` (``row_vectors``): 0 takes the unaligned tiles; a row's frame
    (``row_frame``) needs no more columns than the row."""
    tiles, wave_tiles = (tuning.SHARED_TILES, tuning.SHARED_WAVE_TILES) if vec_cols else (tuning.SHARED_TILES_UNALIGNED,) * 2
    wave_tile = wave_tiles[min(itemsize, 4)]
    if vec_cols > 1:
        wave_tile = dataclasses.replace(wave_tile, wave_head=0)  # heads lost on rows read in frames
    plan = _plan_shared_parts(n_rows, n_cols, device, itemsize, n_splits, tiles[min(itemsize, 4)], wave_tile)
    return dataclasses.replace(plan, vec_cols=vec_cols)


def _plan_shared_parts(
    n_rows: int, n_cols: int, device: torch.device, itemsize: int, n_splits: int | None, tile: SharedRowTile,
    wave_tile: SharedRowTile,
) -> SoftmaxPlan:
    """``_plan_shared_rows`` with one tile, and ``wave_tile`` for many rows in plain waves of parts."""
    info = device_info(device)
    programs = tile.programs_per_sm * info.num_sms
    parts = n_splits or triton.cdiv(n_cols, tile.cols)
    if parts > programs or triton.cdiv(n_cols, parts) > tile.cols:
        return _plan_with_heads(n_cols, min(parts, programs), tile)
    if n_splits is None and n_rows * parts > programs:
        # Fewer waves than the held parts alone need, each part streaming a head: as few as L2 allows.
        plain_waves = triton.cdiv(n_rows, programs // parts)
        for waves in range(1, min(plain_waves, tuning.SHARED_MAX_HEAD_WAVES + 1)):
            rows_per_wave = triton.cdiv(n_rows, waves)
            if rows_per_wave > programs:
                continue
            plan = _plan_with_heads(n_cols, programs // rows_per_wave, tile)
            heads = rows_per_wave * plan.n_splits * plan.head_cols * itemsize
            if plan.head_cols and heads <= tuning.SHARED_HEADS_L2_FRACTION * info.l2_bytes:
                return plan
        tile = wave_tile
        if tile.wave_head:
            return _plan_with_heads(n_cols, triton.cdiv(n_cols, tile.cols + tile.wave_head), tile)
        parts = triton.cdiv(n_cols, tile.cols)
    bn = triton.next_power_of_2(triton.cdiv(n_cols, parts))  # no wider than tile.cols
    return SoftmaxPlan("fused", 1, bn, tile.num_warps, triton.cdiv(n_cols, bn), bn, prefetch=tile.prefetch)


def _plan_with_heads(n_cols: int, parts: int, tile: SharedRowTile) -> SoftmaxPlan:
    """A row in at most ``parts`` parts, each [a head of whole head blocks | tile.cols held on chip]."""
    part_cols = max(triton.cdiv(triton.cdiv(n_cols, parts), tile.head_block) * tile.head_block, tile.cols)
    return SoftmaxPlan("fused", 1, tile.cols, tile.num_warps, triton.cdiv(n_cols, part_cols), part_cols,
                       part_cols - tile.cols, tile.prefetch, tile.head_block, tile.head_group, tile.head_eviction)


@functools.lru_cache(maxsize=4096)
def plan_backward(plan: SoftmaxPlan, n_rows: int, n_cols: int, itemsize: int, device: torch.device) -> SoftmaxPlan:
    """The backward's plan for (n_rows, n_cols) rows of y (``itemsize`` bytes an element) whose forward ran under
    ``plan``, from ``tuning.BWD_TILES``.

    Online plans stay online. On Hopper, rows of ``tuning.BWD_CLUSTER``'s lengths go
    over a thread-block cluster each (``_plan_backward_cluster``), whatever the
    forward's plan. Rows of ``tuning.BWD_SHORT_TILES``'s lengths take tiles of
    ``BWD_SHORT_TILE_ELEMS`` on ``BWD_SHORT_WARPS`` warps; other rows shorter than
    ``tuning.BWD_REREAD_MIN_COLS`` keep the forward's tiles, y and dy held. Rows of
    up to ``fused_max_cols`` take a program each that loads y and dy twice
    (``reread``). Longer ones are shared
    by resident programs holding ``shared_cols`` columns each where the device
    shares rows (``shares_rows_on_chip``) and a row has no more parts than the
    device has multiprocessors, and streamed otherwise. Cached, as ``plan_softmax``.
    """
    if plan.algorithm == "online":
        return plan
    cluster = _plan_backward_cluster(n_cols, itemsize, device)
    if cluster is not None:
        return cluster
    tiles = tuning.BWD_TILES[min(itemsize, 4)]
    block_n = triton.next_power_of_2(n_cols)
    if plan.algorithm == "cluster":  # no cluster backward this long: as after the fused plan of one row a program
        plan = SoftmaxPlan("fused", 1, block_n, fused_warps(block_n))
    if short_backward_rows(block_n, itemsize) and not (plan.shares_rows or plan.reread):  # (reread: forced, tests)
        bm = max(1, min(tuning.BWD_SHORT_TILE_ELEMS // block_n, triton.next_power_of_2(n_rows)))
        return SoftmaxPlan("fused", bm, block_n, tuning.BWD_SHORT_WARPS, vec_cols=plan.vec_cols if bm == 1 else 1)
    if block_n < tuning.BWD_REREAD_MIN_COLS and not plan.shares_rows:
        return plan
    if block_n <= tiles.fused_max_cols:
        return SoftmaxPlan("fused", 1, block_n, tuning.BWD_REREAD_WARPS, reread=True)
    parts = triton.cdiv(n_cols, tiles.shared_cols)
    if shares_rows_on_chip(device) and parts <= device_info(device).num_sms:
        bn = triton.next_power_of_2(triton.cdiv(n_cols, parts))  # no wider than shared_cols
        return SoftmaxPlan("fused", 1, bn, tiles.shared_warps, triton.cdiv(n_cols, bn), bn, prefetch=tiles.prefetch)
    return plan_softmax(n_rows, n_cols, device, "online")


def short_backward_rows(block_n: int, itemsize: int) -> bool:
    """True if the backward of rows in tiles ``block_n`` wide (``itemsize`` bytes an element) takes the short rows'
    tiles (``tuning.BWD_SHORT_TILES``), a program a tile."""
    shortest, longest = tuning.BWD_SHORT_TILES.get(itemsize, (0, 0))
    return shortest <= block_n <= longest


def _plan_backward_cluster(n_cols: int, itemsize: int, device: torch.device) -> SoftmaxPlan | None:
    """The backward of a row over a thread-block cluster (``tuning.BWD_CLUSTER``: its CTAs and their warps, each CTA
    holding ``block_n`` columns of y and dy) for rows of a multiple of 16 columns that fill most of their tile,
    where ``device`` launches clusters; else None."""
    tile = triton.next_power_of_2(n_cols)
    entry = tuning.BWD_CLUSTER.get(itemsize, {}).get(tile)
    if entry is None or n_cols % 16 or n_cols < tuning.CLUSTER_MIN_FILL * tile or not clusters_supported(device):
        return None
    ctas, warps = entry
    return SoftmaxPlan("cluster", 1, tile // ctas, warps, ctas, tile // ctas)


def output_lead(x2d: torch.Tensor, plan: SoftmaxPlan) -> int:
    """Elements past a 16-byte boundary at which the output of ``x2d`` under ``plan`` starts (``rows_output``):
    ``frame_lead(x2d)`` where the kernels read the rows in frames (``plan.vec_cols > 1``), else 0."""
    return frame_lead(x2d) if plan.vec_cols > 1 else 0


def input_frame(x2d: torch.Tensor, plan: SoftmaxPlan) -> tuple[torch.Tensor, int]:
    """``(x_arg, base_lead)``: what the forward kernels read ``x2d`` through under ``plan``: its frame
    (``aligned_frame``) where they read the rows in frames (``plan.vec_cols > 1``), else ``x2d`` and 0."""
    return aligned_frame(x2d) if plan.vec_cols > 1 else (x2d, 0)


def backward_vectors(y2d: torch.Tensor, dy2d: torch.Tensor, dx_dtype: torch.dtype, plan: SoftmaxPlan) -> int:
    """How the backward kernels read ``y2d`` and ``dy2d`` (n_rows, n_cols) and write a fresh contiguous ``dx``
    under ``plan`` (fused or online).

    The columns of one 16-byte vector (> 1): rows of a length that is not a
    multiple of 16 start at the same place in all three (bases 16-byte aligned,
    row stride ``n_cols``), so they are read and written in frames
    (``row_frame``), vectorized; as in the forward, not in fused tiles of
    several rows. 1: as they come (Triton vectorizes rows of a multiple of 16
    from aligned bases itself; other layouts go one element a load).
    """
    n_rows, n_cols = y2d.shape
    if n_cols % 16 == 0 or plan.block_m > 1:
        return 1
    alike = all(t.stride(1) == 1 and (t.stride(0) == n_cols or n_rows == 1) and t.data_ptr() % 16 == 0
                for t in (y2d, dy2d))
    return 16 // min(y2d.element_size(), dy2d.element_size(), dx_dtype.itemsize) if alike else 1
