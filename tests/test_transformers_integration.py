"""attn_implementation="fl_attention" (flashlite) in a tiny random Llama, against transformers' own "eager" and "sdpa"."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the optional extra flashlite[transformers]; CI installs it

import flashlite  # noqa: E402
import flashlite.integrations.transformers as fl_hf  # noqa: E402

from .utils import assert_attention_close  # noqa: E402

VOCAB = 128
SEQLEN = 12
N_PAD = [0, 5]  # left padding of each batch row: row 1's first queries see only padding keys


def tiny_llamas(*implementations: str, dtype: torch.dtype = torch.float32, hidden_size: int = 64,
                max_positions: int = 64) -> list[torch.nn.Module]:
    """One random tiny Llama (hidden 64, 2 layers, 4 heads, 2 K/V heads: GQA, head dim 16; ``hidden_size`` / 4
    the head dim otherwise) per implementation, all with the same weights, on the CPU."""
    fl_hf.register()
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
    )
    # A config per model: the attention layers read config._attn_implementation at every call.
    models = [
        transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl).to(dtype).eval()
        for impl in implementations
    ]
    for model, impl in zip(models, implementations):
        assert model.config._attn_implementation == impl
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    return models


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, L) and the 2-D attention mask (1 = token, 0 = padding), left-padded by N_PAD."""
    ids = torch.randint(0, VOCAB, (len(N_PAD), SEQLEN))
    mask = (torch.arange(SEQLEN)[None, :] >= torch.tensor(N_PAD)[:, None]).long()
    return ids, mask


