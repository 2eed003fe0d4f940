"""Float64 references, tolerances and error helpers shared by every test file."""

from __future__ import annotations

import itertools
import json
import math
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest
import torch

from flashlite.core.runtime import DeviceInfo

ROOT = pathlib.Path(__file__).resolve().parents[1]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# A stand-in H100 for plans made without a GPU: 132 multiprocessors, 64K registers and 227 KB of shared memory
# each, 64 warps, sm_90, 50 MB of L2.
H100 = DeviceInfo(132, 65536, 232448, 64, (9, 0), 50 << 20)

# Elementwise tolerances of a softmax-like output against float64, by output dtype: one rounding of the
# output plus fp32 accumulation. fp16: a rounding is 2^-11 relative. bf16: a rounding to nearest is 2^-9,
# but Triton 3.9's CPU interpreter converts fp32 -> bf16 by truncation (up to one ulp, 2^-7 = 7.8e-3 at the
# bottom of a binade: softmax([0, -12]) gives 0.99609 instead of 1.0), hence 8e-3; on the GPU it rounds.
TOL = {
    torch.float32: dict(atol=1e-6, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=8e-3, rtol=8e-3),
}
# Absolute floor added to the FlashAttention-style bound (2x PyTorch's own error).
ATTN_ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def randn(*shape, dtype=torch.float32, scale: float = 1.0, requires_grad: bool = False) -> torch.Tensor:
    """Fresh normal data in ``dtype`` (on CPU, where the interpreter runs)."""
    x = (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype)
    return x.requires_grad_(requires_grad)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, **kw) -> None:
    """Compare against a float64 reference with the tolerance of ``dtype`` (default: actual's); NaN must match NaN."""
    tol = dict(TOL[dtype or actual.dtype])
    tol.update(kw)
    torch.testing.assert_close(actual.double(), expected.double(), equal_nan=True, check_dtype=False, **tol)


def softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Float64 softmax."""
    return torch.softmax(x.double(), dim)


def softmax_grad_ref(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Float64 softmax backward over the last dim: ``y * (dy - sum(dy * y))``, ``y`` the output, ``dy`` its
    gradient."""
    y, dy = y.double(), dy.double()
    return y * (dy - (y * dy).sum(-1, keepdim=True))


def masked_softmax_ref(x, mask=None, scale=None, causal=False) -> torch.Tensor:
    """Float64 masked softmax over the last dim, built from masked_fill + torch.softmax, with flashlite's
    contract: hidden positions (and so empty rows) exactly 0, also in a row a NaN makes NaN."""
    s = x.double() * (1.0 if scale is None else scale)
    lq, lk = s.shape[-2:]
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        keep = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    if mask is not None:
        if mask.dtype == torch.bool:
            keep = keep & mask
        else:
            s = s + mask.double()
    keep = torch.broadcast_to(keep, s.shape)
    s = s.masked_fill(~keep, float("-inf"))
    hidden = s == float("-inf")
    # A row with nothing visible: its weights are 0 whatever its scores, so its gradient is 0 (softmax of a row
    # of -inf would give NaN, and NaN gradients through it).
    empty = hidden.all(dim=-1, keepdim=True)
    return torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(hidden, 0.0)


def visible_pairs(lq: int, lk: int, causal: bool = False, window_size=None, device=None) -> torch.Tensor:
    """[Lq, Lk] bool: query i sees key j under ``causal`` (the diagonal aligned bottom-right, ``j <= i + Lk - Lq``)
    and ``window_size`` ``(left, right)`` (-1 unbounded), as FlashAttention defines them."""
    keep = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if causal:
        keep = keep.tril(diagonal=lk - lq)
    if window_size is not None:
        left, right = window_size
        if left >= 0:
            keep = keep & ~torch.ones_like(keep).tril(diagonal=lk - lq - left - 1)
        if right >= 0:
            keep = keep & torch.ones_like(keep).tril(diagonal=lk - lq + right)
    return keep


