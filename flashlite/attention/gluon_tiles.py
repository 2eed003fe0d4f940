"""Gluon building blocks of the Hopper kernels (``forward_hopper``, ``backward_hopper``): TMA copies into rings
of shared-memory slots completed on mbarriers, and the host's TMA descriptors.

A ring holds ``KV_STAGES`` slots of K (or V) tiles; tile ``t`` goes to slot ``t % KV_STAGES`` and its mbarrier
completes phase ``(t // KV_STAGES) & 1`` when the copy lands (``issue_kv_load``, ``wait_kv``). The kernels pass a
ring as one tuple ``(desc, smem, ready, free)``: the TMA descriptor of its [1, 1, BLOCK_N, D] boxes, the
``[KV_STAGES, 1, 1, BLOCK_N, D]`` slots, and per slot the mbarrier a landed copy completes (``ready``) and the one
its readers release it on (``free``; ``ready`` again where the readers refill the slot themselves). Tile sizes are
read from the descriptor and the slots, not passed. Gluon is
Triton's lower-level language (``triton.experimental.gluon``, Triton >= 3.5); without it ``gluon`` is None and
the ``triton.language`` kernels serve every call.
"""

from __future__ import annotations

import functools

import torch

try:  # Gluon: Triton >= 3.5 (the GPU image has 3.6)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    # TMA copies: 3.6 names them async_copy_*, 3.9 only async_load / async_store.
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # A barrier of the program's threads: thread_barrier in 3.6, barrier in 3.9.
    thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
except ImportError:  # pragma: no cover - older Triton: the triton.language kernel serves every call
    gluon = None

from ..core.tiles import descriptor_strides
from ..core.triton_compat import new_descriptor

# wgmma is Hopper's own instruction (compute capability 9.0 exactly; Blackwell has tcgen05 instead).
WGMMA_CAPABILITY = (9, 0)


if gluon is not None:

    @gluon.jit
    def issue_kv_load(ring, tile, source):
        """Start the TMA copy of K (or V) tile ``tile`` into its slot of ``ring``, if the tile exists; ``source =
        (b, h_kv, key_start, n_tiles)``: tile ``t`` holds keys from ``key_start + t · BLOCK_N`` of batch ``b``,
        K/V head ``h_kv``, and tiles ``n_tiles`` on do not exist."""
        desc, smem, ready, free = ring
        b, h_kv, key_start, n_tiles = source
        BLOCK_N: gl.constexpr = desc.block_type.shape[2]
        KV_STAGES: gl.constexpr = smem.type.shape[0]
        slot = tile % KV_STAGES
        exists = tile < n_tiles
        bar = ready.index(slot)
        mbarrier.expect(bar, desc.block_type.nbytes, pred=exists)
        tma_load(desc, [b, h_kv, key_start + tile * BLOCK_N, 0], bar, smem.index(slot), pred=exists)

    @gluon.jit
    def wait_kv(ring, tile):
        """Wait for K (or V) tile ``tile`` of ``ring`` and return its slot as a [BLOCK_N, HEAD_DIM] view."""
        desc, smem, ready, free = ring
        KV_STAGES: gl.constexpr = smem.type.shape[0]
        slot = tile % KV_STAGES
        mbarrier.wait(ready.index(slot), (tile // KV_STAGES) & 1)
        return smem.index(slot).reshape([desc.block_type.shape[2], desc.block_type.shape[3]])


def wgmma_available() -> bool:
    """True when this Triton has Gluon's Hopper API (the GPU image's 3.6 and CI's 3.9 do)."""
    return gluon is not None


@functools.lru_cache(maxsize=None)
def box_layout(box: tuple, dtype: torch.dtype):
    """The shared-memory layout (swizzled for TMA and wgmma) of one [1, 1, rows, head_dim] box."""
    return gl.NVMMASharedLayout.get_default_for(list(box), gl.float16 if dtype == torch.float16 else gl.bfloat16)


def gluon_descriptor(t: torch.Tensor, block_rows: int, head_dim: int):
    """A (B, H, L, D) TMA descriptor of ``t`` loading [1, 1, block_rows, head_dim] boxes (zeros past L and D).

    Filled in directly: the dataclass's own checks (alignment, box shape) cost host time on every
    call, four descriptors a call, and ``wgmma_eligible`` / the fixed configs already ensure them
    (TUNING.md#host-cost).
    """
    box = (1, 1, block_rows, head_dim)
    return new_descriptor(GluonTensorDescriptor, base=t, shape=list(t.shape), strides=descriptor_strides(t),
                          block_shape=list(box), layout=box_layout(box, t.dtype), padding="zero")
