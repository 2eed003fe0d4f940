"""flashlite.study: the traced state of the online softmax and of flash attention against the direct float64 computation."""

import math

import pytest
import torch

from flashlite import study

from .utils import attention_ref, randn, softmax_ref

NEG_INF = float("-inf")
# The traces run in fp32: the state after a block is a few roundings away from float64.
STATE_TOL = dict(atol=1e-6, rtol=2e-6)


def direct_prefix_states(x: torch.Tensor, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, sum e^(x - max)) of every prefix x[:, :end] that ends a block, in float64, straight from the definition."""
    x = x.double()
    ms, ds = [], []
    for end in range(block_n, x.shape[1] + block_n, block_n):
        prefix = x[:, :end]
        m = prefix.max(dim=1).values
        d = torch.where(m == NEG_INF, 0.0, torch.exp(prefix - m[:, None]).sum(dim=1))
        ms.append(m)
        ds.append(torch.nan_to_num(d, nan=0.0))
    return torch.stack(ms, dim=1), torch.stack(ds, dim=1)


def assert_state_close(trace: study.SoftmaxTrace, x: torch.Tensor) -> None:
    m, d = direct_prefix_states(x, trace.block_n)
    torch.testing.assert_close(trace.m.double(), m, **STATE_TOL)
    torch.testing.assert_close(trace.d.double(), d, **STATE_TOL)


@pytest.mark.parametrize(
    "shape, block_n",
    [
        ((3, 100), 16),  # 7 blocks, the last one ragged (4 columns)
        ((3, 100), 128),  # one block wider than the row: the fused kernel's case
        ((2, 64), 1),  # one column a block: the element-by-element recurrence
        ((37, 50), 8),  # 37 rows: three programs of 16 rows, the last one partly padding
        ((1, 1), 4),  # a single logit: m = x, d = 1
        ((1, 256 * 4), 4),  # the most blocks a trace holds
    ],
)
def test_softmax_trace_matches_direct(shape, block_n):
    x = randn(*shape, scale=3.0)
    trace = study.trace_softmax(x, block_n=block_n)
    assert trace.m.shape == (shape[0], math.ceil(shape[1] / block_n))
    assert_state_close(trace, x)
    torch.testing.assert_close(trace.y.double(), softmax_ref(x), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(trace.lse.double(), torch.logsumexp(x.double(), dim=1), atol=1e-5, rtol=1e-6)
    # The split-row route (each block alone, then merge_partial_states) lands on the same final state.
    torch.testing.assert_close(trace.merged_m, trace.m[:, -1])
    torch.testing.assert_close(trace.merged_d, trace.d[:, -1], rtol=1e-5, atol=0)
    errors = study.check_trace(trace)
    assert set(errors) >= {"m", "d", "alpha", "y", "lse", "merged_m", "merged_d"}


def test_second_block_raises_the_max():
    x = torch.zeros(1, 32)
    x[0, :16] = torch.linspace(-1.0, 1.0, 16)  # block 0: max 1
    x[0, 16:] = torch.linspace(-2.0, 3.0, 16)  # block 1: max 3, so d from block 0 shrinks by e^(1 - 3)
    trace = study.trace_softmax(x, block_n=16)
    assert trace.alpha[0, 0] == 0.0  # from the empty state
    torch.testing.assert_close(trace.alpha[0, 1], torch.tensor(math.exp(1.0 - 3.0)), rtol=1e-6, atol=0)
    assert trace.m.tolist() == [[1.0, 3.0]]
    assert_state_close(trace, x)
    # d after block 1 is the rescaled old sum plus the new block's sum, under the new max.
    d0_rescaled = trace.d[0, 0] * trace.alpha[0, 1]
    block1 = torch.exp(x[0, 16:].double() - 3.0).sum()
    torch.testing.assert_close(trace.d[0, 1].double(), d0_rescaled.double() + block1, rtol=1e-6, atol=0)
    study.check_trace(trace)


def test_later_blocks_below_the_max_do_not_rescale():
    x = randn(2, 48) - 5.0
    x[:, 3] = 10.0  # the row's max sits in block 0
    trace = study.trace_softmax(x, block_n=16)
    assert (trace.alpha[:, 1:] == 1.0).all()
    assert_state_close(trace, x)


def test_all_neg_inf_first_block():
    x = randn(3, 40)
    x[:, :16] = NEG_INF  # block 0 masked: the state stays empty through it
    x[2, :] = NEG_INF  # and a row masked throughout
    trace = study.trace_softmax(x, block_n=16)
    assert (trace.m[:, 0] == NEG_INF).all() and (trace.d[:, 0] == 0).all()
    assert (trace.alpha[:, :2] == 0).all()  # from an empty state alpha is 0, not e^(-inf + inf) = NaN
    for field in (trace.m, trace.d, trace.alpha, trace.lse):
        assert not field.isnan().any()
    assert (trace.m[2] == NEG_INF).all() and (trace.d[2] == 0).all() and trace.lse[2] == NEG_INF
    assert trace.y[2].isnan().all()  # a row of -inf gives NaN, as torch.softmax does
    assert_state_close(trace, x)
    torch.testing.assert_close(trace.y.double(), softmax_ref(x), atol=1e-6, rtol=1e-5, equal_nan=True)
    study.check_trace(trace)


def test_large_logits_keep_fp32_accuracy():
    # x - m is taken before the scale by log2(e): logits near 1e4 lose nothing beyond their own rounding.
    x = randn(2, 64, scale=2.0) + 1.0e4
    trace = study.trace_softmax(x, 16)
    assert_state_close(trace, x)
    torch.testing.assert_close(trace.y.double(), softmax_ref(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_softmax_trace_of_half_inputs_runs_in_fp32(dtype):
    x = randn(4, 70, dtype=dtype, scale=2.0)
    trace = study.trace_softmax(x, block_n=32)
    assert trace.m.dtype == torch.float32
    assert_state_close(trace, x.float())


@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, head_dim, block_m, block_n, q_tile, causal",
    [
        (64, 128, 32, 16, 16, 3, False),  # 8 full K/V tiles
        (50, 70, 24, 16, 32, 2, True),  # ragged last tiles, head_dim padded to 32, diagonal inside a tile
        (16, 40, 16, 16, 16, 0, True),  # seqlen_q < seqlen_k: bottom-right causal, the last query sees every key
        (64, 16, 16, 16, 16, 3, True),  # seqlen_q > seqlen_k: query i sees keys j <= i - 48, one tile here
        (64, 16, 16, 16, 16, 1, True),  # ... and queries 16..31 see no key at all: no tile is visited
        (40, 33, 16, 32, 16, 1, False),  # a tile of 8 real queries and 24 padding rows
    ],
)
def test_attention_trace_matches_direct(seqlen_q, seqlen_k, head_dim, block_m, block_n, q_tile, causal):
    q, k, v = randn(seqlen_q, head_dim), randn(seqlen_k, head_dim), randn(seqlen_k, head_dim)
    trace = study.trace_attention(q, k, v, block_m=block_m, block_n=block_n, q_tile=q_tile, causal=causal)
    rows = trace.rows
    assert rows.tolist() == list(range(q_tile * block_m, min((q_tile + 1) * block_m, seqlen_q)))

    # State per tile, straight from the definition over the keys seen so far.
    s = (q.double()[rows] @ k.double().T) / math.sqrt(head_dim)
    if causal:
        s = s.masked_fill(torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril(seqlen_k - seqlen_q)[rows] == 0, NEG_INF)
    if causal and (q_tile + 1) * block_m <= seqlen_q - seqlen_k:  # the whole tile sees no key
        assert trace.n_tiles == 0
    m, d = direct_prefix_states(s, block_n)
    torch.testing.assert_close(trace.m.double(), m[:, :trace.n_tiles].T, **STATE_TOL)
    torch.testing.assert_close(trace.d.double(), d[:, :trace.n_tiles].T, **STATE_TOL)
    assert not trace.alpha.isnan().any() and not trace.out.isnan().any()

    # The last partial output is the attention output (float64 reference, every key).
    final = attention_ref(q[None, None], k[None, None], v[None, None], causal=causal)[0, 0, rows]
    last = trace.out[-1] if trace.n_tiles else torch.zeros_like(final)
    torch.testing.assert_close(last.double(), final, atol=2e-6, rtol=1e-5)
    study.check_trace(trace)


def test_attention_alpha_rescales_the_accumulator():
    head_dim = 16
    q = torch.zeros(16, head_dim)
    q[:, 0] = 1.0
    k, v = randn(32, head_dim, scale=0.1), randn(32, head_dim)
    k[20, 0] = 8.0  # a key in tile 1 that every query prefers: the max rises at tile 1
    trace = study.trace_attention(q, k, v, block_m=16, block_n=16, scale=1.0)
    assert trace.n_tiles == 2
    assert (trace.alpha[1] < 0.01).all()
    torch.testing.assert_close(trace.alpha[1], torch.exp(trace.m[0] - trace.m[1]), rtol=1e-5, atol=0)
    # Each partial output is the softmax-weighted mean of the values seen so far.
    for t, end in enumerate(trace.key_ends):
        p = torch.softmax(q.double() @ k.double()[:end].T, dim=1)
        torch.testing.assert_close(trace.out[t].double(), p @ v.double()[:end], atol=2e-6, rtol=1e-5)


def test_attention_trace_m_is_in_natural_units():
    q, k, v = randn(16, 16), randn(48, 16), randn(48, 16)
    trace = study.trace_attention(q, k, v, scale=0.3)
    expected = (q.double() @ k.double().T * 0.3).max(dim=1).values
    torch.testing.assert_close(trace.m[-1].double(), expected, atol=1e-5, rtol=1e-6)


def test_study_validates_arguments():
    x = randn(2, 10)
    with pytest.raises(ValueError, match="block_n"):
        study.trace_softmax(x, block_n=12)
    with pytest.raises(ValueError, match="at most"):
        study.trace_softmax(randn(1, 600), block_n=2)
    with pytest.raises(TypeError, match="x must be"):
        study.trace_softmax(x.to(torch.int32))
    q = randn(16, 16)
    with pytest.raises(ValueError, match="block_m"):
        study.trace_attention(q, q, q, block_m=8)
    with pytest.raises(ValueError, match="q_tile"):
        study.trace_attention(q, q, q, q_tile=1)
    with pytest.raises(ValueError, match="k and v"):
        study.trace_attention(q, q, randn(16, 32))


def test_check_trace_names_the_field_that_differs():
    trace = study.trace_softmax(randn(2, 32), block_n=8)
    trace.d[0, 2] *= 1.01  # a wrong denominator
    with pytest.raises(AssertionError, match=r"\bd\b"):
        study.check_trace(trace)


def test_story_logits_show_each_case():
    x, labels = study.story_logits(block_n=16, n_blocks=6)
    trace = study.trace_softmax(x, block_n=16)
    alpha = dict(zip(labels, trace.alpha))
    assert (alpha["rising"][1:] < 1).any()
    assert (alpha["peak first"][1:] == 1).all()
    assert (alpha["first block masked"][:2] == 0).all()
    study.check_trace(trace)


@pytest.mark.skipif(not study.matplotlib_available(), reason="matplotlib not installed")
def test_plots_are_written(tmp_path):
    x, labels = study.story_logits(block_n=8, n_blocks=4)
    q, k, v = randn(16, 16), randn(32, 16), randn(32, 16)
    paths = [
        study.plot_softmax_trace(study.trace_softmax(x, 8), str(tmp_path / "s.png"), labels),
        study.plot_attention_trace(study.trace_attention(q, k, v, causal=True), str(tmp_path / "a.png")),
        study.plot_errors({"one": 1e-7, "broken": None}, str(tmp_path / "e.png"), {"one": 1e-5}),
    ]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
