"""Ring (context-parallel) attention over ``torch.distributed``: the sequence sharded across ranks, K/V shards
passed around a ring, partial results merged with the online-softmax merge.

Each of the P ranks of a process group holds a shard of the queries and of the
keys/values. In P steps every rank attends its queries to every K/V shard: at
step ``s`` rank ``r`` holds the shard of rank ``src = (r − s) mod P`` and passes
it on to rank ``r + 1`` while it computes (the next shard's transfer is posted
before the current shard's attention). Each step gives a partial ``(o, lse)``
over one shard of keys (``flash_attention(..., return_lse=True)``), folded into
a running fp32 ``(o, lse)`` by ``flashlite.attention.merge``: partial
``(o, lse)`` pairs merge as the core's ``(m, d, acc)`` states do. The
distributed engine is PyTorch's: point-to-point ``batch_isend_irecv`` on the
given group (NCCL on GPUs, gloo on CPUs); on CUDA the transfers are posted
from a side stream, so the compute stream waits only where a shard is used.

Zigzag layout (causal load balance). The global sequence of length L is cut
into 2P chunks of ``c = L / 2P``; rank ``r`` holds chunks ``r`` and
``2P − 1 − r`` (``zigzag_shard``). Every rank then has the same causal work.
Example, P = 2, L = 8, c = 2: rank 0 holds positions [0 1 | 6 7], rank 1
[2 3 | 4 5]. With its local queries split into halves (first = chunk ``r``,
second = chunk ``2P − 1 − r``) and the shard in hand from ``src``:

* ``src == r`` (step 0): the local causal attention, Lq = Lk = 2c (local order
  is global order, so ``causal=True`` on the shard is exact);
* ``src < r``: chunk ``src`` precedes both local chunks and chunk
  ``2P − 1 − src`` follows both: all local queries against the first half of
  the shard, non-causal;
* ``src > r``: both of src's chunks follow chunk ``r`` and precede chunk
  ``2P − 1 − r``: only the second half of the local queries, against the whole
  shard, non-causal.

The masked halves are never computed: each step past the first is 2c² scores
of full tiles, the diagonal step's causal half of (2c)² the same. Without
``causal`` every step is the whole shard against all local queries (any
sharding works; the zigzag one is what the tests use).

Backward. The ring again, with the final ``(o, lse)`` of every query row in
hand: each shard pair's ``P = e^(S − lse)`` is the global softmax's block, so
``flashlite.attention.backward.attention_backward`` on the pair gives its exact
share of dQ, dK, dV. dQ is summed locally in fp32; fp32 dK/dV buffers travel
with the shards (P transfers: the last one brings each rank its own shard's
sums), the transfer of one step overlapping the next step's compute.

Packed batches (``ring_attention_varlen``). Documents of different lengths packed
end to end (``cu_seqlens``), each a multiple of 2P long, are cut per document:
rank ``r`` holds chunks ``r`` and ``2P − 1 − r`` of every document, in document
order (``varlen_shard``; ``cu_seqlens = [0, 8, 12]``, P = 2: rank 0 holds rows
[0 1 6 7 | 8 11], rank 1 [2 3 4 5 | 9 10]). Every rank's shard has the same
layout (document ``b`` owns shard rows ``[cu[b]/P, cu[b+1]/P)``), so the shard
in hand at any step is read with the same offsets as one's own. Each document
then follows the dense rule above. Under ``causal`` the ring regroups the shard's
rows as every document's first chunk, then every second chunk
(``PackedShards``): each half is a packed batch of its own (offsets ``cu/2P``),
and each step is two or three ``flash_attention_varlen`` calls of half against
half: the diagonal step first-first and second-second causal plus second-first;
an earlier rank's shard all local queries against its first halves; a later
rank's our second halves against both of its halves. The regrouping is one
gather of q, k, v (and one of the output) per call.

Precision: every step's attention is flash_attention's (fp32 accumulation,
outputs in the input dtype); the running output, dQ and the travelling dK/dV
are fp32, rounded to the input dtype once at the end.

Limits: every rank must pass shards of one shape (not checked: it would cost a
collective); causal needs an even shard length (two zigzag chunks); no masks,
softcap or sinks; no torch.compile path. The backward recomputes each step's
row sums ``rowsum(dO ⊙ O)`` (one extra read of dO and O per step). Nothing here
touches a device or a process group at import.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable

import torch
import torch.distributed as dist

from .attention import flash_attention, flash_attention_varlen
from .attention.api import check_inputs
from .attention.backward import BackwardLaunch, attention_backward, triton_backward_enabled
from .attention.merge import merge_states_into
from .core.checks import check_cu_seqlens, check_flag, check_scale
from .core.runtime import runs_kernels

__all__ = ["ring_attention", "ring_attention_varlen", "varlen_shard", "varlen_unshard", "zigzag_shard",
           "zigzag_unshard"]


# ----------------------------------------------------------------------------- zigzag layout


def _check_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _check_dim(dim, ndim: int) -> int:
    dim = _check_int("dim", dim)
    if not -ndim <= dim < ndim:
        raise IndexError(f"dim={dim} is out of range for a tensor with {ndim} dimension(s)")
    return dim % ndim


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of ``x``: ``dim`` cut into ``2·world_size`` equal chunks, chunks ``rank`` and
    ``2·world_size − 1 − rank`` concatenated (the causal load-balanced layout of ``ring_attention``).

    Args:
        x: a tensor whose ``dim`` is a multiple of ``2·world_size`` long (a (B, H, L, D) q, k or v: dim 2).
        rank: in ``[0, world_size)``.
        world_size: the number of ranks, >= 1.
        dim: the sequence dim.

    Returns:
        A new tensor, ``x``'s shape with ``dim`` of length ``x.shape[dim] / world_size``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    world_size = _check_int("world_size", world_size)
    rank = _check_int("rank", rank)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size) = [0, {world_size}), got {rank}")
    dim = _check_dim(dim, x.dim())
    length, n_chunks = x.shape[dim], 2 * world_size
    if length % n_chunks:
        raise ValueError(f"x.shape[{dim}] = {length} must be a multiple of 2·world_size = {n_chunks} "
                         "(the zigzag layout cuts it into that many equal chunks)")
    chunk = length // n_chunks
    first = x.narrow(dim, rank * chunk, chunk)
    second = x.narrow(dim, (n_chunks - 1 - rank) * chunk, chunk)
    return torch.cat([first, second], dim)


def zigzag_unshard(shards: list[torch.Tensor] | tuple[torch.Tensor, ...], dim: int = 2) -> torch.Tensor:
    """The global tensor from every rank's zigzag shard, in rank order: the inverse of ``zigzag_shard``.

    Args:
        shards: ``[zigzag_shard(x, r, P, dim) for r in range(P)]`` (or tensors laid out so, such as the shards of
            ``ring_attention``'s output gathered with ``all_gather``): one shape, dtype and device.
        dim: the sequence dim.

    Returns:
        ``x``: the chunks in global order, ``dim`` ``P`` times a shard's length.
    """
    if not isinstance(shards, (list, tuple)) or not shards:
        raise TypeError("shards must be a non-empty list or tuple of tensors, one per rank")
    for i, s in enumerate(shards):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"shards[{i}] must be a torch.Tensor, got {type(s).__name__}")
        if s.shape != shards[0].shape:
            raise ValueError(f"shards[{i}] has shape {tuple(s.shape)} but shards[0] has {tuple(shards[0].shape)}")
    dim = _check_dim(dim, shards[0].dim())
    length = shards[0].shape[dim]
    if length % 2:
        raise ValueError(f"each shard's dim {dim} holds two equal chunks: its length must be even, got {length}")
    chunk = length // 2
    firsts = [s.narrow(dim, 0, chunk) for s in shards]  # chunks 0 .. P-1
    seconds = [s.narrow(dim, chunk, chunk) for s in reversed(shards)]  # chunks P .. 2P-1
    return torch.cat(firsts + seconds, dim)


# ----------------------------------------------------------------------------- the ring


GRADS_TAG = 1  # the tag of the backward's dK/dV transfers (shards travel under 0)


@functools.lru_cache(maxsize=None)
def _comm_stream(device_index: int) -> torch.cuda.Stream:
    """The side stream the ring's transfers are posted from, one per device, made at first use."""
    return torch.cuda.Stream(device=device_index)


class Ring:
    """This rank's place in the ring of ``group``: it sends to the next rank and receives from the previous one."""

    def __init__(self, group) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.send_to = to_global((self.rank + 1) % self.world_size)
        self.recv_from = to_global((self.rank - 1) % self.world_size)

    def source(self, step: int) -> int:
        """The rank whose shard this rank holds at ``step``."""
        return (self.rank - step) % self.world_size

    def start(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0) -> list:
        """Post ``send`` to the next rank and ``recv`` from the previous one; returns the requests (``wait``).

        ``tag`` tells apart transfers in flight at once (the backward's shards and their gradients; gloo
        matches by it, NCCL keeps the order of posting). On CUDA, posted from the side stream once it has
        caught up with the current stream (so that ``send`` is written, and ``recv``'s last readers are done,
        before the transfer touches them)."""
        ops = [dist.P2POp(dist.isend, send, self.send_to, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.recv_from, self.group, tag)]
        if not send.is_cuda:
            return dist.batch_isend_irecv(ops)
        stream = _comm_stream(send.device.index if send.device.index is not None else torch.cuda.current_device())
        stream.wait_stream(torch.cuda.current_stream(send.device))
        with torch.cuda.stream(stream):
            return dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(requests: list) -> None:
        """Wait for posted transfers (on CUDA: make the current stream wait for them)."""
        for request in requests:
            request.wait()


@dataclasses.dataclass(frozen=True)
class Documents:
    """The documents of a packed run of rows: document ``b`` owns rows ``[offsets[b], offsets[b + 1])``. ``cu`` is
    the same offsets as an int32 tensor on the shards' device (what the kernels read), ``offsets`` on the host
    (the PyTorch path's loop), ``longest`` the longest document (the kernels' grids)."""

    cu: torch.Tensor
    offsets: tuple[int, ...]
    longest: int


@dataclasses.dataclass(frozen=True)
class Block:
    """One shard pair of a ring step: query ``rows`` of this rank's shard against ``keys`` of the shard in hand,
    ``causal`` within the pair; ``docs = (the rows' documents, the keys' documents)`` for a packed batch
    (``flash_attention_varlen``), None for a dense one."""

    rows: slice
    keys: slice
    causal: bool
    docs: tuple[Documents, Documents] | None = None


def step_blocks(ring: Ring, step: int, causal: bool, seqlen: int) -> list[Block]:
    """The shard pair of a dense batch at ``step`` (module docstring): one block."""
    everything, half = slice(None), seqlen // 2
    if not causal:
        return [Block(everything, everything, False)]
    src = ring.source(step)
    if src == ring.rank:
        return [Block(everything, everything, True)]
    if src < ring.rank:
        return [Block(everything, slice(0, half), False)]
    return [Block(slice(half, None), everything, False)]


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of one shard pair, (B, H, Lq, D) and (B, H, Lq) (a packed pair's as (1, H, rows, ·))."""
    if block.docs is None:
        return flash_attention(q, k, v, causal=block.causal, scale=scale, return_lse=True)
    rows, keys = block.docs
    o, lse = flash_attention_varlen(*(t.squeeze(0).transpose(0, 1) for t in (q, k, v)), rows.cu, keys.cu, rows.longest,
                                    keys.longest, causal=block.causal, scale=scale, return_lse=True)
    return o.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0)


def block_gradients_torch(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attention_backward``'s dq, dk, dv of one block of keys under the rows' final ``lse``, in PyTorch fp32 ops
    (scores materialised): for tensors the kernels do not run on, and CUDA fp32 (whose ``attention_backward``
    recomputes the LSE from its own keys, not the final one)."""
    batch, n_heads, seqlen_q, head_dim = q.shape
    n_kv, seqlen_k = k.shape[1], k.shape[2]
    grouped = (batch, n_kv, n_heads // n_kv, seqlen_q)  # (B, H_kv, G, Lq): no K/V repeat
    qf, dof, of = (t.float().reshape(*grouped, head_dim) for t in (q, do, o))
    kf, vf = k.float().unsqueeze(2), v.float().unsqueeze(2)  # (B, H_kv, 1, Lk, D)
    s = qf @ kf.transpose(-1, -2) * scale  # (B, H_kv, G, Lq, Lk)
    if causal:
        keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).tril(seqlen_k - seqlen_q)
        s = s.masked_fill(~keep, float("-inf"))
    row_lse = lse.float().reshape(*grouped, 1)
    p = torch.where(row_lse == float("-inf"), 0.0, torch.exp(s - row_lse))
    delta = (dof * of).sum(-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.float().reshape(*grouped, 1)
    ds = p * (dof @ vf.transpose(-1, -2) - delta)
    dq = (ds @ kf * scale).reshape(q.shape)
    dk = (ds.transpose(-1, -2) @ qf).sum(2) * scale
    dv = (p.transpose(-1, -2) @ dof).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def packed_block_gradients_torch(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, block: Block, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``block_gradients_torch`` of each document of a packed pair ((1, H, rows, ·) tensors)."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    rows, keys = block.docs
    for b in range(len(rows.offsets) - 1):
        r, c = slice(*rows.offsets[b:b + 2]), slice(*keys.offsets[b:b + 2])
        if r.stop == r.start or c.stop == c.start:
            continue
        dq[:, :, r], dk[:, :, c], dv[:, :, c] = block_gradients_torch(
            do[:, :, r], q[:, :, r], k[:, :, c], v[:, :, c], o[:, :, r], lse[:, :, r],
            None if dlse is None else dlse[:, :, r], block.causal, scale)
    return dq, dk, dv


# Packed pairs' backward launches and packed batches' layouts kept, up to this many each (then forgotten at once).
KEPT = 64
_PACKED_BACKWARDS: dict = {}
_LAYOUTS: dict = {}


def block_gradients(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, block: Block, scale: float, kernels: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one shard pair: queries ``q`` (their final ``o``, ``lse``, ``do``, ``dlse``) against one
    block of keys, on the kernels (``attention_backward``, or its packed launch) or, without ``kernels``, in
    PyTorch. The probabilities are ``e^(S − lse)`` under the final LSE: each pair's exact share."""
    if block.docs is None:
        if kernels:
            dq, dk, dv, _, _ = attention_backward(do, q, k, v, o, lse, dlse, block.causal, scale, None, False)
            return dq, dk, dv
        return block_gradients_torch(do, q, k, v, o, lse, dlse, block.causal, scale)
    if not kernels:
        return packed_block_gradients_torch(do, q, k, v, o, lse, dlse, block, scale)
    rows, keys = block.docs
    varlen = (len(rows.offsets) - 1, rows.longest, keys.longest)
    key = (block.causal, scale, varlen, dlse is not None,
           *((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16) for t in (do, q, k, v)))
    launch = _PACKED_BACKWARDS.get(key)
    if launch is None:  # planned once per signature, as a route's backward is
        if len(_PACKED_BACKWARDS) >= KEPT:
            _PACKED_BACKWARDS.clear()
        launch = _PACKED_BACKWARDS[key] = BackwardLaunch(do, q, k, v, block.causal, scale, None, False,
                                                         has_dlse=dlse is not None, varlen=varlen)
    dq, dk, dv, _, _ = launch(do, q, k, v, o, lse, dlse, seqs=(rows.cu, keys.cu))
    return dq, dk, dv


def stacked(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``(buffer, dims)``: ``torch.stack([k, v])`` as ``buffer.permute(dims)``, ``buffer`` contiguous (what the
    transfers send) and laid out in k's memory order: a packed shard's token-major (1, H, rows, D) views stay
    token-major (no transposing copy; the fp32 buffers made like it follow)."""
    order = sorted(range(k.dim()), key=lambda d: k.stride(d), reverse=True)  # outermost dim first
    buffer = torch.empty((2, *(k.shape[d] for d in order)), dtype=k.dtype, device=k.device)
    dims = (0, *(order.index(d) + 1 for d in range(k.dim())))
    kv = buffer.permute(dims)
    kv[0].copy_(k)
    kv[1].copy_(v)
    return buffer, dims


# Which blocks a rank computes at a step: ``blocks(ring, step) -> list[Block]``. The blocks of step 0 (the
# rank's own shard) cover every query row; the first block to reach a run of rows there writes it.
StepBlocks = Callable[[Ring, int], list[Block]]


def ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: StepBlocks, scale: float, ring: Ring,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of this rank's queries over every rank's keys: o like q, lse (B, H, L) fp32."""
    kv, dims = stacked(k, v)  # (2, B, H_kv, L, D) as kv.permute(dims): one transfer a step
    shards = [kv, torch.empty_like(kv)]
    o = torch.empty_like(q, dtype=torch.float32)  # in q's memory order, as the partial outputs come
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    written = set()  # the runs of rows step 0 has written (after it: every row)
    for step in range(ring.world_size):
        held = shards[step % 2].permute(dims)
        pending = ring.start(shards[step % 2], shards[(step + 1) % 2]) if step + 1 < ring.world_size else []
        for block in blocks(ring, step):
            rows, keys = block.rows, block.keys
            o_part, lse_part = block_attention(q[:, :, rows], held[0][:, :, keys], held[1][:, :, keys], block, scale)
            span = rows.indices(q.shape[2])
            if step == 0 and span not in written:  # these rows' first partial state
                o[:, :, rows].copy_(o_part)
                lse[:, :, rows].copy_(lse_part)
                written.add(span)
            else:
                merge_states_into(o[:, :, rows], lse[:, :, rows], o_part, lse_part, o[:, :, rows], lse[:, :, rows])
        Ring.wait(pending)
    return o.to(q.dtype), lse


def ring_backward(
    do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, blocks: StepBlocks, scale: float, ring: Ring, kernels: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of this rank's shards: dq summed here, dk/dv summed along the ring and brought home."""
    do = do if do.stride(-1) == 1 else do.contiguous()
    kv, dims = stacked(k, v)
    shards = [kv, torch.empty_like(kv)]
    # fp32 dk/dv of the shard in hand: this rank's own at step 0, then received with the shard's sums so far.
    grads = [torch.zeros_like(kv, dtype=torch.float32), torch.empty_like(kv, dtype=torch.float32)]
    dq = torch.zeros_like(q, dtype=torch.float32)
    grads_pending: list = []
    for step in range(ring.world_size):
        held = shards[step % 2].permute(dims)
        pending = ring.start(shards[step % 2], shards[(step + 1) % 2]) if step + 1 < ring.world_size else []
        key_grads = []
        for block in blocks(ring, step):
            rows, keys = block.rows, block.keys
            dq_part, dk_part, dv_part = block_gradients(
                do[:, :, rows], q[:, :, rows], held[0][:, :, keys], held[1][:, :, keys], o[:, :, rows],
                lse[:, :, rows], None if dlse is None else dlse[:, :, rows], block, scale, kernels)
            dq[:, :, rows] += dq_part
            key_grads.append((keys, dk_part, dv_part))
        Ring.wait(grads_pending)  # the sums of the ranks before this one for the shard in hand
        dkv = grads[step % 2].permute(dims)
        for keys, dk_part, dv_part in key_grads:
            dkv[0][:, :, keys] += dk_part
            dkv[1][:, :, keys] += dv_part
        if ring.world_size > 1:  # to the next rank; the last step's send brings each shard's sums to its owner
            grads_pending = ring.start(grads[step % 2], grads[(step + 1) % 2], tag=GRADS_TAG)
        Ring.wait(pending)
    Ring.wait(grads_pending)
    dkv = grads[ring.world_size % 2 if ring.world_size > 1 else 0].permute(dims)  # received last, or kept (P = 1)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """``(o, lse)`` of ring attention on (B, H, L, D) shards (a packed batch's as (1, H, rows, D) views);
    differentiable in q, k, v, through both outputs."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, scale, group, return_lse, packed):
        ring = Ring(group)
        o, lse = ring_forward(q, k, v, blocks, scale, ring)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.ring, ctx.blocks, ctx.scale, ctx.return_lse = ring, blocks, scale, return_lse
        # Decided here, in the caller's thread (core.runtime.pytorch_path is per thread): kernels, or PyTorch.
        ctx.kernels = runs_kernels(q) and triton_backward_enabled(q, packed)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(do, dlse if ctx.return_lse else None, q, k, v, o, lse, ctx.blocks, ctx.scale,
                                   ctx.ring, ctx.kernels)
        return dq, dk, dv, None, None, None, None, None


def _check_process_group(name: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{name} needs an initialized torch.distributed process group "
                           "(torch.distributed.init_process_group)")


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    causal: bool = False, scale: float | None = None, group: dist.ProcessGroup | None = None, return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a sequence sharded across the ranks of ``group``, K/V passed around a ring (module docstring).

    Every rank of ``group`` calls it with its own shards, of one shape on every rank.

    Args:
        q: (B, H, L/P, D) this rank's zigzag shard of the queries (``zigzag_shard(q, rank, P)``), float16,
            bfloat16 or float32, on the device of this rank's backend (CUDA for NCCL, CPU for gloo).
        k, v: (B, H_kv, L/P, D) this rank's zigzag shards of the keys and values, q's dtype and device;
            ``H % H_kv == 0`` (GQA/MQA as in ``flash_attention``). Under ``causal`` L/P must be even.
        causal: causal over the global positions (query ``i`` sees key ``j <= i``; the global Lq = Lk).
        scale: multiplies the scores; default ``1 / sqrt(D)``.
        group: the process group (default: the world); P is its size.
        return_lse: also return the rows' log-sum-exp over all keys.

    Returns:
        ``o`` (B, H, L/P, D) in q's dtype, this rank's zigzag shard of the output (``zigzag_unshard`` of the
        gathered shards is the whole), or ``(o, lse)`` with ``lse`` (B, H, L/P) float32 natural-log.

    Differentiable in q, k, v and through the LSE: dq stays on this rank, dk/dv travel back around the ring
    to the ranks that own the shards. Each step runs ``flash_attention`` (the Triton kernels; CPU tensors
    through the interpreter under ``TRITON_INTERPRET=1``, else its PyTorch path).
    """
    _check_process_group("ring_attention")
    check_inputs(q, k, v, None)
    causal, return_lse = check_flag("causal", causal), check_flag("return_lse", return_lse)
    scale = check_scale(scale, 1.0 / math.sqrt(q.shape[3]))
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k/v shards must have the same length, got q {q.shape[2]} and k/v {k.shape[2]}")
    if causal and q.shape[2] % 2:
        raise ValueError(f"causal ring attention takes zigzag shards of two equal chunks: the shard length must be "
                         f"even, got {q.shape[2]}")
    seqlen = q.shape[2]
    o, lse = _RingAttention.apply(q, k, v, lambda ring, step: step_blocks(ring, step, causal, seqlen), scale, group,
                                  return_lse, False)
    return (o, lse) if return_lse else o


# ----------------------------------------------------------------------------- packed batches


def document_offsets(cu_seqlens: torch.Tensor, world_size: int, name: str = "cu_seqlens") -> list[int]:
    """``cu_seqlens`` read on the host and checked (errors name it): an int32 1-D tensor rising from 0 whose every
    document is a multiple of ``2·world_size`` long (the per-document zigzag cuts each into that many chunks)."""
    check_cu_seqlens(name, cu_seqlens)
    offsets = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    if offsets[0] != 0 or any(n < 0 for n in lengths):
        raise ValueError(f"{name} must rise from 0 (cumulative document lengths), got {offsets}")
    n_chunks = 2 * world_size
    bad = next((i for i, n in enumerate(lengths) if n % n_chunks), None)
    if bad is not None:
        raise ValueError(f"{name}: document {bad} is {lengths[bad]} long, not a multiple of 2·world_size = {n_chunks} "
                         "(the per-document zigzag cuts every document into that many equal chunks)")
    return offsets


def shard_rows(offsets: list[int], rank: int, world_size: int) -> torch.Tensor:
    """The global rows of rank ``rank``'s shard (int64, CPU): chunks ``rank`` and ``2·world_size − 1 − rank`` of
    every document, in document order."""
    starts, lengths = torch.tensor(offsets[:-1], dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64).diff()
    chunk = lengths // (2 * world_size)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), 2 * chunk)  # each shard row's document
    within = torch.arange(doc.numel()) - torch.repeat_interleave(torch.cumsum(2 * chunk, 0) - 2 * chunk, 2 * chunk)
    second = within >= chunk[doc]
    which = torch.where(second, 2 * world_size - 1 - rank, rank)
    return starts[doc] + which * chunk[doc] + within - second * chunk[doc]


def varlen_shard(x: torch.Tensor, cu_seqlens: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s per-document zigzag shard of a packed batch: each document cut into ``2·world_size`` equal
    chunks, chunks ``rank`` and ``2·world_size − 1 − rank`` of every document kept, in document order (every rank
    gets the same causal work of every document; ``ring_attention_varlen``'s layout).

    Args:
        x: (total, ...) packed along dim 0, documents as ``cu_seqlens`` gives them.
        cu_seqlens: int32 (B + 1,) cumulative document lengths from 0 to ``total`` (read on the host); every
            document a multiple of ``2·world_size`` long (length 0 allowed).
        rank: in ``[0, world_size)``.
        world_size: the number of ranks, >= 1.

    Returns:
        A new tensor (total / world_size, ...): document ``b`` contributes rows ``[cu_seqlens[b] / world_size,
        cu_seqlens[b + 1] / world_size)``.

    Example: ``cu_seqlens = [0, 8, 12]``, ``world_size = 2``: rank 0 keeps rows ``[0 1 6 7 | 8 11]``, rank 1
    ``[2 3 4 5 | 9 10]``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    world_size, rank = _check_int("world_size", world_size), _check_int("rank", rank)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size) = [0, {world_size}), got {rank}")
    offsets = document_offsets(cu_seqlens, world_size)
    if x.dim() < 1 or x.shape[0] != offsets[-1]:
        raise ValueError(f"x.shape[0] must be the packed total cu_seqlens[-1] = {offsets[-1]}, got shape "
                         f"{tuple(x.shape)}")
    return x.index_select(0, shard_rows(offsets, rank, world_size).to(x.device))


def varlen_unshard(shards: list[torch.Tensor] | tuple[torch.Tensor, ...], cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The packed batch from every rank's ``varlen_shard``, in rank order: the inverse of ``varlen_shard``.

    Args:
        shards: ``[varlen_shard(x, cu_seqlens, r, P) for r in range(P)]`` (or tensors laid out so, such as
            ``ring_attention_varlen``'s outputs gathered with ``all_gather``): one shape, dtype and device.
        cu_seqlens: the batch's int32 (B + 1,) cumulative document lengths (read on the host).

    Returns:
        ``x`` (total, ...), ``total = P`` times a shard's rows.
    """
    if not isinstance(shards, (list, tuple)) or not shards:
        raise TypeError("shards must be a non-empty list or tuple of tensors, one per rank")
    for i, s in enumerate(shards):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"shards[{i}] must be a torch.Tensor, got {type(s).__name__}")
        if s.shape != shards[0].shape or s.dtype != shards[0].dtype or s.device != shards[0].device:
            raise ValueError(f"shards[{i}] is {tuple(s.shape)} {s.dtype} on {s.device} but shards[0] is "
                             f"{tuple(shards[0].shape)} {shards[0].dtype} on {shards[0].device}")
    world_size = len(shards)
    offsets = document_offsets(cu_seqlens, world_size)
    if shards[0].dim() < 1 or shards[0].shape[0] * world_size != offsets[-1]:
        raise ValueError(f"{world_size} shards of {tuple(shards[0].shape)} do not hold the cu_seqlens[-1] = "
                         f"{offsets[-1]} rows of the batch")
    x = shards[0].new_empty((offsets[-1], *shards[0].shape[1:]))
    for rank, shard in enumerate(shards):
        x[shard_rows(offsets, rank, world_size).to(x.device)] = shard
    return x


class _Regroup(torch.autograd.Function):
    """``x.index_select(dim, order)`` whose gradient is the gather by ``inverse`` (autograd's own is a scatter-add:
    5 times the time of a gather on a (64K, 32, 128) shard of an H200)."""

    @staticmethod
    def forward(ctx, x, dim, order, inverse):
        ctx.dim, ctx.inverse = dim, inverse
        return x.index_select(dim, order)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(ctx.dim, ctx.inverse), None, None, None


class PackedShards:
    """Where the documents lie in every rank's shard of a packed batch (the same layout on every rank), and the
    blocks each ring step computes (module docstring, "Packed batches").

    A shard holds ``2c`` rows of a document of ``2P·c``: chunk ``r`` then chunk ``2P − 1 − r``. Under
    ``causal`` the ring works on the shard's rows regrouped (``order``) as every document's first chunk, then
    every document's second chunk: the two halves are then packed batches of their own (documents of ``c``
    rows each), and every block below is a pair of them."""

    def __init__(self, offsets: list[int], world_size: int, causal: bool, device: torch.device):
        lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        local = [o // world_size for o in offsets]  # document b: shard rows [local[b], local[b + 1])
        half = [o // (2 * world_size) for o in offsets]  # its chunks' rows in each regrouped half
        longest_chunk = max(lengths, default=0) // (2 * world_size)
        self.offsets, self.rows, self.causal = offsets, local[-1], causal
        self.shard = Documents(torch.tensor(local, dtype=torch.int32, device=device), tuple(local),
                               2 * longest_chunk)
        self.half = Documents(torch.tensor(half, dtype=torch.int32, device=device), tuple(half), longest_chunk)
        self.order = self.inverse = None
        if causal:  # the first chunks (rows of chunk r) in document order, then the second ones
            chunk = torch.tensor(lengths, dtype=torch.int64) // (2 * world_size)
            doc = torch.repeat_interleave(torch.arange(len(lengths)), chunk)
            within = torch.arange(doc.numel()) - torch.tensor(half[:-1], dtype=torch.int64)[doc]
            first = torch.tensor(local[:-1], dtype=torch.int64)[doc] + within
            order = torch.cat([first, first + chunk[doc]])
            self.order, self.inverse = order.to(device), torch.argsort(order).to(device)

    def to_ring(self, x: torch.Tensor) -> torch.Tensor:
        """A (rows, H, D) shard as the ring's (1, H, rows, D) view, regrouped under ``causal`` (differentiable)."""
        if self.order is not None:
            x = _Regroup.apply(x, 0, self.order, self.inverse)
        return x.unsqueeze(0).transpose(1, 2)

    def from_ring(self, o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ring's (1, H, rows, D) output and (1, H, rows) LSE in the shard's layout: (rows, H, D), (H, rows)."""
        o, lse = o.squeeze(0).transpose(0, 1), lse.squeeze(0)  # (a select's gradient would copy the whole)
        if self.inverse is not None:
            o = _Regroup.apply(o, 0, self.inverse, self.order)
            lse = _Regroup.apply(lse, 1, self.inverse, self.order)
        return o, lse

    def blocks(self, ring: Ring, step: int) -> list[Block]:
        """The shard pairs of ``step``: the dense ring's, each half taken as the packed batch it is."""
        if not self.causal:
            return [Block(slice(None), slice(None), False, (self.shard, self.shard))]
        first, second = slice(0, self.rows // 2), slice(self.rows // 2, self.rows)
        src = ring.source(step)
        if src == ring.rank:  # chunk r against itself, 2P−1−r against itself and against chunk r
            pairs = [(first, first, True), (second, second, True), (second, first, False)]
        elif src < ring.rank:  # src's first chunk precedes both of ours; its second follows both
            pairs = [(first, first, False), (second, first, False)]
        else:  # both of src's chunks follow our first and precede our second
            pairs = [(second, first, False), (second, second, False)]
        return [Block(rows, keys, causal, (self.half, self.half)) for rows, keys, causal in pairs]


def packed_layout(cu_seqlens: torch.Tensor, world_size: int, causal: bool, device: torch.device) -> PackedShards:
    """The ``PackedShards`` of ``cu_seqlens`` (checked by ``document_offsets``), kept while that very tensor lives
    unchanged: a repeated call (every layer of a model, forward and backward) reads the offsets neither from the
    device again (no synchronisation) nor rebuilds the regrouping. The kept entry holds ``cu_seqlens`` itself, so
    its address cannot pass to another tensor, and a change in place (its version counter) misses the key."""
    key = (id(cu_seqlens), getattr(cu_seqlens, "_version", None), world_size, causal, device)
    kept = _LAYOUTS.get(key)
    if kept is not None and kept[0] is cu_seqlens:
        return kept[1]
    layout = PackedShards(document_offsets(cu_seqlens, world_size), world_size, causal, device)
    if len(_LAYOUTS) >= KEPT:
        _LAYOUTS.clear()
    _LAYOUTS[key] = (cu_seqlens, layout)
    return layout


def ring_attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, *,
    causal: bool = False, scale: float | None = None, group: dist.ProcessGroup | None = None, return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``flash_attention_varlen`` over a packed batch sharded across the ranks of ``group`` by ``varlen_shard``, K/V
    passed around a ring (module docstring, "Packed batches").

    Every rank of ``group`` calls it with its own shards and the same ``cu_seqlens`` and ``max_seqlen``.

    Args:
        q: (total/P, H, D) this rank's ``varlen_shard`` of the packed queries, float16, bfloat16 or float32, on
            the device of this rank's backend (CUDA for NCCL, CPU for gloo).
        k, v: (total/P, H_kv, D) this rank's shards of the keys and values, q's dtype and device;
            ``H % H_kv == 0``.
        cu_seqlens: the global int32 (B + 1,) cumulative document lengths (queries and keys alike), every
            document a multiple of ``2·P`` long. Read on the host at the first call with this tensor (one device
            synchronisation when it lies on a GPU); later calls with the same, unchanged tensor reuse what was
            read (``packed_layout``).
        max_seqlen: an int, at least the longest document.
        causal: causal within each document (query ``i`` sees key ``j <= i`` of its own document).
        scale: multiplies the scores; default ``1 / sqrt(D)``.
        group: the process group (default: the world); P is its size.
        return_lse: also return the rows' log-sum-exp.

    Returns:
        ``o`` (total/P, H, D) in q's dtype, this rank's ``varlen_shard`` of ``flash_attention_varlen``'s output
        on the whole batch (``varlen_unshard`` of the gathered shards is the whole), or ``(o, lse)`` with
        ``lse`` (H, total/P) float32 natural-log.

    Differentiable in q, k, v and through the LSE, dK/dV brought home around the ring as in ``ring_attention``.
    What is checked here is local: this rank's shards against ``cu_seqlens``. That every rank passes the same
    ``cu_seqlens`` and shards of its layout cannot be checked without a collective.
    """
    _check_process_group("ring_attention_varlen")
    world_size = dist.get_world_size(group)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total/P, heads, head_dim), got shape {tuple(t.shape)}")
    layout = packed_layout(cu_seqlens, world_size, check_flag("causal", causal), q.device)
    offsets = layout.offsets
    if type(max_seqlen) is not int:
        raise TypeError(f"max_seqlen must be an int, got {type(max_seqlen).__name__} {max_seqlen!r}")
    longest = max((b - a for a, b in zip(offsets, offsets[1:])), default=0)
    if max_seqlen < longest:
        raise ValueError(f"max_seqlen ({max_seqlen}) is shorter than the longest document of cu_seqlens ({longest})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[0] * world_size != offsets[-1]:
            raise ValueError(f"{name} holds {t.shape[0]} rows, but a shard of cu_seqlens' {offsets[-1]} tokens over "
                             f"{world_size} ranks holds {offsets[-1] // world_size}")
    return_lse = check_flag("return_lse", return_lse)
    q4, k4, v4 = (layout.to_ring(t) for t in (q, k, v))
    check_inputs(q4, k4, v4, None)
    if v.shape[2] != q.shape[2]:
        raise ValueError(f"head dims differ: q {q.shape[2]}, v {v.shape[2]} (the ring sends k and v as one tensor)")
    scale = check_scale(scale, 1.0 / math.sqrt(q.shape[2]))
    o, lse = _RingAttention.apply(q4, k4, v4, layout.blocks, scale, group, return_lse, True)
    o, lse = layout.from_ring(o, lse)
    return (o, lse) if return_lse else o
