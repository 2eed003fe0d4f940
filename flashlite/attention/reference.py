"""Attention in plain PyTorch (fp32, the scores summed in fp64; the L×L scores materialised): the path of tensors
the kernels do not run on.

CPU tensors without ``TRITON_INTERPRET=1`` take these; they give the answers
the kernels give (the tests run both on the same inputs): rows that see no key
are 0 with gradient 0, a bias of any finite size behaves as in softmax.
"""

from __future__ import annotations

import torch


def _logits(
    q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, attn_mask: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None, softcap: float | None, window: tuple[int, int] | None,
    alibi: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(s, t)``: the (B, H, Lq, Lk) fp32 logits, ``-inf`` where hidden, and under a softcap ``t = tanh(scaled
    scores / softcap)`` (the backward's ``1 - t²``; else None). K is read per GQA group, never repeated."""
    batch, n_heads, seqlen_q, head_dim = q.shape
    n_kv, seqlen_k = k.shape[1], k.shape[2]
    group = n_heads // n_kv
    # The scaled scores summed in float64 and rounded once to fp32: an fp32 sum of D products is off by a few ulps
    # of the logits, which a sharp softmax (logits of ~100) passes on to the output and gradients, more than
    # FlashAttention's rule allows over PyTorch's own fp32 error when the summation orders differ.
    qd = q.double().reshape(batch, n_kv, group, seqlen_q, head_dim)  # (B, H_kv, G, Lq, D): no K/V repeat
    s = (qd @ k.double().unsqueeze(2).transpose(-1, -2) * scale).float().reshape(batch, n_heads, seqlen_q, seqlen_k)
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = softcap * t
    # Keys [0, len_b) of each element (len_b = Lk without a cache); causal, the window and ALiBi aligned
    # bottom-right against len_b: query i's diagonal is key i + len_b - Lq.
    used = seqlen_k if cache_seqlens is None else cache_seqlens.to(device=q.device, dtype=torch.long).view(
        batch, 1, 1, 1)
    key_idx = torch.arange(seqlen_k, device=q.device)
    diagonal = torch.arange(seqlen_q, device=q.device)[:, None] + used - seqlen_q  # (Lq, 1) or (B, 1, Lq, 1)
    if alibi is not None:
        s = s - alibi.detach().float().view(batch, n_heads, 1, 1) * (diagonal - key_idx).abs()
    if cache_seqlens is not None or causal or window is not None:
        keep = key_idx < used
        if causal:
            keep = keep & (key_idx <= diagonal)
        if window is not None:
            left, right = window
            if left >= 0:
                keep = keep & (key_idx >= diagonal - left)
            if right >= 0:
                keep = keep & (key_idx <= diagonal + right)
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.float()
    return s, t


def _probabilities(s: torch.Tensor, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P, lse)`` of logits ``s`` (B, H, Lq, Lk), with each head's sink as one more logit of every row."""
    batch, n_heads, seqlen_q, _ = s.shape
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Lq); -inf for a row that sees no key
    # The weights from softmax (which subtracts the row's maximum), not e^(s - lse): under a bias of -1e9 the
    # LSE has lost log d to rounding, and e^(s - lse) would sum to the key count. A row that sees no key: 0.
    empty = (lse == float("-inf")).unsqueeze(-1)
    if sinks is not None:  # one more column per row, the head's sink, dropped before P V
        sink = sinks.float().view(1, n_heads, 1, 1).expand(batch, n_heads, seqlen_q, 1)
        lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]  # an empty row: all on the sink
    else:
        p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return p, lse


def attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, attn_mask: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None = None, softcap: float | None = None, window: tuple[int, int] | None = None,
    alibi: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same result in PyTorch fp32 ops (CPU without the interpreter); materialises the (Lq, Lk) scores.
    ``attn_mask`` bool (True = keep) or float, broadcastable; ``window``: a sliding window ``(left, right)``, -1
    unbounded (causal folded in or not: both are applied); ``alibi``: (B, H) slopes; ``sinks``: (H,), one more
    logit per row. Returns ``(o, lse)`` (o in q's dtype, lse fp32)."""
    batch, n_heads, seqlen_q, _ = q.shape
    n_kv, seqlen_k, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    s, _ = _logits(q, k, causal, scale, attn_mask, cache_seqlens, softcap, window, alibi)
    p, lse = _probabilities(s, sinks)
    p = p.reshape(batch, n_kv, n_heads // n_kv, seqlen_q, seqlen_k)
    o = (p @ v.float().unsqueeze(2)).reshape(batch, n_heads, seqlen_q, head_dim_v)
    return o.to(q.dtype), lse


def attention_backward_torch(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dlse: torch.Tensor | None,
    causal: bool, scale: float, mask: torch.Tensor | None, mask_is_bool: bool, mask_needs_grad: bool,
    softcap: float | None = None, window: tuple[int, int] | None = None, alibi: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The gradients of ``attention_torch``'s ``(o, lse)``, written out in fp32 (the scores materialised):
    ``(dq, dk, dv, dmask, dsinks)``, dq/dk/dv in the inputs' dtypes, dmask (B, H, Lq, Lk) fp32 (``mask``
    broadcast so, bool as uint8), dsinks fp32. The kernels' formulas (``backward``'s docstring): ``dV = Pᵀ dO``,
    ``dP = dO Vᵀ``, ``dS = P ⊙ (dP - δ)`` with ``δ = rowsum(P ⊙ dP) - dLSE``; a softcap multiplies dS by
    ``1 - tanh²``; dQ and dK are ``dS K · scale`` and ``dSᵀ Q · scale``, summed over each GQA group; the sinks
    get ``-Σ e^(sink - lse) δ``. Explicit, so that it runs where autograd does not record (inside an op)."""
    batch, n_heads, seqlen_q, head_dim = q.shape
    n_kv, seqlen_k, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    group = n_heads // n_kv
    if mask is not None:
        mask = mask.bool() if mask_is_bool else mask.float()  # broadcast_mask gives bool as uint8
    s, t = _logits(q, k, causal, scale, mask, None, softcap, window, alibi)
    p, lse = _probabilities(s, sinks)
    kf, vf = (x.float().repeat_interleave(group, dim=1) for x in (k, v))  # (B, H, Lk, ·)
    dof = do.float()
    dv = (p.transpose(-1, -2) @ dof).reshape(batch, n_kv, group, seqlen_k, head_dim_v).sum(2)
    dp = dof @ vf.transpose(-1, -2)
    delta = (p * dp).sum(-1)  # rowsum(dO ⊙ O), from P itself
    if dlse is not None:
        delta = delta - dlse.float()
    ds = p * (dp - delta.unsqueeze(-1))
    ds_scores = ds if t is None else ds * (1.0 - t * t)
    dq = (ds_scores @ kf) * scale
    dk = ((ds_scores.transpose(-1, -2) @ q.float()) * scale).reshape(batch, n_kv, group, seqlen_k, head_dim).sum(2)
    dsinks = None
    if sinks is not None:
        dsinks = -(torch.exp(sinks.float().view(1, -1, 1) - lse) * delta).sum(dim=(0, 2))
    dmask = ds if mask_needs_grad else None
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask, dsinks


def _sequences(seqs: tuple[torch.Tensor, torch.Tensor]):
    """``(b, query rows, key rows)`` slices of each sequence of a packed batch (``cu_seqlens`` read on the host:
    this path runs on the CPU only)."""
    cu_q, cu_k = (c.tolist() for c in seqs)
    for b in range(len(cu_q) - 1):
        yield b, slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])


def attention_varlen_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: tuple[torch.Tensor, torch.Tensor], causal: bool,
    scale: float, softcap: float | None = None, window: tuple[int, int] | None = None,
    alibi: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_torch`` of each sequence of a packed batch: q (1, H, total_q, D), k/v (1, H_kv, total_k, ·),
    ``seqs = (cu_seqlens_q, cu_seqlens_k)``, ``alibi`` (B, H). Returns ``(o, lse)``, (1, H, total_q, Dv) and
    (1, H, total_q); rows of a sequence without keys are 0 (lse ``-inf``, or the sink)."""
    o = q.new_zeros((*q.shape[:3], v.shape[3]))
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    if sinks is not None:
        lse.copy_(sinks.detach().float().view(1, -1, 1).expand(lse.shape))
    for b, rows, keys in _sequences(seqs):
        if rows.stop > rows.start and keys.stop > keys.start:
            o[:, :, rows], lse[:, :, rows] = attention_torch(
                q[:, :, rows], k[:, :, keys], v[:, :, keys], causal, scale, None, None, softcap, window,
                None if alibi is None else alibi[b:b + 1], sinks)
    return o, lse


def attention_varlen_backward_torch(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dlse: torch.Tensor | None,
    seqs: tuple[torch.Tensor, torch.Tensor], causal: bool, scale: float, softcap: float | None = None,
    window: tuple[int, int] | None = None, alibi: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, torch.Tensor | None]:
    """``attention_backward_torch`` of each sequence of a packed batch (``attention_varlen_torch``'s layouts):
    ``(dq, dk, dv, None, dsinks)``. A sequence without keys passes its dLSE to the sinks alone."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dsinks = None if sinks is None else torch.zeros(sinks.shape, dtype=torch.float32, device=q.device)
    for b, rows, keys in _sequences(seqs):
        if rows.stop == rows.start:
            continue
        if keys.stop == keys.start:  # the LSE is the sink's alone: its gradient goes to the sink
            if sinks is not None and dlse is not None:
                dsinks += dlse[:, :, rows].float().sum(dim=(0, 2))
            continue
        dq[:, :, rows], dk_b, dv_b, _, dsinks_b = attention_backward_torch(
            do[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
            None if dlse is None else dlse[:, :, rows], causal, scale, None, False, False, softcap, window,
            None if alibi is None else alibi[b:b + 1], sinks)
        dk[:, :, keys] += dk_b
        dv[:, :, keys] += dv_b
        if dsinks_b is not None:
            dsinks += dsinks_b
    return dq, dk, dv, None, dsinks
