"""The ``flashlite demo`` command, run in-process (the interpreter is already on) and once as a fresh process."""

import os
import re
import subprocess
import sys

import pytest
import torch

import flashlite
from flashlite import cli, study

from .utils import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLOTS = ("softmax_trace.png", "attention_trace.png", "stage_errors.png")


def table_rows(out: str) -> dict[str, tuple[float, float, str]]:
    """{stage: (max error, tolerance, verdict)} read back from the demo's printed table (stages that ran)."""
    rows = {}
    for _, title, _ in cli.STAGES:
        match = re.search(rf"^{re.escape(title)}  .*  (?:float32|float16|bfloat16)  +(\S+)  +(\S+)  .*(ok|TOO LARGE)$",
                          out, re.M)
        if match:
            rows[title] = (float(match.group(1)), float(match.group(2)), match.group(3))
    return rows


def assert_plots(out_dir, stdout: str) -> None:
    if study.matplotlib_available():
        for name in PLOTS:
            with open(os.path.join(out_dir, name), "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    else:
        assert "matplotlib is not installed" in stdout


def test_demo_runs_every_stage(tmp_path, capsys):
    # Needs flashlite.masked_softmax and flashlite.attention: the whole walk, as a user runs it.
    rc = cli.main(["demo", "--out", str(tmp_path), "--device", "cpu"])
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert set(rows) == {title for _, title, _ in cli.STAGES}, out
    for title, (err, tol, verdict) in rows.items():
        assert verdict == "ok" and err <= tol, f"{title}: error {err} (tol {tol}) {verdict}\n{out}"
    assert rc == 0
    assert "FAILED" not in out
    for i in range(1, len(cli.STAGES) + 1):  # progress: every stage announced with the time so far
        assert re.search(rf"^\[\s*[0-9.]+s\] {i}/{len(cli.STAGES)} ", out, re.M)
    assert_plots(tmp_path, out)


def test_demo_traces_only(tmp_path, capsys):
    rc = cli.main(["demo", "--out", str(tmp_path), "--only", "softmax-trace,attention-trace"])
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert set(rows) == {"online softmax trace", "flash attention trace"}
    assert all(verdict == "ok" and err < 1e-5 for err, _, verdict in rows.values()), out
    assert rc == 0
    assert_plots(tmp_path, out)


def test_a_broken_stage_fails_loudly(tmp_path, capsys, monkeypatch):
    def broken(demo, res):
        raise ImportError("cannot import name 'flash_attention'")

    monkeypatch.setattr(cli, "STAGES", [("naive", "naive softmax (5 torch ops)", cli.stage_naive),
                                        ("broken", "broken stage", broken)])
    rc = cli.main(["demo", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILED: ImportError: cannot import name 'flash_attention'" in out
    assert re.search(r"^broken stage .*FAILED$", out, re.M)
    assert table_rows(out)["naive softmax (5 torch ops)"][2] == "ok"


def test_fresh_process_turns_the_interpreter_on(tmp_path):
    # `python -m flashlite` imports the package (and so its kernels) before main runs: main must relaunch.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    args = [sys.executable, "-m", "flashlite", "demo", "--device", "cpu", "--only", "fused", "--out", str(tmp_path)]
    proc = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Triton's interpreter" in proc.stdout
    assert table_rows(proc.stdout)["fused softmax"][2] == "ok"


@pytest.mark.parametrize("args", [
    ["-c", "import sys; from flashlite.cli import main; sys.exit(main())"],  # the `flashlite` script (pyproject)
    ["-m", "flashlite"],
])
def test_version(args):
    done = run_python(*args, "--version")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"flashlite {flashlite.__version__}"


def test_bad_arguments(capsys):
    assert cli.main(["demo", "--only", "bogus"]) == 2
    assert "unknown stage(s) bogus" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert cli.main(["demo", "--device", "cuda"]) == 2
    with pytest.raises(SystemExit):
        cli.main([])  # a command is required


def test_counts():
    assert cli.softmax_bytes(4, 1000, 4) == 32_000
    assert cli.attention_flops(1, 2, 128, 128, 32, causal=False) == 4 * 2 * 128 * 128 * 32
    assert cli.attention_flops(1, 2, 128, 128, 32, causal=True) == 2 * 2 * 128 * 128 * 32
    x = torch.randn(3, 50)
    torch.testing.assert_close(cli.naive_softmax(x), torch.softmax(x, dim=1))
