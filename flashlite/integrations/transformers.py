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
* for rows padded by a 2-D ``attention_mask`` under the causal mask (or its sliding
  window), Lq == Lk from position 0 (training, a prefill), each row's tokens one
  run (left or right padding): their ids, an int64 (B, 1, 1, L) tensor, 0 on tokens
  and -1 on padding (``padded_documents``; one host read); the hook runs the tokens
  as variable-length sequences (``flash_attention_varlen``) and writes zeros at the
  padding, as FlashAttention's path through transformers does (eager's rows there
  average the values: only a target predicted from a padding position sees it);
* else a boolean (B, 1, Lq, Lk) mask, **True = keep**: flashlite's convention,
  passed through as is. The queries that see no key get zeros (SDPA would give
  NaN).

Sliding windows (Mistral, Gemma-2, gpt-oss). transformers' window keeps keys
``kv > q - sliding_window`` (the query and ``sliding_window - 1`` before it), and
its SDPA mask builder always materialises it (SDPA has no window). flashlite's
builder (``window_mask``) checks that the layer's mask function is that window
(not a chunked one), and then lets SDPA's builder skip the mask wherever it
would skip a plain causal one; the layer passes ``sliding_window``, and the hook
gives ``flash_attention`` ``window_size=(sliding_window - 1, 0)``: no L×L mask is
built or read, and the kernels skip the key tiles outside the window. Padded rows
take the window to the variable-length call; padding between a row's tokens, or a
cache's offsets, put it in the built mask as before.

Packed batches (padding-free training: several documents in one row). Two ways in, neither builds an L×L
mask:

* ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``: the layer's kwargs carry FlashAttention's
  ``cu_seq_lens_q``/``cu_seq_lens_k`` and ``max_length_q``/``max_length_k``; the hook calls
  ``flash_attention_varlen`` on the row, each document attending to itself alone, and does not read the mask.
