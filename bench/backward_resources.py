"""Resource report of the attention backward's dK/dV kernel, built for sm_90 on any machine (no GPU needed).

    python bench/backward_resources.py

For each tile config: registers a thread and spill stores (ptxas -v, Triton's own ptxas), shared memory,
the wgmma instructions in the PTX and the depths of their waits (``wgmma.wait_group N``: 0 means each product
is waited for before the next is issued, so the tensor cores idle while the softmax-like arithmetic runs).
Unmasked, non-causal bf16; ``one_pass`` adds the dQ product and its pointer atomic adds.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # build for the GPU target, not the interpreter
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashlite.attention import backward  # noqa: E402

# (BLOCK_M, BLOCK_N, warps, stages, padded head dim, one pass)
CASES = [(32, 64, 4, 2, 128, False), (64, 128, 8, 2, 128, False), (64, 128, 8, 2, 128, True),
         (64, 64, 4, 2, 64, False), (64, 64, 8, 2, 256, False), (32, 32, 8, 1, 256, False)]


def kernel_fn():
    kernel = backward._attention_bwd_dkdv_kernel
    while not isinstance(kernel, triton.runtime.jit.JITFunction):  # under triton.heuristics
        kernel = kernel.fn
    return kernel


def report(block_m: int, block_n: int, warps: int, stages: int, head_dim: int, one_pass: bool) -> str:
    kernel = kernel_fn()
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM_PADDED=head_dim, IS_CAUSAL=False, HAS_MASK=False,
                  MASK_IS_BOOL=False, MASK_PER_KEY=False, EVEN_D=True, UNITS=1.0, ATOMIC_DQ=one_pass,
                  DQ_BY_TMA=False, DOT_PRECISION="tf32", UPCAST_DOTS=False, mask_ptr=None, dq_desc=None)
    if not one_pass:
        consts["dq_ptr"] = None
    signature = {}
    for name in kernel.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "dk_ptr", "dv_ptr"):
            signature[name] = "*bf16"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32"
        else:
            signature[name] = "fp32" if name in ("qk_scale", "scale") else "i32"
    compiled = triton.compile(ASTSource(kernel, signature, consts), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    ptxas = get_ptxas(90)
    log = subprocess.run([getattr(ptxas, "path", ptxas), "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    os.unlink(f.name)
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)
    return (f"| {head_dim} | {block_m} x {block_n} | {warps} | {stages} | {'yes' if one_pass else 'no'} | "
            f"{regs[0] if regs else '?'} | {spills[0] if spills else '?'} | {compiled.metadata.shared} | "
            f"{ptx.count('wgmma.mma_async')} | {', '.join(sorted(set(waits))) or '—'} |")


def main() -> None:
    print(f"triton {triton.__version__}, sm_90\n")
    print("| D | tiles | warps | stages | one pass | registers | spill stores (B) | shared (B) | wgmma | wait depths |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in CASES:
        print(report(*case), flush=True)


if __name__ == "__main__":
    main()
