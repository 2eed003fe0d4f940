"""``merge_attention_states``: two partial attention results over disjoint key sets, merged into one.

Attention of a row over keys ``K_a ∪ K_b`` from its attention over each part:
with ``lse_x = log Σ_{j∈K_x} e^(s_j)`` and ``o_x`` the normalised output over
``K_x``,

    lse = logaddexp(lse_a, lse_b),   o = e^(lse_a − lse) · o_a + e^(lse_b − lse) · o_b.

That is the online-softmax merge of ``flashlite.core.online_softmax``: the pair
``(o, lse)`` is the state ``(m, d, acc) = (lse, 1, o)`` (a normalised
accumulator under the maximum ``lse``), so ``merge_states`` gives the merged
``(m, d)``, ``rescale_factor`` each side's weight ``e^(lse_x − m)``, and
``state_logsumexp(m, d)`` the merged LSE. Ring attention
(``flashlite.distributed``) merges the shards of keys it attends one at a
time; split-K/V decoding merges its splits the same way, on ``(m, d, acc)``.

Empty sides. A side with ``lse = −inf`` (it saw no key) is an empty state: it
weighs 0 and its ``o`` is not used (even NaN there is ignored). Both empty: the
merged state is empty, ``o = 0`` and ``lse = −inf``, never NaN, and every
gradient is 0.

Gradients. With normalised weights ``p_x = e^(lse_x − lse)`` (``p_a + p_b = 1``)
and ``δ = Σ_D dO ⊙ (o_a − o_b)`` per row (fp32):

    do_a = p_a · dO,   do_b = p_b · dO,
    dlse_a = p_a · (p_b · δ + dLSE),   dlse_b = p_b · (dLSE − p_a · δ)

(``∂o/∂lse_a = p_a (o_a − o) = p_a p_b (o_a − o_b)``, ``∂lse/∂lse_a = p_a``).

Layout and precision. ``o`` is ``(..., L, D)`` in any float dtype (the two sides
may differ: the result takes their promoted dtype, so an fp32 running
accumulator merged with a bf16 partial stays fp32), read through its strides
with the last dim contiguous; ``lse`` is ``(..., L)`` fp32. Leading dims are
flattened into one (a view where the strides allow it: slices of the sequence
dim, as ring attention takes, are read in place). All arithmetic is fp32.
One program merges ``BLOCK_M`` rows, ``BLOCK_D`` columns at a time; offsets are
64-bit. CPU tensors take the same kernel under Triton's interpreter, else a
PyTorch path with the same formulas.

Limits: no torch.compile custom op yet (compiled graphs break around it). The
tiles are not tuned: the kernel is a streaming read of ``o_a`` and ``o_b`` and a
write of ``o``, measured by ``bench/ring_attention.py`` against the copy
bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.checks import check_float_dtype
from ..core.online_softmax import LOG2E, merge_states, rescale_factor, state_logsumexp
from ..core.runtime import launch, runs_kernels

# Elements of one operand tile of one program (BLOCK_M · BLOCK_D): 4096 fp32 values are 32 a thread on 4 warps,
# the size of an elementwise tile that keeps several loads in flight. Not timed.
MERGE_TILE_ELEMENTS = 4096


# The widest column block: 128 columns of fp32 are 512 bytes a row, whole cache lines; wider rows loop. Not timed.
MERGE_MAX_BLOCK_D = 128


MERGE_NUM_WARPS = 4  # Not timed.


def merge_tiles(head_dim: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_D)`` of the merge kernels for rows of ``head_dim`` values."""
    block_d = min(triton.next_power_of_2(max(head_dim, 1)), MERGE_MAX_BLOCK_D)
    return MERGE_TILE_ELEMENTS // block_d, block_d


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _merge_weights(lse_a, lse_b):
    """``(m, d, p_a, p_b)`` of rows whose sides have LSEs ``lse_a``, ``lse_b`` (natural log, fp32).

    Each side is the state ``(lse_x, 1)``; ``(m, d)`` is their merge and ``p_x = e^(lse_x − m) / d`` the side's
    normalised weight, 0 for an empty side (``rescale_factor``) and for both sides of an empty row (d = 0)."""
    ones = tl.full(lse_a.shape, 1.0, tl.float32)
    m, d = merge_states(lse_a, ones, lse_b, ones, LOG2E)
    inv_d = tl.where(d == 0.0, 0.0, 1.0 / d)
    return m, d, rescale_factor(lse_a, m, LOG2E) * inv_d, rescale_factor(lse_b, m, LOG2E) * inv_d


