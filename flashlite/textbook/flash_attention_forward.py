"""Flash attention's forward, plainly: one query tile a program, a loop over K/V tiles, the scores never stored.

The online softmax of each query row runs over the K tiles as over blocks of a
row; ``online_update`` returns the factor ``alpha = e^(m_old - m_new)`` that
rescales the denominator, and the same factor rescales the output accumulator
``acc = sum_j e^(s_j - m) v_j`` (``rescale_accumulator``). At the end
``O = acc / d``. Scores are fp32 dots of the unscaled tiles, scaled in fp32.
``flashlite.flash_attention`` adds to this what the fast kernels need: TMA,
full tiles without mask arithmetic, skipped causal tiles, GQA packing, a
pipelined Hopper loop, masks, the backward.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..core.checks import check_flag, check_kernel_tensor, check_scale
from ..core.masking import apply_masks
from ..core.online_softmax import BASE2_UNITS, LOG2E, empty_state, normalize, online_update, rescale_accumulator
from ..core.runtime import launch
from ..core.tiles import dot

BLOCK_M, BLOCK_N = 64, 64  # query rows a program, keys a K/V tile (the interpreter: 16 and 16)
NUM_WARPS = 4


@triton.jit
def flash_attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, seqlen_q, seqlen_k, head_dim, qk_scale, group, stride_q, stride_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr,
):
    # q, o: contiguous (B·H, Lq, D); k, v: contiguous (B·H_kv, Lk, D), query head bh reading K/V head bh // group.
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q_ok = (rows < seqlen_q)[:, None] & (dims < head_dim)[None, :]
    q = tl.load(q_ptr + bh * stride_q + rows[:, None] * head_dim + dims[None, :], mask=q_ok, other=0.0)
    k_base = (bh // group) * stride_k
    m, d = empty_state(BLOCK_M)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, seqlen_k, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        kv_ok = (keys < seqlen_k)[:, None] & (dims < head_dim)[None, :]
        offsets = k_base + keys[:, None] * head_dim + dims[None, :]
        k = tl.load(k_ptr + offsets, mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + offsets, mask=kv_ok, other=0.0)
        s = dot(q, tl.trans(k), None, DOT_PRECISION, UPCAST_DOTS) * qk_scale  # base-2 logits, in fp32
        s = apply_masks(s, rows, keys, seqlen_q, seqlen_k, None, 0, 0, IS_CAUSAL, False, False, 1.0)
        m, d, p, alpha = online_update(m, d, s, BASE2_UNITS)
        acc = dot(p.to(v.dtype), v, rescale_accumulator(acc, alpha), DOT_PRECISION, UPCAST_DOTS)
    o = normalize(acc, d, True)  # a row that saw no key (causal, Lq > Lk): zeros
    tl.store(o_ptr + bh * stride_q + rows[:, None] * head_dim + dims[None, :], o.to(o_ptr.dtype.element_ty), mask=q_ok)


def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                            scale: float | None = None) -> torch.Tensor:
    """``softmax(q kᵀ · scale) v`` for q (B, H, Lq, D), k and v (B, H_kv, Lk, D), ``H % H_kv == 0``, D up to 256.

    ``causal`` aligns bottom-right (query ``i`` sees keys ``j <= i + Lk - Lq``), as ``flashlite.flash_attention``;
    rows that see no key give zeros. fp32 computes with IEEE fp32 dots. Forward only.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_kernel_tensor(name, t)
        if t.dim() != 4 or t.dtype != q.dtype or t.shape[3] != q.shape[3]:
            raise ValueError(f"{name} must be (B, H, L, D) of q's dtype and head dim, got {tuple(t.shape)} {t.dtype}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"k and v must be (B, H_kv, Lk, D) with H_kv dividing H, got {tuple(k.shape)}, {tuple(v.shape)}")
    causal = check_flag("causal", causal)
    scale = check_scale(scale, 1.0 / math.sqrt(q.shape[3]))
    batch, n_heads, seqlen_q, head_dim = q.shape
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    o = torch.empty_like(qc)
    if o.numel():
        blocks = (BLOCK_M, BLOCK_N) if q.is_cuda else (16, 16)
        launch(flash_attention_forward_kernel, (triton.cdiv(seqlen_q, blocks[0]), batch * n_heads),
               (qc, kc, vc, o, seqlen_q, k.shape[2], head_dim, scale * LOG2E.value, n_heads // k.shape[1],
                seqlen_q * head_dim, k.shape[2] * head_dim),
               BLOCK_M=blocks[0], BLOCK_N=blocks[1], HEAD_DIM=max(16, triton.next_power_of_2(head_dim)), IS_CAUSAL=causal,
               DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
               UPCAST_DOTS=q.dtype == torch.bfloat16 and not q.is_cuda, num_warps=NUM_WARPS)
    return o
