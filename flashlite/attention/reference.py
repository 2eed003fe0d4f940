"""Attention in plain PyTorch (fp32, the L×L scores materialised): the path of tensors the kernels do not run on.

CPU tensors without ``TRITON_INTERPRET=1`` take these; they give the answers
the kernels give (the tests run both on the same inputs): rows that see no key
are 0 with gradient 0, a bias of any finite size behaves as in softmax.
"""

from __future__ import annotations

import torch


def attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, attn_mask: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None = None, softcap: float | None = None, window: tuple[int, int] | None = None,
    alibi: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same result in PyTorch fp32 ops (CPU without the interpreter); materialises the (Lq, Lk) scores.
    ``window``: a sliding window ``(left, right)``, -1 unbounded (causal folded in or not: both are applied);
    ``alibi``: (B, H) slopes (no gradient); ``sinks``: (H,), one more logit per row (differentiable)."""
    batch, n_heads, seqlen_q, head_dim = q.shape
    n_kv, seqlen_k, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    group = n_heads // n_kv
    qf = q.float().reshape(batch, n_kv, group, seqlen_q, head_dim)  # (B, H_kv, G, Lq, D): no K/V repeat
    s = (qf @ k.float().unsqueeze(2).transpose(-1, -2) * scale).reshape(batch, n_heads, seqlen_q, seqlen_k)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
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
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Lq); -inf for a row that sees no key
    # The weights from softmax (which subtracts the row's maximum), not e^(s - lse): under a bias of -1e9 the
    # LSE has lost log d to rounding, and e^(s - lse) would sum to the key count. A row that sees no key: 0,
    # with gradient 0 (softmax of its -inf would give NaN, and NaN gradients through it).
    empty = (lse == float("-inf")).unsqueeze(-1)
    if sinks is not None:  # one more column per row, the head's sink, dropped before P V
        sink = sinks.float().view(1, n_heads, 1, 1).expand(batch, n_heads, seqlen_q, 1)
        lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]  # an empty row: all on the sink
    else:
        p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    p = p.reshape(batch, n_kv, group, seqlen_q, seqlen_k)
    o = (p @ v.float().unsqueeze(2)).reshape(batch, n_heads, seqlen_q, head_dim_v)
    return o.to(q.dtype), lse


def attention_backward_torch(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dlse: torch.Tensor | None,
    causal: bool, scale: float, mask: torch.Tensor | None, mask_is_bool: bool, mask_needs_grad: bool,
    softcap: float | None = None, window: tuple[int, int] | None = None, alibi: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The same gradients by autograd through ``attention_torch`` (fp32, scores materialised):
    ``(dq, dk, dv, dmask, dsinks)``."""
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    if mask is not None:
        mask = mask.detach().bool() if mask_is_bool else mask.detach().float()  # broadcast_mask gives bool as uint8
        if mask_needs_grad:
            inputs.append(mask.requires_grad_())
    if sinks is not None:
        sinks = sinks.detach().requires_grad_()
    with torch.enable_grad():
        o, lse = attention_torch(*inputs[:3], causal, scale, mask, softcap=softcap, window=window, alibi=alibi,
                                 sinks=sinks)
        outputs, grad_outputs = [o], [do]
        if dlse is not None:
            outputs.append(lse)
            grad_outputs.append(dlse.float())
        wrt = inputs + ([sinks] if sinks is not None else [])
        grads = torch.autograd.grad(outputs, wrt, grad_outputs, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, wrt)]
    dsinks = grads[-1] if sinks is not None else None
    return grads[0], grads[1], grads[2], grads[3] if mask_needs_grad else None, dsinks
