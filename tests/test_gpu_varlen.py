"""``flash_attention_varlen`` on the GPU (``pytest -m gpu``): FlashAttention's varlen test matrix (the seqlen pairs
and head dims of its ``test_flash_attn_varlen_output``), MHA/GQA/MQA, causal and not, fp16/bf16 (and fp32 on a
few), output, LSE and gradients against float64 per sequence, on poisoned memory."""

import pytest
import torch

import flashlite

from .utils import check_attention_varlen, cu_seqlens, poison

pytestmark = pytest.mark.gpu

SEQLENS = [(1, 147), (113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024),
           (1023, 1024), (1024, 1023), (2048, 2048)]
HEAD_DIMS = [32, 64, 96, 128, 192, 256]


def random_lengths(batch: int, longest: int, generator: torch.Generator) -> list[int]:
    """``batch`` lengths in [0, longest], the first one the longest, one of them 0 when batch > 2."""
    lengths = torch.randint(0, longest + 1, (batch,), generator=generator).tolist()
    lengths[0] = longest
    if batch > 2:
        lengths[-1] = 0
    return lengths


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mha_type", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlen_q, seqlen_k", SEQLENS)
def test_varlen_matrix(seqlen_q, seqlen_k, head_dim, mha_type, causal, dtype):
    generator = torch.Generator().manual_seed(seqlen_q * 7919 + seqlen_k * 31 + head_dim)
    batch, heads = 4, 6
    kv_heads = {"mha": 6, "gqa": 2, "mqa": 1}[mha_type]
    lengths_q = random_lengths(batch, seqlen_q, generator)
    lengths_k = random_lengths(batch, seqlen_k, generator)
    poison()
    q = torch.randn(sum(lengths_q), heads, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lengths_k), kv_heads, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lengths_k), kv_heads, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    check_attention_varlen(q, k, v, lengths_q, lengths_k, causal=causal)


@pytest.mark.parametrize("variant", [dict(window_size=(64, 16)), dict(softcap=20.0, causal=True),
                                     dict(alibi=True, causal=True), dict(sinks=True, causal=True),
                                     dict(head_dim_v=64), dict(dtype=torch.float32, causal=True)])
def test_varlen_variants(variant):
    variant = dict(variant)
    dtype = variant.pop("dtype", torch.bfloat16)
    head_dim_v = variant.pop("head_dim_v", 128)
    lengths_q, lengths_k = [300, 0, 77, 512, 1], [310, 5, 77, 600, 0]
    poison()
    q = torch.randn(sum(lengths_q), 8, 128, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lengths_k), 2, 128, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lengths_k), 2, head_dim_v, device="cuda", dtype=dtype, requires_grad=True)
    if variant.pop("sinks", False):
        variant["sinks"] = torch.randn(8, device="cuda", requires_grad=True)
    if variant.pop("alibi", False):
        variant["alibi_slopes"] = torch.rand(8, device="cuda") * 0.3
    check_attention_varlen(q, k, v, lengths_q, lengths_k, **variant)


def test_varlen_graph_capture_replays():
    # No host reads of the lengths: a CUDA graph replays the call with new lengths written into cu_seqlens.
    lengths = [100, 37, 250]
    q, k, v = (torch.randn(400, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = cu_seqlens(lengths, "cuda")
    flashlite.flash_attention_varlen(q, k, v, cu, cu, 256, 256, causal=True)  # planned and built before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashlite.flash_attention_varlen(q, k, v, cu, cu, 256, 256, causal=True)
    for new in ([200, 200, 0], [1, 255, 144]):
        cu.copy_(cu_seqlens(new, "cuda"))
        graph.replay()
        expected = flashlite.flash_attention_varlen(q, k, v, cu, cu, 256, 256, causal=True)
        assert torch.equal(out, expected)
