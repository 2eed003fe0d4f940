"""Tile sweep of attention for training: both backward paths at every head dim class, and the forward past D = 128.

    python bench/backward_tune.py [--head-dims 64 96 128 192 256] [--kinds ...] [--length 4096] [--jobs 12] [--out DIR]
        [--name STEM]
    python bench/backward_tune.py --profile [--head-dims ...]   # the default backward's time by kernel

bf16, H = 16, B = 16384 // L, causal and not. For each head dim:

* ``two_pass``: the backward's dK/dV kernel's candidates (dQ on the table's tiles), then its
  dQ kernel's (dK/dV on the best);
* ``hopper_two_pass``: the Hopper (Gluon) backward's candidates (its dK/dV kernel, then its dQ kernel);
* ``hopper_one_pass``: its one pass's candidates; ``hopper_table``: the table's tiles in two passes;
* ``tl_table``: the ``triton.language`` kernels' two passes on the table's tiles;
* ``fwd_tl`` / ``fwd_hopper``: the ``triton.language`` forward's candidates and the Hopper (Gluon) forward's,
  whose boxes are padded to the next power of two (head dims 96 and 192 read 128 and 256 columns);
* SDPA's FlashAttention-2 and cuDNN backends, forward and backward, on the same inputs.

Every candidate's output is compared with the table's (dq, dk, dv; the forward's o):
``err`` is the largest difference over the largest value, ~1e-2 is bf16 rounding. A candidate that does not
build (shared memory, registers) is listed with no time. Kernels are built first by ``--jobs`` processes at
once (Triton's on-disk cache), then timed here one at a time. TFLOP/s as bench/attention.py counts them.
Writes ``backward_tune.{json,md}``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import multiprocessing
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from flashlite.attention.api import attention_forward  # noqa: E402
from flashlite.attention.backward import attention_backward  # noqa: E402
from flashlite.attention.forward_hopper import attention_forward_hopper  # noqa: E402
from flashlite.attention.plan import default_backward_config, head_dim_padded  # noqa: E402
from flashlite.attention.tuning import (  # noqa: E402
    WGMMA_BACKWARD_CONFIGS, AttentionConfig, BackwardConfig, WgmmaBackwardConfig, WgmmaConfig,
)
from common import (  # noqa: E402
    attention_flops, backward_flops, environment, markdown_table, results_dir, tflops, time_ms, write_results,
)

HEADS = 16
TOKENS = 16384

# (BLOCK_M, BLOCK_N, warps, stages) by padded head dim. dK/dV kernels hold a BLOCK_N x D tile of K, V, dK
# and dV; dQ kernels a BLOCK_M x D tile of Q, dO and dQ.
DKDV = {
    64: [(64, 64, 4, 2), (32, 64, 4, 2), (64, 128, 4, 2), (64, 128, 8, 2), (32, 128, 4, 2), (128, 128, 8, 2),
         (64, 64, 4, 3)],
    128: [(32, 64, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (32, 128, 8, 2), (64, 128, 8, 2), (64, 128, 8, 1),
          (32, 128, 4, 2)],
    256: [(32, 32, 8, 1), (32, 64, 8, 1), (64, 64, 8, 1), (32, 64, 4, 1), (16, 64, 4, 1), (32, 128, 8, 1),
          (64, 64, 8, 2), (64, 32, 8, 1)],
}
DQ = {
    64: [(64, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 128, 4, 2)],
    128: [(128, 64, 8, 3), (64, 64, 4, 2), (128, 128, 8, 2), (64, 128, 8, 2)],
    256: [(32, 32, 4, 1), (64, 32, 4, 1), (64, 64, 8, 1), (64, 32, 8, 2), (128, 32, 8, 1), (128, 64, 8, 1)],
}
# The Hopper (Gluon) backward (backward_hopper) by padded head dim, the table's tiles first. Timed in two passes
# (its dK/dV and dQ kernels; the one-pass variant with dQ by atomic adds, timed here once, is gone). (The committed
# backward_tune_hopper.md was timed before D = 64's register cap and D = 256's 64-key dQ tiles joined the table:
# its first D = 64 and D = 256 rows are the uncapped tiles and the 32-key dQ tiles.)
Tiles = WgmmaBackwardConfig
HOPPER = {
    64: [Tiles(64, 64, 2, max_registers=168), Tiles(64, 64, 2), Tiles(64, 128, 2), Tiles(64, 64, 2, dq_block_n=128),
         Tiles(64, 64, 2, dq_stages=3), Tiles(64, 64, 3, dq_block_m=128), Tiles(128, 64, 2),
         Tiles(64, 64, 3, max_registers=168)],
    128: [Tiles(64, 64, 2), Tiles(64, 128, 2), Tiles(64, 64, 2, split=2), Tiles(64, 64, 2, dq_stages=3),
          Tiles(64, 64, 2, dq_block_m=128), Tiles(64, 64, 3)],
    256: [Tiles(64, 64, 2, split=2), Tiles(64, 64, 2, split=2, dq_block_n=32), Tiles(64, 64, 1, split=2, dq_block_n=32),
          Tiles(64, 64, 2, split=2, dq_block_n=32, dq_stages=3)],
}
# The Hopper backward's one pass (two key tiles of 64 a program on two compute warpgroups, dQ by TMA reductions)
# by padded head dim: the table's tiles, then more Q/dO buffers and taller query tiles where shared memory allows.
HOPPER_ONE_PASS = {
    64: [Tiles(64, 64, 2, one_pass=True), Tiles(64, 64, 3, one_pass=True), Tiles(128, 64, 2, one_pass=True)],
    128: [Tiles(64, 64, 2, one_pass=True)],
}
FWD_TL = {
    256: [(128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2), (64, 64, 8, 2), (128, 64, 8, 1)],
}
FWD_HOPPER = {
    128: [WgmmaConfig(64, 128, 4, 2, q_in_registers=True, warp_specialized=True), WgmmaConfig(64, 128, 4, 2),
          WgmmaConfig(64, 64, 4, 2)],
    256: [WgmmaConfig(64, 64, 4, 2, warp_specialized=True), WgmmaConfig(64, 64, 4, 2), WgmmaConfig(64, 32, 4, 2),
          WgmmaConfig(64, 128, 4, 1), WgmmaConfig(64, 64, 4, 3)],
}


def tile(t: tuple, tma: bool = False) -> AttentionConfig:
    return AttentionConfig(*t, use_tma=tma)


class Case:
    """Inputs of one (head dim, causal) shape and the calls the sweep makes on them."""

    def __init__(self, head_dim: int, causal: bool, length: int):
        self.head_dim, self.causal, self.length = head_dim, causal, length
        self.batch = max(1, TOKENS // length)
        g = torch.Generator(device="cuda").manual_seed(0)
        shape = (self.batch, HEADS, length, head_dim)
        self.q, self.k, self.v, self.do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
                                           for _ in range(4))
        self.scale = 1 / math.sqrt(head_dim)
        self.o, self.lse = attention_forward(self.q, self.k, self.v, causal, self.scale, None, False, True)

    def backward(self, config: BackwardConfig):
        return attention_backward(self.do, self.q, self.k, self.v, self.o, self.lse, None, self.causal, self.scale,
                                  None, False, config=config)[:3]

    def forward_tl(self, config: AttentionConfig):
        return attention_forward(self.q, self.k, self.v, self.causal, self.scale, None, False, True, config)[0]

    def forward_hopper(self, config: WgmmaConfig):
        return attention_forward_hopper(self.q, self.k, self.v, self.causal, self.scale, True, config)[0]

    def sdpa(self, backend_name: str):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
        inputs = [t.detach().requires_grad_() for t in (self.q, self.k, self.v)]

        def fwd():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(*inputs, is_causal=self.causal)
        out = fwd()
        return fwd, lambda: torch.autograd.grad(out, inputs, self.do, retain_graph=True)


KINDS = ("two_pass_dkdv", "two_pass_dq", "fwd_tl", "fwd_hopper", "hopper_two_pass", "hopper_one_pass", "hopper_table",
         "tl_table")


def variants(head_dim: int, dkdv_best: tuple | None = None, kinds=KINDS) -> list[tuple[str, object]]:
    """(kind, config) of every candidate of a head dim; the dQ kernel's are paired with ``dkdv_best``."""
    pad = head_dim_padded(head_dim)
    table = default_backward_config(head_dim, torch.bfloat16, torch.device("cuda"))
    out = [("two_pass_dkdv", BackwardConfig(tile(t), table.dq)) for t in DKDV[max(64, pad)]]
    dkdv = tile(dkdv_best) if dkdv_best else table.dkdv
    out += [("two_pass_dq", BackwardConfig(dkdv, tile(t))) for t in DQ[max(64, pad)]]
    out += [("fwd_tl", tile(t, tma=True)) for t in FWD_TL.get(pad, [])]
    out += [("fwd_hopper", c) for c in FWD_HOPPER.get(pad, [])]
    out += [("hopper_two_pass", c) for c in HOPPER.get(pad, [])]
    out += [("hopper_one_pass", c) for c in HOPPER_ONE_PASS.get(pad, [])]
    if pad in WGMMA_BACKWARD_CONFIGS:  # the table's tiles, forced: two passes (forced tiles decide)
        out += [("hopper_table", WGMMA_BACKWARD_CONFIGS[pad])]
    out += [("tl_table", table)]
    return [(kind, config) for kind, config in out if kind in kinds]


