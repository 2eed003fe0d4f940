"""Layers built on ``flashlite.flash_attention``; no kernel code lives here.

``MultiheadAttention`` is the usual projection → split heads → attention →
merge heads → projection, with one fused input projection for Q, K and V. The
heads are split by ``einops.rearrange`` into (B, H, L, D) *views* of the
projection's output (the head dim keeps stride 1, so ``flash_attention`` reads
them in place), and merged back from the attention output, which comes out in
(B, L, H, D) memory order, again without a copy.

Masks follow ``flashlite.masked_softmax`` and ``scaled_dot_product_attention``:
a boolean mask is **True = keep**. That includes ``key_padding_mask``, where
``torch.nn.MultiheadAttention`` uses the opposite (True = ignore): pass
``~mask`` when porting code from it.

Devices: CUDA runs flashlite's kernels; CPU tensors run them through Triton's
interpreter under ``TRITON_INTERPRET=1``, else flashlite's PyTorch path (fp32,
plain autograd), so the layer trains on CPU as it is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .attention.api import flash_attention, flash_attention_varlen
from .attention.tuning import MAX_HEAD_DIM, MIN_HEAD_DIM
from .core.checks import check_flag, check_softcap, check_window_size

__all__ = ["MultiheadAttention", "alibi_slopes"]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's slopes for ``num_heads`` heads (Press et al., 2022), fp32 (H,) on the CPU.

    For a power of two ``n`` the geometric sequence ``2^(-8 i / n)``, i = 1..n (8 heads: 1/2, 1/4, ... 1/256);
    otherwise the slopes of the largest power of two below ``n``, then every other slope of twice that many.
    Example: 12 heads: the 8 slopes of 8 heads, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (odd ones of 16 heads).
    """
    if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads <= 0:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]

    base = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(base) + geometric(2 * base)[0::2][: num_heads - base]
    return torch.tensor(slopes, dtype=torch.float32)


