"""The examples: examples/train_tiny_gpt.py trains (a few CPU steps through flashlite's PyTorch path, plain
autograd); examples/softmax_to_attention.py writes its figures outside the checkout unless told otherwise."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .utils import run_python

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


# Runs examples/softmax_to_attention.py up to its first cell that computes (the whole script runs every stage of
# the demo), stopped there by a stand-in for the first study call: enough to see where figures would go.
FIGURES_SCRIPT = """
import os, runpy, sys
os.environ["TRITON_INTERPRET"] = "1"
from flashlite import study

class Stop(Exception):
    pass

def stop(*args, **kwargs):
    raise Stop

study.story_logits = stop
sys.argv = [sys.argv[1], *sys.argv[2:]]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except Stop:
    pass
"""


@pytest.mark.parametrize("out", [None, "figs"])
def test_softmax_to_attention_writes_outside_the_checkout(tmp_path, out):
    # A fresh clone's `python examples/softmax_to_attention.py` overwrote the tracked docs/img; now only
    # `--out docs/img` does. The default is a new temporary folder, printed.
    args = ["-c", FIGURES_SCRIPT, str(ROOT / "examples" / "softmax_to_attention.py")] + (["--out", out] if out else [])
    done = run_python(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("figures go to ")]
    assert len(lines) == 1, done.stdout
    folder = Path(tmp_path, lines[0].removeprefix("figures go to "))  # relative to the working directory
    assert folder.is_dir()
    if out:
        assert folder == tmp_path / out
    else:
        assert ROOT not in folder.resolve().parents and tmp_path not in folder.parents
        folder.rmdir()  # empty: the run stopped before any figure
