"""``flash_attention`` on a paged KV cache (``block_table``): against float64 on the same cache laid out
contiguously, on the kernels (the interpreter) and the PyTorch path; randomly permuted pages, page sizes 16 and
32, a sequence of 0 keys, FlashAttention's (num_blocks, page_size, H_kv, D) layout as a view; bad inputs."""

import pytest
import torch

import flashlite
from flashlite.core.runtime import pytorch_path

from .utils import assert_attention_close, attention_ref, randn


def paged_cache(lengths, page_size, kv_heads=2, head_dim=32, spare_blocks=3, flash_layout=False):
    """``(k_cache, v_cache, block_table, cache_seqlens, k, v)``: pages of a shuffled pool, and the same keys as
    contiguous (B, H_kv, max_blocks · page_size, D) caches."""
    batch = len(lengths)
    max_blocks = max(1, -(-max(lengths) // page_size))
    n_blocks = batch * max_blocks + spare_blocks
    shape = (n_blocks, page_size, kv_heads, head_dim) if flash_layout else (n_blocks, kv_heads, page_size, head_dim)
    k_cache, v_cache = randn(*shape), randn(*shape)
    if flash_layout:  # FlashAttention's layout, passed as a view
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    block_table = torch.randperm(n_blocks)[:batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    unpaged = [c[block_table.long()].transpose(1, 2).reshape(batch, kv_heads, max_blocks * page_size, head_dim)
               for c in (k_cache, v_cache)]
    return k_cache, v_cache, block_table, torch.tensor(lengths, dtype=torch.int32), *unpaged


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("seqlen_q, causal", [(1, False), (4, True), (3, False)])
@pytest.mark.parametrize("flash_layout", [False, True])
def test_paged_matches_contiguous(small_attention_tiles, page_size, seqlen_q, causal, flash_layout):
    lengths = [37, 0, 70, 16]
    k_cache, v_cache, table, seqlens, k, v = paged_cache(lengths, page_size, flash_layout=flash_layout)
    q = randn(len(lengths), 4, seqlen_q, 32)
    out, lse = flashlite.flash_attention(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                         causal=causal, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, cache_seqlens=seqlens, return_lse=True)
    assert_attention_close(out, ref, attention_ref(q, k, v, causal=causal, cache_seqlens=seqlens, dtype=q.dtype),
                           q.dtype)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # no keys: zeros


@pytest.mark.parametrize("page_size", [16, 48])
def test_pages_smaller_than_a_key_tile(page_size):
    # The interpreter's 32-key tiles: pages of 16 keys (and 48, not a multiple of the tile) are found row by row.
    from flashlite.attention import split_kv

    assert split_kv.paging_mode(page_size, 32) == split_kv.PAGED_ROWS
    lengths = [70, 5, 100]
    k_cache, v_cache, table, seqlens, k, v = paged_cache(lengths, page_size)
    q = randn(3, 4, 2, 32)
    out = flashlite.flash_attention(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, causal=True)
    ref = attention_ref(q, k, v, cache_seqlens=seqlens, causal=True)
    assert_attention_close(out, ref, attention_ref(q, k, v, cache_seqlens=seqlens, causal=True, dtype=q.dtype),
                           q.dtype)


def test_paging_mode():
    from flashlite.attention import split_kv

    assert split_kv.paging_mode(None, 128) == split_kv.PAGED_NONE
    assert split_kv.paging_mode(256, 128) == split_kv.PAGED_TILES
    assert split_kv.paging_mode(64, 128) == split_kv.PAGED_ROWS


def test_paged_config_deepens_the_pipeline_of_a_one_wave_grid():
    from flashlite.attention import split_kv
    from flashlite.attention.tuning import AttentionConfig

    bf16, fp32 = AttentionConfig(16, 128, 4, 3), AttentionConfig(16, 32, 4, 1)
    one_wave = split_kv.paged_config(bf16, 256, 132, 132)
    assert (one_wave.num_stages, one_wave.block_n) == (split_kv.PAGED_ONE_WAVE_STAGES, 128)
    assert split_kv.paged_config(bf16, 64, 8, 132).block_n == split_kv.PAGED_SMALL_BLOCK_N  # a lookup a tile
    assert split_kv.paged_config(bf16, 16, 8, 132).block_n == 128  # pages under a small tile: a lookup a row
    assert split_kv.paged_config(bf16, 64, 133, 132) == bf16  # a second wave: other programs hide the latency
    assert split_kv.paged_config(fp32, 64, 8, 132) == fp32  # one stage: IEEE dots on the FMA units


@pytest.mark.parametrize("variant", [dict(window_size=(20, 0), causal=True), dict(softcap=5.0),
                                     dict(alibi_slopes="heads"), dict(sinks=True), dict(num_splits=3)])
def test_paged_variants(small_attention_tiles, variant):
    variant = dict(variant)
    lengths = [50, 9, 33]
    k_cache, v_cache, table, seqlens, k, v = paged_cache(lengths, 16)
    q = randn(3, 4, 2, 32)
    if variant.pop("sinks", False):
        variant["sinks"] = randn(4)
    if variant.get("alibi_slopes") == "heads":
        variant["alibi_slopes"] = torch.rand(4) * 0.5
    num_splits = variant.pop("num_splits", None)
    out = flashlite.flash_attention(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                    num_splits=num_splits, **variant)
    ref = attention_ref(q, k, v, cache_seqlens=seqlens, **variant)
    assert_attention_close(out, ref, attention_ref(q, k, v, cache_seqlens=seqlens, dtype=q.dtype, **variant),
                           q.dtype)


def test_kernels_and_pytorch_path_agree(small_attention_tiles):
    k_cache, v_cache, table, seqlens, _, _ = paged_cache([45, 3, 64], 32)
    q = randn(3, 4, 1, 32)
    args = dict(cache_seqlens=seqlens, block_table=table, causal=True)
    kernels = flashlite.flash_attention(q, k_cache, v_cache, **args)
    with pytorch_path():
        torch_path = flashlite.flash_attention(q, k_cache, v_cache, **args)
    torch.testing.assert_close(kernels, torch_path, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("change, match", [
    (dict(block_table=lambda t: t.long()), "block_table must be int32"),
    (dict(block_table=lambda t: t[:1]), r"block_table must be \(B, max_blocks\)"),
    (dict(block_table=lambda t: t.t().contiguous().t()), "block_table's rows must be contiguous"),
    (dict(cache_seqlens=lambda s: None), "block_table needs cache_seqlens"),
    (dict(k=lambda k: k[:, :, :8], v=lambda v: v[:, :, :8]), "page size .* multiple of 16"),
    (dict(v=lambda v: v[:-1]), "k and v must hold the same pages"),
    (dict(block_table=lambda t: t + 100), r"block_table values must lie in \[0, num_blocks\)"),
    (dict(attn_mask=lambda m: torch.ones(2, 1, 1, 64, dtype=torch.bool)), "attn_mask is not supported"),
])
def test_bad_input_names_the_argument(change, match):
    k_cache, v_cache, table, seqlens, _, _ = paged_cache([30, 50], 16)
    args = dict(q=randn(2, 4, 1, 32), k=k_cache, v=v_cache, block_table=table, cache_seqlens=seqlens,
                attn_mask=None)
    for name, fn in change.items():
        args[name] = fn(args[name])
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises((ValueError, TypeError), match=match):
        flashlite.flash_attention(q, k, v, **args)


def test_paged_cache_is_inference_only():
    k_cache, v_cache, table, seqlens, _, _ = paged_cache([30, 50], 16)
    q = randn(2, 4, 1, 32, requires_grad=True)
    with pytest.raises(ValueError, match="block_table .* is for inference"):
        flashlite.flash_attention(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)