def run_variant(case: Case, kind: str, config):
    if kind.startswith("hopper") or kind == "tl_table" or kind.startswith("two_pass"):  # tl_table: the table's tiles
        return case.backward(config)
    if kind == "fwd_tl":
        return case.forward_tl(config)
    return case.forward_hopper(config)


def build(head_dim: int, causal: bool, length: int, items: list) -> None:
    """Worker: run each (kind, config) once so that its kernels are built into Triton's cache."""
    case = Case(head_dim, causal, length)
    for kind, config in items:
        try:
            run_variant(case, kind, config)
            torch.cuda.synchronize()
        except Exception:  # reported by the timing pass
            pass


def describe(kind: str, config) -> str:
    if kind == "tl_table":
        return "table"
    if kind.startswith("hopper"):
        return (f"{config.block_m}x{config.block_n} s{config.stages}"
                + (f" split{config.split}" if config.split > 1 else "")
                + (f" maxnreg {config.max_registers}" if config.max_registers and not config.one_pass else "")
                + (" one pass" if config.one_pass else "")
                + f" dq {config.dq_block_m}x{config.dq_block_n} s{config.dq_stages}")
    if kind == "fwd_hopper":
        return f"{config.block_m}x{config.block_n} w{config.num_warps} s{config.kv_stages}" + (
            " ws" if config.warp_specialized else "") + (" qreg" if config.q_in_registers else "")
    c = config if kind == "fwd_tl" else {"two_pass_dkdv": config.dkdv, "two_pass_dq": config.dq}[kind]
    return f"{c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages}"