@pytest.fixture
def attention_calls(monkeypatch):
    """Every call of the registered attention function during the test, as ``(query, key, attention_mask,
    kwargs)``, the hook itself doing the work (``fl_hf.register`` registers the recording one while the test runs,
    the hook again afterwards)."""
    calls = []
    forward = fl_hf.attention_forward

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append((query, key, attention_mask, kwargs))
        return forward(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setattr(fl_hf, "attention_forward", spy)
    fl_hf.register()
    yield calls
    monkeypatch.setattr(fl_hf, "attention_forward", forward)
    fl_hf.register()


def test_register():
    fl_hf.register()
    assert transformers.AttentionInterface().get(fl_hf.NAME) is fl_hf.attention_forward
    with pytest.raises(ValueError, match="contains 'flash'"):  # transformers would route it to FlashAttention-2
        fl_hf.register("flashlite")


@pytest.mark.parametrize("padded", [False, True])
def test_logits_match_eager_and_sdpa(padded):
    # Unpadded: transformers passes no mask and the layer's is_causal (flash_attention(causal=True));
    # padded: the (B, 1, 1, L) ids of ``padded_documents`` (the hook's mask builder), run as variable-length rows.
    flash, eager, sdpa = tiny_llamas(fl_hf.NAME, "eager", "sdpa")
    ids, mask = batch()
    kw = dict(attention_mask=mask) if padded else {}
    with torch.no_grad():
        logits = flash(ids, **kw).logits
        logits_eager = eager(ids, **kw).logits
        logits_sdpa = sdpa(ids, **kw).logits
    assert torch.isfinite(logits).all()  # padding queries see no key: zeros, never NaN
    real = mask.bool() if padded else torch.ones_like(mask, dtype=torch.bool)
    torch.testing.assert_close(logits[real], logits_eager[real], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[real], logits_sdpa[real], atol=1e-4, rtol=1e-4)


def test_bf16_padded_within_flash_attention_tolerance():
    # FlashAttention's rule on the logits: flashlite's bf16 error vs a float64 model at most twice
    # that of transformers' bf16 SDPA model, plus the bf16 floor. The float64 model is "sdpa":
    # "eager" in float64 gives NaN on the fully masked padding rows, which then spreads to every row.
    flash, sdpa = tiny_llamas(fl_hf.NAME, "sdpa", dtype=torch.bfloat16)
    (sdpa64,) = tiny_llamas("sdpa", dtype=torch.float64)
    sdpa64.load_state_dict(flash.state_dict())
    ids, mask = batch()
    real = mask.bool()
    with torch.no_grad():
        logits = flash(ids, attention_mask=mask).logits[real]
        ref64 = sdpa64(ids, attention_mask=mask).logits[real]
        logits_sdpa = sdpa(ids, attention_mask=mask).logits[real]
    assert_attention_close(logits, ref64, logits_sdpa, torch.bfloat16)


def test_kv_cache_continuation():
    # A prefill of 9 tokens, then 3 more against the cache (Lq = 3 < Lk = 12: causal aligned
    # bottom-right, through the mask transformers builds), against one eager pass over all 12.
    flash, eager = tiny_llamas(fl_hf.NAME, "eager")
    ids, mask = batch()
    with torch.no_grad():
        full = eager(ids, attention_mask=mask).logits
        cache = flash(ids[:, :9], attention_mask=mask[:, :9], use_cache=True).past_key_values
        step = flash(ids[:, 9:], attention_mask=mask, past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(step, full[:, 9:], atol=1e-4, rtol=1e-4)


def test_static_cache_prefill(attention_calls):
    # The prefill of an empty StaticCache: transformers passes no mask and K/V as long as the cache
    # (Lk = 20 > Lq = 9, the slots past 9 unused): the branch that drops the unused slots.
    flash, eager = tiny_llamas(fl_hf.NAME, "eager")
    ids, _ = batch()
    with torch.no_grad():
        cache = transformers.StaticCache(config=flash.config, max_cache_len=20)
        logits = flash(ids[:, :9], past_key_values=cache, use_cache=True).logits
        reference = eager(ids[:, :9]).logits
    calls = [(query.shape[2], key.shape[2], mask is None) for query, key, mask, _ in attention_calls]
    assert calls and all(call == (9, 20, True) for call in calls), calls
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)


def test_float_mask_is_an_additive_bias():
    # A 4-D float mask (0 or the dtype's minimum, as transformers < 4.53 builds it), one key longer
    # than K (cut to Lk), with a query row that sees no key: the same as the boolean mask on the
    # other rows, and on that one what SDPA gives under the same bias (finite: the mean of the values).
    q = torch.randn(2, 4, 6, 16)
    k, v = (torch.randn(2, 2, 7, 16) for _ in range(2))
    keep = torch.rand(2, 1, 6, 8) > 0.3
    keep[0, 0, 2] = False  # row 2 of batch 0 sees nothing
    keep[..., 0] |= torch.arange(6) != 2  # every other row sees at least key 0
    bias = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    out_float, _ = fl_hf.attention_forward(module, q, k, v, bias)
    out_bool, _ = fl_hf.attention_forward(module, q, k, v, keep)
    assert torch.isfinite(out_float).all()
    visible = torch.ones(2, 6, dtype=torch.bool)
    visible[0, 2] = False
    torch.testing.assert_close(out_float[visible], out_bool[visible], atol=1e-5, rtol=1e-5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=bias[..., :7])
    torch.testing.assert_close(out_float, sdpa.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_unsupported_arguments():
    q = torch.randn(1, 2, 3, 16)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="dropout"):
        fl_hf.attention_forward(module, q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match="position_bias"):
        fl_hf.attention_forward(module, q, q, q, None, position_bias=torch.zeros(1))
    out, weights = fl_hf.attention_forward(module, q, q, q, None)
    assert out.shape == (1, 3, 2, 16) and weights is None


def test_sinks_from_s_aux():
    # gpt-oss passes its per-head sinks as s_aux: they reach flash_attention's sinks.
    from .utils import attention_ref

    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    sinks = torch.randn(4)
    module = torch.nn.Module()
    out, _ = fl_hf.attention_forward(module, q, k, v, None, s_aux=sinks)
    ref = attention_ref(q, k, v, causal=True, sinks=sinks)
    torch.testing.assert_close(out.double(), ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


def tiny_gpt_oss(*implementations: str) -> list[torch.nn.Module]:
    """One random tiny gpt-oss (sinks in every layer; sliding-window and full layers; 2 experts) per implementation,
    fp32, the same weights (sinks random, not zeros)."""
    fl_hf.register()
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1, sliding_window=4,
        max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
    )
    models = [transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl).eval()
              for impl in implementations]
    with torch.no_grad():
        for layer in models[0].model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    return models


