"""Resource report of the Hopper attention forward's kernels, dense and packed, built for sm_90 on any machine (no GPU).

    python bench/forward_resources.py

For each case (head dims in column parts, as the default plans them; bf16): the kernel (``ws``: warp-specialized),
registers a thread (for the warp-specialized kernel, the launch's ``maxnreg``: its warpgroups then set their own)
and spill stores (ptxas -v, Triton's own ptxas), shared memory, the depths of the wgmma waits, and the O stores:
TMA stores and, in a packed batch's kernel, the pointer stores of a sequence's last query tile.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # build for the GPU target, not the interpreter
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402

from common import sm90_resources  # noqa: E402
from flashlite.attention import forward_hopper, plan  # noqa: E402

EVERY_VARIANT = dict(HAS_SOFTCAP=True, FAST_TANH=True, HAS_ALIBI=True, HAS_WINDOW=True, HAS_SINKS=True)
# (D, Dv, causal, every variant, keys): the table's kernels, a short causal call's, one with v narrower than q
CASES = [(128, 128, False, False, 4096), (128, 128, True, False, 4096), (64, 64, True, False, 4096),
         (64, 64, False, True, 4096), (256, 256, True, False, 4096), (192, 192, True, False, 4096),
         (96, 96, True, True, 4096), (128, 128, True, False, 512), (128, 64, False, True, 4096)]


def row(head_dim: int, head_dim_v: int, causal: bool, variants: bool, seqlen_k: int, packed: bool) -> str:
    width = max(sum(plan.head_dim_parts(head_dim)), sum(plan.head_dim_parts(head_dim_v)))  # (split=True below)
    config = plan.wgmma_config(max(head_dim, head_dim_v), causal, seqlen_k, width)
    compiled = forward_hopper.build_for_sm90(config, head_dim, causal, True, EVERY_VARIANT if variants else None,
                                             head_dim_v, split=True, packed=packed)
    ptx, regs, spills, waits = sm90_resources(compiled)
    tma_stores = len(re.findall(r"cp\.async\.bulk\.tensor\.4d\.global\.shared", ptx))
    pointer_stores = len(re.findall(r"st\.global\.v?\d*\.?b(?:16|32)", ptx))
    return (f"| {head_dim}/{head_dim_v} | {'yes' if causal else 'no'} | {'all' if variants else '-'} | {seqlen_k} | "
            f"{'packed' if packed else 'dense'} | {'ws' if config.warp_specialized else 'wgmma'} | {regs} | {spills} | "
            f"{compiled.metadata.shared} | {', '.join(waits)} | {tma_stores} | {pointer_stores} |")


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(f"triton {triton.__version__}, sm_90\n")
    print("| D/Dv | causal | variants | keys | batch | kernel | registers | spill stores (B) | shared (B) |"
          " wait depths | TMA stores | pointer stores |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in CASES:
        for packed in (False, True):
            print(row(*case, packed), flush=True)


if __name__ == "__main__":
    main()
