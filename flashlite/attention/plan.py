"""Which kernel and tiles an attention call runs on, and the flags every kernel's K/V loop is built with.

Pure functions of the call's shapes, dtypes and the tables of ``tuning``:
``default_config`` (the ``triton.language`` forward), ``wgmma_config`` (the
Hopper forward), ``default_backward_config``; ``kv_loop_flags`` and
``kernel_switches`` (the constexprs derived from the arguments), the logits' units
(``logit_units``, ``qk_scale_for``), and how query tiles are numbered
(``query_tile``, shared by every forward kernel and the backward's dQ kernel).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..core.online_softmax import BASE2_UNITS, LOG2E
from ..core.packed import tile_sequence
from . import tuning
from .tuning import AttentionConfig, BackwardConfig, WgmmaConfig


# An additive mask is only ever added to logits in its own natural-log units (``UNITS = LOG2E``).
NATURAL_BIAS = tl.constexpr(1.0)


@triton.jit
def query_tile(tile, n_query_tiles, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """``(bh, m_start)`` of query tile number ``tile``: numbered head-major, query tile fastest, so that
    programs running together share their head's K/V in L2; under causal each head's last (heaviest)
    tiles come first. Every forward kernel and the backward's dQ kernel number tiles so."""
    bh = tile // n_query_tiles
    m_tile = tile % n_query_tiles
    if IS_CAUSAL:
        m_tile = n_query_tiles - 1 - m_tile
    return bh, m_tile * BLOCK_M


