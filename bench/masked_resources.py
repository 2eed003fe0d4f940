"""Resource report of the masked softmax's fused forward kernel, built for sm_90 on any machine (no GPU needed).

    python bench/masked_resources.py [--tree DIR]

For the fused plans of ``bench/masked_softmax.py``'s shapes ((4, 16, L, L), L in {1024, 2048, 4096}: BLOCK_M
rows of BLOCK_N = L columns on 4 warps), causal and boolean key padding, bf16 and fp32: registers a thread and
spill stores (Triton's own ptxas), the PTX instructions (lines of the kernel's body), and the programs a multiprocessor holds at that register count (64K
registers). ``--tree DIR``: the ``flashlite`` package of another tree (``DIR/flashlite``, e.g. an older commit's
``git archive``), whose ``masked_softmax`` module has the same kernel arguments.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # build for the GPU target, not the interpreter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

# (L, BLOCK_M): the fused plans on an H100/H200 (masked_softmax._plan), 4 warps each.
PLANS = [(1024, 4), (2048, 2), (4096, 1)]
WARPS = 4
REGISTERS_PER_SM = 65536


def build(module, ptxas_report, seqlen: int, block_m: int, causal: bool, dtype: str) -> tuple[str, str, int]:
    kernel = module._masked_softmax_fwd_kernel
    while not isinstance(kernel, JITFunction):  # heuristics wrappers
        kernel = kernel.fn
    consts = dict(BLOCK_M=block_m, BLOCK_N=seqlen, SPLITS_POW2=1, PASS=module.BOTH_PASSES.value, IS_CAUSAL=causal,
                  HAS_MASK=not causal, MASK_IS_BOOL=not causal, SINGLE_BLOCK=True)
    if causal:
        consts["mask_ptr"] = None
    signature = {}
    for name in kernel.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in ("x_ptr", "y_ptr"):
            signature[name] = f"*{dtype}"
        elif name == "mask_ptr":
            signature[name] = "*u8"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32"
        else:
            signature[name] = "fp32" if name == "scale" else "i32"
    index = kernel.arg_names.index
    consts = {(index(k),): v for k, v in consts.items()}
    compiled = triton.compile(ASTSource(kernel, signature, consts), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=WARPS, num_stages=1))
    ptx = compiled.asm["ptx"]
    instructions = sum(1 for line in ptx.splitlines() if line.strip().endswith(";") and not line.strip().startswith("."))
    return (*ptxas_report(ptx), instructions)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=os.path.dirname(HERE), help="the tree whose flashlite is built")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.tree))
    importlib.import_module("flashlite")  # before backward_resources, which imports this tree's flashlite
    module = sys.modules["flashlite.masked_softmax"]
    from common import ptxas_report
    print(f"flashlite from {module.__file__}, Triton {triton.__version__}, sm_90, {WARPS} warps\n")
    print("| L | BLOCK_M | mask | dtype | registers | spill bytes | programs / SM | PTX instructions |\n"
          "|---|---|---|---|---|---|---|---|")
    for seqlen, block_m in PLANS:
        for causal in (True, False):
            for dtype in ("bf16", "fp32"):
                regs, spills, instructions = build(module, ptxas_report, seqlen, block_m, causal, dtype)
                programs = REGISTERS_PER_SM // (int(regs) * 32 * WARPS) if regs.isdigit() else "?"
                print(f"| {seqlen} | {block_m} | {'causal' if causal else 'key padding'} | {dtype} | {regs} | "
                      f"{spills} | {programs} | {instructions} |", flush=True)


if __name__ == "__main__":
    main()
