"""The online-softmax core: a running maximum ``m`` and denominator ``d``.

Every flashlite kernel is built on one fact. For a row of logits split into
blocks, the pair ``(m, d) = (max x, sum exp(x - m))`` of the whole row can be
built block by block, and two partial states merge as

    (m1, d1) (+) (m2, d2) = (m, d1 * e^(m1 - m) + d2 * e^(m2 - m)),   m = max(m1, m2).

The factor ``e^(m_old - m_new)`` ("alpha") rescales what was summed under an
older, smaller maximum. Softmax uses the final state to normalise; attention
uses the same alpha to rescale its output accumulator (``rescale_accumulator``);
split-row softmax merges per-program partial states with ``merge_states``, and
split-K/V decoding merges them with their accumulators (``merge_accumulators``,
``merge_partial_accumulators``), and an attention sink is one more state, ``(sink, 1)``, merged into each
row's (``merge_sink``).
Programs that trade partial states through memory do it with
``flashlite.core.partials``.

Units. The exponentials are ``exp2``. A caller states how many base-2 units one
unit of its logits is, as the constexpr ``LOG2_PER_UNIT``:

* ``LOG2E`` for natural-log logits (softmax). The difference ``x - m`` is taken
  first, exactly, and only then scaled, so inputs around 1e4 keep fp32 accuracy.
* ``BASE2_UNITS`` (1.0) for logits already in base-2 units.

Attention's scores ``s = q·k`` are fp32 dot products of unscaled inputs; its
logits are ``s · scale · log2(e)``. ``online_update_scaled`` folds that factor
into the exponential (one fused multiply-add a score, as FlashAttention does),
keeping ``m`` in base-2 units; tiles that need masking scale first, then mask,
then call ``online_update`` in base-2 units, and an additive bias keeps the
logits in natural-log units instead (``LOG2E``), so that a huge finite bias
such as ``finfo.min`` is never multiplied past the fp32 range.

Empty states. A state that has seen only ``-inf`` (or nothing) is
``(m, d) = (-inf, 0)``. ``e^(m_old - m_new)`` would then be ``e^(-inf + inf)``
= NaN, so ``rescale_factor`` returns 0 for an empty old state and ``safe_max``
replaces an empty maximum by 0 before it is subtracted. Merging two empty
states gives an empty state, never NaN. NaN in the logits still propagates to
``d`` (and so to every output of the row), as in ``torch.softmax``.

Infinite states. A row holding ``+inf`` (and no NaN) has ``m = +inf``; ``safe_max``
replaces that maximum by 0 too, so ``d`` becomes ``+inf`` rather than
``e^(inf - inf)`` = NaN. The log-sum-exp of such a state is ``+inf`` (as
``torch.logsumexp``), and ``normalize`` turns ``d = +inf`` into NaN weights for
the whole row (as ``torch.softmax``). A finite row never reaches ``d = +inf``:
each of its weights is at most 1.

All helpers work on 2-D tiles ``x`` of shape ``[ROWS, COLS]`` reduced along
axis 1, with states as 1-D vectors of length ``ROWS``.
"""


import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)


BASE2_UNITS = tl.constexpr(1.0)  # LOG2_PER_UNIT of logits already in base 2


LN2 = tl.constexpr(0.6931471805599453)  # log(y) = log2(y) * LN2


@triton.jit
def safe_max(m):
    """The running maximum with an infinite one (an empty state's ``-inf``, a ``+inf`` logit) replaced by 0,
    so that ``x - m`` is never ``inf - inf``."""
    return tl.where(tl.abs(m) == float("inf"), 0.0, m)


@triton.jit
def rescale_factor(m_old, m_new, LOG2_PER_UNIT: tl.constexpr):
    """``e^(m_old - m_new)``: how much a sum taken under ``m_old`` shrinks under ``m_new``; 0 for an empty old
    state. Under ``m_new = +inf`` sums are taken under ``safe_max``'s 0, so the factor is ``e^(m_old)``."""
    return tl.where(m_old == float("-inf"), 0.0, tl.exp2((m_old - safe_max(m_new)) * LOG2_PER_UNIT))


@triton.jit
def empty_state(ROWS: tl.constexpr):
    """The state of rows that have seen nothing yet: ``m = -inf``, ``d = 0``."""
    m = tl.full([ROWS], float("-inf"), tl.float32)
    d = tl.zeros([ROWS], tl.float32)
    return m, d


