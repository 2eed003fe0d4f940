"""Masked softmax bandwidth: flashlite against the unfused PyTorch chain and torch.compile of it.

The peers compute ``softmax(masked_fill(s * scale, ~mask, -inf))``, eagerly and
compiled, for three masks on (B, H, L, L) scores:

* ``causal``: flashlite's ``causal=True`` (no mask tensor), the peers an (L, L) ``tril`` mask;
* ``key_padding``: a (B, 1, 1, L) boolean mask, each batch entry keeping a random prefix;
* ``full``: a (B, H, L, L) boolean mask, 90 % kept.

Effective GB/s counts one read and one write of the scores plus the bytes of
the mask as given (not expanded), the same bytes for every provider, so the
ratios are ratios of times. A causal row needs only its visible part read, so
flashlite's causal case can pass the plain-softmax bandwidth (column
``softmax``: ``flashlite.softmax`` of the same scores, no mask). The device copy
bandwidth measured in the same run is the ceiling. Modes:

    python bench/masked_softmax.py            # full sweep -> bench/results/<gpu>/masked_softmax.{json,md,png}
    python bench/masked_softmax.py --quick    # L = 2048 only
    python bench/masked_softmax.py --tune     # the fused tile: (MASKED_TILE_ELEMS, MASKED_ELEMS_PER_THREAD)
                                              # pairs, flashlite's forward and backward -> masked_softmax_tune.*
    python bench/masked_softmax.py --tune causal-warps --masks causal
                                              # (MASKED_CAUSAL_FEWEST_WARPS, MASKED_CAUSAL_THREAD_BYTES)
                                              # pairs -> masked_softmax_causal_warps.*
    python bench/masked_softmax.py --calls 5 --masks causal --dtypes bf16 --lengths 1024
                                              # flashlite's forward of that case 5 times, nothing timed (for a
                                              # profiler: ncu --kernel-name regex:masked_softmax_fwd ...)

GPU correctness (float64 references, poisoned memory) is tests/test_gpu_masked_softmax.py's (pytest -m gpu).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flashlite  # noqa: E402

from common import (  # noqa: E402
    copy_bandwidth_gbs, environment, gbs, plot_lines, results_dir, try_time_ms, write_results,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MASKS = ("causal", "key_padding", "full")
PEERS = ("torch", "compile")
FULL_MASK_KEEP = 0.9
# The targets: flashlite over each peer, on every case.
TARGETS = {"torch": 4.0, "compile": 1.0}


def masked_softmax_bytes(scores: torch.Tensor, mask: torch.Tensor | None) -> int:
    """Bytes a masked softmax must move: read the scores once, write them once, read the mask as given."""
    mask_bytes = 0 if mask is None else mask.numel() * mask.element_size()
    return 2 * scores.numel() * scores.element_size() + mask_bytes


def torch_chain(s: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """The unfused PyTorch masked softmax every peer computes."""
    return torch.softmax((s * scale).masked_fill(~keep, float("-inf")), dim=-1)


def _compiled_chain():
    import torch._dynamo

    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1024)
    return torch.compile(torch_chain, dynamic=False)


def make_case(kind: str, shape: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Scores, the boolean mask the peers use, and flashlite's keyword arguments for mask ``kind``."""
    b, h, lq, lk = shape
    s = torch.randn(shape, device="cuda", dtype=dtype)
    if kind == "causal":
        keep = torch.ones(lq, lk, dtype=torch.bool, device="cuda").tril(lk - lq)
        return s, keep, {"causal": True}
    if kind == "key_padding":
        lengths = torch.randint(lk // 2, lk + 1, (b,), device="cuda")
        keep = (torch.arange(lk, device="cuda") < lengths[:, None]).view(b, 1, 1, lk)
    else:
        keep = torch.rand(shape, device="cuda") < FULL_MASK_KEEP
    return s, keep, {"mask": keep}


def measure(kind: str, shape: tuple, dtype: torch.dtype, compiled, scale: float) -> dict:
    s, keep, kw = make_case(kind, shape, dtype)
    n_bytes = masked_softmax_bytes(s, kw.get("mask"))
    row = {"mask": kind, "dtype": str(dtype).replace("torch.", ""), "B": shape[0], "H": shape[1], "L": shape[3],
           "MB": n_bytes / 2**20}
    provs = {
        "flashlite": lambda: flashlite.masked_softmax(s, scale=scale, **kw),
        "torch": lambda: torch_chain(s, keep, scale),
        "compile": lambda: compiled(s, keep, scale),
        "softmax": lambda: flashlite.softmax(s),  # plain softmax, no mask: the bandwidth causal should pass
    }
    for name, fn in provs.items():
        row[name] = gbs(n_bytes, try_time_ms(fn))
    return row  # the scores and masks go with this frame; run_bench empties the cache


def run_bench(args) -> None:
    copy = copy_bandwidth_gbs()
    compiled = _compiled_chain()
    lengths = [2048] if args.quick else args.lengths
    rows = []
    for dname in args.dtypes:
        for kind in args.masks:
            for length in lengths:
                t0 = time.time()
                row = measure(kind, (args.batch, args.heads, length, length), DTYPES[dname], compiled, args.scale)
                torch.cuda.empty_cache()
                fl = row["flashlite"]
                row["frac_copy"] = fl / copy if fl else None
                for peer in PEERS + ("softmax",):
                    row[f"x_{peer}"] = fl / row[peer] if fl and row[peer] else None
                rows.append(row)
                print(f"{dname} {kind:12} L={length}: flashlite {fl or 0:.0f} GB/s ({row['frac_copy'] or 0:.0%} of copy), "
                      f"x{row['x_torch'] or 0:.2f} torch, x{row['x_compile'] or 0:.2f} compile, "
                      f"x{row['x_softmax'] or 0:.2f} plain softmax  [{time.time() - t0:.1f}s]", flush=True)
    meta = environment() | {"command": "python bench/masked_softmax.py " + " ".join(sys.argv[1:]), "copy_gbs": copy,
                            "scale": args.scale, "full_mask_keep": FULL_MASK_KEEP}
    out = results_dir(args.out)
    cols = ["mask", "dtype", "B", "H", "L", "flashlite", "torch", "compile", "softmax", "frac_copy",
            "x_torch", "x_compile", "x_softmax"]
    write_results("masked_softmax", out, meta, rows, cols,
                  "Masked softmax forward, effective GB/s (scores read + written, mask bytes as given)")
    panels = []
    for dname in args.dtypes:
        dt = str(DTYPES[dname]).replace("torch.", "")
        for kind in args.masks:
            sel = [r for r in rows if r["dtype"] == dt and r["mask"] == kind]
            if sel:
                series = {n: [r[n] for r in sel] for n in ("flashlite", "torch", "compile", "softmax")}
                series["copy (ceiling)"] = [copy for _ in sel]
                panels.append((f"{kind} {dname}, ({args.batch}, {args.heads}, L, L)", [r["L"] for r in sel],
                               series, "effective GB/s"))
    plot_lines(os.path.join(out, "masked_softmax.png"), panels)
    print_summary(rows, copy)


# --tune tiles: (scores a fused tile holds at most, scores a thread holds) pairs, the same tile for causal rows and
# masked ones; the defaults: (4096, 32), causal rows without a mask 1024. (Since --tune causal-warps, causal rows'
# forward holds MASKED_CAUSAL_THREAD_BYTES a thread: a pair's second number reaches their backward only.)
TUNE_TILES = [(4096, 32), (4096, 16), (4096, 8), (2048, 32), (2048, 16), (1024, 32), (1024, 16)]
# --tune causal-warps: the fewest warps of the forward's causal-row tiles and the bytes a thread holds there.
TUNE_CAUSAL_WARPS = [(4, 64), (1, 64), (2, 64), (1, 128), (1, 32)]


def tune_variants(kind: str) -> dict:
    """``--tune kind``'s variants: name -> the masked_softmax constants it sets."""
    if kind == "tiles":
        return {f"t{tile}e{per_thread}": {"MASKED_TILE_ELEMS": tile, "MASKED_CAUSAL_TILE_ELEMS": tile,
                                          "MASKED_ELEMS_PER_THREAD": per_thread} for tile, per_thread in TUNE_TILES}
    return {f"w{warps}b{size}": {"MASKED_CAUSAL_FEWEST_WARPS": warps, "MASKED_CAUSAL_THREAD_BYTES": size}
            for warps, size in TUNE_CAUSAL_WARPS}


def run_tune(args) -> None:
    """flashlite's fused masked softmax, forward and backward alone, under each variant of ``--tune``
    (``tune_variants``; its plans and planned calls cleared between them), on the sweep's cases; GB/s as the
    sweep counts them (the backward: y and dy read, dx written), and each variant's forward plan."""
    masked = importlib.import_module("flashlite.masked_softmax")
    variants = tune_variants(args.tune)
    names = sorted({name for settings in variants.values() for name in settings})
    defaults = {name: getattr(masked, name) for name in names}
    rows = []
    try:
        for dname in args.dtypes:
            for kind in args.masks:
                for length in args.lengths:
                    s, _, kw = make_case(kind, (args.batch, args.heads, length, length), DTYPES[dname])
                    leaf = s.detach().requires_grad_()
                    row = {"mask": kind, "dtype": str(DTYPES[dname]).replace("torch.", ""), "L": length}
                    for name, settings in variants.items():
                        for constant, value in (defaults | settings).items():
                            setattr(masked, constant, value)
                        masked.clear_plans()
                        plan = masked.forward_plan(s, kw.get("mask"), kind == "causal")
                        call = lambda: flashlite.masked_softmax(s, scale=args.scale, **kw)  # noqa: E731
                        row[f"{name}_fwd"] = gbs(masked_softmax_bytes(s, kw.get("mask")), try_time_ms(call))
                        y = flashlite.masked_softmax(leaf, scale=args.scale, **kw)
                        dy = torch.randn_like(y)
                        grad = lambda: torch.autograd.grad(y, leaf, dy, retain_graph=True)  # noqa: E731
                        row[f"{name}_bwd"] = gbs(3 * y.numel() * y.element_size(), try_time_ms(grad))
                        row[f"{name}_plan"] = f"{plan.block_m}x{plan.block_n}/{plan.num_warps}w"
                        del y, dy
                    rows.append(row)
                    print(" ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                          flush=True)
                    del s, leaf
                    torch.cuda.empty_cache()
    finally:
        for name, value in defaults.items():
            setattr(masked, name, value)
        masked.clear_plans()
    meta = environment() | {"command": "python bench/masked_softmax.py " + " ".join(sys.argv[1:]),
                            "scale": args.scale, "variants": variants, "default": defaults}
    cols = (["mask", "dtype", "L"] + [f"{n}_fwd" for n in variants] + [f"{n}_bwd" for n in variants]
            + [f"{n}_plan" for n in variants])
    if args.tune == "tiles":
        write_results("masked_softmax_tune", results_dir(args.out), meta, rows, cols,
                      "Masked softmax: the fused tile (scores a tile at most, a thread), GB/s, forward and backward "
                      "alone")
    else:
        write_results("masked_softmax_causal_warps", results_dir(args.out), meta, rows, cols,
                      "Masked softmax: the fewest warps (w) and the bytes a thread holds (b) of causal rows' forward "
                      "tiles, GB/s, forward and backward alone; plans of the forward")


def run_calls(args) -> None:
    """flashlite's forward of each case ``args.calls`` times, synchronized, nothing timed: the launches a profiler
    reads."""
    for dname in args.dtypes:
        for kind in args.masks:
            for length in args.lengths:
                s, _, kw = make_case(kind, (args.batch, args.heads, length, length), DTYPES[dname])
                for _ in range(args.calls):
                    flashlite.masked_softmax(s, scale=args.scale, **kw)
                torch.cuda.synchronize()


def print_summary(rows: list[dict], copy: float) -> None:
    print(f"\ncopy {copy:.0f} GB/s; targets: x{TARGETS['torch']:g} the unfused chain, x{TARGETS['compile']:g} torch.compile")
    print(f"{'mask':13}{'dtype':10}{'L':>6}{'flashlite':>10}{'torch':>8}{'compile':>9}{'softmax':>9}"
          f"{'%copy':>7}{'xtorch':>8}{'xcomp':>7}  targets")
    for r in rows:
        met = all(r[f"x_{p}"] is not None and r[f"x_{p}"] >= t for p, t in TARGETS.items())
        print(f"{r['mask']:13}{r['dtype']:10}{r['L']:>6}{r['flashlite'] or 0:>10.0f}{r['torch'] or 0:>8.0f}"
              f"{r['compile'] or 0:>9.0f}{r['softmax'] or 0:>9.0f}{r['frac_copy'] or 0:>7.0%}"
              f"{r['x_torch'] or 0:>8.2f}{r['x_compile'] or 0:>7.2f}  {'met' if met else 'MISSED'}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="output folder (default bench/results/<gpu>)")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    parser.add_argument("--masks", nargs="+", default=list(MASKS), choices=list(MASKS))
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096], help="L of (B, H, L, L)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--scale", type=float, default=0.125, help="score scale (1/sqrt(64))")
    parser.add_argument("--quick", action="store_true", help="L = 2048 only")
    parser.add_argument("--tune", nargs="?", const="tiles", choices=["tiles", "causal-warps"],
                        help="flashlite alone under each variant: tiles (TUNE_TILES, the default) or causal-warps "
                             "(TUNE_CAUSAL_WARPS)")
    parser.add_argument("--calls", type=int, help="only run flashlite's forward of each case this many times")
    args = parser.parse_args(argv)
    if args.calls:
        run_calls(args)
        return
    run_tune(args) if args.tune else run_bench(args)


if __name__ == "__main__":
    main()
