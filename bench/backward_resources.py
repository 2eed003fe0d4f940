"""Resource report of the attention backward's kernels, built for sm_90 on any machine (no GPU needed).

    python bench/backward_resources.py

The Hopper (Gluon) kernels of ``backward_hopper`` on the table's tiles (and the candidates bench/backward_tune.py
times), the one pass (``FLASHLITE_BACKWARD_ONE_PASS=1``), head dims in column parts, a packed batch's kernels (``FLASHLITE_HOPPER_VARLEN=1``), then the
``triton.language`` dK/dV kernel on its candidates.

For each tile config: registers a thread and spill stores (ptxas -v, Triton's own ptxas), shared memory,
the wgmma instructions in the PTX and the depths of their waits (``wgmma.wait_group N``: 0 means each product
is waited for before the next is issued, so the tensor cores idle while the softmax-like arithmetic runs).
Unmasked, non-causal bf16.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # build for the GPU target, not the interpreter
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from common import sm90_resources  # noqa: E402
from flashlite.attention import backward, backward_hopper, tuning  # noqa: E402
from flashlite.attention.tuning import WgmmaBackwardConfig  # noqa: E402

# (BLOCK_M, BLOCK_N, warps, stages, padded head dim)
CASES = [(32, 64, 4, 2, 128), (64, 128, 8, 2, 128), (64, 64, 4, 2, 64), (64, 64, 8, 2, 256), (32, 32, 8, 1, 256)]


# The dK/dV kernel's grouped run-time arguments (backward's host side), as types: the mask (absent: its pointer
# a constexpr None), the (b, h, row) strides of q, k, v, do, dk, dv, heads, sizes, variants.
TUPLE_TYPES = dict(mask=("constexpr", "i32", "i32", "i32", "i32"), heads=("i32",) * 3, sizes=("i32",) * 4,
                   variants=("fp32", "i32", "i32"), **{f"{t}_strides": ("i32",) * 3
                                                       for t in ("q", "k", "v", "do", "dk", "dv")})


def report(block_m: int, block_n: int, warps: int, stages: int, head_dim: int) -> str:
    kernel = backward._attention_bwd_dkdv_kernel
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, DIMS=(head_dim, head_dim, True, True),
                  MASKING=(False, False, False, False, 0), UNITS=1.0, DOTS=("tf32", False),
                  MODS=(False, False, False, False), alibi_ptr=None, seqs=None)
    signature = {}
    for name in kernel.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in TUPLE_TYPES:
            signature[name] = TUPLE_TYPES[name]
        elif name in ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "dk_ptr", "dv_ptr"):
            signature[name] = "*bf16"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32"
        else:
            signature[name] = "fp32" if name in ("qk_scale", "scale") else "i32"
    consts[("mask", 0)] = None
    # Constants keyed by argument index (a tuple's element by its path), as ASTSource sorts and looks them up.
    index = kernel.arg_names.index
    consts = {(index(k),) if isinstance(k, str) else (index(k[0]), *k[1:]): v for k, v in consts.items()}
    compiled = triton.compile(ASTSource(kernel, signature, consts), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    ptx, regs, spills, waits = sm90_resources(compiled)
    return (f"| {head_dim} | {block_m} x {block_n} | {warps} | {stages} | "
            f"{regs} | {spills} | {compiled.metadata.shared} | "
            f"{ptx.count('wgmma.mma_async')} | {', '.join(waits) or '—'} |")


# (padded head dim, kernel, config): the table's tiles, and the dK/dV candidates bench/backward_tune.py times.
Tiles = WgmmaBackwardConfig
HOPPER_CASES = [(d, kernel, tuning.WGMMA_BACKWARD_CONFIGS[d]) for d in (64, 128, 256) for kernel in ("dK/dV", "dQ")]
HOPPER_CASES += [(128, "dK/dV", Tiles(64, 128, 2)), (128, "dK/dV", Tiles(64, 64, 2, split=2)),
                 (256, "dQ", Tiles(64, 64, 2, split=2, dq_block_n=32))]
# Head dims in column parts (FLASHLITE_HEAD_SPLIT=1, plan.head_dim_parts), on the padded head dim's tiles, and D =
# 192 on one warpgroup (D = 128's tiles: dK and dV of 64 x 192 fp32 would be 96 registers each a thread).
HOPPER_SPLIT_CASES = [(d, dv, kernel, tuning.WGMMA_BACKWARD_CONFIGS[256])
                      for d, dv in ((192, 192), (192, 128), (160, 160)) for kernel in ("dK/dV", "dQ")]
HOPPER_SPLIT_CASES += [(192, 192, "dK/dV", Tiles(64, 64, 2))]
# The one pass (FLASHLITE_BACKWARD_ONE_PASS=1: two key tiles of 64 a program, TMA reductions of dQ), on the table's
# tiles: TUNING.md#one-pass-ws.
ONE_PASS_CASES = [(d, "one pass", dataclasses.replace(tuning.WGMMA_BACKWARD_CONFIGS[d], one_pass=True))
                  for d in (64, 128)]


def hopper_report(head_dim: int, kernel_name: str, config, head_dim_v: int | None = None, split: bool = False,
                  packed: bool = False) -> str:
    """One row of the Hopper kernels' table (non-causal, bf16, no variants); ``split``: head dims in column parts
    (``head_dim_v``: v's head dim, by default q's); ``packed``: a packed batch's kernel."""
    dq = kernel_name == "dQ"
    rows, keys = (config.dq_block_m, config.dq_block_n) if dq else (config.block_m, config.block_n)
    if kernel_name == "one pass":
        keys = 2 * config.block_n  # (a program's two key tiles, one a compute warpgroup)
    build = {"dQ": "dq", "dK/dV": "dkdv", "one pass": "one_pass"}[kernel_name]
    compiled = backward_hopper.build_for_sm90(build, config, head_dim, False, head_dim_v=head_dim_v, split=split,
                                              packed=packed)
    ptx, regs, spills, waits = sm90_resources(compiled)
    atomics = len(re.findall(r"\b(?:red|atom)\.global[\w.]*add\.f32", ptx))
    reductions = len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", ptx))
    split = f", split {config.split}" if config.split > 1 and not dq else ""  # (the warpgroups' column split)
    stages = config.dq_stages if dq else config.stages
    dims = f"{head_dim}/{head_dim_v} in parts" if head_dim_v else head_dim
    dims = f"{dims}, packed" if packed else dims
    return (f"| {dims} | {kernel_name} | {rows} x {keys}{split} | "
            f"{compiled.metadata.num_warps} | {stages} | {regs} | {spills} | {compiled.metadata.shared} | "
            f"{ptx.count('wgmma.mma_async')} | {', '.join(waits)} | {atomics} | {reductions} |")


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(f"triton {triton.__version__}, sm_90\n")
    print("Hopper (Gluon) kernels, `backward_hopper`: tiles are query rows x keys (a program's keys for dK/dV, its"
          " query rows for dQ, both key tiles of the one pass); atomics = fp32 atomic-add instructions a thread"
          " issues per tile; TMA reductions = cp.reduce.async.bulk.tensor instructions in the PTX\n")
    print("| D | kernel | tiles | warps | buffers | registers | spill stores (B) | shared (B) | wgmma | wait depths |"
          " atomics | TMA reductions |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in HOPPER_CASES + ONE_PASS_CASES:
        print(hopper_report(*case), flush=True)
    for head_dim, head_dim_v, kernel_name, config in HOPPER_SPLIT_CASES:
        print(hopper_report(head_dim, kernel_name, config, head_dim_v, split=True), flush=True)
    for head_dim, kernel_name, config in HOPPER_CASES[:6]:  # a packed batch's (FLASHLITE_HOPPER_VARLEN=1)
        print(hopper_report(head_dim, kernel_name, config, packed=True), flush=True)
    print(hopper_report(192, "dK/dV", tuning.WGMMA_BACKWARD_CONFIGS[256], 192, split=True, packed=True), flush=True)
    print(hopper_report(192, "dQ", tuning.WGMMA_BACKWARD_CONFIGS[256], 192, split=True, packed=True), flush=True)
    print("\n`triton.language` dK/dV kernel, `backward`\n")
    print("| D | tiles | warps | stages | registers | spill stores (B) | shared (B) | wgmma | wait depths |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in CASES:
        print(report(*case), flush=True)


if __name__ == "__main__":
    main()