@triton.jit
def packed_tile(tile, cu_seqlens, n_seqs, total, seq, ROWS: tl.constexpr, REVERSE: tl.constexpr):
    """``(head, b, start)`` of program tile ``tile`` of a packed batch (``core.packed.tile_sequence``'s schedule
    of the tiles of ``ROWS`` rows of ``cu_seqlens``' sequences, ``total`` rows in all): numbered head-major as
    ``query_tile`` numbers a dense batch's, the schedule's numbers backwards under ``REVERSE`` (causal query
    tiles: the last, heaviest, start first). ``seq``: ``tile_sequence``'s block of sequence numbers."""
    head, number = query_tile(tile, total // ROWS + n_seqs, 1, REVERSE)
    b, start = tile_sequence(number, cu_seqlens, n_seqs, seq, ROWS)
    return head, b, start


def kv_loop_flags(mask_ptr, mask_is_bool: bool, stride_mask_q: int, head_dim: int, head_dim_pad: int,
                  head_dim_v: int, head_dim_v_pad: int) -> dict:
    """The constexpr flags of every kernel built on ``attend_kv_tiles``, from its arguments."""
    return dict(
        HAS_MASK=mask_ptr is not None,
        # A key-padding mask (B, 1, 1, Lk): one mask row per key tile instead of BLOCK_M copies of it.
        MASK_PER_KEY=stride_mask_q == 0,
        EVEN_D=head_dim == head_dim_pad,
        EVEN_DV=head_dim_v == head_dim_v_pad,
        UNITS=logit_units(mask_ptr is not None and not mask_is_bool),
    )


def logit_units(additive_mask: bool) -> float:
    """``LOG2_PER_UNIT`` of a kernel's logits: natural-log units under an additive mask (a bias of any finite
    size stays finite), else base 2 (``log2(e)`` folded into the scale)."""
    return LOG2E.value if additive_mask else BASE2_UNITS.value


def qk_scale_for(scale: float, additive_mask: bool) -> float:
    """The factor a kernel multiplies its fp32 scores by: ``scale`` in the units of ``logit_units``."""
    return scale if additive_mask else scale * LOG2E.value


def kernel_switches(q: torch.Tensor, causal: bool, mask: torch.Tensor | None, mask_is_bool: bool, head_dim: int,
                    head_dim_v: int, variant_meta: dict, seq_block: int = 0) -> dict:
    """The constexpr tuples every ``triton.language`` attention kernel takes (``forward``'s module docstring):
    ``DIMS``, ``MASKING``, ``UNITS``, ``DOTS`` and ``MODS``, for a call on ``q`` with ``mask`` broadcast to
    (B, H, Lq, Lk) and ``variant_meta`` from ``variant_args``; ``seq_block``: a packed batch's ``SEQ_BLOCK``
    (``packed_schedule``; ``MASKING[4]``, 0 for a dense batch)."""
    hd_pad, dv_pad = head_dim_padded(head_dim), head_dim_padded(head_dim_v)
    flags = kv_loop_flags(mask, mask_is_bool, mask.stride(2) if mask is not None else 0, head_dim, hd_pad,
                          head_dim_v, dv_pad)
    return dict(
        DIMS=(hd_pad, dv_pad, flags["EVEN_D"], flags["EVEN_DV"]),
        MASKING=(causal, flags["HAS_MASK"], mask_is_bool, flags["MASK_PER_KEY"], seq_block),
        UNITS=flags["UNITS"],
        DOTS=("ieee" if q.dtype == torch.float32 else "tf32",
              q.dtype == torch.bfloat16 and not q.is_cuda),  # UPCAST_DOTS: the interpreter (core.tiles.dot)
        MODS=tuple(variant_meta[name] for name in ("HAS_SOFTCAP", "FAST_TANH", "HAS_ALIBI", "HAS_WINDOW")),
    )


def visibility(causal: bool, window: tuple[int, int] | None) -> tuple[bool, tuple[int, int] | None]:
    """``(causal, window)`` as the kernels take them: a checked ``window_size`` ``(left, right)`` (-1 unbounded)
    with ``causal`` folded in (a key must pass both: ``right = 0``), or None when it hides nothing beyond
    causal. A window bounded on neither side is no window; ``(-1, 0)`` is causal itself.
    Examples: ``(True, (4, -1))`` -> ``(False, (4, 0))``; ``(False, (-1, 0))`` -> ``(True, None)``."""
    if window is None:
        return causal, None
    left, right = window
    if causal:
        right = 0
    if left == -1 and right == -1:
        return causal, None
    if left == -1 and right == 0:
        return True, None
    return False, (left, right)


def window_bounds(window: tuple[int, int] | None, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """The kernels' ``(window_left, window_right)``: an unbounded side (-1), and any side wider, becomes
    ``seqlen_q + seqlen_k``, which no (query, key) distance reaches (so the kernels' 32-bit sums of it with a
    position cannot overflow); ``(0, 0)`` without a window (unread: ``HAS_WINDOW`` is off)."""
    if window is None:
        return 0, 0
    unbounded = seqlen_q + seqlen_k
    return tuple(unbounded if side == -1 else min(side, unbounded) for side in window)


# ``variant_args``' switches for a call with no variant (what a kernel's launch takes by default).
NO_VARIANTS = dict(HAS_SOFTCAP=False, FAST_TANH=False, HAS_ALIBI=False, HAS_WINDOW=False, HAS_SINKS=False)


def variant_args(q: torch.Tensor, additive_mask: bool, softcap: float | None, window: tuple[int, int] | None,
                 has_alibi: bool, has_sinks: bool, seqlen_q: int, seqlen_k: int) -> tuple[tuple, dict]:
    """The variants' kernel arguments: the run-time ``(softcap, window_left, window_right)`` (the softcap in the
    logits' units, ``window_bounds``) and the constexpr switches ``HAS_SOFTCAP``, ``FAST_TANH`` (the
    one-instruction tanh: fp16/bf16 on a GPU, ``tuning.SOFTCAP_FAST_TANH``), ``HAS_ALIBI``, ``HAS_WINDOW`` and
    ``HAS_SINKS``. Every attention kernel takes them so (``core.masking``'s ``mods``/``MODS``)."""
    scalars = (qk_scale_for(softcap or 1.0, additive_mask), *window_bounds(window, seqlen_q, seqlen_k))
    meta = dict(
        HAS_SOFTCAP=softcap is not None,
        FAST_TANH=softcap is not None and q.is_cuda and q.dtype != torch.float32 and tuning.SOFTCAP_FAST_TANH,
        HAS_ALIBI=has_alibi, HAS_WINDOW=window is not None, HAS_SINKS=has_sinks,
    )
    return scalars, meta


def alibi_view(alibi_slopes: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """Checked ALiBi slopes, (H,) or (B, H) fp32, as the (B, H) tensor the kernels read (``stride(0)`` 0 for
    slopes shared by the batch, the head dim contiguous), or None."""
    if alibi_slopes is None:
        return None
    slopes = alibi_slopes.detach().contiguous()
    return slopes.expand(batch, -1) if slopes.dim() == 1 else slopes


def output_like(q: torch.Tensor, head_dim_v: int) -> torch.Tensor:
    """An empty (B, H, Lq, Dv) output in q's dtype and device, its (B, H, L) dims in q's memory order (as
    ``torch.empty_like(q)`` orders them), so that queries in (B, L, H, D) order give an output in (B, L, H, Dv)
    order, which merges its heads without a copy."""
    if head_dim_v == q.shape[3]:
        return torch.empty_like(q)
    outer = sorted(range(3), key=lambda dim: -q.stride(dim))  # outermost first; ties keep (B, H, L)
    order = [*outer, 3]
    out = q.new_empty([q.shape[dim] for dim in outer] + [head_dim_v])
    return out.permute(*[order.index(dim) for dim in range(4)])


class OutputLayout:
    """The (B, H, Lq, Dv) output of a call signature: ``output_like``'s shape and strides, worked out once from q's
    shape and strides; ``empty(q)`` allocates one in q's dtype and on q's device, ``meta(dtype)`` one that holds
    no memory (descriptor templates). With ``head_dim_v`` q's own head dim it is ``torch.empty_like(q)``'s layout:
    the gradient of a (B, H, L, D) input."""

    __slots__ = ("shape", "strides")

    def __init__(self, q: torch.Tensor, head_dim_v: int):
        like = output_like(torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device="meta"), head_dim_v)
        self.shape, self.strides = tuple(like.shape), like.stride()

    def empty(self, q: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.strides, dtype=q.dtype, device=q.device)

    def meta(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.strides, dtype=dtype, device="meta")


def head_dim_padded(head_dim: int) -> int:
    """Width of the on-chip Q/K/V tiles: the next power of two, at least 16."""
    return max(tuning.MIN_HEAD_DIM, triton.next_power_of_2(head_dim))


# The head dims split into two column parts (``head_dim_parts``; FLASHLITE_HEAD_SPLIT=0 pads them instead):
# (largest head dim, its parts), the smallest range first. A part is a power of two of at least 16 columns: a TMA box's inner
# dimension takes at least 16 bytes, and 16 is the K step of an fp16/bf16 wgmma. 97 to 127 stay padded to 128 (no
# two parts fit them closer), and 193 to 255 to 256.
HEAD_DIM_SPLITS = ((80, (64, 16)), (96, (64, 32)), (160, (128, 32)), (192, (128, 64)))


def head_dim_parts(head_dim: int) -> tuple[int, ...]:
    """The column parts, powers of two, first to last, that the Hopper forward kernels load a head dim in while
    ``head_split_enabled``: ``HEAD_DIM_SPLITS``' -- 65 to 80 -> (64, 16), 81 to 96 ->
    (64, 32), 129 to 160 -> (128, 32), 161 to 192 -> (128, 64); any other head dim is one part,
    ``head_dim_padded``. The parts' sum is the tile's width on chip: 96 (80) columns of products instead of the
    padded 128, a quarter (three eighths) fewer; 192 (160) instead of 256, a third (three eighths) fewer."""
    padded = head_dim_padded(head_dim)
    for limit, parts in HEAD_DIM_SPLITS:
        if head_dim <= limit and head_dim_padded(limit) == padded:  # (the first range of its power of two)
            return parts
    return (padded,)


def head_split_enabled() -> bool:
    """True unless ``FLASHLITE_HEAD_SPLIT=0``: the Hopper forward kernels (the warp-specialized one too) load head
    dims of 65 to 96 and 129 to 192 in two column parts (``head_dim_parts``) rather than padded to 128 and 256,
    and the Hopper backward's two passes those of 129 to 192 (``column_parts``; ``backward_hopper.column_parts``).

    On by default since they ran on the H200: tests/test_gpu_attention.py checks them against float64, and
    bench/results/h200/attention_head_split.json times them beside the padded kernels (1.0-1.8x forward,
    1.1-1.25x backward at D 160/192; even at D 96). ``FLASHLITE_HEAD_SPLIT=0`` pads every head dim instead.
    Read when a call is planned (``api.clear_routes`` after changing it)."""
    return os.environ.get("FLASHLITE_HEAD_SPLIT", "1") != "0"


def backward_one_pass_enabled() -> bool:
    """True when ``FLASHLITE_BACKWARD_ONE_PASS=1``: the Hopper backward of dense calls on the table's tiles, where
    they allow it (head dims up to 128; forced tiles decide for themselves), runs in one pass, dQ added to an fp32
    workspace by TMA reductions (``backward_hopper._attention_bwd_one_pass_kernel``), unless
    ``torch.use_deterministic_algorithms(True)`` is on. Off by default: measured at 0.78-0.92x the two passes on
    the H200 (bench/results/h200/TUNING.md#one-pass-ws). Read when a call is planned (``api.clear_routes`` after
    changing it)."""
    return os.environ.get("FLASHLITE_BACKWARD_ONE_PASS", "0") == "1"


def hopper_varlen_enabled() -> bool:
    """True unless ``FLASHLITE_HOPPER_VARLEN=0``: packed batches (``flash_attention_varlen``) run their forward and
    backward on the Hopper kernels (``forward_hopper``, ``backward_hopper``: flattened schedules of every
    sequence's tiles, ``core.packed.tile_sequence``) rather than on the ``triton.language`` ones.

    On by default since the varlen matrix passed on both kernel families on an H200 (tests/test_gpu_varlen.py)
    and the Hopper kernels ran packed batches at 0.75-0.99x the dense forward against the tl kernels'
    0.54-0.77x (bench/results/h200/varlen.json). ``=0`` keeps the tl kernels (to compare them). Read when a call
    is planned (``api.clear_routes`` after changing it)."""
    return os.environ.get("FLASHLITE_HOPPER_VARLEN", "1") != "0"


def column_parts(head_dim: int) -> tuple[int, ...]:
    """The column parts the Hopper kernels load a head dim in: ``head_dim_parts``' while ``head_split_enabled``
    (unless ``FLASHLITE_HEAD_SPLIT=0``), else one part, the padded head dim."""
    if head_split_enabled():
        return head_dim_parts(head_dim)
    return (head_dim_padded(head_dim),)


def default_config(
    head_dim: int, dtype: torch.dtype, device: torch.device,
    causal: bool = False, seqlen_k: int | None = None, has_mask: bool = False,
) -> AttentionConfig:
    """The fixed tile config of a call: the interpreter's, or the fp32 or fp16/bf16 table's.

    Unmasked fp16/bf16 calls at D <= 64 take ``tuning.SHORT_WORK_CONFIGS`` while ``seqlen_k`` is
    at most ``tuning.SHORT_SEQLEN_K`` (``tuning.SHORT_SEQLEN_K_CAUSAL`` under causal).
    """
    if device.type != "cuda":
        return tuning.INTERPRETER_CONFIG
    hd_pad = head_dim_padded(head_dim)
    if dtype == torch.float32:
        return tuning.FP32_CONFIGS[hd_pad]
    short_limit = tuning.SHORT_SEQLEN_K_CAUSAL if causal else tuning.SHORT_SEQLEN_K
    if hd_pad in tuning.SHORT_WORK_CONFIGS and not has_mask and seqlen_k is not None and seqlen_k <= short_limit:
        return tuning.SHORT_WORK_CONFIGS[hd_pad]
    return tuning.FORWARD_CONFIGS[hd_pad]


def tma_safe(has_mask: bool, block_n: int, head_dim_pad: int) -> bool:
    """False for the combination that Triton 3.6 miscompiles on sm_90: a user mask with K/V
    tiles by TMA in square boxes (``BLOCK_N == HEAD_DIM_PADDED``).

    Such launches gave errors of about 2 (tolerances ~0.03) whenever the loop ran more than one
    K tile; pointer loads, non-square boxes and unmasked calls are right (``bench/probe_tma_mask.py`` at
    commit 17242bc finds them: ``git show 17242bc:bench/probe_tma_mask.py``; TUNING.md#tma-safe). Such
    launches take pointer loads, and such configs leave the autotune list.
    """
    return not (has_mask and block_n == head_dim_pad)


def autotune_enabled() -> bool:
    """True when ``FLASHLITE_AUTOTUNE=1``: on first use of a shape bucket, time up to six tile configs."""
    return os.environ.get("FLASHLITE_AUTOTUNE", "0") not in ("", "0")


# The mask layouts the autotuner tells apart (tune_mask_layout).
MASK_LAYOUT_NONE, MASK_LAYOUT_PER_KEY, MASK_LAYOUT_FULL = 0, 1, 2


def mask_layout(mask: torch.Tensor | None) -> int:
    """``MASK_LAYOUT_*`` of a (B, H, Lq, Lk) broadcast mask: none, one row per key tile, or gathered per query."""
    if mask is None:
        return MASK_LAYOUT_NONE
    return MASK_LAYOUT_PER_KEY if mask.stride(2) == 0 else MASK_LAYOUT_FULL


def prune_tune_space(configs, named_args, **kwargs):
    hd_pad, dv_pad = kwargs["DIMS"][:2]
    keep = tuning.TUNE_CANDIDATES[max(64, hd_pad, dv_pad)]
    has_mask = named_args.get("tune_mask_layout", MASK_LAYOUT_NONE) != MASK_LAYOUT_NONE
    return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in keep
            and tma_safe(has_mask, c.kwargs["BLOCK_N"], hd_pad) and tma_safe(has_mask, c.kwargs["BLOCK_N"], dv_pad)]


def wgmma_config(head_dim: int, causal: bool, seqlen_k: int, width: int | None = None) -> WgmmaConfig:
    """The Hopper kernel's tiles for a call, by padded head dim: ``tuning.WGMMA_CONFIGS``; under causal
    ``tuning.WGMMA_SHORT_CAUSAL``'s with few keys, else ``tuning.WGMMA_CAUSAL_CONFIGS``' where there is one.
    ``width``: the widest head dim on chip (the column parts' sum, ``column_parts``); causal calls of a width in
    ``tuning.WGMMA_SPLIT_CAUSAL_CONFIGS`` narrower than the padded head dim take its tiles."""
    hd_pad = head_dim_padded(head_dim)
    if causal and width is not None and width < hd_pad and width in tuning.WGMMA_SPLIT_CAUSAL_CONFIGS:
        return tuning.WGMMA_SPLIT_CAUSAL_CONFIGS[width]
    if causal:
        max_keys, short = tuning.WGMMA_SHORT_CAUSAL.get(hd_pad, (0, None))
        if seqlen_k <= max_keys:
            return short
        if hd_pad in tuning.WGMMA_CAUSAL_CONFIGS:
            return tuning.WGMMA_CAUSAL_CONFIGS[hd_pad]
    return tuning.WGMMA_CONFIGS[hd_pad]


def packed_schedule(n_seqs: int, total_rows: int, rows: int, num_warps: int) -> tuple[int, int]:
    """``(numbers, SEQ_BLOCK)`` of a packed batch's flattened tile schedule (``core.packed.tile_sequence``): the
    tile numbers a head of ``n_seqs`` sequences of ``total_rows`` rows in all takes, in tiles of ``rows`` rows
    (``total_rows // rows + n_seqs``: every tile, and at most one number a sequence without one), and how many
    sequence starts one load of the kernel's search reads (a power of two, at least one a thread of
    ``num_warps`` warps, at most ``tuning.PACKED_SEQ_BLOCK``)."""
    seq_block = max(32 * num_warps, min(triton.next_power_of_2(max(n_seqs, 1)), tuning.PACKED_SEQ_BLOCK))
    return total_rows // rows + n_seqs, seq_block


def default_backward_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> BackwardConfig:
    """The tile config of a backward call: the interpreter's, or the fp32 or fp16/bf16 table's."""
    if device.type != "cuda":
        return tuning.BACKWARD_INTERPRETER_CONFIG
    table = tuning.BACKWARD_FP32_CONFIGS if dtype == torch.float32 else tuning.BACKWARD_CONFIGS
    return table[head_dim_padded(head_dim)]
