"""Attention sinks: one extra logit per head whose value vector is zeros (gpt-oss's ``s_aux``).

The softmax of a row runs over its scores and the head's sink, ``[s_0 .. s_{Lk-1}, sink]``, and the sink's
column is dropped before ``P V``. So ``o = Σ_j e^(s_j) v_j / (Σ_j e^(s_j) + e^(sink))`` and the row's
log-sum-exp grows to ``logaddexp(lse, sink)``. That is the merge of two online-softmax states
(``flashlite.core.online_softmax``): the row's ``(o, lse)`` from the kernels, and the sink's, whose output is 0.
Merged in fp32 after the forward (every kernel and path gets sinks the same way, and autograd gives
``d sink = -Σ_i p_sink,i · δ_i`` through it), at the cost of one pass over ``o``.
"""

from __future__ import annotations

import torch


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """``sinks``: None, or a floating (H,) tensor on q's device (``H`` = q's heads)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a tensor of shape (H,), got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor, got dtype {sinks.dtype}")
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must have shape (H,) = ({q.shape[1]},), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device}, q on {q.device}: they must be on the same device")


def merge_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of (B, H, Lq, D) / (B, H, Lq) attention with each head's sink added to every row's softmax.

    ``lse' = logaddexp(lse, sink)``, ``o' = e^(lse - lse') o`` in fp32, rounded to o's dtype. A row that saw no
    key (``lse = -inf``) keeps ``o = 0`` and gets ``lse' = sink``.
    """
    sink = sinks.float().view(1, -1, 1)
    merged = torch.logaddexp(lse, sink)
    weight = torch.exp(lse - merged)
    return (o.float() * weight.unsqueeze(-1)).to(o.dtype), merged
