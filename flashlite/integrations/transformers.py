"""HuggingFace transformers on flashlite: ``attn_implementation="fl_attention"``.

    import flashlite.integrations.transformers as fl_hf
    fl_hf.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=fl_hf.NAME)  # "fl_attention"

Why not "flashlite": transformers sends every implementation whose name
contains "flash" down its FlashAttention-2 path (``is_flash_attention_requested``
is ``"flash" in name`` in transformers 5.x: unpadded varlen inputs, and a hub
kernel looked up under that name), which flashlite's (B, H, L, D) function is
not. So the name avoids that substring (and "sdpa", "flex", "paged", which
transformers matches too).

``register()`` puts ``attention_forward`` in transformers' ``AttentionInterface``,
which every recent model's attention layer looks up by
``config._attn_implementation``. The layer calls it with
``query`` (B, H, Lq, D), ``key``/``value`` (B, H_kv, Lk, D) (K/V heads not
repeated: flash_attention does GQA itself), the 4-D ``attention_mask`` or None,
``scaling`` and ``dropout``; it returns ``(attn_output (B, Lq, H, D), None)``.

Masks. transformers builds the mask with the function that its
``AttentionMaskInterface`` holds under the same name, and hands a custom
implementation without one *no mask at all* (padding would be ignored), so
``register()`` also registers the mask builder of "sdpa" (transformers >= 4.53).
That builder gives

* None when the mask is plain causal (no padding, Lq == Lk or Lq == 1): then
  the layer's ``is_causal`` decides, as in SDPA;
* else a boolean (B, 1, Lq, Lk) mask, **True = keep**: flashlite's convention,
  passed through as is. With left padding, the queries at padding positions
  see no key; flash_attention gives them zeros (SDPA would give NaN).

Sliding windows (Mistral, Gemma-2, gpt-oss). transformers' window keeps keys
``kv > q - sliding_window`` (the query and ``sliding_window - 1`` before it), and
its SDPA mask builder always materialises it (SDPA has no window). flashlite's
builder (``window_mask``) checks that the layer's mask function is that window
(not a chunked one), and then lets SDPA's builder skip the mask wherever it
would skip a plain causal one; the layer passes ``sliding_window``, and the hook
gives ``flash_attention`` ``window_size=(sliding_window - 1, 0)``: no L×L mask is
built or read, and the kernels skip the key tiles outside the window. With
padding the window is in the built mask as before.

Packed batches (padding-free training: several documents in one row, ``DataCollatorWithFlattening(
return_flash_attn_kwargs=True)``). The layer's kwargs carry FlashAttention's ``cu_seq_lens_q``/``cu_seq_lens_k``
and ``max_length_q``/``max_length_k``; the hook then calls ``flash_attention_varlen`` on the row, each document
attending to itself alone, and does not read the mask. transformers' mask builder still makes its
block-diagonal mask of the row's ``position_ids`` (it does not see those kwargs). A packed row given by
``position_ids`` alone goes through that mask, as transformers' SDPA path treats it (transformers packs only
without a cache; the hook cannot tell, so it leaves that to the mask).

A float mask (additive, 0 or the dtype's minimum: what transformers < 4.53
builds for a custom name, or a user's 4-D mask) is passed through as an additive
bias; a row masked with the minimum everywhere gives what SDPA gives there (the
mean of the values: the scores are lost to the bias's rounding).
"""

from __future__ import annotations

import torch

from ..attention import flash_attention, flash_attention_varlen

# Registered name. Must not contain "flash", "sdpa", "flex" or "paged": transformers matches those substrings.
NAME = "fl_attention"
_RESERVED_SUBSTRINGS = ("flash", "sdpa", "flex", "paged")

__all__ = ["NAME", "attention_forward", "is_sliding_window", "packed_sequences", "register", "window_mask"]


def packed_sequences(query: torch.Tensor, kwargs: dict) -> tuple | None:
    """``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` of a packed row (a batch of one row holding
    several documents) from FlashAttention's kwargs (``cu_seq_lens_q`` ...), or None."""
    if query.shape[0] != 1 or kwargs.get("cu_seq_lens_q") is None:
        return None
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs.get("cu_seq_lens_k", kwargs["cu_seq_lens_q"])
    max_q = kwargs.get("max_length_q")
    max_k = kwargs.get("max_length_k", max_q)
    if max_q is None or max_k is None:  # read from the lengths: one host synchronisation
        max_q, max_k = int(cu_q.diff().max()), int(cu_k.diff().max())
    return cu_q.to(torch.int32).contiguous(), cu_k.to(torch.int32).contiguous(), int(max_q), int(max_k)


def attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0, **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature on ``flashlite.flash_attention``.

    Args:
        module: the calling attention layer; its ``is_causal`` (default True) is
            used when no mask is given (``kwargs["is_causal"]`` wins if present).
        query: (B, H, Lq, D). key, value: (B, H_kv, Lk, D) with ``H % H_kv == 0``.
        attention_mask: None, or 4-D broadcastable to (B, H, Lq, Lk'), Lk' >= Lk
            (cut to Lk): bool True = keep, or float additive.
        scaling: the score scale; default ``1 / sqrt(D)``.
        dropout: must be 0.0 (flashlite has no attention dropout).
        **kwargs: ``s_aux`` (gpt-oss's attention sinks, (H,)) and ``softcap``
            (Gemma-2's logit softcapping) go to ``flash_attention``'s ``sinks`` and
            ``softcap``; ``sliding_window`` becomes ``window_size=(sliding_window - 1,
            0)`` when no mask is given (a given mask holds the window already);
            ``position_bias`` is not supported and raises when set; the rest (cache
            details) are ignored.

    Returns:
        ``(attn_output, None)``: attn_output (B, Lq, H, D) contiguous, in query's dtype;
        no attention weights (they are never formed).
    """
    if dropout:
        raise ValueError(f"dropout={dropout} is not supported by flashlite's attention (set attention_dropout=0.0)")
    for name in ("position_bias",):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name} is not supported by attn_implementation={NAME!r}; use 'eager' or 'sdpa'")
    packed = packed_sequences(query, kwargs)
    if packed is not None:
        return _attend_packed(module, query, key, value, scaling, packed, kwargs), None
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    causal = False
    window_size = None
    if attention_mask is not None:
        if attention_mask.dim() != 4:
            raise ValueError(f"attention_mask must be 4-D (B, 1 or H, Lq, Lk), got shape {tuple(attention_mask.shape)}")
        attention_mask = attention_mask[..., :seqlen_k]  # some versions build it to the cache's full length
    else:
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        causal = bool(is_causal) and seqlen_q > 1  # one query row sees every key either way
        if causal and seqlen_k > seqlen_q:
            # transformers omits the mask with Lk > Lq > 1 only for the prefill of an empty static cache:
            # the keys past Lq are unused slots and "causal" means top-left, as SDPA's is_causal.
            # flashlite aligns causal bottom-right, so drop the unused slots, as transformers' SDPA path does.
            key, value = key[:, :, :seqlen_q], value[:, :, :seqlen_q]
        if kwargs.get("sliding_window") is not None:  # keys kv > q - sliding_window, aligned bottom-right
            window_size = (int(kwargs["sliding_window"]) - 1, 0)
    out = flash_attention(query, key, value, causal=causal, scale=scaling, attn_mask=attention_mask,
                          softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"),
                          window_size=window_size)  # (B, H, Lq, D)
    return out.transpose(1, 2).contiguous(), None  # (B, Lq, H, D)


def _attend_packed(module, query, key, value, scaling, packed, kwargs) -> torch.Tensor:
    """``flash_attention_varlen`` on a packed row: (1, H, L, D) in, (1, L, H, D) contiguous out."""
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = None
    if kwargs.get("sliding_window") is not None:
        window = (int(kwargs["sliding_window"]) - 1, 0)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (L, H, D) views
    out = flash_attention_varlen(q, k, v, *packed, causal=causal, scale=scaling, window_size=window,
                                 softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
    return out.unsqueeze(0).contiguous()


def is_sliding_window(mask_function, window: int) -> bool:
    """True when transformers' ``mask_function(b, h, q, kv)`` is its causal sliding window of ``window`` keys
    (``kv <= q`` and ``kv > q - window``), not a chunked mask (which also sets a ``local_size``): probed at
    the positions where the two differ."""
    def keeps(q: int, kv: int) -> bool:
        zero = torch.tensor(0)
        return bool(mask_function(zero, zero, torch.tensor(q), torch.tensor(kv)))

    try:
        return (keeps(window, 1) and not keeps(window, 0) and keeps(2 * window - 1, window)
                and not keeps(window, window + 1))
    except Exception:  # a mask function that cannot be probed so: keep transformers' own mask
        return False


def window_mask(*args, local_size: int | None = None, mask_function=None, **kwargs):
    """SDPA's mask builder, but for a sliding window (``local_size``) it may return None where it would for a
    plain causal mask (no padding, Lq == Lk or Lq == 1): the hook then passes the window to the kernels."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    sdpa = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    if mask_function is not None:
        kwargs["mask_function"] = mask_function
    if local_size is not None and mask_function is not None and is_sliding_window(mask_function, local_size):
        local_size = None
    return sdpa(*args, local_size=local_size, **kwargs)


def register(name: str = NAME) -> None:
    """Make ``attn_implementation=name`` (default ``"fl_attention"``) available to transformers models (idempotent).

    Registers ``attention_forward`` in ``transformers.AttentionInterface`` and,
    where transformers has one (>= 4.53), SDPA's mask builder under the same name
    in ``AttentionMaskInterface`` (boolean masks, True = keep; None when causal
    alone suffices, or causal and a sliding window: ``window_mask``).

    Raises:
        ValueError: ``name`` contains a substring that transformers routes elsewhere ("flash", ...).
    """
    reserved = [part for part in _RESERVED_SUBSTRINGS if part in name.lower()]
    if reserved:
        raise ValueError(
            f"name {name!r} contains {reserved[0]!r}: transformers would treat it as its own "
            f"{reserved[0]} implementation; choose another (default {NAME!r})"
        )
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention_forward)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # pragma: no cover - before 4.53 models build an additive 4-D mask for custom names
        return
    if "sdpa" in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, window_mask)