* ``position_ids`` that restart (transformers packs by them without a cache and without a 2-D mask): its mask
  function is then the causal one (or the sliding window) on the positions, and-ed with the documents' block
  diagonal. flashlite's builder (``packed_documents``) recognises exactly that composition and returns the
  document ids, an int64 (B, 1, 1, L) tensor, instead of the (B, 1, L, L) mask; the hook turns them into
  ``cu_seqlens`` over the B·L tokens (``document_sequences``: two host reads, as FlashAttention's own path)
  and calls ``flash_attention_varlen``. Any other composition (overlays, chunks) gets SDPA's mask as before.

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

__all__ = ["NAME", "attention_forward", "document_sequences", "is_sliding_window", "packed_documents",
           "packed_sequences", "padded_documents", "register", "window_mask"]


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


def document_sequences(documents: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """``(cu_seqlens, max_seqlen, tokens)`` of the B·L tokens of (B, L) document ids (transformers' packed-sequence
    ids: equal within a document, changing where one starts; -1 on padding, ``padded_documents``), rows flattened
    one after the other: a sequence starts at every row's first token and wherever the id changes; padding is in
    none. ``tokens``: the flat indices of the tokens the sequences hold, in order, or None when they hold all.
    Reads two values on the host (how many tokens and sequences, the longest), as FlashAttention's path through
    transformers does."""
    flat = documents.flatten()
    tokens = (flat >= 0).nonzero().flatten()
    ids, rows = flat[tokens], tokens // documents.shape[-1]
    starts = torch.ones_like(tokens, dtype=torch.bool)
    starts[1:] = (ids[1:] != ids[:-1]) | (rows[1:] != rows[:-1])
    first = starts.nonzero().flatten()
    cu_seqlens = torch.cat([first, first.new_tensor([tokens.numel()])]).to(torch.int32)
    longest = int(cu_seqlens.diff().max()) if first.numel() else 0
    return cu_seqlens, longest, (None if tokens.numel() == flat.numel() else tokens)


def padded_documents(padding_mask: torch.Tensor) -> torch.Tensor | None:
    """The (B, L) ids ``document_sequences`` takes for rows padded as transformers' 2-D ``attention_mask``
    ((B, L), 1 or True on tokens, 0 or False on padding) says: 0 on tokens, -1 on padding; None when nothing is
    padded (the plain causal call is faster), or when padding lies between a row's tokens (its causal window on
    indices would then not be the one on the tokens that ``flash_attention_varlen`` applies). Reads two values
    on the host."""
    real = padding_mask.bool()
    runs = real[:, 0].long() + (real[:, 1:] & ~real[:, :-1]).sum(1)  # runs of tokens a row
    pads, most_runs = torch.stack([(~real).sum(), runs.max()]).tolist()
    if pads == 0 or most_runs > 1:
        return None
    return torch.where(real, 0, -1).to(torch.int64)


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
            (cut to Lk): bool True = keep, or float additive; or the int64 (B, 1, 1, L)
            document ids of packed rows that ``window_mask`` returns (``packed_documents``).
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
    if attention_mask is not None and not attention_mask.is_floating_point() and attention_mask.dtype != torch.bool:
        if attention_mask.dim() != 4 or attention_mask.shape[1:3] != (1, 1) or query.shape[2] != key.shape[2]:
            raise ValueError(f"an integer attention_mask holds packed rows' document ids, (B, 1, 1, L) with "
                             f"Lq = Lk = L; got shape {tuple(attention_mask.shape)}, Lq {query.shape[2]}, "
                             f"Lk {key.shape[2]}")
        return _attend_documents(module, query, key, value, scaling, attention_mask[:, 0, 0], kwargs), None
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


def _attend_packed(module, query, key, value, scaling, packed, kwargs, tokens=None) -> torch.Tensor:
    """``flash_attention_varlen`` on packed rows, ``packed = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k)`` over their B·L tokens (``tokens``: only those flat indices, the rest padding, whose output
    rows are zeros as in FlashAttention's path through transformers): (B, H, L, D) in, (B, L, H, D) contiguous
    out."""
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = None
    if kwargs.get("sliding_window") is not None:
        window = (int(kwargs["sliding_window"]) - 1, 0)
    batch, seqlen = query.shape[0], query.shape[2]
    q, k, v = (t.transpose(1, 2).reshape(batch * seqlen, t.shape[1], t.shape[3]) for t in (query, key, value))
    if tokens is not None:
        q, k, v = (t.index_select(0, tokens) for t in (q, k, v))
    out = flash_attention_varlen(q, k, v, *packed, causal=causal, scale=scaling, window_size=window,
                                 softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
    if tokens is not None:
        out = out.new_zeros(batch * seqlen, *out.shape[1:]).index_copy(0, tokens, out)
    return out.view(batch, seqlen, *out.shape[1:]).contiguous()


def _attend_documents(module, query, key, value, scaling, documents, kwargs) -> torch.Tensor:
    """Packed or padded rows given by their (B, L) document ids (``packed_documents``, ``padded_documents``):
    ``_attend_packed`` on their sequences (``document_sequences``)."""
    cu_seqlens, longest, tokens = document_sequences(documents)
    return _attend_packed(module, query, key, value, scaling, (cu_seqlens, cu_seqlens, longest, longest), kwargs,
                          tokens)


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


def _closure(fn, like) -> dict | None:
    """The closure of ``fn`` by variable name if ``fn`` is an instance of the inner function ``like`` is one of
    (the same code: made by the same transformers factory), else None."""
    if getattr(fn, "__code__", None) is not like.__code__ or fn.__closure__ is None:
        return None
    return dict(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in fn.__closure__)))


def packed_documents(mask_function, local_size: int | None = None) -> torch.Tensor | None:
    """The (B, L) document ids of packed rows when ``mask_function`` is transformers' mask of them and nothing
    else: the causal mask (with ``local_size``, its sliding window of that many keys) and-ed with the documents'
    block diagonal (``masking_utils``: ``and_masks(causal, packed_sequence_mask_function(documents))``, the causal
    mask on token indices up to transformers 5.17, on the rows' positions, ``remap_positions_for_packed_sequence
    (causal, position_ids)``, after); None for any other mask, or where this transformers builds it otherwise.
    Within a document the positions count up by one, so the causal mask (and the window) on positions, or on
    token indices, is the one on token indices that ``flash_attention_varlen`` applies."""
    try:
        from transformers.masking_utils import and_masks, causal_mask_function, packed_sequence_mask_function
    except ImportError:  # pragma: no cover - transformers < 4.53: no packed-sequence masks
        return None
    probe = torch.zeros(1, 1, dtype=torch.long)
    outer = _closure(mask_function, and_masks(causal_mask_function))
    if outer is None or len(outer.get("mask_functions", ())) != 2:
        return None
    inner, documents = outer["mask_functions"]
    packed = _closure(documents, packed_sequence_mask_function(probe))
    if packed is None:
        return None
    try:  # transformers > 5.17 always wraps the causal mask in the remap to positions: required then
        from transformers.masking_utils import remap_positions_for_packed_sequence
    except ImportError:
        pass
    else:
        remapped = _closure(inner, remap_positions_for_packed_sequence(causal_mask_function, probe))
        if remapped is None:
            return None
        inner = remapped.get("mask_function")
    return packed.get("packed_sequence_mask") if _causal(inner, local_size) else None


def _whole_rows(seqlen: int, builder_kwargs: dict, padded: bool = False) -> bool:
    """True when a mask builder's call (its keywords, as ``create_causal_mask`` passes them) is for ``seqlen``
    queries over as many keys, from position 0, without a padding mask (``padded``: with one of (B, seqlen)): what
    packed (padded) rows are built for."""
    kw = builder_kwargs
    padding = kw.get("attention_mask")
    rows_padded = padding is not None and padding.dim() == 2 and padding.shape[-1] == seqlen
    return (kw.get("q_length") == kw.get("kv_length") == seqlen and (rows_padded if padded else padding is None)
            and not kw.get("q_offset", 0) and not kw.get("kv_offset", 0))


def _causal(mask_function, local_size: int | None) -> bool:
    """True when ``mask_function`` is transformers' causal mask itself, or with ``local_size`` its sliding window of
    that many keys as its factory builds it (``and_masks(sliding_window_overlay(local_size), causal_mask_function)``),
    recognised by structure: an overlay or-ed onto the window (images' bidirectional blocks) may keep every
    position a probe (``is_sliding_window``) would look at."""
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

    if local_size is None:
        return mask_function is causal_mask_function
    outer = _closure(mask_function, and_masks(causal_mask_function))
    parts = outer.get("mask_functions", ()) if outer is not None else ()
    if len(parts) != 2 or parts[1] is not causal_mask_function:
        return False
    overlay = _closure(parts[0], sliding_window_overlay(1))
    return overlay is not None and overlay.get("sliding_window") == local_size


def window_mask(*args, local_size: int | None = None, mask_function=None, **kwargs):
    """SDPA's mask builder, but for a sliding window (``local_size``) it may return None where it would for a
    plain causal mask (no padding, Lq == Lk or Lq == 1): the hook then passes the window to the kernels. Packed
    rows (``packed_documents``), and rows padded by a 2-D ``attention_mask`` under the causal mask (or its window;
    ``padded_documents``), get their document ids as an int64 (B, 1, 1, L) tensor instead of a mask: the hook runs
    them as variable-length sequences, never forming an L x L mask."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    sdpa = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    documents = packed_documents(mask_function, local_size) if mask_function is not None else None
    if documents is not None and _whole_rows(documents.shape[-1], kwargs):
        return documents.to(torch.int64)[:, None, None, :]
    if (mask_function is not None and kwargs.get("q_length") is not None and kwargs.get("allow_is_causal_skip", True)
            and not torch.compiler.is_compiling() and _causal(mask_function, local_size)):
        # (allow_is_causal_skip: transformers turns it off for overlays, and a layer that adds to the mask
        # itself asks for the mask; compiling, the host read of padded_documents would break the graph)
        if _whole_rows(kwargs["q_length"], kwargs, padded=True):
            documents = padded_documents(kwargs["attention_mask"])
            if documents is not None:
                return documents[:, None, None, :]
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