@pytest.mark.parametrize("padded", [False, True])
def test_gpt_oss_sinks_match_eager(padded):
    # gpt-oss: s_aux (sinks) reaches the kernel; its sliding window as window_size (unpadded) or in the mask.
    flash, eager = tiny_gpt_oss(fl_hf.NAME, "eager")
    ids, mask = batch()
    kw = dict(attention_mask=mask) if padded else {}
    with torch.no_grad():
        logits, logits_eager = flash(ids, **kw).logits, eager(ids, **kw).logits
    real = mask.bool() if padded else torch.ones_like(mask, dtype=torch.bool)
    torch.testing.assert_close(logits[real], logits_eager[real], atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # greedy decoding with a KV cache: the same tokens
        out = flash.generate(ids[:1], max_new_tokens=6, do_sample=False)
        out_eager = eager.generate(ids[:1], max_new_tokens=6, do_sample=False)
    assert torch.equal(out, out_eager)


def assert_logits_match(flash, eager, ids, mask) -> None:
    """fl_attention's logits against eager's, unpadded and left-padded (padding positions not compared)."""
    for kw in ({}, dict(attention_mask=mask)):
        with torch.no_grad():
            logits, logits_eager = flash(ids, **kw).logits, eager(ids, **kw).logits
        real = mask.bool() if kw else torch.ones_like(mask, dtype=torch.bool)
        torch.testing.assert_close(logits[real], logits_eager[real], atol=1e-4, rtol=1e-4)


def test_gemma2_softcap_matches_eager():
    # Gemma-2: logit softcapping (softcap reaches the kernel), head dim 32 with query_pre_attn_scalar, alternating
    # sliding-window and full layers (the window as window_size, or in the mask when padded), plain and padded.
    fl_hf.register()
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=4, attn_logit_softcapping=2.0,
        final_logit_softcapping=None, max_position_embeddings=64,
    )
    flash, eager = (transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl).eval()
                    for impl in (fl_hf.NAME, "eager"))
    with torch.no_grad():  # scores of several units, where tanh bends (random weights give ~0.1: the cap idles)
        for layer in flash.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    eager.load_state_dict(flash.state_dict())
    assert_logits_match(flash, eager, *batch())


def test_mistral_sliding_window_matches_eager(attention_calls):
    # Mistral: every layer a causal sliding window (4 keys: the query and 3 before it) over 12 tokens. Unpadded,
    # no mask is built: the hook gets None and sliding_window, and passes window_size=(3, 0); padded, the rows run
    # as variable-length sequences with the window (``padded_documents``' ids). Logits against eager, and greedy
    # decoding with a KV cache.
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, max_position_embeddings=64,
    )
    flash, eager, full = (transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
                          .eval() for impl in (fl_hf.NAME, "eager", "eager"))
    eager.load_state_dict(flash.state_dict())
    full.load_state_dict(flash.state_dict())
    full.config.sliding_window = None  # the same model without its window: the window must change the logits
    ids, mask = batch()
    for kw in ({}, dict(attention_mask=mask)):
        attention_calls.clear()
        with torch.no_grad():
            logits, logits_eager = flash(ids, **kw).logits, eager(ids, **kw).logits
        real = mask.bool() if kw else torch.ones_like(mask, dtype=torch.bool)
        torch.testing.assert_close(logits[real], logits_eager[real], atol=1e-4, rtol=1e-4)
        seen = [(m, call_kw.get("sliding_window")) for _, _, m, call_kw in attention_calls]
        assert all(window == 4 for _, window in seen)
        if kw:  # padded: the rows' ids, run as variable-length sequences with the window
            assert all(m is not None and m.dtype == torch.int64 for m, _ in seen)
        if not kw:
            assert all(m is None for m, _ in seen)  # causal + window: no (L, L) mask built
            with torch.no_grad():
                assert (full(ids).logits - logits).abs().max() > 1e-3
    with torch.no_grad():  # greedy decoding with a KV cache past the window: the same tokens
        out = flash.generate(ids[:1], max_new_tokens=6, do_sample=False)
        out_eager = eager.generate(ids[:1], max_new_tokens=6, do_sample=False)
    assert torch.equal(out, out_eager)


