"""``pytest -m gpu`` in several processes at once: building kernels is CPU-bound, and one process builds one at a time.

    python tests/run_gpu.py [-j 12] [--timeout 560] [--log FILE] [pytest paths and options ...]

Collects the ``gpu`` tests of the given paths (default: ``tests``), deals them round-robin to ``-j`` pytest
processes (each a shard of whole test ids, on the one GPU), and waits up to ``--timeout`` seconds. Prints
and logs each shard's last line and every failure (``--shard-logs`` keeps each shard's whole output). The exit status is 0 only when every shard passed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

PYTEST = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rfE"]


def collect(paths: list[str]) -> list[str]:
    out = subprocess.run([*PYTEST, "--collect-only", *paths], capture_output=True, text=True, check=False).stdout
    return [line.strip() for line in out.splitlines() if "::" in line and not line.startswith(" ")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-j", "--jobs", type=int, default=12)
    parser.add_argument("--timeout", type=float, default=560.0)
    parser.add_argument("--log", default=None, help="also write the summary here")
    parser.add_argument("--shard-logs", default=None, help="keep each shard's full output in this folder")
    # -k takes a value, which parse_known_args would take for a path: declared here, passed on below.
    parser.add_argument("-k", dest="keyword", default=None, help="pytest's -k expression")
    parser.add_argument("paths", nargs="*", default=["tests"])
    args, options = parser.parse_known_args()  # options (-x, --maxfail=N, ...) go to every pytest run
    if args.keyword is not None:
        options += ["-k", args.keyword]

    ids = collect([*args.paths, *options])
    if not ids:
        print("no gpu tests collected")
        return 1
    shards = [ids[i::args.jobs] for i in range(min(args.jobs, len(ids)))]
    folder = args.shard_logs or tempfile.mkdtemp(prefix="flashlite-gpu-")
    os.makedirs(folder, exist_ok=True)
    logs = [open(os.path.join(folder, f"shard{i}.log"), "w+") for i in range(len(shards))]
    start = time.time()
    procs = [subprocess.Popen([*PYTEST, *options, *shard], stdout=log, stderr=subprocess.STDOUT)
             for shard, log in zip(shards, logs)]
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, args.timeout - (time.time() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    lines = [f"# {len(ids)} gpu tests of {' '.join(args.paths)} in {len(shards)} processes, {time.time() - start:.0f} s"]
    ok = True
    for i, (proc, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        text = log.read().strip().splitlines()
        log.close()
        if not args.shard_logs:
            os.unlink(log.name)
        last = text[-1] if text else "(no output)"
        if proc.returncode != 0:
            ok = False
            last += f"  [exit {proc.returncode}{': timed out' if proc.returncode < 0 else ''}]"
        lines.append(f"shard {i} ({len(shards[i])} tests): {last}")
        lines += [f"  {line}" for line in text if line.startswith(("FAILED", "ERROR"))]
    summary = "\n".join(lines)
    print(summary)
    if args.log:
        with open(args.log, "w") as f:
            f.write(summary + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
