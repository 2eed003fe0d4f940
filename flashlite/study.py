"""Study tools: watch the online-softmax state ``(m, d)`` move block by block, built from the kernels' own helpers.

Two tracing kernels replay the algorithms of ``flashlite.softmax`` (its online
kernel) and of flash attention on a small input and store the state after every block:

* ``trace_softmax``: pass 1 of the online softmax over blocks of ``block_n``
  columns, storing the running maximum ``m``, the denominator ``d`` and the
  factor ``alpha = e^(m_old - m_new)`` that rescaled ``d`` at each block; each
  block's own state, merged with ``merge_partial_states`` as a split row is;
  then pass 2 (``y = e^(x - m) / d``) and the log-sum-exp.
* ``trace_attention``: one tile of queries against every K/V tile. The trace
  kernel calls flash attention's own K/V loop, ``attend_kv_tiles`` (scores,
  ``apply_masks``, ``online_update``, the output accumulator rescaled by the
  same ``alpha``: ``acc = acc * alpha + p v``), one tile per call, and stores
  ``m``, ``d``, ``alpha`` and the partial output ``acc / d`` after each.

Both are built from the helpers the production kernels use (``empty_state``,
``online_update``, ``merge_partial_states``, ``final_weights``,
``attend_kv_tiles``, ``causal_key_end`` ...): nothing of the algorithm is
written again. Where a trace differs from the production schedule, it is to
have one state per block to show: the online softmax kernel keeps one state
per lane (``online_update_lanes``) and merges the lanes once per row, where
the trace folds each whole block with ``online_update``; the attention trace
runs every tile through the masked branch of the loop (``attention_fwd_kernel``
takes full tiles through the unmasked one, with the same result) and in fp32
with IEEE dots whatever the input dtype. The states agree to rounding. What
Python computes is the *direct* answer, from the definitions, for every prefix
of the row: ``m = max x[:end]``, ``d = sum e^(x[:end] - m)`` in float64;
``trace_errors`` compares the two and ``check_trace`` raises if they differ.

Units. Attention folds ``log2(e)`` into its score scale, so its kernel keeps
``m`` in base-2 units; ``AttentionTrace.m`` is converted back to natural units
(``m * ln 2``) for display. ``d`` and ``alpha`` have no units.

Limits. Inputs are small by design: everything is computed in float32 whatever
the input dtype (the tensor-core dot products use full fp32 precision, so the
trace matches float64 closely); a softmax trace holds at most
``TRACE_MAX_BLOCKS`` blocks, an attention trace one query tile. CPU tensors need
``TRITON_INTERPRET=1`` set before ``triton`` is imported. The plotting helpers
need matplotlib (``pip install flashlite[plots]``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention.forward import attend_kv_tiles
from .core.checks import check_flag, check_kernel_tensor, check_scale
from .core.masking import causal_key_end
from .core.online_softmax import (
    BASE2_UNITS,
    LN2,
    LOG2E,
    empty_state,
    final_weights,
    merge_partial_states,
    normalize,
    online_update,
    rescale_factor,
    state_logsumexp,
)
from .core.runtime import launch

# ----------------------------------------------------------------------------- jit helpers


@triton.jit
def _put_column(tile, column, b, COLS: tl.constexpr):
    """``tile`` ``[ROWS, COLS]`` with its column ``b`` replaced by ``column`` ``[ROWS]`` (kept in registers)."""
    return tl.where(tl.arange(0, COLS)[None, :] == b, column[:, None], tile)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _softmax_trace_kernel(
    x_ptr, y_ptr, lse_ptr,
    m_ptr, d_ptr, alpha_ptr, block_m_ptr, block_d_ptr, merged_m_ptr, merged_d_ptr,
    n_rows, n_cols, n_blocks, stride_xm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_POW2: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    x_rows = x_ptr + rows[:, None] * stride_xm

    # Pass 1 of the online kernel, storing the state after every block.
    m, d = empty_state(BLOCK_M)
    part_m = tl.full([BLOCK_M, BLOCKS_POW2], float("-inf"), tl.float32)  # each block's own state:
    part_d = tl.zeros([BLOCK_M, BLOCKS_POW2], tl.float32)  # empty in padded slots, which merge as neutral
    for b in range(0, n_blocks):
        cols = b * BLOCK_N + tl.arange(0, BLOCK_N)
        x = tl.load(x_rows + cols[None, :], mask=row_ok[:, None] & (cols < n_cols)[None, :], other=float("-inf"))
        x = x.to(tl.float32)
        m, d, _, alpha = online_update(m, d, x, LOG2E)
        here = rows * n_blocks + b
        tl.store(m_ptr + here, m, mask=row_ok)
        tl.store(d_ptr + here, d, mask=row_ok)
        tl.store(alpha_ptr + here, alpha, mask=row_ok)
        # The same block alone, as one program of a split row sees it.
        bm, bd = empty_state(BLOCK_M)
        bm, bd, _, _ = online_update(bm, bd, x, LOG2E)
        tl.store(block_m_ptr + here, bm, mask=row_ok)
        tl.store(block_d_ptr + here, bd, mask=row_ok)
        part_m = _put_column(part_m, bm, b, BLOCKS_POW2)
        part_d = _put_column(part_d, bd, b, BLOCKS_POW2)

    # The split-row route: merge the blocks' own states in one reduction.
    merged_m, merged_d = merge_partial_states(part_m, part_d, LOG2E)
    tl.store(merged_m_ptr + rows, merged_m, mask=row_ok)
    tl.store(merged_d_ptr + rows, merged_d, mask=row_ok)

    # Pass 2: normalise under the final state.
    tl.store(lse_ptr + rows, state_logsumexp(m, d, LOG2E), mask=row_ok)
    for b in range(0, n_blocks):
        cols = b * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = row_ok[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=ok, other=float("-inf")).to(tl.float32)
        y = final_weights(x, m, d, LOG2E, False)
        tl.store(y_ptr + rows[:, None] * n_cols + cols[None, :], y, mask=ok)


@triton.jit
def _attention_trace_kernel(
    q_ptr, k_ptr, v_ptr,
    m_ptr, d_ptr, alpha_ptr, o_ptr, n_tiles_ptr,
    seqlen_q, seqlen_k, head_dim, q_start, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    q_idx = q_start + tl.arange(0, BLOCK_M).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + q_idx[:, None] * head_dim + dims[None, :],
                mask=(q_idx < seqlen_q)[:, None] & (dims < head_dim)[None, :], other=0.0)
    m, d = empty_state(BLOCK_M)  # base-2 units: qk_scale = scale * log2(e) scales the fp32 scores
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    key_end = seqlen_k
    if IS_CAUSAL:
        # Tiles past the tile's last visible key are masked for every row: never visited.
        key_end = causal_key_end(tl.minimum(q_start + BLOCK_M, seqlen_q) - 1, seqlen_q, seqlen_k)
    n_tiles = tl.cdiv(key_end, BLOCK_N)
    for t in range(0, n_tiles):
        m_old = m
        # The production K/V loop (flash attention's attend_kv_tiles) over this one tile, masked:
        # scores, masks, online_update, and acc = acc * alpha + p v.
        # No user mask (mask_bh unused) and no score modifiers: mods (softcap, slope, window) unused, MODS all off.
        acc, m, d = attend_kv_tiles(
            acc, m, d, q, q_idx, qk_scale, k_ptr, v_ptr, head_dim, head_dim, t * BLOCK_N, (t + 1) * BLOCK_N,
            (seqlen_q, seqlen_k, head_dim, head_dim), mask_bh=(q_ptr, 0, 0), mods=(1.0, 0.0, 0, 0), pages=None,
            TILE=(BLOCK_N, HEAD_DIM, HEAD_DIM, EVEN_D, EVEN_D), MASKING=(IS_CAUSAL, False, False, False),
            UNITS=BASE2_UNITS, MASKED=True, USE_TMA=False, DOTS=("ieee", False), MODS=(False, False, False, False),
        )
        alpha = rescale_factor(m_old, m, BASE2_UNITS)  # the factor the loop applied to d and acc
        here = t * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(m_ptr + here, m)
        tl.store(d_ptr + here, d)
        tl.store(alpha_ptr + here, alpha)
        tl.store(o_ptr + here[:, None] * HEAD_DIM + dims[None, :], normalize(acc, d, True))
    tl.store(n_tiles_ptr, n_tiles)


# ----------------------------------------------------------------------------- host side

# A softmax trace keeps every block's own state in registers, as a [rows, blocks] tile.
TRACE_MAX_BLOCKS = 256
# Rows of the softmax trace handled by one program.
TRACE_BLOCK_M = 16
# tl.dot needs every dimension of its operands to be at least 16 on GPUs.
DOT_MIN = 16
# An attention trace is one tile of queries held in registers with its accumulator.
TRACE_MAX_BLOCK_M = 128


def _check_block(value: int, name: str, least: int = 1) -> None:
    if not isinstance(value, int) or value < least or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {least}, got {value!r}")


@dataclass(frozen=True)
class SoftmaxTrace:
    """The online softmax of ``x`` row by row, its state stored after every block (all float32, on ``x``'s device).

    ``m``, ``d`` and ``alpha`` are in natural units; column ``b`` is the state
    after blocks ``0..b``; ``alpha[:, b]`` is the factor ``e^(m[:, b-1] - m[:, b])``
    that rescaled the old ``d`` (0 while the state was empty, including ``b = 0``).
    """

    x: torch.Tensor  # (n_rows, n_cols), the input as float32
    block_n: int
    m: torch.Tensor  # (n_rows, n_blocks) running maximum
    d: torch.Tensor  # (n_rows, n_blocks) running denominator sum e^(x - m)
    alpha: torch.Tensor  # (n_rows, n_blocks) rescale factor applied to d at each block
    block_max: torch.Tensor  # (n_rows, n_blocks) each block's own state, as a split-row program sees it
    block_sum: torch.Tensor  # (n_rows, n_blocks)
    merged_m: torch.Tensor  # (n_rows,) the block states merged with merge_partial_states
    merged_d: torch.Tensor  # (n_rows,)
    y: torch.Tensor  # (n_rows, n_cols) pass 2: e^(x - m) / d
    lse: torch.Tensor  # (n_rows,) m + log d

    @property
    def n_blocks(self) -> int:
        return self.m.shape[1]

    @property
    def block_ends(self) -> list[int]:
        """One past the last column of each block."""
        n_cols = self.x.shape[1]
        return [min((b + 1) * self.block_n, n_cols) for b in range(self.n_blocks)]


def trace_softmax(x: torch.Tensor, block_n: int = 16) -> SoftmaxTrace:
    """Run the online softmax of each row of ``x`` in blocks of ``block_n`` columns, keeping its state after each block.

    Args:
        x: logits of shape (n_cols,) or (n_rows, n_cols), float32/float16/bfloat16,
            on a CUDA device or on the CPU under ``TRITON_INTERPRET=1``.
            Computed in float32. A row may hold ``-inf`` (masked positions).
        block_n: columns per block, a power of two; at most ``TRACE_MAX_BLOCKS`` blocks.

    Returns:
        A ``SoftmaxTrace`` (a 1-D ``x`` is traced as one row).
    """
    check_kernel_tensor("x", x)
    _check_block(block_n, "block_n")
    if x.dim() not in (1, 2) or x.shape[-1] == 0:
        raise ValueError(f"x must have shape (n_cols,) or (n_rows, n_cols) with n_cols > 0, got {tuple(x.shape)}")
    x2d = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()  # (n_rows, n_cols)
    n_rows, n_cols = x2d.shape
    n_blocks = triton.cdiv(n_cols, block_n)
    if n_blocks > TRACE_MAX_BLOCKS:
        raise ValueError(f"block_n={block_n} cuts {n_cols} columns into {n_blocks} blocks; "
                         f"a trace holds at most {TRACE_MAX_BLOCKS}: raise block_n")

    def buf(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32, device=x2d.device)

    y, lse = buf(n_rows, n_cols), buf(n_rows)
    m, d, alpha, block_max, block_sum = (buf(n_rows, n_blocks) for _ in range(5))
    merged_m, merged_d = buf(n_rows), buf(n_rows)
    block_m = min(TRACE_BLOCK_M, triton.next_power_of_2(n_rows))
    launch(_softmax_trace_kernel, (triton.cdiv(n_rows, block_m),), (
        x2d, y, lse, m, d, alpha, block_max, block_sum, merged_m, merged_d,
        n_rows, n_cols, n_blocks, x2d.stride(0),
    ), BLOCK_M=block_m, BLOCK_N=block_n, BLOCKS_POW2=triton.next_power_of_2(n_blocks))
    return SoftmaxTrace(x2d, block_n, m, d, alpha, block_max, block_sum, merged_m, merged_d, y, lse)


@dataclass(frozen=True)
class AttentionTrace:
    """One tile of queries of a flash-attention forward, its state stored after every K/V tile (float32).

    ``m`` is in natural units (the kernel keeps base-2 units; ``m * ln 2`` here).
    Row ``t`` is the state after K/V tiles ``0..t``; ``out[t]`` the partial output
    ``acc / d`` then. Rows of the query tile past ``seqlen_q`` are dropped.
    """

    q: torch.Tensor  # (seqlen_q, head_dim) float32
    k: torch.Tensor  # (seqlen_k, head_dim)
    v: torch.Tensor  # (seqlen_k, head_dim)
    rows: torch.Tensor  # (n_q,) int64 query indices of the traced tile
    block_n: int
    scale: float
    causal: bool
    m: torch.Tensor  # (n_tiles, n_q) running maximum of the scaled scores, natural units
    d: torch.Tensor  # (n_tiles, n_q) running denominator
    alpha: torch.Tensor  # (n_tiles, n_q) factor that rescaled d and the accumulator at each tile
    out: torch.Tensor  # (n_tiles, n_q, head_dim) partial output acc / d after each tile (0 while d = 0)

    @property
    def n_tiles(self) -> int:
        return self.m.shape[0]

    @property
    def key_ends(self) -> list[int]:
        """One past the last key of each visited K/V tile."""
        return [min((t + 1) * self.block_n, self.k.shape[0]) for t in range(self.n_tiles)]


def trace_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    block_m: int = 16, block_n: int = 16, q_tile: int = 0, causal: bool = False, scale: float | None = None,
) -> AttentionTrace:
    """Run one query tile of flash attention over the K/V tiles of one head, keeping the state after each tile.

    Args:
        q: (seqlen_q, head_dim) queries; k, v: (seqlen_k, head_dim) keys and values;
            float32/float16/bfloat16 on a CUDA device or on the CPU under
            ``TRITON_INTERPRET=1``. Computed in float32.
        block_m: queries in the tile, a power of two in [16, 128].
        block_n: keys per K/V tile, a power of two >= 16.
        q_tile: which tile of queries: rows ``q_tile * block_m`` onwards.
        causal: bottom-right aligned causal mask (as ``flash_attention``); tiles
            wholly above the diagonal are skipped, as the kernel skips them.
        scale: score scale, default ``1 / sqrt(head_dim)``.

    Returns:
        An ``AttentionTrace``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_kernel_tensor(name, t)
        if t.dim() != 2:
            raise ValueError(f"{name} must have shape (seqlen, head_dim), got {tuple(t.shape)}")
    if k.shape != v.shape or k.shape[1] != q.shape[1]:
        raise ValueError(f"k and v must both be (seqlen_k, {q.shape[1]}), got {tuple(k.shape)} and {tuple(v.shape)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    _check_block(block_m, "block_m", DOT_MIN)
    _check_block(block_n, "block_n", DOT_MIN)
    if block_m > TRACE_MAX_BLOCK_M:
        raise ValueError(f"block_m must be at most {TRACE_MAX_BLOCK_M}, got {block_m}")
    seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[0]
    if seqlen_k == 0 or not 0 <= q_tile * block_m < seqlen_q:
        raise ValueError(f"q_tile={q_tile} of {block_m} rows is outside seqlen_q={seqlen_q} (or seqlen_k is 0)")
    scale = check_scale(scale, 1.0 / math.sqrt(head_dim))
    causal = check_flag("causal", causal)
    q32, k32, v32 = (t.to(torch.float32).contiguous() for t in (q, k, v))
    n_tiles_max = triton.cdiv(seqlen_k, block_n)
    HEAD_DIM = max(DOT_MIN, triton.next_power_of_2(head_dim))
    m, d, alpha = (torch.full((n_tiles_max, block_m), float("nan"), device=q.device) for _ in range(3))
    out = torch.full((n_tiles_max, block_m, HEAD_DIM), float("nan"), device=q.device)
    n_tiles = torch.zeros(1, dtype=torch.int32, device=q.device)
    q_start = q_tile * block_m
    launch(_attention_trace_kernel, (1,), (
        q32, k32, v32, m, d, alpha, out, n_tiles,
        seqlen_q, seqlen_k, head_dim, q_start, scale * LOG2E.value,
    ), BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=HEAD_DIM, IS_CAUSAL=causal, EVEN_D=head_dim == HEAD_DIM)
    t, n_q = int(n_tiles.item()), min(block_m, seqlen_q - q_start)
    rows = torch.arange(q_start, q_start + n_q, device=q.device)
    return AttentionTrace(
        q32, k32, v32, rows, block_n, scale, causal,
        m[:t, :n_q] * LN2.value, d[:t, :n_q], alpha[:t, :n_q], out[:t, :n_q, :head_dim],
    )


# ----------------------------------------------------------------------------- the direct computation


def _prefix_state(s: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max, sum e^(s - max))`` over the first ``end`` columns of float64 ``s``, from the definition."""
    prefix = s[:, :end]
    m = prefix.max(dim=1).values
    m_safe = torch.where(m == float("-inf"), 0.0, m)  # an all -inf prefix: d = 0, not NaN
    return m, torch.exp(prefix - m_safe[:, None]).sum(dim=1)


def _prefix_alpha(m: torch.Tensor) -> torch.Tensor:
    """``e^(m_prev - m)`` for a column-per-block ``m``, 0 where the previous state was empty (and for block 0)."""
    prev = torch.cat([torch.full_like(m[:, :1], float("-inf")), m[:, :-1]], dim=1)
    return torch.where(prev == float("-inf"), 0.0, torch.exp(prev - m))


def softmax_trace_reference(trace: SoftmaxTrace) -> dict[str, torch.Tensor]:
    """The float64 values every field of ``trace`` should hold, from the definitions, prefix by prefix."""
    x = trace.x.double()
    states = [_prefix_state(x, end) for end in trace.block_ends]
    m = torch.stack([s[0] for s in states], dim=1)
    d = torch.stack([s[1] for s in states], dim=1)
    starts = [b * trace.block_n for b in range(trace.n_blocks)]
    blocks = [_prefix_state(x[:, start:], end - start) for start, end in zip(starts, trace.block_ends)]
    return dict(
        m=m, d=d, alpha=_prefix_alpha(m),
        block_max=torch.stack([b[0] for b in blocks], dim=1), block_sum=torch.stack([b[1] for b in blocks], dim=1),
        merged_m=m[:, -1], merged_d=d[:, -1],
        y=torch.softmax(x, dim=1), lse=torch.logsumexp(x, dim=1),
    )


def _scores64(trace: AttentionTrace) -> torch.Tensor:
    """float64 scaled scores of the traced queries, ``-inf`` where the causal mask hides a key."""
    q, k = trace.q.double()[trace.rows], trace.k.double()
    s = (q @ k.T) * trace.scale
    if trace.causal:
        seqlen_q, seqlen_k = trace.q.shape[0], trace.k.shape[0]
        keys = torch.arange(seqlen_k, device=s.device)
        s = s.masked_fill(keys[None, :] > trace.rows[:, None] + (seqlen_k - seqlen_q), float("-inf"))
    return s


def attention_trace_reference(trace: AttentionTrace) -> dict[str, torch.Tensor]:
    """The float64 values the trace should hold: state and softmax(s) v over each prefix of keys;
    ``final`` is the full attention output of the traced queries (all keys)."""
    s, v = _scores64(trace), trace.v.double()

    def attend(end: int) -> torch.Tensor:  # softmax(s[:, :end]) v[:end]
        p = torch.nan_to_num(torch.softmax(s[:, :end], dim=1), nan=0.0)  # a query with no key yet: 0
        return p @ v[:end]

    n_q, head_dim = s.shape[0], v.shape[1]
    states = [_prefix_state(s, end) for end in trace.key_ends]
    m = torch.stack([st[0] for st in states]) if states else s.new_empty(0, n_q)  # (n_tiles, n_q)
    d = torch.stack([st[1] for st in states]) if states else s.new_empty(0, n_q)
    out = torch.stack([attend(end) for end in trace.key_ends]) if states else s.new_empty(0, n_q, head_dim)
    return dict(m=m, d=d, alpha=_prefix_alpha(m.T).T, out=out, final=attend(s.shape[1]))


def _max_error(actual: torch.Tensor, expected: torch.Tensor, relative: bool) -> float:
    """Largest |actual - expected| (over max(|expected|, 1) if ``relative``); equal infinities and NaN/NaN count 0."""
    a, e = actual.double(), expected.double()
    same = (a == e) | (a.isnan() & e.isnan())
    diff = (a - e).abs()
    if relative:
        diff = diff / e.abs().clamp_min(1.0)
    diff = torch.where(same, 0.0, diff.nan_to_num(nan=float("inf")))
    return float(diff.max()) if diff.numel() else 0.0


# Which fields are compared relative to their size: d grows with the row, m and alpha are O(1) values.
_RELATIVE = {"d", "block_sum", "merged_d"}


def trace_errors(trace: SoftmaxTrace | AttentionTrace) -> dict[str, float]:
    """Max error of every field of ``trace`` against the float64 direct computation.

    ``d``-like fields are relative errors (over ``max(|d|, 1)``), the rest absolute.
    For an attention trace, ``final`` compares the last partial output with the
    full float64 attention of the traced queries.
    """
    if isinstance(trace, SoftmaxTrace):
        ref = softmax_trace_reference(trace)
    else:
        ref = attention_trace_reference(trace)
    errors = {}
    for name, expected in ref.items():
        if name == "final":  # a query tile that sees no key at all visits no tile: its output is 0
            actual = trace.out[-1] if trace.n_tiles else torch.zeros_like(expected)
        else:
            actual = getattr(trace, name)
        errors[name] = _max_error(actual.cpu(), expected.cpu(), name in _RELATIVE)
    return errors


def check_trace(trace: SoftmaxTrace | AttentionTrace, tol: float = 2e-5) -> dict[str, float]:
    """``trace_errors``, raising an AssertionError naming the field when one exceeds ``tol``.

    The default suits the float32 traces of O(1) logits: a few float32 roundings
    per block, relative to ``d``. Returns the errors.
    """
    errors = trace_errors(trace)
    bad = {k: e for k, e in errors.items() if not e <= tol}
    if bad:
        raise AssertionError(f"trace differs from the direct float64 computation (tol {tol:.0e}): "
                             + ", ".join(f"{k} {e:.2e}" for k, e in bad.items()))
    return errors


# ----------------------------------------------------------------------------- example inputs


def story_logits(block_n: int = 32, n_blocks: int = 8, seed: int = 0) -> tuple[torch.Tensor, list[str]]:
    """Four rows of logits that make the rescaling visible, with a label for each.

    * ``random``: N(0, 1.5^2); the maximum rises now and then.
    * ``rising``: a ramp plus noise; a later block raises the maximum almost every time (alpha < 1).
    * ``peak first``: the largest logit is in block 0; later blocks never rescale (alpha = 1).
    * ``first block masked``: block 0 is all ``-inf``: the state stays empty (m = -inf, d = 0,
      alpha = 0 at the next block, never NaN).

    Returns ``(x, labels)`` with ``x`` of shape (4, block_n * n_blocks), float32 on the CPU.
    """
    gen = torch.Generator().manual_seed(seed)
    n = block_n * n_blocks
    noise = torch.randn(4, n, generator=gen)
    x = torch.empty(4, n)
    x[0] = 1.5 * noise[0]
    x[1] = torch.linspace(0.0, 8.0, n) + 0.7 * noise[1]
    x[2] = 0.8 * noise[2] - 3.0
    x[2, block_n // 3] = 4.0
    x[3] = 1.5 * noise[3]
    x[3, :block_n] = float("-inf")
    return x, ["random", "rising", "peak first", "first block masked"]


# ----------------------------------------------------------------------------- plots


def matplotlib_available() -> bool:
    """True if the plotting helpers can run (``pip install flashlite[plots]``)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():  # -> the matplotlib.pyplot module, on the file-only Agg backend
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install 'flashlite[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_softmax_trace(trace: SoftmaxTrace, path: str, labels: list[str] | None = None) -> str:
    """PNG of the running maximum, denominator and rescale factor of each row over the blocks; returns ``path``."""
    plt = _pyplot()
    labels = labels or [f"row {i}" for i in range(trace.x.shape[0])]
    blocks = list(range(trace.n_blocks))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, label in enumerate(labels):
        color = f"C{i}"
        m = trace.m[i].cpu()
        axes[0].step(blocks, m, where="post", color=color, label=f"{label}: running m")
        axes[0].plot(blocks, trace.block_max[i].cpu(), "o", color=color, alpha=0.45, ms=4)
        axes[1].plot(blocks, trace.d[i].cpu(), marker="o", color=color, label=label)
        axes[2].plot(blocks, trace.alpha[i].cpu(), marker="o", color=color, label=label)
    for i, label in enumerate(labels):
        empty = int((trace.m[i] == float("-inf")).sum())
        if empty:
            axes[0].annotate(f"{label}: m = -inf, d = 0 for {empty} block(s)", (0.02, 0.02 + 0.07 * i),
                             xycoords="axes fraction", fontsize=7, color=f"C{i}")
    axes[0].set_title("running max m (line) and each block's max (dots)")
    axes[1].set_title("denominator d = sum e^(x - m) so far")
    axes[1].set_yscale("log")
    axes[2].set_title("rescale factor alpha = e^(m_old - m_new)")
    axes[2].set_ylim(-0.05, 1.1)
    for ax in axes:
        ax.set_xlabel(f"block (of {trace.block_n} columns)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.suptitle("online softmax, state after each block (natural units); alpha < 1 where a block raised the max")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_attention_trace(trace: AttentionTrace, path: str, n_rows: int = 4) -> str:
    """PNG of m, alpha and the partial output's distance to the final output over the K/V tiles; returns ``path``."""
    plt = _pyplot()
    tiles = list(range(trace.n_tiles))
    final = attention_trace_reference(trace)["final"].to(trace.out.device)  # the float64 answer, all keys
    distance = (trace.out.double() - final[None]).norm(dim=-1) / final.norm(dim=-1).clamp_min(1e-30)[None]
    picks = torch.linspace(0, len(trace.rows) - 1, min(n_rows, len(trace.rows))).round().long().tolist()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for j, r in enumerate(picks):
        label = f"query {int(trace.rows[r])}"
        axes[0].step(tiles, trace.m[:, r].cpu(), where="post", color=f"C{j}", label=label)
        axes[1].plot(tiles, trace.alpha[:, r].cpu(), marker="o", color=f"C{j}", label=label)
        axes[2].plot(tiles, distance[:, r].cpu(), marker="o", color=f"C{j}", label=label)
    axes[0].set_title("running max m of the scaled scores (natural units)")
    axes[1].set_title("alpha: rescales d AND the output accumulator")
    axes[1].set_ylim(-0.05, 1.1)
    axes[2].set_title("partial output vs exact attention: |O_t - O| / |O|")
    axes[2].set_yscale("log")
    for ax in axes:
        ax.set_xlabel(f"K/V tile (of {trace.block_n} keys)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    mode = "causal" if trace.causal else "full"
    fig.suptitle(f"flash attention, one tile of {len(trace.rows)} queries, {mode} mask, state after each K/V tile")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_errors(errors: dict[str, float | None], path: str, tolerances: dict[str, float] | None = None) -> str:
    """PNG bar chart (log scale) of each stage's max error against float64; failed stages (None) marked; returns ``path``."""
    plt = _pyplot()
    names = list(errors)
    floor = 1e-12  # an exact answer still gets a visible bar on the log axis
    values = [max(e, floor) if e is not None else floor for e in errors.values()]
    colors = ["C3" if e is None else "C0" for e in errors.values()]
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(names)), 4.5))
    ax.bar(range(len(names)), values, color=colors)
    for i, name in enumerate(names):
        if errors[name] is None:
            ax.text(i, floor * 3, "failed", ha="center", color="C3", rotation=90, fontsize=8)
        if tolerances and name in tolerances:
            ax.hlines(tolerances[name], i - 0.4, i + 0.4, colors="k", linestyles="dashed", lw=1)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("max |out - float64 reference|")
    ax.set_title("error of each stage (dashed: tolerance)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