def test_window_probe_tells_sliding_from_chunked():
    from transformers import masking_utils as mu

    sliding = mu.and_masks(mu.sliding_window_overlay(4), mu.causal_mask_function)
    assert fl_hf.is_sliding_window(sliding, 4)
    assert not fl_hf.is_sliding_window(sliding, 5)
    assert not fl_hf.is_sliding_window(mu.causal_mask_function, 4)
    chunked = getattr(mu, "chunked_causal_mask_function", None)
    if chunked is not None:
        try:
            function = chunked(4, torch.zeros(1, dtype=torch.long))
        except TypeError:
            function = chunked(4)
        assert not fl_hf.is_sliding_window(function, 4)


def test_deepseek_v3_mla_head_dims_match_eager():
    # DeepSeek-V3's multi-head latent attention: q/k head dim 24 (16 without rope + 8 with), v head dim 16, so the
    # hook hands flash_attention a v of its own width (no padding to q's, as transformers' FlashAttention path
    # does). Logits against eager, plain and padded, and greedy decoding with a KV cache.
    fl_hf.register()
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, max_position_embeddings=64,
    )
    flash, eager = (transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl).eval()
                    for impl in (fl_hf.NAME, "eager"))
    eager.load_state_dict(flash.state_dict())
    ids, mask = batch()
    assert_logits_match(flash, eager, ids, mask)
    layer = flash.model.layers[0].self_attn
    assert layer.qk_head_dim != layer.v_head_dim  # the case under test: D = 24, Dv = 16
    with torch.no_grad():
        out = flash.generate(ids[:1], max_new_tokens=6, do_sample=False)
        out_eager = eager.generate(ids[:1], max_new_tokens=6, do_sample=False)
    assert torch.equal(out, out_eager)


def _documents_one_by_one(model, ids: torch.Tensor, lengths: list[list[int]]) -> torch.Tensor:
    """The logits of every document of every row run alone through ``model``, laid out as the packed rows."""
    rows = []
    for row, row_lengths in zip(ids, lengths):
        parts, start = [], 0
        for n in row_lengths:
            parts.append(model(row[None, start:start + n]).logits[0])
            start += n
        rows.append(torch.cat(parts))
    return torch.stack(rows)


