"""Train a tiny character-level GPT whose attention is ``flashlite.nn.MultiheadAttention``.

The model: token + position embeddings, ``--layers`` pre-norm blocks
(LayerNorm → causal flashlite attention → residual, LayerNorm → MLP → residual),
a final LayerNorm and a linear head over the characters. The text is the
repository's own Markdown (README.md, docs/*.md); windows of ``--seq-len``
characters are drawn at random, the model predicts each next character, AdamW
minimises the cross-entropy. Every ``--log-every`` steps it prints the training
loss and tokens/s; at the end, the loss on the held-out last 10% of the text.

    python examples/train_tiny_gpt.py                      # CUDA when available (bf16 autocast)
    python examples/train_tiny_gpt.py --device cpu --steps 100   # about 5 s on 2 CPU cores (300 steps: about 10 s)

On CUDA the attention runs flashlite's Triton kernels, forward and backward.
On CPU it runs flashlite's PyTorch path (fp32, plain autograd): small and slow,
but the same model. Leave ``TRITON_INTERPRET`` unset for CPU training: under
the interpreter every attention call would run the Triton kernels in numpy.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from flashlite.nn import MultiheadAttention  # noqa: E402

HOLDOUT = 0.1  # the last 10% of the text is never trained on


def load_text() -> str:
    """The Markdown that ships with the repository (about 70 kB)."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files if f.exists())


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = MultiheadAttention(d_model, n_heads, causal=True)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, L) → logits (B, L, vocab)."""
        x = self.tok_emb(ids) + self.pos_emb(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def random_windows(data: torch.Tensor, seq_len: int, batch: int, generator: torch.Generator) -> tuple:
    """Inputs and next-character targets, (batch, seq_len) each, from random offsets of ``data``."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=generator)
    rows = torch.stack([data[s: s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def train(
    steps: int, device: str, seq_len: int, batch: int, *, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
    lr: float = 3e-3, log_every: int = 10, seed: int = 0, verbose: bool = True,
) -> dict:
    """Train from scratch; returns ``{"losses": [per step], "val_loss": float, "tokens_per_s": float}``."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    text = load_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(len(data) * (1 - HOLDOUT))
    train_data, val_data = data[:split], data[split:]

    model = TinyGPT(len(chars), seq_len, d_model, n_layers, n_heads).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # linear warmup, then cosine decay to 10%
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * min(s / steps, 1.0))))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))
    if verbose:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{n_params / 1e6:.2f}M parameters, vocab {len(chars)}, {len(train_data)} training characters, "
              f"device {device}, batch {batch} x {seq_len}")

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    losses = []
    sync()
    t_start = t_log = time.perf_counter()
    for step in range(1, steps + 1):
        x, y = (t.to(device) for t in random_windows(train_data, seq_len, batch, generator))
        with autocast:
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())  # .item() syncs: the timing below is honest
        if verbose and (step % log_every == 0 or step == steps):
            now = time.perf_counter()
            n_steps = log_every if step % log_every == 0 else step % log_every
            print(f"step {step:5d}  loss {sum(losses[-n_steps:]) / n_steps:.4f}  "
                  f"{n_steps * batch * seq_len / (now - t_log):,.0f} tokens/s")
            t_log = now
    elapsed = time.perf_counter() - t_start

    model.eval()
    with torch.no_grad(), autocast:
        x, y = (t.to(device) for t in random_windows(val_data, seq_len, batch, generator))
        val_loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).item()
    result = {"losses": losses, "val_loss": val_loss, "tokens_per_s": steps * batch * seq_len / elapsed}
    if verbose:
        print(f"held-out loss {val_loss:.4f} (uniform guess: {math.log(len(chars)):.4f}); "
              f"{result['tokens_per_s']:,.0f} tokens/s overall")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-len", type=int, default=None, help="default 256 on CUDA, 64 on CPU")
    parser.add_argument("--batch", type=int, default=None, help="default 32 on CUDA, 16 on CPU")
    parser.add_argument("--d-model", type=int, default=None, help="default 256 on CUDA, 64 on CPU")
    parser.add_argument("--layers", type=int, default=None, help="default 4 on CUDA, 2 on CPU")
    parser.add_argument("--heads", type=int, default=4, help="head dim = d_model / heads must be >= 16")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=25)
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    train(
        args.steps, args.device,
        seq_len=args.seq_len or (256 if cuda else 64), batch=args.batch or (32 if cuda else 16),
        d_model=args.d_model or (256 if cuda else 64), n_layers=args.layers or (4 if cuda else 2),
        n_heads=args.heads, lr=args.lr, log_every=args.log_every,
    )


if __name__ == "__main__":
    main()