@triton.jit
def online_update(m, d, x, LOG2_PER_UNIT: tl.constexpr):
    """Fold a block of logits ``x`` ``[ROWS, COLS]`` into the running state ``(m, d)``.

    Returns ``(m_new, d_new, p, alpha)``: the new state, the block's unnormalised
    weights ``p = e^(x - m_new)`` (attention multiplies them into V) and
    ``alpha = e^(m - m_new)``, the factor that rescaled the old denominator
    (attention rescales its output accumulator by the same factor).
    Positions that must not count are ``-inf`` in ``x`` and get ``p = 0``.
    """
    m_new = tl.maximum(m, tl.max(x, axis=1))
    alpha = rescale_factor(m, m_new, LOG2_PER_UNIT)
    p = tl.exp2((x - safe_max(m_new)[:, None]) * LOG2_PER_UNIT)
    d_new = d * alpha + tl.sum(p, axis=1)
    return m_new, d_new, p, alpha


@triton.jit
def online_update_scaled(m, d, s, qk_scale):
    """``online_update`` of the base-2 logits ``s * qk_scale``, the scale folded into the exponential.

    ``s`` ``[ROWS, COLS]`` are raw fp32 scores and ``qk_scale >= 0`` (a run-time
    float); ``m`` is kept in base-2 units. A positive factor keeps the order of
    floats, so the block's maximum is ``max(s) * qk_scale`` exactly, and each
    weight ``2^(s * qk_scale - m)`` is one fused multiply-add and an ``exp2``:
    the scores are never rounded to the input dtype, and scaling costs no
    instruction of its own. Positions that must not count are ``-inf`` in ``s``
    (only with ``qk_scale > 0``: callers mask after scaling otherwise).
    """
    m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)
    alpha = rescale_factor(m, m_new, BASE2_UNITS)
    p = tl.exp2(s * qk_scale - safe_max(m_new)[:, None])
    d_new = d * alpha + tl.sum(p, axis=1)
    return m_new, d_new, p, alpha


@triton.jit
def online_update_lanes(m, d, x, LOG2_PER_UNIT: tl.constexpr):
    """Fold one value per lane into per-lane states ``(m, d)`` (all three the same shape): no reduction.

    This is the element-wise form of ``online_update``, for streaming loops:
    each lane keeps its own state, so a loop turn has no cross-thread
    reduction to wait on, and lanes are merged once at the end with
    ``merge_partial_states``. One exponential a value: whichever of ``m`` and
    ``x`` is smaller is weighed by ``e^(smaller - larger)``:

        x > m:  (m, d) -> (x, d * e^(m - x) + 1)
        x <= m: (m, d) -> (m, d + e^(x - m))

    NaN in ``x`` makes the lane's state NaN (and so the row's).
    """
    m_new = tl.maximum(m, x, propagate_nan=tl.PropagateNan.ALL)
    e = tl.exp2((tl.minimum(m, x) - m_new) * LOG2_PER_UNIT)
    e = tl.where(m_new == float("-inf"), 0.0, e)  # both empty: e^(-inf + inf) would be NaN
    d_new = tl.where(x > m, d * e + 1.0, d + e)
    # A lane that saw +inf: d = +inf, as online_update gives it (sums under safe_max's 0), whether or not
    # lanes are merged afterwards.
    return m_new, tl.where(m_new == float("inf"), float("inf"), d_new)


@triton.jit
def merge_states(m_a, d_a, m_b, d_b, LOG2_PER_UNIT: tl.constexpr):
    """``(m_a, d_a) (+) (m_b, d_b)``: the state of the union of two disjoint parts of a row."""
    m = tl.maximum(m_a, m_b)
    d = d_a * rescale_factor(m_a, m, LOG2_PER_UNIT) + d_b * rescale_factor(m_b, m, LOG2_PER_UNIT)
    return m, d


@triton.jit
def merge_sink(m, d, sink, LOG2_PER_UNIT: tl.constexpr):
    """``(m, d, alpha)``: the rows' states with one more logit, ``sink`` (an attention sink, whose value vector is
    zeros), merged in as the state ``(sink, 1)``; ``alpha`` rescales an output accumulator to the new maximum (the
    sink adds nothing to it). A row that saw nothing becomes ``(sink, 1)``: its output stays 0, its log-sum-exp
    is ``sink``."""
    m_new, d_new = merge_states(m, d, sink, 1.0, LOG2_PER_UNIT)
    return m_new, d_new, rescale_factor(m, m_new, LOG2_PER_UNIT)


