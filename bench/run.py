"""One entry point for the README's figures: every sweep its headline table reads, then the tables.

    python bench/run.py headline [--out DIR] [--dry-run]   # the sweeps, on the GPU machine (PYTHONPATH=.)
    python bench/run.py report [--out DIR]                 # DIR/README.md from the JSON files (no GPU)

``headline`` runs, one process each (a failure is reported and the rest still run), the command recorded in
each JSON file the README quotes: the softmax sweep, the attention forward (quick) and backward sweeps (L = 2K-16K;
L = 2K and 8K into attention_backward_fa4 for FlashAttention-4's backward), the masked softmax sweep, decoding
(quick, one forced split), the packed batches (speed and paged decoding; host cost), the packed fine-tuning step,
the one-pass backward and the head dims loaded in column parts; and on a machine of two or more GPUs the dense
and the packed ring on two of them (torchrun). Each script writes its JSON (with the command that made it),
Markdown and plot into DIR (default bench/results/<gpu>). FlashAttention-4 and quack are measured when they
import (``../shared/tools/peer_wheels.sh`` installs them). ``--dry-run`` prints the commands only. Each JSON
also records the commit measured (``git rev-parse``; in a copy of the tree without ``.git``, such as the GPU
machine's, set ``FLASHLITE_COMMIT=<rev>``) and the peers' versions (``common.environment``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RING_LENGTHS = ["131072", "262144", "524288"]
TIMEOUT_S = 1800  # one sweep


def headline_commands(gpus: int) -> list[list[str]]:
    """The sweeps behind every figure the README quotes, as argument lists (run from the repository root)."""
    python = [sys.executable]
    commands = [
        [*python, "bench/softmax.py"],  # the full sweep: the README's 1K-16M columns (--quick has 3 shapes)
        [*python, "bench/attention.py", "--quick"],
        [*python, "bench/attention.py", "--backward", "--lengths", "2048", "4096", "8192", "16384"],
        [*python, "bench/attention.py", "--backward", "--lengths", "2048", "8192", "--name", "attention_backward_fa4"],
        [*python, "bench/masked_softmax.py"],
        [*python, "bench/decode.py", "--quick", "--splits", "1"],
        [*python, "bench/varlen.py", "--part", "paged", "speed"],  # varlen.json and paged_decode.json
        [*python, "bench/varlen.py", "--part", "host"],
        [*python, "bench/training.py", "--packed"],
        [*python, "bench/attention.py", "--backward", "--one-pass", "--head-dims", "64", "128", "--lengths", "2048",
         "8192", "--name", "attention_backward_one_pass"],
        [*python, "bench/attention.py", "--head-split", "--head-dims", "96", "192", "160", "--lengths", "4096"],
    ]
    if gpus >= 2:
        torchrun = [*python, "-m", "torch.distributed.run", "--nproc-per-node", "2", "bench/ring_attention.py"]
        commands += [[*torchrun, "--lengths", *RING_LENGTHS], [*torchrun, "--varlen", "--lengths", *RING_LENGTHS]]
    return commands


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def run_headline(out: str | None, dry_run: bool) -> int:
    gpus = 0 if dry_run else gpu_count()
    if not dry_run and gpus == 0:
        raise SystemExit("bench/run.py headline times CUDA kernels: run it on a GPU machine (or pass --dry-run)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    failed = []
    for command in headline_commands(gpus if not dry_run else 2):
        command = command + (["--out", out] if out else [])
        shown = " ".join(os.path.relpath(c) if c == sys.executable else c for c in command)
        print(f"== {shown}", flush=True)
        if dry_run:
            continue
        start = time.time()
        try:
            code = subprocess.run(command, cwd=ROOT, env=env, timeout=TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        print(f"== {'ok' if code == 0 else f'FAILED ({code})'} in {time.time() - start:.0f} s", flush=True)
        if code != 0:
            failed.append(shown)
    for shown in failed:
        print(f"failed: {shown}")
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["headline", "report"])
    parser.add_argument("--out", help="results folder (default bench/results/<gpu>; report: bench/results/h200)")
    parser.add_argument("--dry-run", action="store_true", help="headline: print the commands only")
    args = parser.parse_args(argv)
    if args.what == "report":
        folder = args.out or os.path.join(HERE, "results", "h200")
        return subprocess.run([sys.executable, os.path.join(HERE, "report.py"), folder, "--write"],
                              cwd=ROOT, stdout=subprocess.DEVNULL).returncode
    return run_headline(args.out, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
