"""Headline tables from a results folder's JSON, for the README and the folder's own README.md (no GPU needed).

    python bench/report.py [DIR]            # print the tables (default bench/results/h200)
    python bench/report.py [DIR] --write    # also write DIR/README.md

Each table keeps flashlite's column, the peers', the ratio to the best peer
and the fraction of the ceiling measured in the same run (the files' meta:
copy bandwidth, matrix rate). Missing files are skipped.
"""

from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _fmt(value, digits: int = 0) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if digits else f"{value:.0f}"
    return str(value)


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell if isinstance(cell, str) else _fmt(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _load(folder: str, name: str) -> dict | None:
    path = os.path.join(folder, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)


def softmax_table(data: dict) -> str:
    # quack: a peer from 2026-11-28 on (None where it did not import or refused the shape)
    rows = [[_short(r["dtype"]), f"{r['M']} × {r['N']}", r["flashlite"], f"{r['frac_copy']:.0%}", r["torch"],
             r["compile"], r.get("quack"), f"{r['x_best_peer']:.2f}"] for r in data["rows"]]
    return _table(["dtype", "M × N", "flashlite GB/s", "% of copy", "torch.softmax", "torch.compile", "quack",
                   "× best peer"], rows)


def attention_table(data: dict) -> str:
    # FlashAttention-4: a peer from 2026-11-28 on (— in older files, or where it did not import)
    rows = [[r["D"], "yes" if r["causal"] else "no", r["L"], r["flashlite"], f"{r['frac_matmul']:.0%}", r.get("fa4"),
             r["flash"], r["cudnn"], _ratio(r.get("x_fa4")), f"{r['x_flash']:.2f}", f"{r['x_cudnn']:.2f}"]
            for r in data["rows"]]
    return _table(["D", "causal", "L", "flashlite TFLOP/s", "% of matmul", "FA4", "SDPA flash", "SDPA cuDNN",
                   "× FA4", "× flash", "× cuDNN"], rows)


def backward_table(data: dict) -> str:
    rows = [[r["D"], "yes" if r["causal"] else "no", r["L"], r["flashlite_bwd"], f"{r['frac_matmul_bwd']:.0%}",
             r.get("fa4_bwd"), r["flash_bwd"], r["cudnn_bwd"], _ratio(r.get("x_fa4_bwd")), f"{r['x_flash_bwd']:.2f}",
             f"{r['x_cudnn_bwd']:.2f}"] for r in data["rows"]]
    return _table(["D", "causal", "L", "flashlite TFLOP/s", "% of matmul", "FA4", "SDPA flash", "SDPA cuDNN",
                   "× FA4", "× flash", "× cuDNN"], rows)


def one_pass_table(data: dict) -> str:
    rows = [[r["D"], "yes" if r["causal"] else "no", r["L"], r["flashlite_bwd"], r.get("one_pass_bwd"),
             _ratio(r.get("x_one_pass_bwd")), r.get("fa4_bwd"), r.get("cudnn_bwd"), _ratio(r.get("x_fa4_bwd")),
             _ratio(r.get("x_cudnn_bwd"))] for r in data["rows"]]
    return _table(["D", "causal", "L", "two passes (default)", "one pass", "one / two", "FA4", "SDPA cuDNN",
                   "default × FA4", "default × cuDNN"], rows)


def variants_table(data: dict) -> str:
    rows = [[r["variant"], r["D"], r["L"], r["plain_fwd"], r["fwd"], _ratio(r["x_plain_fwd"]), _ratio(r.get("x_flex_fwd")),
             r["plain_fwdbwd"], r["fwdbwd"], _ratio(r["x_plain_fwdbwd"]), _ratio(r.get("x_flex_fwdbwd"))]
            for r in data["rows"]]
    return _table(["variant", "D", "L", "plain fwd", "variant fwd", "× plain", "× Flex", "plain fwd+bwd",
                   "variant fwd+bwd", "× plain", "× Flex"], rows)


def window_table(data: dict) -> str:
    rows = [[r["L"], r["B"], r["full_causal_fwd"], r["fwd"], _ratio(r["x_full_fwd"]), _ratio(r.get("x_flex_fwd")),
             r["full_causal_fwdbwd"], r["fwdbwd"], _ratio(r["x_full_fwdbwd"]), _ratio(r.get("x_flex_fwdbwd")),
             f"{r['extra_mib']:.0f} / {r['output_lse_mib']:.0f}"] for r in data["rows"]]
    return _table(["L", "B", "full causal fwd", "window fwd", "× full", "× Flex", "full causal fwd+bwd",
                   "window fwd+bwd", "× full", "× Flex", "peak extra / o+lse MiB"], rows)


def head_dim_v_table(data: dict) -> str:
    rows = [[r["D"], r["Dv"], "yes" if r["causal"] else "no", r["L"], r["same_dv_fwd"], r["fwd"],
             _ratio(r["x_same_dv_fwd"]), r["sdpa_fwd"], _ratio(r["x_sdpa_fwd"]), r["same_dv_fwdbwd"], r["fwdbwd"],
             _ratio(r["x_same_dv_fwdbwd"]), _ratio(r["x_sdpa_fwdbwd"])] for r in data["rows"]]
    return _table(["D", "Dv", "causal", "L", "Dv = D fwd", "fwd", "× Dv = D", "SDPA fwd", "× SDPA", "Dv = D fwd+bwd",
                   "fwd+bwd", "× Dv = D", "× SDPA"], rows)


def _ratio(value) -> str:
    return f"{value:.2f}" if value else "—"


def training_table(data: dict) -> str:
    rows = [[r["model"], r["flashlite_tokens_per_s"], r["sdpa_tokens_per_s"], f"{r['x_sdpa']:.2f}"] for r in data["rows"]]
    return _table(["model", "flashlite tokens/s", "SDPA tokens/s", "× SDPA"], rows)


def training_packed_table(data: dict) -> str:
    rows = [[r["attention"], r["layout"], r["tokens_per_s"], f"{1 / r['x_flashlite_packed']:.2f}"] for r in data["rows"]]
    return _table(["attention", "layout", "tokens/s (documents' tokens)", "× flashlite packed"], rows)


def head_split_table(data: dict) -> str:
    rows = [[r["D"], "yes" if r["causal"] else "no", r["L"], r["padded_fwd"], r["split_fwd"], r["fa4_fwd"],
             r["cudnn_fwd"], _ratio(r["x_fa4_fwd"]), r["padded_bwd"], r["split_bwd"], r["fa4_bwd"], r["cudnn_bwd"],
             _ratio(r["x_fa4_bwd"])] for r in data["rows"]]
    return _table(["D", "causal", "L", "fwd padded", "fwd split", "fwd FA4", "fwd cuDNN", "split × FA4",
                   "bwd padded", "bwd split", "bwd FA4", "bwd cuDNN", "split × FA4"], rows)


def masked_table(data: dict) -> str:
    rows = [[r["mask"], _short(r["dtype"]), f"{r['B']}×{r['H']}×{r['L']}²", r["flashlite"], f"{r['frac_copy']:.0%}",
             r["torch"], r["compile"], f"{r['x_compile']:.2f}"] for r in data["rows"]]
    return _table(["mask", "dtype", "scores", "flashlite GB/s", "% of copy", "PyTorch chain", "torch.compile",
                   "× compile"], rows)


def decode_table(data: dict) -> str:
    rows = [[r["B"], r["H_kv"], r["Lk"], r["auto_splits"], r["flashlite_us"], r["flashlite"], f"{r['frac_copy']:.0%}",
             r["flash"], r["cudnn"], f"{r['x_best_sdpa']:.2f}" if r.get("x_best_sdpa") else "—"]
            for r in data["rows"]]
    return _table(["B", "H_kv", "Lk", "splits", "flashlite µs", "flashlite GB/s", "% of copy", "SDPA flash",
                   "SDPA cuDNN", "× faster SDPA"], rows)


def call_path_table(data: dict) -> str:
    """One row per (B, H_kv, Lq): flashlite's time at the shortest and longest cache, the worst ratios to SDPA."""
    groups: dict = {}
    for r in data["rows"]:
        groups.setdefault((r["B"], r["H_kv"], r["Lq"]), []).append(r)
    rows = []
    for (batch, kv_heads, seqlen_q), sel in groups.items():
        sel.sort(key=lambda r: r["Lk"])
        rows.append([batch, kv_heads, seqlen_q, f"{sel[0]['Lk']}–{sel[-1]['Lk']}",
                     f"{sel[0]['flashlite_us']:.1f} / {sel[-1]['flashlite_us']:.1f}",
                     f"{max(r['x_sdpa'] for r in sel):.2f}", f"{max(r['x_sdpa_loop'] for r in sel):.2f}"])
    return _table(["B", "H_kv", "Lq", "Lk", "flashlite µs (shortest / longest Lk)", "worst × fastest SDPA",
                   "worst × (loop of calls)"], rows)


def varlen_table(data: dict) -> str:
    # (runs since 2026-12-01 also time the triton.language kernels, FLASHLITE_HOPPER_VARLEN=0: their columns last)
    tl = "tl_fwd" in data["rows"][0]
    rows = [[r["mix"], r["tokens"], r["D"], r["docs"], r["flashlite_fwd"], r["x_dense_fwd"], r["x_fa4_fwd"],
             r["x_flex_fwd"], r["x_mask_fwd"], r["flashlite_fwd_bwd"], r["x_dense_fwd_bwd"], r["x_fa4_fwd_bwd"],
             r["x_flex_fwd_bwd"]] + ([r["tl_fwd"], r["tl_x_dense_fwd"], r["tl_fwd_bwd"], r["tl_x_dense_fwd_bwd"]]
                                     if tl else []) for r in data["rows"]]
    rows = [[cell if not isinstance(cell, float) or j in (4, 9, 13, 15) else f"{cell:.2f}"
             for j, cell in enumerate(row)] for row in rows]
    return _table(["documents", "tokens", "D", "docs", "fwd TFLOP/s", "× dense", "× FA4", "× Flex", "× mask",
                   "fwd+bwd TFLOP/s", "× dense", "× FA4", "× Flex"]
                  + (["tl fwd", "× dense", "tl fwd+bwd", "× dense"] if tl else []), rows)


def paged_table(data: dict) -> str:
    fa4 = any(r.get("fa4_paged_gbs") for r in data["rows"])
    rows = [[r["B"], r["Lk"], r["page"], r["paged_gbs"], r["contiguous_gbs"], f"{r['x_contiguous']:.2f}"]
            + ([r.get("fa4_paged_gbs"), r.get("fa4_contiguous_gbs"),
                f"{r['x_fa4_paged']:.2f}" if r.get("x_fa4_paged") else "—"] if fa4 else [])
            for r in data["rows"]]
    return _table(["B", "Lk", "page", "paged GB/s", "contiguous GB/s", "× contiguous"]
                  + (["FA4 paged GB/s", "FA4 contiguous GB/s", "× FA4 paged"] if fa4 else []), rows)


def ring_table(data: dict) -> str:
    rows = [[r["L"], r["P"], r.get("docs", 1), f"{r['p2p_GBs']:.0f}", f"{r['ring_fwd_ms']:.1f}",
             f"{r['ring_fwdbwd_ms']:.1f}", f"{r['single_fwd_ms']:.1f}", f"{r['single_fwdbwd_ms']:.1f}",
             f"{r['eff_fwd']:.3f}", f"{r['eff_fwdbwd']:.3f}"] for r in data["rows"]]
    return _table(["L", "P", "documents", "point-to-point GB/s", "ring fwd ms", "ring fwd+bwd ms", "one GPU fwd ms",
                   "one GPU fwd+bwd ms", "efficiency fwd", "efficiency fwd+bwd"], rows)


SECTIONS = [
    ("softmax", "Softmax (`bench/softmax.py`): GB/s, one read and one write", softmax_table),
    ("softmax_backward_changed_shapes", "Softmax backward at the shapes its 2026-12-03 plans changed "
     "(`bench/softmax_backward.py --cols 256 1024 65536 131072`): GB/s, y and dy read, dx written; bf16 × 256 ran "
     "short tiles since dropped (TUNING.md#backward-short)", softmax_table),
    ("softmax_backward_long_rows", "Softmax backward on long rows after the clusters' exchange moved to distributed "
     "shared memory (`bench/softmax_backward.py --cols 65536 131072`): GB/s, y and dy read, dx written",
     softmax_table),
    ("attention", "Attention forward (`bench/attention.py`): TFLOP/s, bf16, H = 16, B·L = 16K", attention_table),
    ("attention_backward", "Attention backward (`bench/attention.py --backward`): TFLOP/s (2.5× the forward's FLOPs)",
     backward_table),
    ("attention_backward_fa4", "Attention backward beside FlashAttention-4 (`bench/attention.py --backward "
     "--lengths 2048 8192 --name attention_backward_fa4`): TFLOP/s", backward_table),
    ("attention_backward_one_pass", "The one-pass backward (`FLASHLITE_BACKWARD_ONE_PASS=1`, off by default) beside "
     "the two passes, FA4 and cuDNN (`bench/attention.py --backward --one-pass --lengths 2048 8192 --name "
     "attention_backward_one_pass`): TFLOP/s; TUNING.md#one-pass-ws", one_pass_table),
    ("attention_head_dims", "Attention forward at other head dims (`bench/attention.py --head-dims 96 192 256 "
     "--lengths 4096`): TFLOP/s; D 96/192 measured padded, before column parts became the default (next table)",
     attention_table),
    ("attention_backward_head_dims", "Attention backward at other head dims (`bench/attention.py --backward "
     "--head-dims 96 192 256 --lengths 4096`): TFLOP/s; D 192 measured padded, before column parts became the "
     "default (next table)", backward_table),
    ("attention_head_split", "Head dims in column parts (`bench/attention.py --head-split --head-dims 96 192 160 "
     "--lengths 4096`): TFLOP/s padded (`FLASHLITE_HEAD_SPLIT=0`) and split (the default), bf16, H = 16",
     head_split_table),
    ("variants", "Attention variants (`bench/variants.py`): TFLOP/s against the plain call and FlexAttention, bf16, "
     "causal, H = 32, H_kv = 8", variants_table),
    ("variants_window", "Sliding window (`bench/variants.py --window`): causal, 4096 keys, D = 128, TFLOP/s on the "
     "visible pairs, bf16, H = 32, H_kv = 8, B·L = 128K", window_table),
    ("variants_head_dim_v", "V head dim of its own (`bench/variants.py --head-dim-v`): D = 192, Dv = 128 against "
     "D = Dv = 192 and SDPA, TFLOP/s (2·B·H·L²·(D + Dv), halved causal), bf16, H = 32, H_kv = 8", head_dim_v_table),
    ("training", "Training steps (`bench/training.py`): tokens/s, bf16, same model, data and weights", training_table),
    ("training_packed", "Padding-free fine-tuning (`bench/training.py --packed`): a 4-layer D = 128 Llama on 34 "
     "documents, 16K tokens, packed by position_ids or padded", training_packed_table),
    ("masked_softmax", "Masked softmax (`bench/masked_softmax.py`): effective GB/s", masked_table),
    ("decode", "Decoding (`bench/decode.py --quick`): Lq = 1, bf16, H = 32, D = 128, K/V GB/s, eager", decode_table),
    ("call_path", "Decoding calls (`bench/call_path.py`): eager µs per call against the fastest SDPA backend, "
     "bf16, H = 32, D = 128", call_path_table),
    ("varlen", "Packed batches (`bench/varlen.py`): causal, bf16, H = 16, TFLOP/s on the visible pairs; ratios are "
     "flashlite's speed over the peer's", varlen_table),
    ("paged_decode", "Paged decoding (`bench/varlen.py --part paged`): Lq = 1, bf16, H = 32, H_kv = 8, D = 128, "
     "K/V GB/s", paged_table),
    *((f"ring_attention{kind}_p{p}", f"{title} on {p} GPUs (`torchrun --nproc-per-node {p} bench/ring_attention.py"
       f"{flag}`): bf16, H = 32, H_kv = 8, D = 128, causal; efficiency = (one GPU's time / P) / ring time",
       ring_table)
      for kind, flag, title in (("", "", "Ring attention"),
                                ("_varlen", " --varlen", "Packed ring attention (long-context document mix)"))
      for p in (2, 4, 8)),
]


def report(folder: str, heading: str = "###", link_prefix: str = "") -> str:
    parts = []
    for name, title, table in SECTIONS:
        data = _load(folder, name)
        if data is None:
            continue
        meta = data["meta"]
        ceiling = (f", copy {meta['copy_gbs']:.0f} GB/s measured in the same run" if "copy_gbs" in meta else
                   f", copy {meta['copy_GBs']:.0f} GB/s measured in the same run" if "copy_GBs" in meta else
                   f", bf16 matmul {meta['matmul_tflops_bf16']:.0f} TFLOP/s measured in the same run"
                   if "matmul_tflops_bf16" in meta else "")
        parts.append(f"{heading} {title}\n\n{meta['gpu']}, {meta['date']}{ceiling} "
                     f"([`{name}.json`]({link_prefix}{name}.json)).\n\n{table(data)}\n")
    return "\n".join(parts)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", nargs="?", default=os.path.join(HERE, "results", "h200"))
    parser.add_argument("--write", action="store_true", help="also write FOLDER/README.md")
    parser.add_argument("--link-prefix", default="", help="prefix of the JSON links (the README: bench/results/h200/)")
    args = parser.parse_args(argv)
    text = report(args.folder, link_prefix=args.link_prefix)
    print(text)
    if args.write:
        with open(os.path.join(args.folder, "README.md"), "w") as f:
            f.write("# Results on this GPU\n\nGenerated from the JSON files beside this one by `python bench/report.py "
                    f"{os.path.relpath(args.folder, os.path.dirname(HERE))} --write`; each table's file says how it "
                    "was measured (its meta). `python bench/run.py headline` makes the sweeps, `python bench/call_path.py` the "
                    "call costs. [`refinements.md`](refinements.md) (`python bench/refinements.py`) times the "
                    "textbook kernels and each refinement of the fast ones; [`TUNING.md`](TUNING.md) holds the "
                    "measurements behind the tuning tables; `ab_*.md` compare two trees in one process "
                    "(`bench/ab_ops.py`, `bench/ab_attention.py`); [`pytest_gpu.log`](pytest_gpu.log) is the last "
                    "`pytest -m gpu`.\n\n" + report(args.folder, "##"))


if __name__ == "__main__":
    main()