@triton.jit
def _merge_natural(m_a, d_a, m_b, d_b):
    # tl.reduce's combine function takes only the values: bind the units here.
    return merge_states(m_a, d_a, m_b, d_b, LOG2E)


@triton.jit
def _merge_base2(m_a, d_a, m_b, d_b):
    return merge_states(m_a, d_a, m_b, d_b, 1.0)


@triton.jit
def merge_partial_states(part_m, part_d, LOG2_PER_UNIT: tl.constexpr, AXIS: tl.constexpr = 1):
    """Merge the partial states ``[ROWS, PARTS]`` of each row into one state ``[ROWS]`` (``AXIS``: the parts'
    axis; 0 merges a row's ``[PARTS]`` into one scalar state).

    Empty parts (``-inf``, 0) are neutral, so padded slots may be loaded that way.
    """
    if LOG2_PER_UNIT == 1.0:
        m, d = tl.reduce((part_m, part_d), AXIS, _merge_base2)
    else:
        m, d = tl.reduce((part_m, part_d), AXIS, _merge_natural)
    return m, d


@triton.jit
def normalize(p, d, ZERO_IF_EMPTY: tl.constexpr):
    """Divide weights ``p`` ``[ROWS, COLS]`` by the row denominators ``d``.

    With ``ZERO_IF_EMPTY`` a row whose every position was masked (``d = 0``)
    gives zeros (masked softmax, attention); without it, 0/0 = NaN, as
    ``torch.softmax`` gives for a row of ``-inf``. A row that held ``+inf``
    (``d = +inf``) gives NaN everywhere, as ``torch.softmax``.
    """
    inv_d = tl.where(d == float("inf"), float("nan"), 1.0 / d)
    if ZERO_IF_EMPTY:
        inv_d = tl.where(d == 0.0, 0.0, inv_d)
    return p * inv_d[:, None]


@triton.jit
def state_logsumexp(m, d, LOG2_PER_UNIT: tl.constexpr):
    """The natural-log log-sum-exp ``log sum e^x`` of a state; ``-inf`` for an empty one, ``+inf`` for one that
    held ``+inf``."""
    return (m + tl.log2(d) / LOG2_PER_UNIT) * (LOG2_PER_UNIT * LN2)


@triton.jit
def final_weights(x, m, d, LOG2_PER_UNIT: tl.constexpr, ZERO_IF_EMPTY: tl.constexpr):
    """Softmax weights of logits ``x`` ``[ROWS, COLS]`` under a row's final state ``(m, d)``."""
    p = tl.exp2((x - safe_max(m)[:, None]) * LOG2_PER_UNIT)
    return normalize(p, d, ZERO_IF_EMPTY)


@triton.jit
def rescale_accumulator(acc, alpha):
    """An output accumulator ``acc`` ``[ROWS, COLS]`` (sums of ``e^(x - m_old) v``) under a new maximum: times
    ``alpha = e^(m_old - m_new)`` (``online_update``'s, or ``rescale_factor``'s), row by row."""
    return acc * alpha[:, None]


@triton.jit
def merge_accumulators(m_a, d_a, acc_a, m_b, d_b, acc_b, LOG2_PER_UNIT: tl.constexpr):
    """``(m, d, acc)``: two partial states with their output accumulators, merged (``merge_states``, each
    accumulator rescaled to the common maximum). Attention over two disjoint key ranges becomes attention over
    their union: split-K/V decoding merges its splits so."""
    m, d = merge_states(m_a, d_a, m_b, d_b, LOG2_PER_UNIT)
    acc = (rescale_accumulator(acc_a, rescale_factor(m_a, m, LOG2_PER_UNIT))
           + rescale_accumulator(acc_b, rescale_factor(m_b, m, LOG2_PER_UNIT)))
    return m, d, acc


@triton.jit
def merge_partial_accumulators(part_m, part_d, part_acc, LOG2_PER_UNIT: tl.constexpr):
    """``(m, d, acc)``: the partial states ``[ROWS, PARTS]`` of each row with their accumulators
    ``[ROWS, PARTS, COLS]``, merged at once (``merge_partial_states``, each accumulator weighted by its
    ``rescale_factor`` under the row's maximum, then summed over the parts). Empty parts weigh 0."""
    m, d = merge_partial_states(part_m, part_d, LOG2_PER_UNIT)
    weights = rescale_factor(part_m, m[:, None], LOG2_PER_UNIT)
    return m, d, tl.sum(part_acc * weights[:, :, None], 1)
