"""Paged KV caches on the GPU (``pytest -m gpu``): page sizes 16 to 256, decoding and chunked prefill, GQA,
against float64 on the same keys laid out contiguously, on poisoned memory."""

import pytest
import torch

import flashlite

from .utils import assert_attention_close, attention_ref, poison


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 48, 64, 128, 256])
@pytest.mark.parametrize("seqlen_q, causal", [(1, False), (1, True), (16, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_decoding(page_size, seqlen_q, causal, dtype):
    lengths = [5000, 0, 1, 777, 3000]
    batch, heads, kv_heads, head_dim = len(lengths), 32, 8, 128
    max_blocks = -(-max(lengths) // page_size)
    n_blocks = batch * max_blocks + 7
    poison()
    k_cache = torch.randn(n_blocks, page_size, kv_heads, head_dim, device="cuda", dtype=dtype).transpose(1, 2)
    v_cache = torch.randn(n_blocks, page_size, kv_heads, head_dim, device="cuda", dtype=dtype).transpose(1, 2)
    table = torch.randperm(n_blocks, device="cuda")[:batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, seqlen_q, head_dim, device="cuda", dtype=dtype)
    out = flashlite.flash_attention(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, causal=causal)
    k, v = (c[table.long()].transpose(1, 2).reshape(batch, kv_heads, -1, head_dim) for c in (k_cache, v_cache))
    ref = attention_ref(q, k, v, causal=causal, cache_seqlens=seqlens)
    assert_attention_close(out, ref, attention_ref(q, k, v, causal=causal, cache_seqlens=seqlens, dtype=dtype), dtype)
    contiguous = flashlite.flash_attention(q, k, v, cache_seqlens=seqlens, causal=causal)
    torch.testing.assert_close(out, contiguous, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 256])  # a lookup a row, a lookup a tile
@pytest.mark.parametrize("variant", [dict(window_size=(700, 0), causal=True), dict(softcap=20.0),
                                     dict(alibi_slopes=True), dict(sinks=True), dict(num_splits=7)])
def test_paged_variants(page_size, variant):
    variant = dict(variant)
    lengths = [4100, 1, 2999]
    batch, heads, kv_heads, head_dim = len(lengths), 16, 4, 128
    max_blocks = -(-max(lengths) // page_size)
    n_blocks = batch * max_blocks + 3
    poison()
    k_cache, v_cache = (torch.randn(n_blocks, kv_heads, page_size, head_dim, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    table = torch.randperm(n_blocks, device="cuda")[:batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, 2, head_dim, device="cuda", dtype=torch.bfloat16)
    if variant.pop("alibi_slopes", False):
        variant["alibi_slopes"] = torch.rand(heads, device="cuda") * 0.05
    if variant.pop("sinks", False):
        variant["sinks"] = torch.randn(heads, device="cuda")
    num_splits = variant.pop("num_splits", None)
    out = flashlite.flash_attention(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                    num_splits=num_splits, **variant)
    k, v = (c[table.long()].transpose(1, 2).reshape(batch, kv_heads, -1, head_dim) for c in (k_cache, v_cache))
    ref = attention_ref(q, k, v, cache_seqlens=seqlens, **variant)
    assert_attention_close(out, ref, attention_ref(q, k, v, cache_seqlens=seqlens, dtype=q.dtype, **variant),
                           q.dtype)