class MultiheadAttention(nn.Module):
    """Multi-head (or grouped-query) attention on ``flashlite.flash_attention``.

    Weights: ``qkv`` is one ``Linear(E, (H + 2·H_kv)·D)`` whose output rows are
    ``[Q (H·D) | K (H_kv·D) | V (H_kv·D)]``, each head's D features together
    (``(h d)`` order); ``out_proj`` is ``Linear(E, E)``. ``D = E / H``.
    Self-attention runs the fused projection once on ``x``; cross-attention
    (``kv`` given) applies the Q rows of the same weight to ``x`` and the K/V
    rows to ``kv``, so one set of weights serves both uses.

    Args:
        embed_dim: E, the model width of ``x``, ``kv`` and the output.
        num_heads: H query heads; must divide ``embed_dim``, and the head dim
            ``embed_dim // num_heads`` must lie in [16, 256] (flash_attention's range).
        num_kv_heads: H_kv key/value heads (GQA/MQA); must divide ``num_heads``.
            Default ``num_heads`` (plain multi-head attention). K/V heads are
            shared by ``num_heads // num_kv_heads`` query heads without being copied.
        causal: causal self-attention. Aligned bottom-right as in
            ``flash_attention``: query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq``
            (the usual lower triangle when Lq == Lk).
        bias: biases in both projections.
        softcap: None, or a float > 0: logit softcapping, ``softcap · tanh(s / softcap)``
            of the scaled scores (``flash_attention``'s ``softcap``, as Gemma-2).
        window_size: None, or ``(left, right)`` ints >= -1: a sliding window
            (``flash_attention``'s ``window_size``; with ``causal``, ``(W, 0)`` is
            Mistral's window of W keys before each query).
        alibi: ALiBi with the paper's slopes for ``num_heads`` (``alibi_slopes``): each score
            minus ``slope_h · |i + Lk - Lq - j|`` (``flash_attention``'s ``alibi_slopes``). Fixed,
            fp32 whatever the parameters' dtype, not in the state dict.
        sinks: learnable attention sinks (``self.sinks``, (H,), zeros at first): one
            extra logit per head in every row's softmax, with a zero value vector
            (``flash_attention``'s ``sinks``, as gpt-oss).
        dropout: only 0.0: flashlite's attention has no dropout on the
            attention weights. Any other value raises ValueError.
        device, dtype: of the parameters, as for ``torch.nn.Linear``.
    """

    def __init__(
        self, embed_dim: int, num_heads: int, *, num_kv_heads: int | None = None, causal: bool = False,
        bias: bool = True, softcap: float | None = None, window_size: tuple[int, int] | None = None,
        alibi: bool = False, sinks: bool = False, dropout: float = 0.0,
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if num_kv_heads is None:
            num_kv_heads = num_heads
        causal, bias, sinks = check_flag("causal", causal), check_flag("bias", bias), check_flag("sinks", sinks)
        alibi = check_flag("alibi", alibi)
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        head_dim = embed_dim // num_heads
        if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
            raise ValueError(
                f"head dim embed_dim // num_heads = {embed_dim} // {num_heads} = {head_dim} is not supported: "
                f"it must lie in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
            )
        if dropout != 0.0:
            raise ValueError(
                f"dropout={dropout!r} is not supported: flashlite's attention has no dropout, only dropout=0.0"
            )
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.causal = causal
        self.dropout = 0.0
        factory = dict(device=device, dtype=dtype)
        self.qkv = nn.Linear(embed_dim, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.sinks = nn.Parameter(torch.zeros(num_heads, **factory)) if sinks else None
        self.softcap = check_softcap(softcap)
        self.window_size = check_window_size(window_size)
        self.alibi = alibi
        self._alibi_slopes: dict[torch.device, torch.Tensor] = {}  # by device: fixed values, built once on each

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"causal={self.causal}, softcap={self.softcap}, window_size={self.window_size}, alibi={self.alibi}, "
            f"sinks={self.sinks is not None}"
        )

    def forward(
        self, x: torch.Tensor, kv: torch.Tensor | None = None, *,
        key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """Attention of ``x`` over itself, or over ``kv`` (cross-attention), or of each sequence of a packed batch.

        Args:
            x: (B, Lq, E), the queries (and keys/values when ``kv`` is None).
            kv: None, or (B, Lk, E): the keys/values source for cross-attention.
            key_padding_mask: None, or (B, Lk) bool, **True = keep** (a real token),
                False = padding. This is the opposite of ``torch.nn.MultiheadAttention``,
                where True marks a key to ignore: pass ``~mask`` when porting.
            attn_mask: None, or broadcastable to (B, H, Lq, Lk): bool (True = keep)
                or float (added to the scaled scores). Combined with
                ``key_padding_mask`` and ``causal`` (a key counts only if all allow it).
            cu_seqlens: None, or int32 (B + 1,): ``x`` is then a packed batch (total, E) of B sequences of
                different lengths (``flash_attention_varlen``'s convention), each attending to itself alone;
                no ``kv`` or masks. Returns (total, E).
            max_seqlen: with ``cu_seqlens``, the longest sequence (read from ``cu_seqlens`` on the host when
                None: one device synchronisation).

        Returns:
            (B, Lq, E) in x's dtype. A query that may see no key at all (every key
            masked) gets zero attention output, so its result is ``out_proj``'s bias.
        """
        if cu_seqlens is not None:
            return self._packed_forward(x, kv, key_padding_mask, attn_mask, cu_seqlens, max_seqlen)
        batch, seqlen_q = self._check_input("x", x)
        if kv is None:
            seqlen_k = seqlen_q
            q, k, v = self.qkv(x).split(self._split_sizes(), dim=-1)  # (B, L, H·D), (B, L, H_kv·D) x 2
        else:
            kv_batch, seqlen_k = self._check_input("kv", kv)
            if kv_batch != batch:
                raise ValueError(f"kv has batch size {kv_batch} but x has {batch}")
            q_size = self.num_heads * self.head_dim
            weight_q, weight_kv = self.qkv.weight.split([q_size, self.qkv.out_features - q_size])
            bias_q, bias_kv = (None, None) if self.qkv.bias is None else self.qkv.bias.split(
                [q_size, self.qkv.out_features - q_size])
            q = F.linear(x, weight_q, bias_q)  # (B, Lq, H·D)
            k, v = F.linear(kv, weight_kv, bias_kv).chunk(2, dim=-1)  # (B, Lk, H_kv·D) x 2
        mask = self._combine_masks(key_padding_mask, attn_mask, batch, seqlen_q, seqlen_k, x.device)

        # Views, no copies: the last dim splits into (heads, head_dim) with head_dim at stride 1.
        q = rearrange(q, "b l (h d) -> b h l d", h=self.num_heads)  # (B, H, Lq, D)
        k = rearrange(k, "b l (h d) -> b h l d", h=self.num_kv_heads)  # (B, H_kv, Lk, D)
        v = rearrange(v, "b l (h d) -> b h l d", h=self.num_kv_heads)  # (B, H_kv, Lk, D)
        o = flash_attention(q, k, v, causal=self.causal, attn_mask=mask, softcap=self.softcap,
                            window_size=self.window_size, alibi_slopes=self._slopes(x.device),
                            sinks=self.sinks)  # (B, H, Lq, D)
        o = rearrange(o, "b h l d -> b l (h d)")  # (B, Lq, E); a view when o is in (B, L, H, D) order
        return self.out_proj(o)

    # ------------------------------------------------------------------------- helpers

    def _packed_forward(self, x, kv, key_padding_mask, attn_mask, cu_seqlens, max_seqlen) -> torch.Tensor:
        """``forward`` on a packed (total, E) batch: ``flash_attention_varlen`` of each sequence."""
        if kv is not None or key_padding_mask is not None or attn_mask is not None:
            raise ValueError("cu_seqlens (a packed batch) takes no kv, key_padding_mask or attn_mask: each "
                             "sequence attends to itself")
        if x.dim() != 2 or x.shape[1] != self.embed_dim:
            raise ValueError(f"x must be (total, embed_dim={self.embed_dim}) with cu_seqlens, got {tuple(x.shape)}")
        if max_seqlen is None:
            max_seqlen = int(cu_seqlens.diff().max()) if cu_seqlens.numel() > 1 else 0
        q, k, v = self.qkv(x).split(self._split_sizes(), dim=-1)  # (total, H·D), (total, H_kv·D) x 2
        q = rearrange(q, "t (h d) -> t h d", h=self.num_heads)
        k = rearrange(k, "t (h d) -> t h d", h=self.num_kv_heads)
        v = rearrange(v, "t (h d) -> t h d", h=self.num_kv_heads)
        o = flash_attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=self.causal,
                                   softcap=self.softcap, window_size=self.window_size,
                                   alibi_slopes=self._slopes(x.device), sinks=self.sinks)  # (total, H, D)
        return self.out_proj(rearrange(o, "t h d -> t (h d)"))

    def _slopes(self, device: torch.device) -> torch.Tensor | None:
        """The ALiBi slopes on ``device`` (None without ALiBi)."""
        if not self.alibi:
            return None
        if device not in self._alibi_slopes:
            self._alibi_slopes[device] = alibi_slopes(self.num_heads).to(device)
        return self._alibi_slopes[device]

    def _split_sizes(self) -> list[int]:
        kv_size = self.num_kv_heads * self.head_dim
        return [self.num_heads * self.head_dim, kv_size, kv_size]

    def _check_input(self, name: str, t: torch.Tensor) -> tuple[int, int]:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3 or t.shape[-1] != self.embed_dim:
            raise ValueError(
                f"{name} must have shape (batch, seqlen, embed_dim={self.embed_dim}), got {tuple(t.shape)}"
            )
        return t.shape[0], t.shape[1]

    def _combine_masks(
        self, key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
        batch: int, seqlen_q: int, seqlen_k: int, device: torch.device,
    ) -> torch.Tensor | None:
        """One mask for flash_attention: ``attn_mask`` and ``key_padding_mask`` (as (B, 1, 1, Lk)), both True = keep."""
        full = (batch, self.num_heads, seqlen_q, seqlen_k)
        if attn_mask is not None:
            if not isinstance(attn_mask, torch.Tensor):
                raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
            try:
                ok = torch.broadcast_shapes(attn_mask.shape, full) == full
            except RuntimeError:
                ok = False
            if not ok:
                raise ValueError(
                    f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, Lq, Lk) = {full}"
                )
        if key_padding_mask is None:
            return attn_mask
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError(
                "key_padding_mask must be a bool tensor (True = keep, the opposite of torch.nn.MultiheadAttention), "
                f"got {getattr(key_padding_mask, 'dtype', type(key_padding_mask).__name__)}"
            )
        if tuple(key_padding_mask.shape) != (batch, seqlen_k):
            raise ValueError(
                f"key_padding_mask must have shape (B, Lk) = {(batch, seqlen_k)}, got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but x is on {device}")
        keep = key_padding_mask[:, None, None, :]  # (B, 1, 1, Lk): flash_attention reads it once per key tile
        if attn_mask is None:
            return keep
        if attn_mask.dtype == torch.bool:
            return attn_mask & keep
        return torch.where(keep, attn_mask, float("-inf"))