def attention_ref(q, k, v, causal=False, scale=None, attn_mask=None, dtype=torch.float64, return_lse=False,
                  sinks=None, softcap=None, window_size=None, alibi_slopes=None, cache_seqlens=None):
    """Attention computed as softmax(q k^T * scale + mask) v in ``dtype``: float64 for the reference, or the input
    dtype for PyTorch's own error, FlashAttention's ``upcast=False``: scores, weights and products each rounded
    to it (softmax's own sums in fp32, as torch does). GQA by repeating K/V heads; empty rows give 0. ``sinks``
    (H,): one more column per row, ``sinks[h]``, in the softmax, dropped before ``P V`` (gpt-oss's eager).
    ``softcap``: scores ``softcap · tanh(s / softcap)`` before the masks (Gemma-2's eager). ``window_size``
    ``(left, right)``, -1 unbounded: query i sees key j iff ``i + lk - lq - left <= j <= i + lk - lq + right``.
    ``alibi_slopes`` (H,) or (B, H): ``s - slope · |i + lk - lq - j|`` after the softcap (FlashAttention's ALiBi).
    ``cache_seqlens``: (B,) lengths; each batch element's keys past its own are cut off (as separate calls would).
    v may have its own head dim."""
    if cache_seqlens is not None:  # one call per batch element on its used keys
        outs = []
        for b, n in enumerate(cache_seqlens.tolist()):
            mask_b = attn_mask
            if attn_mask is not None:
                mask_b = (attn_mask if attn_mask.shape[0] == 1 else attn_mask[b:b + 1])
                mask_b = mask_b if mask_b.shape[-1] == 1 else mask_b[..., :n]
            slopes_b = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1]
            outs.append(attention_ref(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], causal, scale, mask_b, dtype,
                                      True, sinks, softcap, window_size, slopes_b))
        out, lse = torch.cat([o for o, _ in outs]), torch.cat([l for _, l in outs])
        return (out, lse) if return_lse else out
    h, h_kv = q.shape[1], k.shape[1]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if h != h_kv:
        k = k.repeat_interleave(h // h_kv, dim=1)
        v = v.repeat_interleave(h // h_kv, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:  # Gemma-2's logit softcapping, before the masks
        s = softcap * torch.tanh(s / softcap)
    lq, lk = s.shape[-2:]
    if alibi_slopes is not None:  # after the softcap, before the masks
        distance = (torch.arange(lq, device=s.device)[:, None] + lk - lq - torch.arange(lk, device=s.device)).abs()
        slopes = alibi_slopes.to(s.dtype).view(-1 if alibi_slopes.dim() == 2 else 1, s.shape[1], 1, 1)
        s = s - slopes * distance.to(s.dtype)
    keep = visible_pairs(lq, lk, causal, window_size, s.device)  # on the inputs' device: also a GPU reference
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = keep & attn_mask
        else:
            s = s + attn_mask.to(s.dtype)
    keep = torch.broadcast_to(keep, s.shape)
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.softmax(s, dim=-1)[..., :-1]
        return (p @ v, lse) if return_lse else p @ v
    lse = torch.logsumexp(s, dim=-1)
    empty = (s == float("-inf")).all(dim=-1, keepdim=True)  # no key: output 0, gradient 0 (not NaN)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    out = p @ v
    return (out, lse) if return_lse else out


def attention_grads_ref(q, k, v, do, dtype=torch.float64, **kw):
    """dq, dk, dv (and d attn_mask if it requires grad) by autograd of ``attention_ref`` in ``dtype``."""
    inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    mask = kw.pop("attn_mask", None)
    if mask is not None and mask.requires_grad:
        mask = mask.detach().to(dtype).requires_grad_()
        inputs.append(mask)
    sinks = kw.pop("sinks", None)
    if sinks is not None:
        sinks = sinks.detach().to(dtype).requires_grad_(sinks.requires_grad)
        if sinks.requires_grad:
            inputs.append(sinks)
    out = attention_ref(*inputs[:3], attn_mask=mask, dtype=dtype, sinks=sinks, **kw)
    return torch.autograd.grad(out, inputs, do.to(out.dtype))


def cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    """int32 (B + 1,) cumulative lengths from 0 (FlashAttention's ``cu_seqlens``)."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def varlen_ref(q, k, v, lengths_q, lengths_k, dtype=torch.float64, return_lse=False, alibi_slopes=None, **kw):
    """``attention_ref`` of each sequence of a packed batch (q (total_q, H, D), k/v (total_k, H_kv, ·)),
    concatenated: (total_q, H, Dv), and with ``return_lse`` the (H, total_q) LSE."""
    outs, lses = [], []
    cq, ck = list(itertools.accumulate([0, *lengths_q])), list(itertools.accumulate([0, *lengths_k]))
    for b in range(len(lengths_q)):
        qb, kb, vb = (t[lo:hi].transpose(0, 1).unsqueeze(0) for t, lo, hi in
                      ((q, cq[b], cq[b + 1]), (k, ck[b], ck[b + 1]), (v, ck[b], ck[b + 1])))
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1]
        o, lse = attention_ref(qb, kb, vb, dtype=dtype, return_lse=True, alibi_slopes=slopes, **kw)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    return (out, lse) if return_lse else out


def check_attention_varlen(q, k, v, lengths_q, lengths_k, **kw):
    """``flashlite.flash_attention_varlen`` on the packed batch of the given lengths: output, LSE and the gradients
    of q, k, v (and of sinks that require grad, and through the LSE) against float64 per sequence, under
    FlashAttention's rule. Returns ``(out, lse)``."""
    import flashlite

    cu_q, cu_k = cu_seqlens(lengths_q, q.device), cu_seqlens(lengths_k, q.device)
    max_q, max_k = max(lengths_q, default=0), max(lengths_k, default=0)
    out, lse = flashlite.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **kw)
    assert out.shape == (q.shape[0], q.shape[1], v.shape[2]) and lse.shape == (q.shape[1], q.shape[0])
    ref, ref_lse = varlen_ref(q, k, v, lengths_q, lengths_k, return_lse=True, **kw)
    assert_attention_close(out, ref, varlen_ref(q, k, v, lengths_q, lengths_k, dtype=q.dtype, **kw), q.dtype)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    low = q.dtype != torch.float32
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=2e-2 if low else 1e-5,
                               rtol=1e-2 if low else 1e-5)
    sinks = kw.get("sinks")
    inputs = [q, k, v] + ([sinks] if sinks is not None and sinks.requires_grad else [])
    do, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out, lse), inputs, (do, dlse))

    def ref_grads(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
        kw_ref = dict(kw, sinks=leaves[3]) if len(leaves) == 4 else kw
        o, l = varlen_ref(*leaves[:3], lengths_q, lengths_k, dtype=dtype, return_lse=True, **kw_ref)
        l = torch.where(torch.isfinite(l), l, 0.0)  # an empty row's -inf LSE: no gradient
        return torch.autograd.grad((o, l), leaves, (do.to(dtype), dlse.to(dtype)))

    for g, r, t in zip(grads, ref_grads(torch.float64), ref_grads(q.dtype)):
        assert torch.isfinite(g).all()
        assert_attention_close(g, r, t, q.dtype)
    return out, lse


# Triton 3.9's interpreter truncates fp32 -> bf16 (TOL above): each bf16 value the kernels store or feed to a
# dot can be off by one ulp, 2^-7 of its magnitude, where PyTorch's rounding is off by half of one. Truncation
# is biased toward zero, so a dot of truncated terms (P into O, dS into dK and dQ) adds their errors where
# rounded ones would partly cancel: measured up to ~2 ulps of the output's largest value; the floor allows 4.
INTERPRETER_BF16_ULPS = 4 * 2.0**-7


def attention_floor(ref64: torch.Tensor, dtype: torch.dtype, device: torch.device, magnitude: float = 1.0) -> float:
    """The absolute floor of FlashAttention's rule for an output like ``ref64``: ``ATTN_ATOL`` (stated for inputs of
    unit variance; ``magnitude`` scales it for larger ones), and for bf16 on the CPU (the interpreter's truncating
    casts, twice a rounding's error) twice that, and at least ``INTERPRETER_BF16_ULPS`` of the output's largest
    magnitude."""
    floor = ATTN_ATOL[dtype] * magnitude
    if dtype == torch.bfloat16 and device.type == "cpu":  # every rounding the floor stands for is a truncation there
        floor = max(2 * floor, INTERPRETER_BF16_ULPS * ref64.abs().max().item())
    return floor


def assert_attention_close(out, ref64, out_torch, dtype, magnitude: float = 1.0) -> None:
    """FlashAttention's rule: max|out - ref64| <= 2 * max|out_torch - ref64| + floor (``attention_floor``).

    ``magnitude``: how much larger than unit variance the products of the inputs are. PyTorch's own error can
    be exactly 0 (one key: its softmax is exactly 1), while any flash kernel's fp32 arithmetic leaves ~1e-7 of
    its intermediate values, which grow with the inputs.
    """
    err = (out.double() - ref64).abs().max().item()
    torch_err = (out_torch.double() - ref64).abs().max().item()
    bound = 2 * torch_err + attention_floor(ref64, dtype, out.device, magnitude)
    assert not math.isnan(err), "NaN in output"
    assert err <= bound, f"max error {err:.3e} > 2 x torch's {torch_err:.3e} + {bound - 2 * torch_err:.1e}"


def check_attention(q, k, v, **kw):
    """``flashlite.flash_attention(q, k, v, **kw)``: output, LSE and the gradient of every input that requires
    grad (q, k, v, a float ``attn_mask``, ``sinks``) against float64, under FlashAttention's rule (the LSE within
    1e-5 in fp32, 2e-2 otherwise, where it is finite). Returns the output."""
    import flashlite

    out, lse = flashlite.flash_attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse = attention_ref(q, k, v, return_lse=True, **kw)
    assert_attention_close(out, ref, attention_ref(q, k, v, dtype=q.dtype, **kw), q.dtype)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    low = q.dtype != torch.float32
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=2e-2 if low else 1e-5,
                               rtol=1e-2 if low else 1e-5)
    do = torch.randn_like(out)
    mask, sinks = kw.get("attn_mask"), kw.get("sinks")
    inputs = [q, k, v] + [t for t in (mask, sinks) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(out, inputs, do)
    for g, r, t in zip(grads, attention_grads_ref(q, k, v, do, **kw), attention_grads_ref(q, k, v, do, dtype=q.dtype,
                                                                                            **kw)):
        assert torch.isfinite(g).all()
        assert_attention_close(g, r, t, q.dtype)
    return out


# ----------------------------------------------------------------------------- GPU tests


def poison(n_bytes: int = 1 << 30) -> None:
    """Fill what the caching allocator hands out next with 0xFF bytes, NaN in every float dtype, so that an output
    element never written shows. (A fp32 NaN's bytes read as bf16 or fp16 are half zeros.) Small blocks too:
    allocations of up to 1 MB come from the allocator's small pool, in 2 MB segments."""
    small = [torch.full((1 << 20,), 0xFF, dtype=torch.uint8, device="cuda") for _ in range(32)]
    large = torch.full((n_bytes,), 0xFF, dtype=torch.uint8, device="cuda")
    del small, large


def need_memory(n_bytes: int) -> None:
    """Skip the test unless the GPU has ``n_bytes`` and 8 GB to spare."""
    total = torch.cuda.get_device_properties(0).total_memory
    if total < n_bytes + (8 << 30):
        pytest.skip(f"needs {(n_bytes + (8 << 30)) / 2**30:.0f} GiB of GPU memory, the GPU has {total / 2**30:.0f}")


# A Hopper GPU as the dispatch rules see it (tests/test_attention_wgmma.py, test_attention_backward_wgmma.py).
HOPPER = DeviceInfo(num_sms=132, regs_per_sm=65536, smem_per_sm=232448, max_warps_per_sm=64, capability=(9, 0))


class OnHopper(torch.Tensor):
    """A CPU tensor that says it is on a CUDA device (the rules read ``is_cuda`` and the device's capability)."""

    @property
    def is_cuda(self):
        return True


def on_hopper(t: torch.Tensor) -> torch.Tensor:
    """``t`` as an ``OnHopper`` tensor (same data)."""
    return torch.Tensor._make_subclass(OnHopper, t)


def hopper_qkv(head_dim=128, dtype=torch.bfloat16, seqlen_q=100, seqlen_k=130, kv_heads=2):
    """CPU (B, H, L, D) q, k, v of 4 query heads for the dispatch rules' tests."""
    q = torch.randn(2, 4, seqlen_q, head_dim, dtype=dtype)
    k, v = (torch.randn(2, kv_heads, seqlen_k, head_dim, dtype=dtype) for _ in range(2))
    return q, k, v


def run_python(*args: str, cwd: str | os.PathLike = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python *args`` in a fresh process, flashlite importable, without the TRITON_INTERPRET that conftest sets
    for this session: there the kernels are built for the GPU, as on a new user's machine. Output captured as text."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def fresh_process_report(module: str, function: str, cases: list, timeout: float = 600) -> dict:
    """The JSON report of ``module.function(cases)`` computed in a fresh process (``run_python``: without the
    interpreter, so that kernels are built for the GPU there; sm_90 builds need no GPU)."""
    done = run_python("-c", f"import json; from {module} import {function}; print(json.dumps({function}({cases!r})))",
                      timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def free_port() -> int:
    """A TCP port free on this machine now (a spawned process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(main, world_size: int, args: tuple, timeout_s: float) -> None:
    """Run ``main(rank, world_size, port, *args)`` in ``world_size`` spawned processes (a free rendezvous port);
    a rank's error is raised here, and ranks still running after ``timeout_s`` are stopped (TimeoutError)."""
    import torch.multiprocessing as mp

    context = mp.start_processes(main, nprocs=world_size, join=False, start_method="spawn",
                                 args=(world_size, free_port(), *args))
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:  # the ranks started here
                process.terminate()
            raise TimeoutError(f"{world_size} ranks did not finish in {timeout_s} s")


def made_once(make):
    """``get(key)``: ``make(key)``, made at the first call with that key and kept; an error is kept too and
    raised at every call (each test of a spawned run reports the run's one failure)."""
    made = {}

    def get(key):
        if key not in made:
            try:
                made[key] = make(key)
            except Exception as err:  # noqa: BLE001 - kept for every caller
                made[key] = err
        if isinstance(made[key], Exception):
            raise made[key]
        return made[key]

    return get


def spy_tma_launches(monkeypatch, launched: list) -> None:
    """Record instead of run every ``core.runtime.TmaLaunch`` call: ``(launch, args)`` with ``args`` the arguments
    its kernel gets, the descriptors bound to the call's tensors first (``bind_descriptors``)."""
    from flashlite.core import runtime

    def record(launch, tensors, *rest):
        launched.append((launch, (*runtime.bind_descriptors(launch.templates, tensors), *rest)))

    monkeypatch.setattr(runtime.TmaLaunch, "__call__", record)

