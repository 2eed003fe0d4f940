"""Argument checks shared by the public functions: each raises an error that names the argument at fault."""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from .runtime import runs_kernels

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# The kernels take a scale as a float32 argument, multiplied by up to log2(e): the largest that stays finite.
MAX_SCALE = float(torch.finfo(torch.float32).max) / math.log2(math.e)


def check_float_dtype(name: str, t: torch.Tensor) -> None:
    """Raise a TypeError naming argument ``name`` unless it is fp32, fp16 or bf16."""
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_kernel_tensor(name: str, x: torch.Tensor) -> None:
    """Raise naming argument ``name`` unless ``x`` is a fp32, fp16 or bf16 tensor that flashlite's Triton kernels
    can run on (``runs_kernels``): a CUDA tensor, or a CPU tensor with the kernels built for Triton's interpreter.
    For the functions that have no PyTorch path of their own (``flashlite.textbook``, ``flashlite.study``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    check_float_dtype(name, x)
    if not runs_kernels(x):
        raise RuntimeError(
            f"{name} is on {x.device}: flashlite's Triton kernels need a CUDA tensor, or TRITON_INTERPRET=1 set "
            "before triton is imported to run them on the CPU (`flashlite demo` does it)"
        )


def check_scale(scale, default: float) -> float:
    """``scale`` as a float (``default`` when None); a TypeError for a bool, tensor or anything not a real number,
    a ValueError for NaN, an infinity, or a value the kernels' float32 arithmetic cannot hold."""
    if scale is None:
        return default
    if type(scale) is not float and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if abs(scale) > MAX_SCALE:
        raise ValueError(f"scale={scale:g} is too large: the kernels apply it in float32, where |scale| must stay "
                         f"under {MAX_SCALE:.3g}")
    return scale


def check_softcap(softcap) -> float | None:
    """``softcap`` as a float: None, or a finite number > 0 (not a bool)."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be None or a float > 0, got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap must be finite and > 0, got {softcap!r}")
    return float(softcap)


def check_window_size(window_size) -> tuple[int, int] | None:
    """``window_size`` as ``(left, right)``: None, or a pair (tuple or list) of ints >= -1, -1 meaning unbounded
    on that side (FlashAttention's ``window_size``); a TypeError or ValueError naming ``window_size`` otherwise."""
    if window_size is None:
        return None
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be None or a pair (left, right) of ints >= -1, got {window_size!r}")
    for side in window_size:
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise TypeError(f"window_size must be a pair of ints >= -1, got {window_size!r}")
        if side < -1:
            raise ValueError(f"window_size sides must be >= -1 (-1: unbounded), got {tuple(window_size)!r}")
    return int(window_size[0]), int(window_size[1])


def check_alibi_slopes(alibi_slopes, q: torch.Tensor, batch: int | None = None) -> None:
    """``alibi_slopes``: None, or a float32 tensor of shape (H,) or (B, H) on q's device (q is (B, H, L, D); a
    packed batch gives its number of sequences as ``batch``)."""
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a float32 tensor of shape (H,) or (B, H), got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    batch, n_heads = q.shape[0] if batch is None else batch, q.shape[1]
    if tuple(alibi_slopes.shape) not in ((n_heads,), (batch, n_heads)):
        raise ValueError(f"alibi_slopes must have shape (H,) = ({n_heads},) or (B, H) = ({batch}, {n_heads}), "
                         f"got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device}, q on {q.device}: they must be on the same device")


def check_sinks(sinks, q: torch.Tensor) -> None:
    """``sinks``: None, or a floating (H,) tensor on q's device (``H`` = q's heads)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a tensor of shape (H,), got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor, got dtype {sinks.dtype}")
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must have shape (H,) = ({q.shape[1]},), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device}, q on {q.device}: they must be on the same device")


def check_flag(name: str, value) -> bool:
    """``value`` as a bool; a TypeError naming ``name`` for anything but a bool (``"no"`` or None is not one)."""
    if type(value) is bool or isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_dim(dim, ndim: int) -> int:
    """``dim`` of a tensor with ``ndim`` dims (0-d counts as 1, as torch does), made non-negative; a TypeError
    naming ``dim`` unless it is an int (not a bool, str, float, None or tuple), an IndexError when out of range."""
    if isinstance(dim, (bool, np.bool_)) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"dim must be an int, got {type(dim).__name__} {dim!r}")
    dim = int(dim)
    size = max(ndim, 1)
    if not -size <= dim < size:
        raise IndexError(f"dim={dim} is out of range for a tensor with {ndim} dimension(s)")
    return dim % size


def check_cu_seqlens(name: str, cu: torch.Tensor) -> None:
    """A packed batch's cumulative lengths (``cu_seqlens``): an int32 1-D tensor of at least one element; a
    TypeError or ValueError naming ``name`` otherwise."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D (sequences + 1,), got shape {tuple(cu.shape)}")
