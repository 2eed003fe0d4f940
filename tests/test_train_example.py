"""examples/train_tiny_gpt.py trains: a few CPU steps through flashlite's PyTorch path (plain autograd)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter without TRITON_INTERPRET (which conftest sets for this session), so that
# CPU tensors take the PyTorch path the example is meant to use on CPU.
SCRIPT = """
import json, sys
sys.path.insert(0, "examples")
from train_tiny_gpt import train
result = train(steps=30, device="cpu", seq_len=32, batch=8, log_every=10, verbose=False)
print(json.dumps(result))
"""


def test_tiny_gpt_loss_falls_on_cpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    losses = result["losses"]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, f"loss did not fall: first 5 steps {first:.3f}, last 5 {last:.3f}"
    assert math.isfinite(result["val_loss"]) and result["tokens_per_s"] > 0
