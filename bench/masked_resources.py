"""Resource report of the masked softmax's fused forward kernel, built for sm_90 on any machine (no GPU needed).

    python bench/masked_resources.py [--tree DIR]

For the fused plans of ``bench/masked_softmax.py``'s shapes ((4, 16, L, L), L in {1024, 2048, 4096}) on the H200,
causal (no mask tensor) and boolean key padding, bf16 and fp32: registers a thread and spill stores (Triton's own
ptxas), the global loads and stores the PTX issues (a vector load, ``v4``, moves 16 bytes), the PTX instructions
(lines of the kernel's body), and the programs a multiprocessor holds at that register count (64K registers, 64
warps, 32 programs at most). Each kernel is built with what a launch specializes on those shapes: 16-byte
aligned pointers, ints divisible by 16 marked so, the key stride 1 and one split compiled in (a build without
them issues scalar loads and takes 2-5x the registers: it is not the launched kernel). ``--tree DIR``: the
``flashlite`` package of another tree (``DIR/flashlite``, e.g. an older commit's ``git archive``), whose
``masked_softmax`` module has the same kernel arguments.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # build for the GPU target, not the interpreter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

# (L, mask, dtype) -> (BLOCK_M, warps): the forward's fused plans on the H200 (masked_softmax.forward_plan, as
# bench/masked_softmax.py --tune causal-warps prints them).
PLANS = {
    (1024, "causal", "bf16"): (1, 1), (2048, "causal", "bf16"): (1, 2), (4096, "causal", "bf16"): (1, 4),
    (1024, "causal", "fp32"): (1, 2), (2048, "causal", "fp32"): (1, 4), (4096, "causal", "fp32"): (1, 8),
    **{(length, "key padding", dtype): (rows, 4) for length, rows in ((1024, 4), (2048, 2), (4096, 1))
       for dtype in ("bf16", "fp32")},
}
REGISTERS_PER_SM, WARPS_PER_SM, PROGRAMS_PER_SM = 65536, 64, 32
# Arguments a launch on bench/masked_softmax.py's shapes finds divisible by 16 (pointers: 16-byte aligned).
DIVISIBLE = ("x_ptr", "y_ptr", "mask_ptr", "bad_ptr", "n_rows", "n_inner", "seqlen_q", "seqlen_k", "cols_per_split",
             "stride_xb", "stride_xh", "stride_xm", "stride_mb", "stride_mh", "stride_mm", "stride_mn")


def build(module, ptxas_report, seqlen: int, block_m: int, warps: int, causal: bool, dtype: str):
    """``(registers, spill bytes, {load/store op: count}, PTX instructions)`` of the fused forward so planned."""
    kernel = module._masked_softmax_fwd_kernel
    while not isinstance(kernel, JITFunction):  # heuristics wrappers
        kernel = kernel.fn
    consts = dict(BLOCK_M=block_m, BLOCK_N=seqlen, SPLITS_POW2=1, PASS=module.BOTH_PASSES.value, IS_CAUSAL=causal,
                  HAS_MASK=not causal, MASK_IS_BOOL=not causal, SINGLE_BLOCK=True, part_m_ptr=None, part_d_ptr=None,
                  stride_xn=1, n_splits=1)
    if causal:
        consts["mask_ptr"] = None
    else:
        consts["stride_mn"] = 1  # (a (B, 1, 1, L) key-padding mask's keys)
    signature = {}
    for name in kernel.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in ("x_ptr", "y_ptr"):
            signature[name] = f"*{dtype}"
        elif name == "mask_ptr":
            signature[name] = "*u8"
        elif name == "bad_ptr":
            signature[name] = "*i8"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32"
        else:
            signature[name] = "fp32" if name == "scale" else "i32"
    index = kernel.arg_names.index
    attrs = {(index(name),): [["tt.divisibility", 16]] for name in DIVISIBLE if signature.get(name) not in
             (None, "constexpr")}
    compiled = triton.compile(ASTSource(kernel, signature, {(index(k),): v for k, v in consts.items()}, attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    ptx = compiled.asm["ptx"]
    memory = collections.Counter(re.findall(r"^\s*(?:@%p\d+\s+)?((?:ld|st)\.global[a-z0-9.]*)", ptx, re.M))
    instructions = sum(1 for line in ptx.splitlines() if line.strip().endswith(";") and not line.strip().startswith("."))
    return (*ptxas_report(ptx), memory, instructions)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=os.path.dirname(HERE), help="the tree whose flashlite is built")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.tree))
    importlib.import_module("flashlite")  # before backward_resources, which imports this tree's flashlite
    module = sys.modules["flashlite.masked_softmax"]
    from common import ptxas_report
    print(f"flashlite from {module.__file__}, Triton {triton.__version__}, sm_90\n")
    print("| L | mask | dtype | BLOCK_M | warps | registers | spill bytes | programs / SM | global loads, stores | "
          "PTX instructions |\n|---|---|---|---|---|---|---|---|---|---|")
    for (seqlen, mask, dtype), (block_m, warps) in PLANS.items():
        regs, spills, memory, instructions = build(module, ptxas_report, seqlen, block_m, warps, mask == "causal",
                                                   dtype)
        programs = "?"
        if regs.isdigit():
            by_registers = REGISTERS_PER_SM // (-(-int(regs) // 8) * 8 * 32 * warps)  # (allocated 8 at a time)
            programs = min(by_registers, WARPS_PER_SM // warps, PROGRAMS_PER_SM)
        ops = ", ".join(f"{count} {op}" for op, count in sorted(memory.items()))
        print(f"| {seqlen} | {mask} | {dtype} | {block_m} | {warps} | {regs} | {spills} | {programs} | {ops} | "
              f"{instructions} |", flush=True)


if __name__ == "__main__":
    main()
