"""Host cost of a call: microseconds to enqueue flashlite's ops (and two peers) on tensors so small the GPU never waits.

    python bench/host_overhead.py            # this checkout's flashlite
    python bench/host_overhead.py OTHER_ROOT # another checkout's (e.g. `git archive` of an older commit), to compare

Prints one JSON object: op -> the least of three timings of ~660 back-to-back calls
each. What it measures is Python and driver work per launch; on the H100
machine's host it decides calls shorter than ~50 us (bench/results/h100/host_overhead.log).
"""

import json
import os
import sys
import time

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import flashlite  # noqa: E402

assert flashlite.__file__.startswith(os.path.join(ROOT, "flashlite")), flashlite.__file__


def host_us(fn, calls: int = 2000) -> float:
    """Least of three timings of calls // 3 enqueues (after a warm-up), in us per call."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    timings = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls // 3):
            fn()
        timings.append((time.perf_counter() - start) / (calls // 3) * 1e6)
        torch.cuda.synchronize()
    return min(timings)


def cases() -> dict:
    """op name -> a call on tiny CUDA tensors."""
    q = torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16)
    q64 = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    q80 = torch.randn(1, 2, 64, 80, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 256, device="cuda")
    x_bf16 = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    x_long = torch.randn(2, 1 << 20, device="cuda")
    mask = torch.rand(64, 64, device="cuda") > 0.5
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return {
        "torch.softmax fp32 64x256": lambda: torch.softmax(x, -1),
        "sdpa D128": lambda: sdpa(q, q, q),
        "flashlite.softmax fp32 64x256": lambda: flashlite.softmax(x),
        "flashlite.softmax bf16 64x1024": lambda: flashlite.softmax(x_bf16),
        "flashlite.softmax split rows 2x1M": lambda: flashlite.softmax(x_long),
        "flashlite.logsumexp fp32 64x256": lambda: flashlite.logsumexp(x),
        "masked_softmax causal": lambda: flashlite.masked_softmax(x[:, :64], causal=True),
        "flash_attention D128 (WS)": lambda: flashlite.flash_attention(q, q, q),
        "flash_attention D64 causal": lambda: flashlite.flash_attention(q64, q64, q64, causal=True),
        "flash_attention D80 (tl)": lambda: flashlite.flash_attention(q80, q80, q80),
        "flash_attention D128 mask (tl)": lambda: flashlite.flash_attention(q, q, q, attn_mask=mask),
        "flash_attention decode split": lambda: flashlite.flash_attention(q[:, :, :1], q, q, num_splits=2),
    }


if __name__ == "__main__":
    print(json.dumps({name: round(host_us(fn), 1) for name, fn in cases().items()}))
