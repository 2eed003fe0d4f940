"""Resource report of the attention backward's kernels, built for sm_90 on any machine (no GPU needed).

    python bench/backward_resources.py

The Hopper (Gluon) kernels of ``backward_hopper`` on the table's tiles (and the candidates bench/backward_tune.py
times), the one pass (``FLASHLITE_BACKWARD_ONE_PASS=1``), head dims in column parts, a packed batch's kernels
(``FLASHLITE_HOPPER_VARLEN=1``; the dK/dV kernel's also causal), then the ``triton.language`` dK/dV kernel on
its candidates, then the Hopper dK/dV kernel's main loop in SASS, packed and dense.

For each tile config: registers a thread and spill stores (ptxas -v, Triton's own ptxas), shared memory,
the wgmma instructions in the PTX and the depths of their waits (``wgmma.wait_group N``: 0 means each product
is waited for before the next is issued, so the tensor cores idle while the softmax-like arithmetic runs).
Unmasked, non-causal bf16 unless a row says causal.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

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
                  packed: bool = False, causal: bool = False) -> str:
    """One row of the Hopper kernels' table (bf16, no variants, non-causal unless ``causal``); ``split``: head dims
    in column parts (``head_dim_v``: v's head dim, by default q's); ``packed``: a packed batch's kernel."""
    dq = kernel_name == "dQ"
    rows, keys = (config.dq_block_m, config.dq_block_n) if dq else (config.block_m, config.block_n)
    if kernel_name == "one pass":
        keys = 2 * config.block_n  # (a program's two key tiles, one a compute warpgroup)
    build = {"dQ": "dq", "dK/dV": "dkdv", "one pass": "one_pass"}[kernel_name]
    compiled = backward_hopper.build_for_sm90(build, config, head_dim, causal, head_dim_v=head_dim_v, split=split,
                                              packed=packed)
    ptx, regs, spills, waits = sm90_resources(compiled)
    atomics = len(re.findall(r"\b(?:red|atom)\.global[\w.]*add\.f32", ptx))
    reductions = len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", ptx))
    split = f", split {config.split}" if config.split > 1 and not dq else ""  # (the warpgroups' column split)
    stages = config.dq_stages if dq else config.stages
    dims = f"{head_dim}/{head_dim_v} in parts" if head_dim_v else head_dim
    dims = f"{dims}, packed" if packed else dims
    dims = f"{dims}, causal" if causal else dims
    return (f"| {dims} | {kernel_name} | {rows} x {keys}{split} | "
            f"{compiled.metadata.num_warps} | {stages} | {regs} | {spills} | {compiled.metadata.shared} | "
            f"{ptx.count('wgmma.mma_async')} | {', '.join(waits)} | {atomics} | {reductions} |")


def loop_instructions(compiled) -> tuple[int, int, collections.Counter]:
    """The main loop of a compiled kernel's SASS (nvdisasm of its cubin): the widest backward branch whose body
    holds wgmma (HGMMA) instructions and no EXIT (ptxas puts cold blocks, such as a barrier wait's retry, past
    the kernel's exit, with branches back into the loop). Returns ``(instructions, cleared, rest)``: its static
    instruction count, those in forward branches that skip 8 or more shared-memory stores and no wgmma (a cut
    tile's clearing, run on few turns), and the opcodes of the rest (the turn every tile takes, masked and unmasked
    code both)."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        text = subprocess.run([nvdisasm, "-c", cubin.name], capture_output=True, text=True, check=True).stdout
    code, labels, label = [], {}, None
    for line in text.splitlines():
        if found := re.match(r"\s*\.(L_x_\d+):", line):
            label = found.group(1)
        elif found := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line):
            code.append((int(found.group(1), 16), found.group(2)))
            if label:
                labels[label], label = code[-1][0], None
    branches = [(address, labels[found.group(1)], text) for address, text in code
                if (found := re.search(r"BRA\s+(?:`\()?\.?(L_x_\d+)", text)) and found.group(1) in labels]
    loop = max(([op for op in code if target <= op[0] <= address] for address, target, _ in branches
                if target < address), key=lambda body: len(body) if any("HGMMA" in t for _, t in body)
                and not any(t.startswith("EXIT") for _, t in body) else 0)
    end = loop[-1][0]
    cleared = set()
    for address, target, text in branches:
        if loop[0][0] <= address < target <= end and text.startswith("@"):
            skipped = [op for op in loop if address < op[0] < target]
            if sum(t.startswith("STS") for _, t in skipped) >= 8 and not any("HGMMA" in t for _, t in skipped):
                cleared.update(a for a, _ in skipped)
    rest = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                               for a, t in loop if a not in cleared)
    return len(loop), len(cleared), rest


def loop_report(head_dim: int, causal: bool, packed: bool) -> str:
    """One row of the dK/dV kernel's loop table (bf16, no variants, the table's tiles)."""
    compiled = backward_hopper.build_for_sm90("dkdv", tuning.WGMMA_BACKWARD_CONFIGS[head_dim], head_dim, causal,
                                              packed=packed)
    total, cleared, rest = loop_instructions(compiled)
    batch = "packed" if packed else "dense"
    return (f"| {head_dim} | {batch} | {'yes' if causal else 'no'} | {total} | {cleared} | {sum(rest.values())} | "
            f"{rest['LDL']} | {rest['STL']} |")


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
    for head_dim in (64, 128, 256):  # the packed dK/dV kernel under causal
        print(hopper_report(head_dim, "dK/dV", tuning.WGMMA_BACKWARD_CONFIGS[head_dim], packed=True, causal=True),
              flush=True)
    print("\n`triton.language` dK/dV kernel, `backward`\n")
    print("| D | tiles | warps | stages | registers | spill stores (B) | shared (B) | wgmma | wait depths |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in CASES:
        print(report(*case), flush=True)
    print("\nThe Hopper dK/dV kernel's main loop in SASS (static counts: `loop_instructions`): cleared = in branches"
          " that clear a cut tile's rows, rest = the code every turn runs through (masked and unmasked both), its"
          " local-memory loads and stores (spills)\n")
    print("| D | batch | causal | loop | cleared | rest | LDL | STL |")
    print("|---|---|---|---|---|---|---|---|")
    for head_dim in (64, 128):
        for causal in (False, True):
            for packed in (False, True):
                print(loop_report(head_dim, causal, packed), flush=True)


if __name__ == "__main__":
    main()
