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

import functools
import math
import numbers

import torch
import torch.distributed as dist

from .attention import flash_attention
from .attention.api import check_inputs
from .attention.backward import attention_backward, triton_backward_enabled
from .attention.merge import merge_states_into
from .core.checks import check_flag, check_scale
from .core.runtime import runs_kernels

__all__ = ["ring_attention", "zigzag_shard", "zigzag_unshard"]


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


def step_blocks(ring: Ring, step: int, causal: bool, seqlen: int) -> tuple[slice, slice, bool]:
    """``(query rows, key rows, causal)`` of the local shard pair at ``step`` (module docstring)."""
    everything, half = slice(None), seqlen // 2
    if not causal:
        return everything, everything, False
    src = ring.source(step)
    if src == ring.rank:
        return everything, everything, True
    if src < ring.rank:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


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


def block_gradients(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, causal: bool, scale: float, kernels: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one shard pair: queries ``q`` (their final ``o``, ``lse``, ``do``, ``dlse``) against one
    block of keys, on the kernels (``attention_backward``) or, without ``kernels``, in PyTorch."""
    if kernels:
        dq, dk, dv, _, _ = attention_backward(do, q, k, v, o, lse, dlse, causal, scale, None, False)
        return dq, dk, dv
    return block_gradients_torch(do, q, k, v, o, lse, dlse, causal, scale)


def ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, ring: Ring,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of this rank's queries over every rank's keys: o like q, lse (B, H, L) fp32."""
    kv = torch.stack([k, v])  # (2, B, H_kv, L, D): one transfer a step
    shards = [kv, torch.empty_like(kv)]
    o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for step in range(ring.world_size):
        held = shards[step % 2]
        pending = ring.start(held, shards[(step + 1) % 2]) if step + 1 < ring.world_size else []
        rows, keys, block_causal = step_blocks(ring, step, causal, q.shape[2])
        o_part, lse_part = flash_attention(q[:, :, rows], held[0][:, :, keys], held[1][:, :, keys],
                                           causal=block_causal, scale=scale, return_lse=True)
        if step == 0:  # every query row's first partial state
            o.copy_(o_part)
            lse.copy_(lse_part)
        else:
            merge_states_into(o[:, :, rows], lse[:, :, rows], o_part, lse_part, o[:, :, rows], lse[:, :, rows])
        Ring.wait(pending)
    return o.to(q.dtype), lse


def ring_backward(
    do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, causal: bool, scale: float, ring: Ring, kernels: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of this rank's shards: dq summed here, dk/dv summed along the ring and brought home."""
    do = do if do.stride(-1) == 1 else do.contiguous()
    kv = torch.stack([k, v])
    shards = [kv, torch.empty_like(kv)]
    # fp32 dk/dv of the shard in hand: this rank's own at step 0, then received with the shard's sums so far.
    grads = [torch.zeros(kv.shape, dtype=torch.float32, device=kv.device),
             torch.empty(kv.shape, dtype=torch.float32, device=kv.device)]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grads_pending: list = []
    for step in range(ring.world_size):
        held = shards[step % 2]
        pending = ring.start(held, shards[(step + 1) % 2]) if step + 1 < ring.world_size else []
        rows, keys, block_causal = step_blocks(ring, step, causal, q.shape[2])
        block = (do[:, :, rows], q[:, :, rows], held[0][:, :, keys], held[1][:, :, keys], o[:, :, rows],
                 lse[:, :, rows], None if dlse is None else dlse[:, :, rows])
        dq_part, dk_part, dv_part = block_gradients(*block, block_causal, scale, kernels)
        dq[:, :, rows] += dq_part
        Ring.wait(grads_pending)  # the sums of the ranks before this one for the shard in hand
        dkv = grads[step % 2]
        dkv[0][:, :, keys] += dk_part
        dkv[1][:, :, keys] += dv_part
        if ring.world_size > 1:  # to the next rank; the last step's send brings each shard's sums to its owner
            grads_pending = ring.start(dkv, grads[(step + 1) % 2], tag=GRADS_TAG)
        Ring.wait(pending)
    Ring.wait(grads_pending)
    dkv = grads[ring.world_size % 2] if ring.world_size > 1 else grads[0]  # received last, or kept (P = 1)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """``(o, lse)`` of ring attention; differentiable in q, k, v, through both outputs."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, return_lse):
        ring = Ring(group)
        o, lse = ring_forward(q, k, v, causal, scale, ring)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.ring, ctx.causal, ctx.scale, ctx.return_lse = ring, causal, scale, return_lse
        # Decided here, in the caller's thread (core.runtime.pytorch_path is per thread): kernels, or PyTorch.
        ctx.kernels = runs_kernels(q) and triton_backward_enabled(q)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(do, dlse if ctx.return_lse else None, q, k, v, o, lse, ctx.causal, ctx.scale,
                                   ctx.ring, ctx.kernels)
        return dq, dk, dv, None, None, None, None


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
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention needs an initialized torch.distributed process group "
                           "(torch.distributed.init_process_group)")
    check_inputs(q, k, v, None)
    causal, return_lse = check_flag("causal", causal), check_flag("return_lse", return_lse)
    scale = check_scale(scale, 1.0 / math.sqrt(q.shape[3]))
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k/v shards must have the same length, got q {q.shape[2]} and k/v {k.shape[2]}")
    if causal and q.shape[2] % 2:
        raise ValueError(f"causal ring attention takes zigzag shards of two equal chunks: the shard length must be "
                         f"even, got {q.shape[2]}")
    o, lse = _RingAttention.apply(q, k, v, causal, scale, group, return_lse)
    return (o, lse) if return_lse else o
