"""From softmax to attention, step by step, on flashlite's own kernels.

A notebook-style script: each ``# %%`` cell can be run on its own in an editor
that knows cells (VS Code, Jupyter via jupytext), or the whole file at once:

    python examples/softmax_to_attention.py [--out DIR]

It prints the online-softmax state block by block, checks every step against
the direct float64 computation, and writes the figures of
docs/softmax_to_attention.md to ``--out`` (default: a new temporary folder,
printed), never into the checkout unless asked: the docs' figures are
regenerated with

    python examples/softmax_to_attention.py --out docs/img

Without a GPU the kernels run through Triton's CPU interpreter; the whole script
takes about a minute there.
"""

# %% Setup: the interpreter must be on before Triton defines flashlite's kernels.
import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import flashlite  # noqa: E402
from flashlite import study  # noqa: E402
from flashlite.cli import plot_stage_errors, run_demo  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--out", default=None,
                    help="folder for the PNG figures (default: a new temporary folder; docs/img for the docs' own)")
args, _ = parser.parse_known_args()  # known only: a notebook kernel passes its own arguments
if args.out is None:
    args.out = tempfile.mkdtemp(prefix="softmax_to_attention_")
os.makedirs(args.out, exist_ok=True)
print(f"figures go to {args.out}")
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"running on {device}" + ("" if device.type == "cuda" else " through Triton's interpreter"))

# %% 1. Softmax needs the maximum first.
# softmax(x)_i = e^(x_i) / sum_j e^(x_j) overflows for large logits; subtracting any
# constant c leaves it unchanged, and c = max(x) makes the largest term e^0 = 1.
x = torch.tensor([1000.0, 1001.0, 1002.0])
print("\n1. e^x of [1000, 1001, 1002]:", torch.exp(x).tolist(), " -> inf / inf = NaN")
print("   e^(x - max):", torch.exp(x - x.max()).tolist(), " -> softmax", torch.softmax(x, 0).tolist())

# %% 2. The state (m, d) after each block.
# m = max of the logits seen so far, d = sum e^(x - m) over them. When a block
# arrives, m_new = max(m, max(block)), and the old d, summed under m, is worth
# d * e^(m - m_new) under m_new: alpha = e^(m - m_new) <= 1 (online_update).
logits, labels = study.story_logits(block_n=32, n_blocks=8)
trace = study.trace_softmax(logits.to(device), block_n=32)
ref = study.softmax_trace_reference(trace)
row = labels.index("rising")
print(f"\n2. row '{labels[row]}', {trace.n_blocks} blocks of {trace.block_n} columns")
print("   block  block max   running m   alpha      d (kernel)   d (float64, from the definition)")
for b in range(trace.n_blocks):
    print(f"   {b:5d}  {float(trace.block_max[row, b]):9.4f}  {float(trace.m[row, b]):10.4f}  "
          f"{float(trace.alpha[row, b]):7.4f}  {float(trace.d[row, b]):11.6f}  {float(ref['d'][row, b]):11.6f}")

# %% 3. Why alpha rescales correctly: d_new = d * alpha + (the block's own sum, moved to m_new).
# Each block's own state (max b_m, sum b_d) is what a program that saw only that
# block holds; moving it to m_new multiplies it by e^(b_m - m_new). Check the
# identity on the kernel's numbers:
b = 1
m_new = trace.m[row, b].double()
rebuilt = trace.d[row, b - 1].double() * trace.alpha[row, b].double() + \
    trace.block_sum[row, b].double() * torch.exp(trace.block_max[row, b].double() - m_new)
print(f"\n3. block {b}: d * alpha + b_d * e^(b_m - m_new) = {float(rebuilt):.6f}; kernel d = {float(trace.d[row, b]):.6f}")

# %% 4. An all -inf first block: the state stays empty, alpha = 0, never NaN.
row = labels.index("first block masked")
print(f"\n4. row '{labels[row]}': m = {trace.m[row, :3].tolist()}, d = {trace.d[row, :3].tolist()}, "
      f"alpha = {trace.alpha[row, :3].tolist()}")

# %% 5. Merging: the blocks' own states, merged in any grouping, give the same (m, d).
# (m1, d1) (+) (m2, d2) = (m, d1 e^(m1 - m) + d2 e^(m2 - m)), m = max(m1, m2) (merge_states).
print("\n5. merged block states vs the state after the last block:")
for i, label in enumerate(labels):
    print(f"   {label:20s} m {float(trace.merged_m[i]):8.4f} / {float(trace.m[i, -1]):8.4f}   "
          f"d {float(trace.merged_d[i]):9.5f} / {float(trace.d[i, -1]):9.5f}")
errors = study.check_trace(trace)
print("   every field vs float64:", {k: f"{v:.1e}" for k, v in errors.items()})
print("   wrote", study.plot_softmax_trace(trace, os.path.join(args.out, "softmax_trace.png"), labels))

# %% 6. The same algorithm in flashlite's production kernels.
# fused: the row on chip, one online_update over the whole row; online: blocks of
# 4096 streamed through the state, long rows split across programs and merged.
for algorithm, shape in (("fused", (8, 2_000)), ("online", (8, 20_000))):
    x = torch.randn(*shape, device=device) * 3
    y = flashlite.softmax(x, algorithm=algorithm)
    err = float((y.double() - torch.softmax(x.double(), 1)).abs().max())
    print(f"\n6. flashlite.softmax(algorithm={algorithm!r}) on {shape}: max error vs float64 {err:.1e}")

# %% 7. Attention: the same step, and the output accumulator rescaled by the same alpha.
# For one query row, acc = sum_j e^(s_j - m) v_j. When a K/V tile raises m,
# acc *= alpha exactly as d does; O = acc / d at any tile is the attention over
# the keys seen so far, and after the last tile it is the attention output.
q, k, v = (torch.randn(128, 32, device=device) for _ in range(3))
att = study.trace_attention(q, k, v, block_m=16, block_n=16, q_tile=7, causal=True)
exact = study.attention_trace_reference(att)["final"]
r = 15  # the last query: under the causal mask it sees all 128 keys
print(f"\n7. query {int(att.rows[r])}, causal, {att.n_tiles} K/V tiles of {att.block_n} keys (m in natural units)")
print("   tile  keys   m        alpha    d          |O_t - O| / |O|")
for t in range(att.n_tiles):
    dist = (att.out[t, r].double() - exact[r].to(device)).norm() / exact[r].norm()
    print(f"   {t:4d}  {att.key_ends[t]:4d}  {float(att.m[t, r]):7.4f}  {float(att.alpha[t, r]):6.4f}  "
          f"{float(att.d[t, r]):9.4f}  {float(dist):.2e}")
print("   every field vs float64:", {k: f"{v:.1e}" for k, v in study.check_trace(att).items()})
print("   wrote", study.plot_attention_trace(att, os.path.join(args.out, "attention_trace.png")))

# %% 8. The whole walk, as `flashlite demo` runs it: every stage against float64.
print("\n8. flashlite demo")
results = run_demo(None, device)  # its table; of its figures, the one the sections above have not drawn
print("wrote", plot_stage_errors(results, os.path.join(args.out, "stage_errors.png")))
