"""The textbook kernels (flashlite.textbook) against float64, as the fast kernels are tested, in the interpreter.

Sizes are odd on purpose: rows shorter and longer than one block, a last block
that is partly padding, head dims that are not powers of two, Lq != Lk, GQA,
causal rows that see no key. The same inputs through the fast kernels give the
same answers within the same tolerances.
"""

import importlib

import pytest
import torch

import flashlite
from flashlite.textbook import flash_attention_forward, fused_softmax, online_softmax

online_module = importlib.import_module("flashlite.textbook.online_softmax")  # the module (the package exports the function)

from .utils import (
    DTYPES,
    assert_attention_close,
    assert_close,
    attention_ref,
    randn,
    run_python,
    softmax_ref,
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (2, 5, 300), (4, 1025)])
@pytest.mark.parametrize("kernel", [fused_softmax, online_softmax])
def test_softmax(kernel, shape, dtype):
    x = randn(*shape, dtype=dtype, scale=4.0)
    y = kernel(x)
    assert y.shape == x.shape and y.dtype == dtype
    assert_close(y, softmax_ref(x))
    assert_close(y, flashlite.softmax(x).double(), dtype)  # the fast kernels agree


def test_online_softmax_many_blocks(monkeypatch):
    # Rows of 5 blocks and a ragged sixth: the state carried across blocks, the maximum raised by a late block.
    monkeypatch.setattr(online_module, "BLOCK_N", 16)
    x = randn(3, 85, scale=3.0)
    x[1, 80] = 40.0  # the largest logit of row 1 in its last block
    assert_close(online_softmax(x), softmax_ref(x))


@pytest.mark.parametrize("kernel", [fused_softmax, online_softmax])
def test_softmax_special_values(kernel):
    # As torch.softmax: -inf entries give 0, a row of -inf and a row holding NaN give NaN.
    x = randn(4, 20)
    x[0, :5] = float("-inf")
    x[1] = float("-inf")
    x[2, 3] = float("nan")
    torch.testing.assert_close(kernel(x), torch.softmax(x, -1), equal_nan=True)


def test_softmax_errors():
    with pytest.raises(TypeError, match="x must be float32"):
        fused_softmax(torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="at most 65536"):
        fused_softmax(torch.empty(1, 65537))
    assert online_softmax(torch.empty(0, 7)).shape == (0, 7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "b, h, h_kv, lq, lk, d, causal",
    [
        (1, 2, 2, 37, 50, 40, False),  # ragged tiles, a head dim padded to 64
        (2, 4, 2, 50, 37, 64, True),  # GQA; causal with Lq > Lk: the first 13 queries see no key (zeros)
        (1, 3, 1, 1, 70, 24, True),  # MQA decoding: one query sees every key
        (1, 1, 1, 20, 20, 160, False),  # a wide head dim
    ],
)
def test_flash_attention_forward(b, h, h_kv, lq, lk, d, causal, dtype):
    q = randn(b, h, lq, d, dtype=dtype)
    k, v = randn(b, h_kv, lk, d, dtype=dtype), randn(b, h_kv, lk, d, dtype=dtype)
    out = flash_attention_forward(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == dtype
    ref = attention_ref(q, k, v, causal=causal)
    assert_attention_close(out, ref, attention_ref(q, k, v, causal=causal, dtype=dtype), dtype)
    fast = flashlite.flash_attention(q, k, v, causal=causal)
    assert_attention_close(fast, ref, attention_ref(q, k, v, causal=causal, dtype=dtype), dtype)


def test_flash_attention_forward_scale_and_strides():
    # A transposed (B, L, H, D) view is read as given (copied to contiguous first), and the scale is the caller's.
    q, k, v = (randn(2, 33, 2, 32).transpose(1, 2) for _ in range(3))
    out = flash_attention_forward(q, k, v, scale=0.3)
    assert_attention_close(out, attention_ref(q, k, v, scale=0.3), attention_ref(q, k, v, scale=0.3,
                                                                                 dtype=torch.float32), torch.float32)


def test_flash_attention_forward_errors():
    q = randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="k and v"):
        flash_attention_forward(q, randn(1, 3, 4, 16), randn(1, 3, 4, 16))
    with pytest.raises(ValueError, match="must be"):
        flash_attention_forward(q, randn(1, 2, 4, 32), randn(1, 2, 4, 32))
    with pytest.raises(TypeError, match="causal"):
        flash_attention_forward(q, q, q, causal="yes")
    with pytest.raises(ValueError, match="scale"):
        flash_attention_forward(q, q, q, scale=float("nan"))



def test_cpu_tensor_without_the_interpreter():
    # Kernels built for the GPU (no TRITON_INTERPRET) and a CPU tensor: the textbook has no PyTorch path, so a
    # clear error naming the argument, not torch's "Torch not compiled with CUDA enabled" from deep in a launch.
    code = (
        "import torch\n"
        "from flashlite.textbook import flash_attention_forward, fused_softmax, online_softmax\n"
        "x = torch.randn(1, 1, 4, 16)\n"
        "for name, call in [('x', lambda: fused_softmax(x)), ('x', lambda: online_softmax(x)),\n"
        "                   ('q', lambda: flash_attention_forward(x, x, x))]:\n"
        "    try:\n"
        "        call()\n"
        "    except RuntimeError as err:\n"
        "        print(type(err).__name__, err)\n"
        "    else:\n"
        "        print('no error')\n"
    )
    done = run_python("-c", code)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 3, done.stdout
    for line, name in zip(lines, "xxq"):
        assert line.startswith(f"RuntimeError {name} is on cpu: flashlite's Triton kernels need a CUDA tensor"), line
        assert "TRITON_INTERPRET=1 set before triton is imported" in line, line
