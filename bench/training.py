"""Training steps end to end: flashlite against SDPA in the same process, on the same model and data.

    python bench/training.py [--steps 6] [--out DIR]
    python bench/training.py --packed [--steps 6] [--out DIR]   # padding-free fine-tuning -> training_packed.*
    python bench/training.py --packed --profile   # and each layout's step under torch.profiler -> training_packed_profile.txt

Two models, each trained for ``--steps`` timed steps (after two untimed ones) with attention by flashlite and by
SDPA (PyTorch's default backend choice), from the same initial weights and batches:

* ``tiny_gpt``: examples/train_tiny_gpt.py's model (``flashlite.nn.MultiheadAttention``; the SDPA run swaps
  its ``flash_attention`` for ``F.scaled_dot_product_attention``), d_model 1024, 8 heads (D = 128), 8 layers,
  batch 8 x 2048, bf16 autocast, AdamW.
* ``llama_d128`` / ``llama_d256``: a transformers Llama built from a config (random weights, bf16 parameters),
  4 layers, hidden 2048, 16 heads of 128 (4 K/V heads) or 8 of 256 (2 K/V heads), batch 2 x 4096,
  ``attn_implementation`` "fl_attention" against "sdpa"; loss = next-token cross-entropy, AdamW.

Tokens/s = batch x length x steps / wall time (synchronized). Writes ``training.{json,md}``.

``--packed``: a fine-tuning step of the D = 128 Llama on documents of mixed lengths (``bench/varlen.py``'s
long-tailed mix, 16K tokens), laid out three ways and trained from the same weights: packed in one row whose
``position_ids`` restart at each document (transformers' padding-free format; flashlite runs
``flash_attention_varlen``, SDPA gets transformers' block-diagonal mask), and padded to the longest document
(one row a document, a 2-D padding mask) for flashlite. Tokens/s counts the documents' tokens only. Writes
``training_packed.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))
sys.path.insert(0, os.path.join(REPO, "examples"))

import flashlite.nn  # noqa: E402
from common import environment, markdown_table, results_dir, write_results  # noqa: E402


def sdpa_like_flashlite(q, k, v, *, causal=False, attn_mask=None, **_):
    """``flash_attention``'s (B, H, L, D) call served by SDPA (GQA through ``enable_gqa``)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal and attn_mask is None,
                                          enable_gqa=k.shape[1] != q.shape[1])


def _synchronize() -> None:
    if torch.cuda.is_available():  # (a CPU run only checks the script: packed_llama(..., device="cpu"))
        torch.cuda.synchronize()


def tokens_per_s(step, batch: int, length: int, steps: int) -> float:
    for _ in range(2):
        step()
    _synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _synchronize()
    return batch * length * steps / (time.perf_counter() - start)


def tiny_gpt(attention: str, steps: int) -> float:
    from train_tiny_gpt import TinyGPT

    batch, length, vocab = 8, 2048, 96
    torch.manual_seed(0)
    model = TinyGPT(vocab, length, 1024, 8, 8).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (batch, length + 1), device="cuda")
    original = flashlite.nn.flash_attention
    if attention == "sdpa":
        flashlite.nn.flash_attention = sdpa_like_flashlite

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    try:
        return tokens_per_s(step, batch, length, steps)
    finally:
        flashlite.nn.flash_attention = original


LLAMA_SIZES = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4)


def llama_model(attention: str, head_dim: int, max_positions: int, device="cuda") -> torch.nn.Module:
    """A transformers Llama of ``LLAMA_SIZES`` with heads of ``head_dim`` (a quarter as many K/V heads), random
    weights from seed 0, bf16 parameters, attention by flashlite ("flashlite") or SDPA ("sdpa")."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import flashlite.integrations.transformers as fl_hf

    fl_hf.register()
    heads = LLAMA_SIZES["hidden_size"] // head_dim
    config = LlamaConfig(**LLAMA_SIZES, num_attention_heads=heads, num_key_value_heads=heads // 4, head_dim=head_dim,
                         max_position_embeddings=max_positions)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        config, attn_implementation=fl_hf.NAME if attention == "flashlite" else "sdpa").to(device, torch.bfloat16)


def hf_step(model: torch.nn.Module, inputs: dict):
    """One fine-tuning step of a transformers model on ``inputs`` (its keywords, labels among them): the loss's
    backward and an AdamW step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        loss = model(**inputs).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return step


def llama(attention: str, head_dim: int, steps: int) -> float:
    model = llama_model(attention, head_dim, max_positions=4096)
    batch, length = 2, 4096
    ids = torch.randint(0, LLAMA_SIZES["vocab_size"], (batch, length), device="cuda")
    return tokens_per_s(hf_step(model, dict(input_ids=ids, labels=ids)), batch, length, steps)


PACKED_TOKENS = 16384