def rel_err(got, want) -> float:
    if isinstance(got, torch.Tensor):
        got, want = (got,), (want,)
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
               for a, b in zip(got, want))


def time_case(case: Case, items: list, peers: bool = True) -> list[dict]:
    rows = []
    ref_bwd = case.backward(default_backward_config(case.head_dim, torch.bfloat16, torch.device("cuda")))
    ref_fwd = case.o
    bwd_flops = backward_flops(case.batch, HEADS, case.length, case.length, case.head_dim, case.causal)
    fwd_flops = attention_flops(case.batch, HEADS, case.length, case.length, case.head_dim, case.causal)
    base = {"D": case.head_dim, "causal": case.causal, "L": case.length, "B": case.batch}
    for kind, config in items:
        row = dict(base, kind=kind, tiles=describe(kind, config))
        try:
            got = run_variant(case, kind, config)
            row["err"] = rel_err(got, ref_fwd if kind.startswith("fwd") else ref_bwd)
            ms = time_ms(lambda: run_variant(case, kind, config))
            row["tflops"] = tflops(fwd_flops if kind.startswith("fwd") else bwd_flops, ms)
        except Exception as e:  # does not build or launch
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
            torch.cuda.empty_cache()
        rows.append(row)
    for peer in ("flash", "cudnn") if peers else ():
        try:
            fwd, bwd = case.sdpa(peer)
            rows.append(dict(base, kind=f"sdpa_{peer}_fwd", tiles="", tflops=tflops(fwd_flops, time_ms(fwd))))
            rows.append(dict(base, kind=f"sdpa_{peer}_bwd", tiles="", tflops=tflops(bwd_flops, time_ms(bwd))))
        except RuntimeError as e:
            rows.append(dict(base, kind=f"sdpa_{peer}", tiles="", error=str(e).splitlines()[0][:80]))
    return rows


