"""A call's route, planned once: which kernels run it, on which tiles and grids, with which constexprs.

``Route`` is built from a checked call's tensors (their shapes, strides, dtypes, alignments) and options, and
holds the forward's launch (``forward_hopper.HopperForwardLaunch``, ``forward.TlForwardLaunch`` or
``split_kv.SplitLaunch``) and, from the first backward on, the backward's launches
(``backward.BackwardLaunch``, one per layout of dO). Calling ``Route.forward`` or ``Route.backward`` with
tensors of that signature binds them and launches: no eligibility check, tile choice or planner call is
repeated. ``flashlite.attention.api`` keeps the routes by signature and calls them from the one custom op
(``flashlite::flash_attention``) and its eager fast path alike.

Routes without kernels: tensors the kernels do not run on take ``reference``'s PyTorch path; a call with no
query row or no key launches nothing (rows that see no key give zeros, and the LSE is ``-inf``, or the sink).
"""

from __future__ import annotations

import torch

from ..core.runtime import runs_kernels
from .backward import BackwardLaunch
from .forward import TlForwardLaunch
from .forward_hopper import HopperForwardLaunch, wgmma_eligible
from .plan import hopper_varlen_enabled
from .reference import (
    attention_backward_torch, attention_torch, attention_varlen_backward_torch, attention_varlen_torch,
)
from .split_kv import SplitLaunch