def packed_documents_batch(lengths: list[int], vocab: int, device) -> dict:
    """The documents of ``lengths`` as the inputs of both layouts: ``packed`` (one row, position_ids restarting at
    each document, labels -100 at document starts: no target across a boundary) and ``padded`` (a row a
    document, right-padded to the longest, a 2-D attention mask, labels -100 on padding)."""
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[positions == 0] = -100
    longest = max(lengths)
    padded_ids = torch.zeros(len(docs), longest, dtype=torch.long)
    mask = torch.zeros(len(docs), longest, dtype=torch.long)
    for row, doc in enumerate(docs):
        padded_ids[row, :len(doc)] = doc
        mask[row, :len(doc)] = 1
    padded_labels = padded_ids.masked_fill(mask == 0, -100)
    return {
        "packed": dict(input_ids=ids.to(device), position_ids=positions.to(device), labels=labels.to(device),
                       use_cache=False),
        "padded": dict(input_ids=padded_ids.to(device), attention_mask=mask.to(device),
                       labels=padded_labels.to(device), use_cache=False),
    }


def packed_llama(attention: str, layout: str, lengths: list[int], steps: int, device: str = "cuda",
                 profile: list | None = None) -> float:
    """Tokens/s (documents' tokens) of fine-tuning steps of the D = 128 Llama of ``llama`` with ``attention``
    ("flashlite" or "sdpa") on the documents ``lengths`` laid out as ``layout`` (``packed_documents_batch``).
    ``profile``: a list that gets one step's torch.profiler table (the kernels and operators of most device time)
    after the timed steps."""
    model = llama_model(attention, 128, max_positions=PACKED_TOKENS, device=device)
    step = hf_step(model, packed_documents_batch(lengths, LLAMA_SIZES["vocab_size"], device)[layout])
    rate = tokens_per_s(step, 1, sum(lengths), steps)
    if profile is not None:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            _synchronize()
        profile.append(f"## {attention} {layout}: {rate:,.0f} tokens/s\n"
                       + prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    return rate


def run_packed(args) -> None:
    """``--packed``: the three layouts of one document mix (module docstring)."""
    from varlen import document_lengths

    lengths = document_lengths("longtail", PACKED_TOKENS)
    rows = []
    profiles = [] if args.profile else None
    for attention, layout in (("flashlite", "packed"), ("sdpa", "packed"), ("flashlite", "padded")):
        rate = packed_llama(attention, layout, lengths, args.steps, profile=profiles)
        rows.append({"attention": attention, "layout": layout, "tokens_per_s": rate})
        torch.cuda.empty_cache()
        print(f"{attention} {layout}: {rate:,.0f} tokens/s", flush=True)
    mine = rows[0]["tokens_per_s"]
    for row in rows:
        row["x_flashlite_packed"] = mine / row["tokens_per_s"]
    meta = environment() | {"steps": args.steps, "documents": len(lengths), "tokens": sum(lengths),
                            "longest": max(lengths), "mix": "bench/varlen.py longtail", "model": "Llama D = 128, 4 layers"}
    cols = ["attention", "layout", "tokens_per_s", "x_flashlite_packed"]
    write_results("training_packed", results_dir(args.out), meta, rows, cols,
                  "Padding-free fine-tuning steps, tokens/s of the documents (bf16)")
    print(markdown_table(rows, cols))
    if profiles:
        path = os.path.join(results_dir(args.out), "training_packed_profile.txt")
        with open(path, "w") as f:
            f.write(f"# {environment()['command']}\n\n" + "\n\n".join(profiles) + "\n")
        print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=None)
    parser.add_argument("--packed", action="store_true", help="padding-free fine-tuning instead (training_packed.*)")
    parser.add_argument("--profile", action="store_true", help="with --packed: one step of each under torch.profiler")
    args = parser.parse_args()
    if args.packed:
        run_packed(args)
        return
    runs = {"tiny_gpt": lambda a: tiny_gpt(a, args.steps),
            "llama_d128": lambda a: llama(a, 128, args.steps),
            "llama_d256": lambda a: llama(a, 256, args.steps)}
    rows = []
    for name, run in runs.items():
        row = {"model": name}
        for attention in ("flashlite", "sdpa"):
            row[f"{attention}_tokens_per_s"] = run(attention)
            torch.cuda.empty_cache()
        row["x_sdpa"] = row["flashlite_tokens_per_s"] / row["sdpa_tokens_per_s"]
        rows.append(row)
        print(f"{name}: flashlite {row['flashlite_tokens_per_s']:,.0f} tokens/s, sdpa {row['sdpa_tokens_per_s']:,.0f} "
              f"({row['x_sdpa']:.2f}x)", flush=True)
    cols = ["model", "flashlite_tokens_per_s", "sdpa_tokens_per_s", "x_sdpa"]
    write_results("training", results_dir(args.out), environment() | {"steps": args.steps}, rows, cols,
                  "Training steps, tokens/s (bf16)")
    print(markdown_table(rows, cols))


if __name__ == "__main__":
    main()