@pytest.mark.parametrize("model_kind", ["llama", "mistral"])
@pytest.mark.parametrize("flash_kwargs", [False, True])
def test_packed_batch_trains_as_separate_documents(flash_kwargs, model_kind, monkeypatch):
    # Padding-free training: documents packed in rows, given by position_ids that restart at 0 (flashlite's mask
    # builder returns the document ids, never an L x L mask), or with FlashAttention's cu_seq_lens kwargs (one
    # row). Both run flash_attention_varlen. One training step's loss and gradients equal those of the documents
    # run one by one (eager attention, fp32); Mistral's sliding window (3 keys) holds inside each document.
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if model_kind == "llama":
        flash, eager = tiny_llamas(fl_hf.NAME, "eager")
    else:
        fl_hf.register()
        config = transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=3, max_position_embeddings=64,
        )
        flash, eager = (transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
                        for impl in (fl_hf.NAME, "eager"))
        eager.load_state_dict(flash.state_dict())
    flash.train()
    eager.train()
    varlen_calls, masks_built = [], []

    def spy(*args, **kwargs):
        varlen_calls.append(args[3])  # cu_seqlens_q
        return flashlite.flash_attention_varlen(*args, **kwargs)

    sdpa_builder = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]

    def builder_spy(*args, **kwargs):
        mask = sdpa_builder(*args, **kwargs)
        masks_built.append(mask)
        return mask

    monkeypatch.setattr(fl_hf, "flash_attention_varlen", spy)
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "sdpa", builder_spy)
    lengths = [[5, 9, 4]] if flash_kwargs else [[5, 9, 4], [1, 12, 2, 3]]  # the cu_seq_lens kwargs: one row
    ids = torch.randint(0, VOCAB, (len(lengths), 18))
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    kw = dict(position_ids=positions, use_cache=False)  # transformers packs by positions only without a cache
    if flash_kwargs:
        cu = torch.tensor([0, 5, 14, 18], dtype=torch.int32)
        kw.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)
    labels = ids.clone()
    labels[positions == 0] = -100  # no target across a document start
    logits = flash(ids, **kw).logits
    assert len(varlen_calls) == 2  # one call a layer
    assert all(mask is None or mask.shape[-2] < ids.shape[1] for mask in masks_built)  # no L x L mask built
    if not flash_kwargs:
        assert varlen_calls[0].tolist() == [0, 5, 14, 18, 19, 31, 33, 36]  # the rows' documents, one after another
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                             ignore_index=-100, reduction="sum")
    grads = torch.autograd.grad(loss, list(flash.parameters()))
    logits_eager = _documents_one_by_one(eager, ids, lengths)
    loss_eager = torch.nn.functional.cross_entropy(logits_eager[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                   ignore_index=-100, reduction="sum")
    grads_eager = torch.autograd.grad(loss_eager, list(eager.parameters()))
    torch.testing.assert_close(logits, logits_eager, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(loss, loss_eager, atol=1e-4, rtol=1e-4)
    for g, g_eager in zip(grads, grads_eager):
        torch.testing.assert_close(g, g_eager, atol=1e-4, rtol=1e-3)


def test_packed_documents_only_from_transformers_packed_causal_mask():
    # The builder hands over document ids only for exactly "causal (or its sliding window) on positions, and
    # the documents' block diagonal"; an overlay, a chunked mask or another window keeps transformers' mask.
    from transformers import masking_utils as mu

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    documents = mu.find_packed_sequence_indices(positions)

    def packed(mask_function):
        return mu.and_masks(mu.remap_positions_for_packed_sequence(mask_function, positions),
                            mu.packed_sequence_mask_function(documents))

    assert torch.equal(fl_hf.packed_documents(packed(mu.causal_mask_function)), documents)
    window = mu.sliding_window_causal_mask_function(3)
    assert torch.equal(fl_hf.packed_documents(packed(window), local_size=3), documents)
    assert fl_hf.packed_documents(packed(window)) is None  # a window the layer would not be told of
    assert fl_hf.packed_documents(packed(window), local_size=4) is None
    assert fl_hf.packed_documents(packed(mu.causal_mask_function), local_size=3) is None
    overlay = mu.and_masks(mu.causal_mask_function, lambda b, h, q, kv: kv != 1)
    assert fl_hf.packed_documents(packed(overlay)) is None
    chunked = mu.and_masks(mu.chunked_overlay(2, torch.zeros(1, dtype=torch.long)), mu.causal_mask_function)
    assert fl_hf.packed_documents(packed(chunked), local_size=2) is None
    assert fl_hf.packed_documents(mu.causal_mask_function) is None  # not packed
    # An overlay or-ed onto the window that keeps every position a probe would look at (an image's bidirectional
    # block far from them): not the window, by structure.
    block = mu.or_masks(window, lambda b, h, q, kv: (q >= 6) & (kv >= 6) & (q < 9) & (kv < 9))
    assert fl_hf.is_sliding_window(block, 3) and fl_hf.packed_documents(packed(block), local_size=3) is None
    # Where this transformers remaps positions, a packed mask without the remap is not its own: kept as a mask.
    bare = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(documents))
    assert fl_hf.packed_documents(bare) is None


def test_packed_documents_of_transformers_5_17(monkeypatch):
    # transformers 5.17 has no remap to positions: its packed mask is the causal mask (or window) on token
    # indices, and-ed with the documents' block diagonal.
    from transformers import masking_utils as mu

    documents = mu.find_packed_sequence_indices(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    monkeypatch.delattr(mu, "remap_positions_for_packed_sequence")
    window = mu.sliding_window_causal_mask_function(3)
    packed = mu.packed_sequence_mask_function(documents)
    assert torch.equal(fl_hf.packed_documents(mu.and_masks(mu.causal_mask_function, packed)), documents)
    assert torch.equal(fl_hf.packed_documents(mu.and_masks(window, packed), local_size=3), documents)
    overlay = mu.and_masks(mu.causal_mask_function, lambda b, h, q, kv: kv != 1)
    assert fl_hf.packed_documents(mu.and_masks(overlay, packed)) is None
    assert fl_hf.packed_documents(mu.and_masks(packed, mu.causal_mask_function)) is None  # not transformers' order
    cu, longest, tokens = fl_hf.document_sequences(torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 2]]))
    assert cu.tolist() == [0, 2, 5, 6, 9, 10] and cu.dtype == torch.int32 and longest == 3 and tokens is None
    # Padding (-1, ``padded_documents``) is in no sequence: the tokens' flat indices come back.
    cu, longest, tokens = fl_hf.document_sequences(torch.tensor([[-1, -1, 0, 0, 0], [0, 0, 0, 0, -1]]))
    assert cu.tolist() == [0, 3, 7] and longest == 4 and tokens.tolist() == [2, 3, 4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match="document ids"):  # an integer mask of another shape
        fl_hf.attention_forward(torch.nn.Module(), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16),
                                torch.randn(1, 2, 4, 16), torch.ones(1, 1, 4, 4, dtype=torch.int64))