def unpage(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """A paged (num_blocks, H_kv, page_size, D) cache as the contiguous (B, H_kv, max_blocks · page_size, D) one
    of the (B, max_blocks) ``block_table`` (a copy: the PyTorch path's)."""
    pages = cache[block_table.long()]  # (B, max_blocks, H_kv, page_size, D)
    batch, blocks, heads, page_size, dim = pages.shape
    return pages.transpose(1, 2).reshape(batch, heads, blocks * page_size, dim)


SPLIT_HAS_NO_BACKWARD = (
    "flashlite.flash_attention has no backward pass for split-K/V attention (num_splits > 1 or "
    "cache_seqlens given); call it with num_splits=1 and without cache_seqlens to train"
)


class Route:
    """The forward (and backward) of one call signature; see the module docstring.

    Built from checked (B, H, L, D) tensors whose head dim has stride 1 (v's head dim Dv may differ): ``mask``
    broadcast to (B, H, Lq, Lk) (``broadcast_mask``) or None; ``causal``, ``scale``, ``softcap`` and ``window``
    (``plan.visibility``'s) as the kernels take them; ``has_alibi``/``has_sinks``: calls bring (B, H) slopes
    (``plan.alibi_view``) and (H,) sinks; ``write_lse``: the forward returns the LSE; ``training``: the forward
    keeps what the backward needs (the LSE, and each row's ``(m, log d)`` under an additive mask);
    ``num_splits`` (resolved, >= 1) and ``has_cache_seqlens`` choose split-K/V. ``varlen = (sequences,
    max_seqlen_q, max_seqlen_k)``: a packed batch (``core.packed``) of (1, H, total, D) tensors, whose calls
    bring ``seqs = (cu_seqlens_q, cu_seqlens_k)`` (no mask, no split): it runs on the Hopper kernels where they
    apply (unless ``FLASHLITE_HOPPER_VARLEN=0``, ``plan.hopper_varlen_enabled``), else on the ``triton.language``
    ones. ``paged = (page_size, max_blocks)``: k, v are (num_blocks, H_kv, page_size, ·) pages whose calls bring
    a (B, max_blocks) ``block_table`` (split-K/V decoding, no backward).
    """

    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, mask_is_bool: bool,
        causal: bool, scale: float, softcap: float | None, window: tuple[int, int] | None, has_alibi: bool,
        has_sinks: bool, write_lse: bool, training: bool, num_splits: int, has_cache_seqlens: bool,
        varlen: tuple[int, int, int] | None = None, paged: tuple[int, int] | None = None,
    ):
        self.options = dict(causal=causal, scale=scale, softcap=softcap, window=window)
        self.mask_is_bool = mask_is_bool
        self.varlen, self.paged = varlen, paged
        self.split = num_splits != 1 or has_cache_seqlens
        batch, n_heads, seqlen_q, _ = q.shape
        self.lse_shape = (batch, n_heads, seqlen_q)
        self.head_dim_v = v.shape[3]
        # (m, log d) of each row apart from the LSE: the backward of an additive mask (see ``forward``).
        self.keeps_row_stats = training and mask is not None and not mask_is_bool and not self.split
        self.torch_path = not runs_kernels(q)  # fixed at planning: a backward may run outside ``pytorch_path()``
        self.kernels = not self.torch_path and batch * n_heads * seqlen_q > 0 and k.shape[2] > 0
        self._backwards: dict = {}
        self.launch = None
        self.hopper = False  # the launch takes no mask and fills no row stats
        if not self.kernels:
            return
        variants = dict(softcap=softcap, window=window, has_alibi=has_alibi, has_sinks=has_sinks)
        write_lse = write_lse or training
        if varlen is not None and hopper_varlen_enabled() and wgmma_eligible(q, k, v, False, scale):
            self.launch = HopperForwardLaunch(q, k, v, causal, scale, write_lse, varlen=varlen, **variants)
            self.hopper = True
        elif varlen is not None:
            self.launch = TlForwardLaunch(q, k, v, causal, scale, None, False, write_lse, varlen=varlen, **variants)
        elif self.split:
            self.launch = SplitLaunch(q, k, v, mask, causal, scale, mask_is_bool, write_lse, num_splits,
                                      has_cache_seqlens, paged=paged, **variants)
        elif not self.keeps_row_stats and wgmma_eligible(q, k, v, mask is not None, scale):
            self.launch = HopperForwardLaunch(q, k, v, causal, scale, write_lse, **variants)
            self.hopper = True
        else:
            # Under an additive mask the rows' (m, log d) stay apart (a bias of -1e9 leaves no room for log d in
            # the LSE's fp32, and P recomputed from it would sum to the key count): the LSE is their sum.
            self.launch = TlForwardLaunch(q, k, v, causal, scale, mask, mask_is_bool,
                                          write_lse and not self.keeps_row_stats,
                                          write_stats=self.keeps_row_stats, **variants)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
        cache_seqlens: torch.Tensor | None, alibi: torch.Tensor | None, sinks: torch.Tensor | None,
        seqs: tuple[torch.Tensor, torch.Tensor] | None = None, block_table: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(o, lse, row_stats)``: o (B, H, Lq, Dv) in q's dtype, lse (B, H, Lq) fp32 natural-log (or None when
        neither written nor needed), row_stats (2, B, H, Lq) fp32 when ``keeps_row_stats``, else None."""
        if not self.kernels:
            return (*self._forward_without_kernels(q, k, v, mask, cache_seqlens, alibi, sinks, seqs, block_table),
                    None)
        launch = self.launch
        if self.hopper:
            return (*launch(q, k, v, alibi, sinks, seqs), None)
        if self.varlen is not None:
            return (*launch(q, k, v, None, alibi, sinks, seqs=seqs), None)
        if self.split:
            return (*launch(q, k, v, mask, cache_seqlens, alibi, sinks, block_table), None)
        if self.keeps_row_stats:
            row_stats = torch.empty((2, *self.lse_shape), dtype=torch.float32, device=q.device)
            o, _ = launch(q, k, v, mask, alibi, sinks, row_stats)
            return o, row_stats[0] + row_stats[1], row_stats
        return (*launch(q, k, v, mask, alibi, sinks), None)

    def _forward_without_kernels(self, q, k, v, mask, cache_seqlens, alibi, sinks, seqs, block_table):
        if not self.torch_path:  # no query row or no key: nothing to launch
            o = q.new_zeros((*q.shape[:3], self.head_dim_v))
            if sinks is not None:  # every row's softmax is the sink alone
                lse = sinks.detach().float().view(1, -1, 1).expand(self.lse_shape).contiguous()
            else:
                lse = torch.full(self.lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
            return o, lse
        if self.varlen is not None:
            return attention_varlen_torch(q, k, v, seqs, alibi=alibi, sinks=sinks, **self.options)
        if self.paged is not None:  # the pages gathered into one (B, H_kv, max_blocks · page_size, ·) cache
            k, v = (unpage(t, block_table) for t in (k, v))
        if mask is not None and self.mask_is_bool:
            mask = mask.bool()  # broadcast_mask views a boolean mask as uint8
        o, lse = attention_torch(q, k, v, attn_mask=mask, cache_seqlens=cache_seqlens, alibi=alibi, sinks=sinks,
                                 **self.options)
        return o, lse

    def backward(
        self, do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        o: torch.Tensor, lse: torch.Tensor, row_stats: torch.Tensor | None, mask: torch.Tensor | None,
        alibi: torch.Tensor | None, sinks: torch.Tensor | None, mask_needs_grad: bool,
        seqs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(dq, dk, dv, dmask, dsinks)`` (``backward.attention_backward``'s) for the forward this route ran;
        ``do`` with its head dim of stride 1. The backward's launches are planned at the first call of each
        layout of ``do``."""
        if self.split:
            raise NotImplementedError(SPLIT_HAS_NO_BACKWARD)
        if not self.kernels:
            return self._backward_without_kernels(do, dlse, q, k, v, lse, mask, alibi, sinks, mask_needs_grad, seqs)
        key = (do.stride(), do.dtype, do.data_ptr() % 16, dlse is None, mask_needs_grad)
        launch = self._backwards.get(key)
        if launch is None:
            opts = self.options
            launch = BackwardLaunch(do, q, k, v, opts["causal"], opts["scale"], mask, self.mask_is_bool,
                                    mask_needs_grad, dlse is not None, softcap=opts["softcap"],
                                    window=opts["window"], has_alibi=alibi is not None, varlen=self.varlen)
            self._backwards[key] = launch
        return launch(do, q, k, v, o, lse, dlse, mask, alibi, sinks, row_stats, seqs)

    def _backward_without_kernels(self, do, dlse, q, k, v, lse, mask, alibi, sinks, mask_needs_grad, seqs):
        if not self.torch_path:  # no query row or no key: o is 0 whatever q, k, v hold; the LSE is the sink's
            dsinks = None
            if sinks is not None:
                dsinks = (dlse.float().sum(dim=(0, 2)) if dlse is not None else torch.zeros_like(sinks.float()))
            dmask = torch.zeros(mask.shape, dtype=torch.float32, device=q.device) if mask_needs_grad else None
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dmask, dsinks
        if self.varlen is not None:
            return attention_varlen_backward_torch(do, q, k, v, dlse, seqs, alibi=alibi, sinks=sinks, **self.options)
        return attention_backward_torch(do, q, k, v, dlse, mask=mask, mask_is_bool=self.mask_is_bool,
                                        mask_needs_grad=mask_needs_grad, alibi=alibi, sinks=sinks, **self.options)


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
    mask: torch.Tensor | None, mask_is_bool: bool, write_lse: bool, config=None,
    *, softcap: float | None = None, window: tuple[int, int] | None = None,
    alibi: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward of checked (B, H, L, D) tensors (head dim stride 1), planned and run once: the Hopper kernel
    where it applies, else the ``triton.language`` one; ``config`` forces the latter and its tiles (tests and
    benchmarks). ``mask`` broadcast to (B, H, Lq, Lk) already. Returns ``(o, lse)`` (lse None unless
    ``write_lse``)."""
    variants = dict(softcap=softcap, window=window, has_alibi=alibi is not None, has_sinks=sinks is not None)
    if config is None and wgmma_eligible(q, k, v, mask is not None, scale):
        return HopperForwardLaunch(q, k, v, causal, scale, write_lse, **variants)(q, k, v, alibi, sinks)
    launch = TlForwardLaunch(q, k, v, causal, scale, mask, mask_is_bool, write_lse, config, **variants)
    return launch(q, k, v, mask, alibi, sinks)