def profile(head_dims: list, length: int, out_dir: str | None) -> None:
    """``--profile``: the default backward's time by kernel (torch.profiler, CUDA time of 5 calls), per shape."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    rows = []
    for d in head_dims:
        for causal in (False, True):
            case = Case(d, causal, length)
            case.backward(None)
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    case.backward(None)
                torch.cuda.synchronize()
            events = [e for e in prof.key_averages() if e.device_time_total > 0]
            total = sum(e.device_time_total for e in events)
            for e in sorted(events, key=lambda e: -e.device_time_total):
                rows.append(dict(D=d, causal=causal, L=length, kernel=e.key[:60], ms=e.device_time_total / 5e3,
                                 share=e.device_time_total / total))
                print(f"D={d} causal={causal!s:5} {e.key[:60]:60} {e.device_time_total / 5e3:7.3f} ms "
                      f"{e.device_time_total / total:5.1%}", flush=True)
            del case
    meta = environment() | {"heads": HEADS, "tokens_per_batch": TOKENS, "dtype": "bfloat16", "length": length}
    write_results("backward_profile", results_dir(out_dir), meta, rows, ["D", "causal", "L", "kernel", "ms", "share"],
                  "The default backward's time by kernel (torch.profiler, bf16, H = 16)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 96, 128, 192, 256])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--kinds", nargs="+", default=["two_pass_dkdv", "two_pass_dq", "fwd_tl", "fwd_hopper"],
                        help="which candidates to time (two_pass_dq pairs with the best two_pass_dkdv, or the table's)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default="backward_tune", help="results' file stem")
    parser.add_argument("--profile", action="store_true", help="time the default backward by kernel instead")
    args = parser.parse_args()
    if args.profile:
        profile(args.head_dims, args.length, args.out)
        return

    shapes = [(d, c) for d in args.head_dims for c in (False, True)]
    if args.jobs > 1:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            futures = []
            for d, c in shapes:
                items = variants(d, kinds=args.kinds)
                for i in range(0, len(items), 3):
                    futures.append(pool.submit(build, d, c, args.length, items[i:i + 3]))
            concurrent.futures.wait(futures)
        print("built", flush=True)
    rows = []
    for d, c in shapes:
        case = Case(d, c, args.length)
        items = [v for v in variants(d, kinds=args.kinds) if v[0] != "two_pass_dq"]
        got = time_case(case, items)
        dkdv = [r for r in got if r["kind"] == "two_pass_dkdv" and r.get("tflops")]
        best = max(dkdv, key=lambda r: r["tflops"])["tiles"] if dkdv else None
        best_tiles = None
        if best:
            bm_bn, w, s = best.split()
            best_tiles = (*map(int, bm_bn.split("x")), int(w[1:]), int(s[1:]))
        got += time_case(case, [v for v in variants(d, best_tiles, args.kinds) if v[0] == "two_pass_dq"], peers=False)
        rows += got
        for r in got:
            print(f"D={d} causal={c!s:5} {r['kind']:14} {r['tiles']:22} "
                  + (f"{r['tflops']:6.0f} TFLOP/s err {r.get('err', 0):.1e}" if r.get("tflops") else r.get("error", "")),
                  flush=True)
        del case
        torch.cuda.empty_cache()
    out = results_dir(args.out)
    meta = environment() | {"heads": HEADS, "tokens_per_batch": TOKENS, "dtype": "bfloat16", "length": args.length}
    write_results(args.name, out, meta, rows, ["D", "causal", "L", "B", "kind", "tiles", "tflops", "err", "error"],
                  "Attention tiles for training, TFLOP/s (bf16, H = 16)")
    print("\nbest per (D, causal, kind):")
    best = {}
    for r in rows:
        key = (r["D"], r["causal"], r["kind"])
        if r.get("tflops") and (key not in best or r["tflops"] > best[key]["tflops"]):
            best[key] = r
    print(markdown_table(sorted(best.values(), key=lambda r: (r["D"], r["causal"], r["kind"])),
                         ["D", "causal", "kind", "tiles", "tflops", "err"]))


if __name__ == "__main__":
    main()