def test_packed_row_detection():
    q = torch.randn(1, 4, 6, 16)
    cu = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    assert fl_hf.packed_sequences(q, dict(position_ids=torch.tensor([[0, 1, 2, 0, 1, 0]]))) is None  # no kwargs
    cu_q, cu_k, max_q, max_k = fl_hf.packed_sequences(q, dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu))
    assert cu_q.tolist() == [0, 3, 5, 6] and max_q == max_k == 3  # the longest read from the lengths
    assert fl_hf.packed_sequences(q, dict(cu_seq_lens_q=cu, max_length_q=7, max_length_k=7))[2:] == (7, 7)
    assert fl_hf.packed_sequences(torch.randn(2, 4, 6, 16), dict(cu_seq_lens_q=cu)) is None  # not one row


def test_padded_rows_run_as_variable_length_sequences(attention_calls):
    # A 2-D padding mask under the causal mask: the builder hands over (B, 1, 1, L) ids (``padded_documents``) and
    # the hook runs the rows' tokens as variable-length sequences (no L x L mask), left- or right-padded; padding
    # between a row's tokens keeps transformers' boolean mask, and no padding at all the plain causal call. Logits
    # at the tokens, the loss and every gradient against eager's.
    flash, eager = tiny_llamas(fl_hf.NAME, "eager")
    ids, left = batch()
    right = left.flip(-1)
    holes = torch.ones_like(left)
    holes[0, 3:5] = 0  # padding between tokens
    for mask, kind in ((left, torch.int64), (right, torch.int64), (holes, torch.bool), (torch.ones_like(left), None)):
        attention_calls.clear()
        # Targets only where a token predicts a token: the output rows of padding are zeros here (FlashAttention's
        # convention), and eager's are its uniform average over keys, so a pad must predict nothing.
        predicted_by_pad = torch.zeros_like(mask, dtype=torch.bool)
        predicted_by_pad[:, 1:] = mask[:, :-1] == 0
        labels = ids.masked_fill((mask == 0) | predicted_by_pad, -100)
        out = flash(ids, attention_mask=mask, labels=labels)
        out_eager = eager(ids, attention_mask=mask, labels=labels)
        seen = [None if m is None else m.dtype for _, _, m, _ in attention_calls]
        assert seen and all(dtype == kind for dtype in seen), (kind, seen)
        real = mask.bool()
        torch.testing.assert_close(out.logits[real], out_eager.logits[real], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.loss, out_eager.loss, atol=1e-5, rtol=1e-5)
        grads = torch.autograd.grad(out.loss, list(flash.parameters()))
        grads_eager = torch.autograd.grad(out_eager.loss, list(eager.parameters()))
        for g, g_eager in zip(grads, grads_eager):
            torch.testing.assert_close(g, g_eager, atol=1e-5, rtol=1e-4)
    # The builder keeps transformers' mask where the layer asks for it (allow_is_causal_skip=False: an overlay, or
    # a layer adding to the mask itself), or for a window with an overlay or-ed on.
    from transformers import masking_utils as mu

    builder = dict(batch_size=2, q_length=SEQLEN, kv_length=SEQLEN, attention_mask=left.bool())
    assert fl_hf.window_mask(mask_function=mu.causal_mask_function, **builder).dtype == torch.int64
    assert fl_hf.window_mask(mask_function=mu.causal_mask_function, allow_is_causal_skip=False,
                             **builder).dtype == torch.bool
    window = mu.sliding_window_causal_mask_function(3)
    assert fl_hf.window_mask(mask_function=window, local_size=3, **builder).dtype == torch.int64
    block = mu.or_masks(window, lambda b, h, q, kv: (q >= 6) & (kv >= 6))
    assert fl_hf.window_mask(mask_function=block, local_size=3, **builder).dtype == torch.bool
    padded = fl_hf.padded_documents(left)
    assert padded.dtype == torch.int64 and torch.equal(padded, torch.where(left.bool(), 0, -1))
    assert fl_hf.padded_documents(holes) is None and fl_hf.padded_documents(torch.ones_like(left)) is None


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["left", "right", "packed"])
def test_bf16_rows_on_the_gpu(layout):
    # On the GPU, a Llama of head dim 64 (the Hopper kernels' range) with rows padded left or right (run as
    # variable-length sequences) or packed by position_ids: bf16 logits at the tokens within FlashAttention's rule
    # of a float64 SDPA model, against transformers' bf16 SDPA model; the loss's gradients finite.
    sizes = dict(hidden_size=256, max_positions=512)  # head dim 64
    flash, sdpa = (m.cuda() for m in tiny_llamas(fl_hf.NAME, "sdpa", dtype=torch.bfloat16, **sizes))
    (sdpa64,) = tiny_llamas("sdpa", dtype=torch.float64, **sizes)
    sdpa64.load_state_dict(flash.state_dict())
    sdpa64.cuda()
    lengths = [200, 163, 80]
    if layout == "packed":
        ids = torch.randint(0, VOCAB, (1, sum(lengths)), device="cuda")
        positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
        kw = dict(position_ids=positions)
        real = torch.ones_like(ids, dtype=torch.bool)
    else:
        ids = torch.randint(0, VOCAB, (len(lengths), max(lengths)), device="cuda")
        real = torch.arange(max(lengths), device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None]
        if layout == "left":
            real = real.flip(-1)
        kw = dict(attention_mask=real.long())
    with torch.no_grad():
        logits = flash(ids, **kw).logits[real]
        ref64 = sdpa64(ids, **kw).logits[real]
        logits_sdpa = sdpa(ids, **kw).logits[real]
    assert_attention_close(logits, ref64, logits_sdpa, torch.bfloat16)
    loss = flash(ids, labels=ids.masked_fill(~real, -100), **kw).loss
    grads = torch.autograd.grad(loss, [p for p in flash.parameters() if p.requires_grad])
    assert all(torch.isfinite(g).all() for g in grads)