@triton.jit
def _load_side(o_ptr, rows_n, rows_l, stride_n, stride_l, dims, ok, lse):
    """One side's ``[BLOCK_M, BLOCK_D]`` tile in fp32; rows of an empty side (``lse = −inf``) read as 0."""
    o = tl.load(o_ptr + rows_n[:, None] * stride_n + rows_l[:, None] * stride_l + dims[None, :], mask=ok, other=0.0)
    return tl.where((lse == float("-inf"))[:, None], 0.0, o.to(tl.float32))


@triton.jit
def _rows(n_seq, seqlen, BLOCK_M: tl.constexpr):
    """The rows of this program: ``(n, l, valid)`` (64-bit), row tiles of one leading index ``n`` fastest."""
    n_tiles = tl.cdiv(seqlen, BLOCK_M)
    pid = tl.program_id(0).to(tl.int64)
    n = pid // n_tiles
    rows_l = (pid % n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = rows_l < seqlen
    return tl.full([BLOCK_M], 0, tl.int64) + n, rows_l, valid


@triton.jit
def _merge_fwd_kernel(
    o_a_ptr, lse_a_ptr, o_b_ptr, lse_b_ptr, o_ptr, lse_ptr,
    stride_oa_n, stride_oa_l, stride_ob_n, stride_ob_l, stride_o_n, stride_o_l,
    stride_lsea_n, stride_lsea_l, stride_lseb_n, stride_lseb_l, stride_lse_n, stride_lse_l,
    n_seq, seqlen, head_dim,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n, rows, valid = _rows(n_seq, seqlen, BLOCK_M)
    lse_a = tl.load(lse_a_ptr + n * stride_lsea_n + rows * stride_lsea_l, mask=valid, other=float("-inf"))
    lse_b = tl.load(lse_b_ptr + n * stride_lseb_n + rows * stride_lseb_l, mask=valid, other=float("-inf"))
    m, d, p_a, p_b = _merge_weights(lse_a, lse_b)
    for start in range(0, head_dim, BLOCK_D):
        dims = start + tl.arange(0, BLOCK_D)
        ok = valid[:, None] & (dims < head_dim)[None, :]
        o_a = _load_side(o_a_ptr, n, rows, stride_oa_n, stride_oa_l, dims, ok, lse_a)
        o_b = _load_side(o_b_ptr, n, rows, stride_ob_n, stride_ob_l, dims, ok, lse_b)
        o = o_a * p_a[:, None] + o_b * p_b[:, None]
        o_dst = o_ptr + n[:, None] * stride_o_n + rows[:, None] * stride_o_l + dims[None, :]
        tl.store(o_dst, o.to(o_ptr.dtype.element_ty), mask=ok)
    tl.store(lse_ptr + n * stride_lse_n + rows * stride_lse_l, state_logsumexp(m, d, LOG2E), mask=valid)


@triton.jit
def _merge_bwd_kernel(
    o_a_ptr, lse_a_ptr, o_b_ptr, lse_b_ptr, do_ptr, dlse_ptr, do_a_ptr, dlse_a_ptr, do_b_ptr, dlse_b_ptr,
    stride_oa_n, stride_oa_l, stride_ob_n, stride_ob_l, stride_do_n, stride_do_l,
    stride_doa_n, stride_doa_l, stride_dob_n, stride_dob_l,
    n_seq, seqlen, head_dim,
    HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # lse_a, lse_b, dlse and the outputs dlse_a, dlse_b are contiguous (n_seq, seqlen) rows.
    n, rows, valid = _rows(n_seq, seqlen, BLOCK_M)
    flat = n * seqlen + rows
    lse_a = tl.load(lse_a_ptr + flat, mask=valid, other=float("-inf"))
    lse_b = tl.load(lse_b_ptr + flat, mask=valid, other=float("-inf"))
    _, _, p_a, p_b = _merge_weights(lse_a, lse_b)
    delta = tl.zeros([BLOCK_M], tl.float32)  # Σ_D dO ⊙ (o_a − o_b)
    for start in range(0, head_dim, BLOCK_D):
        dims = start + tl.arange(0, BLOCK_D)
        ok = valid[:, None] & (dims < head_dim)[None, :]
        o_a = _load_side(o_a_ptr, n, rows, stride_oa_n, stride_oa_l, dims, ok, lse_a)
        o_b = _load_side(o_b_ptr, n, rows, stride_ob_n, stride_ob_l, dims, ok, lse_b)
        do_src = do_ptr + n[:, None] * stride_do_n + rows[:, None] * stride_do_l + dims[None, :]
        do = tl.load(do_src, mask=ok, other=0.0).to(tl.float32)
        delta += tl.sum(do * (o_a - o_b), axis=1)
        do_a_dst = do_a_ptr + n[:, None] * stride_doa_n + rows[:, None] * stride_doa_l + dims[None, :]
        do_b_dst = do_b_ptr + n[:, None] * stride_dob_n + rows[:, None] * stride_dob_l + dims[None, :]
        tl.store(do_a_dst, (do * p_a[:, None]).to(do_a_ptr.dtype.element_ty), mask=ok)
        tl.store(do_b_dst, (do * p_b[:, None]).to(do_b_ptr.dtype.element_ty), mask=ok)
    dlse = tl.zeros([BLOCK_M], tl.float32)
    if HAS_DLSE:
        dlse = tl.load(dlse_ptr + flat, mask=valid, other=0.0)
    tl.store(dlse_a_ptr + flat, p_a * (p_b * delta + dlse), mask=valid)
    tl.store(dlse_b_ptr + flat, p_b * (dlse - p_a * delta), mask=valid)


# ----------------------------------------------------------------------------- host side


def check_merge_args(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Validate the two sides, with errors naming the argument at fault."""
    named = (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in named:
        if t.device != o_a.device:
            raise ValueError(f"{name} is on {t.device} but o_a is on {o_a.device}: all four must be on one device")
    check_float_dtype("o_a", o_a)
    check_float_dtype("o_b", o_b)
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 (as flash_attention(..., return_lse=True) returns it), "
                            f"got {t.dtype}")
    if o_a.dim() < 2:
        raise ValueError(f"o_a must have shape (..., L, D), got {tuple(o_a.shape)}")
    if o_b.shape != o_a.shape:
        raise ValueError(f"o_b has shape {tuple(o_b.shape)} but o_a has {tuple(o_a.shape)}: they must be equal")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.shape != o_a.shape[:-1]:
            raise ValueError(f"{name} must have shape o_a.shape[:-1] = {tuple(o_a.shape[:-1])}, "
                             f"got {tuple(t.shape)}")


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """An input ``x`` (..., L, D) as (N, L, D) with the last dim contiguous: a view where the strides allow it,
    else a copy."""
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        x = x.contiguous()
    return x.reshape(-1, *x.shape[-2:])


def _out_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """An output ``x`` (..., L, D) or (..., L) as (N, L, D) or (N, L): always a view (what the kernel writes must
    land in ``x``)."""
    rest = x.shape[-2:] if name == "o" else x.shape[-1:]
    if name == "o" and x.stride(-1) != 1 and x.shape[-1] > 1:  # (the LSE's rows are read through their stride)
        raise ValueError(f"{name}: the merge writes rows whose last dim has stride 1, got strides {x.stride()}")
    try:
        return x.view(-1, *rest)
    except RuntimeError as err:
        raise ValueError(f"{name}: its leading dims must flatten into one without a copy, got shape "
                         f"{tuple(x.shape)} and strides {x.stride()}") from err


def _grid(o: torch.Tensor, block_m: int) -> tuple[int]:
    return (o.shape[0] * triton.cdiv(o.shape[1], block_m),)


def merge_states_into(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
    o: torch.Tensor, lse: torch.Tensor,
) -> None:
    """Write the merge of two checked sides into ``o`` (..., L, D) and ``lse`` (..., L) fp32 (no autograd).

    ``o``/``lse`` may be ``o_a``/``lse_a`` themselves (an in-place running merge: each element is read before it
    is written, by the same program) or views such as sequence slices of larger tensors, as long as their
    leading dims flatten into one without a copy (a ValueError otherwise).
    """
    if lse.numel() == 0:
        return
    if not runs_kernels(o_a):
        merged_o, merged_lse = merge_torch(o_a, lse_a, o_b, lse_b)
        o.copy_(merged_o)
        lse.copy_(merged_lse)
        return
    rows_a, rows_b, rows_o = _as_rows(o_a), _as_rows(o_b), _out_rows(o, "o")
    lse_rows_a, lse_rows_b = (x.reshape(-1, x.shape[-1]) for x in (lse_a, lse_b))
    lse_rows = _out_rows(lse, "lse")
    block_m, block_d = merge_tiles(o.shape[-1])
    launch(
        _merge_fwd_kernel, _grid(rows_o, block_m),
        (rows_a, lse_rows_a, rows_b, lse_rows_b, rows_o, lse_rows,
         rows_a.stride(0), rows_a.stride(1), rows_b.stride(0), rows_b.stride(1), rows_o.stride(0), rows_o.stride(1),
         *lse_rows_a.stride(), *lse_rows_b.stride(), *lse_rows.stride(),
         rows_o.shape[0], rows_o.shape[1], rows_o.shape[2]),
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=MERGE_NUM_WARPS,
    )


def merge_backward(
    do: torch.Tensor, dlse: torch.Tensor | None, o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
    lse_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(do_a, dlse_a, do_b, dlse_b)`` of ``merge_attention_states`` (module docstring), each like its input."""
    if not runs_kernels(o_a):
        return merge_backward_torch(do, dlse, o_a, lse_a, o_b, lse_b)
    # Contiguous (not empty_like, which keeps a permuted input's strides): the kernel writes them as rows.
    do_a = torch.empty(o_a.shape, dtype=o_a.dtype, device=o_a.device)
    do_b = torch.empty(o_b.shape, dtype=o_b.dtype, device=o_b.device)
    dlse_a = torch.empty(lse_a.shape, dtype=torch.float32, device=lse_a.device)
    dlse_b = torch.empty_like(dlse_a)
    if dlse_a.numel() == 0:
        return do_a, dlse_a.zero_(), do_b, dlse_b.zero_()
    rows_a, rows_b, rows_do = _as_rows(o_a), _as_rows(o_b), _as_rows(do)
    rows_da, rows_db = _out_rows(do_a, "o"), _out_rows(do_b, "o")
    lse_a, lse_b = lse_a.contiguous(), lse_b.contiguous()
    if dlse is not None:
        dlse = dlse.float().contiguous()
    block_m, block_d = merge_tiles(o_a.shape[-1])
    launch(
        _merge_bwd_kernel, _grid(rows_a, block_m),
        (rows_a, lse_a, rows_b, lse_b, rows_do, dlse, rows_da, dlse_a, rows_db, dlse_b,
         rows_a.stride(0), rows_a.stride(1), rows_b.stride(0), rows_b.stride(1), rows_do.stride(0), rows_do.stride(1),
         rows_da.stride(0), rows_da.stride(1), rows_db.stride(0), rows_db.stride(1),
         rows_a.shape[0], rows_a.shape[1], rows_a.shape[2]),
        HAS_DLSE=dlse is not None, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=MERGE_NUM_WARPS,
    )
    return do_a, dlse_a, do_b, dlse_b


# ----------------------------------------------------------------------------- the PyTorch path


def merge_weights_torch(lse_a: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lse, p_a, p_b)``: ``_merge_weights`` in PyTorch ops (empty sides weigh 0, an empty row gives −inf)."""
    m = torch.maximum(lse_a, lse_b)
    safe = torch.where(m.abs() == float("inf"), 0.0, m)  # the core's safe_max: never inf − inf
    e_a = torch.where(lse_a == float("-inf"), 0.0, torch.exp(lse_a - safe))
    e_b = torch.where(lse_b == float("-inf"), 0.0, torch.exp(lse_b - safe))
    d = e_a + e_b
    inv_d = torch.where(d == 0.0, 0.0, 1.0 / d)
    return torch.where(d == 0.0, float("-inf"), m + torch.log(d)), e_a * inv_d, e_b * inv_d


def _side_torch(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    return torch.where((lse == float("-inf")).unsqueeze(-1), 0.0, o.float())


def merge_torch(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """``(o, lse)`` of the merge in PyTorch fp32 ops: the path of CPU tensors without the interpreter."""
    lse, p_a, p_b = merge_weights_torch(lse_a, lse_b)
    o = _side_torch(o_a, lse_a) * p_a.unsqueeze(-1) + _side_torch(o_b, lse_b) * p_b.unsqueeze(-1)
    return o.to(torch.promote_types(o_a.dtype, o_b.dtype)), lse


def merge_backward_torch(do, dlse, o_a, lse_a, o_b, lse_b):
    """``merge_backward`` in PyTorch fp32 ops."""
    _, p_a, p_b = merge_weights_torch(lse_a, lse_b)
    do = do.float()
    delta = (do * (_side_torch(o_a, lse_a) - _side_torch(o_b, lse_b))).sum(-1)
    dlse = torch.zeros_like(delta) if dlse is None else dlse.float()
    do_a, do_b = (do * p_a.unsqueeze(-1)).to(o_a.dtype), (do * p_b.unsqueeze(-1)).to(o_b.dtype)
    return do_a, p_a * (p_b * delta + dlse), do_b, p_b * (dlse - p_a * delta)


# ----------------------------------------------------------------------------- autograd and the public function


class _MergeAttentionStates(torch.autograd.Function):
    """``(o, lse)`` of two sides; differentiable in both outputs and the four inputs (module docstring)."""

    @staticmethod
    def forward(ctx, o_a, lse_a, o_b, lse_b):
        o = torch.empty(o_a.shape, dtype=torch.promote_types(o_a.dtype, o_b.dtype), device=o_a.device)
        lse = torch.empty(lse_a.shape, dtype=torch.float32, device=o_a.device)
        merge_states_into(o_a, lse_a, o_b, lse_b, o, lse)
        ctx.save_for_backward(o_a, lse_a, o_b, lse_b)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        o_a, lse_a, o_b, lse_b = ctx.saved_tensors
        if do is None:
            do = torch.zeros(o_a.shape, dtype=torch.promote_types(o_a.dtype, o_b.dtype), device=o_a.device)
        return merge_backward(do, dlse, o_a, lse_a, o_b, lse_b)


def merge_attention_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention results over disjoint key sets into the attention over their union.

    ``lse = logaddexp(lse_a, lse_b)`` and ``o = e^(lse_a − lse) · o_a + e^(lse_b − lse) · o_b``, in fp32
    (``flashlite.attention.merge``). Attending keys ``[0, n)`` and ``[n, Lk)`` separately with
    ``flash_attention(..., return_lse=True)`` and merging gives attention over all ``Lk`` keys.

    Args:
        o_a, o_b: (..., L, D) outputs of the two parts, float32, float16 or bfloat16 (the two may differ), on one
            device; the last dim is read contiguous (other strides in place).
        lse_a, lse_b: (..., L) float32 natural-log log-sum-exps of each row's scores over its part, ``−inf`` for
            a row that saw no key there (that side is then neutral: its ``o`` is not used).

    Returns:
        ``(o, lse)``: o (..., L, D) in the promoted dtype of o_a and o_b, lse (..., L) float32. A row empty on
        both sides gives ``o = 0``, ``lse = −inf``.

    Differentiable in all four inputs, through both outputs (no NaN gradient for empty rows). CUDA tensors run a
    Triton kernel; CPU tensors run it through Triton's interpreter under ``TRITON_INTERPRET=1``, else PyTorch
    operations with the same formulas.

    Raises:
        TypeError: an argument that is not a tensor, o of an unsupported dtype, lse not float32.
        ValueError: tensors on different devices, o_b's shape differing from o_a's, lse shapes other than
            o_a.shape[:-1], o with fewer than 2 dims.
    """
    check_merge_args(o_a, lse_a, o_b, lse_b)
    return _MergeAttentionStates.apply(o_a, lse_a, o_b, lse_b)
