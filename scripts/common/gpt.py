"""A small GPT (decoder-only transformer), a character-level corpus (``pydoc_data.topics``, about
465k characters, 103 distinct) and what its training runs share (optimizer, held-out evaluation,
the PowerSGD rank matched to a quantized payload's bytes). Each block is one element of
``model.blocks``, so FSDP2 can shard them one by one.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))`` (causal attention, GELU MLP of 4x width)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and learned position embeddings, ``layers`` blocks, final LayerNorm, linear head to
    ``vocab`` logits; inputs of at most ``context`` tokens. About ``12 x layers x width^2``
    parameters (1.84M for width 192, 4 layers, vocab 103, context 128)."""

    def __init__(self, vocab: int, width: int = 192, layers: int = 4, heads: int = 4, context: int = 128) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (batch, time, vocab) for token ids ``idx`` (batch, time)."""
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"{t} tokens exceed the context of {self.context}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of next-token predictions ``self(x)`` against targets ``y``."""
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def corpus() -> str:
    """Python's pydoc topics (its ``help()`` text), joined in key order."""
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics))


def char_splits(val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(train, val, chars): the corpus encoded as indices into ``chars`` (its sorted distinct
    characters), the last ``val_fraction`` of it held out for validation."""
    text = corpus()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    cut = int(len(data) * (1 - val_fraction))
    return data[:cut], data[cut:], chars


def sample_batch(
    data: torch.Tensor, batch_size: int, context: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``data``: inputs (batch, context) and the next characters as targets."""
    start = torch.randint(0, len(data) - context - 1, (batch_size,), generator=generator)
    offsets = start[:, None] + torch.arange(context + 1)
    windows = data[offsets]
    return windows[:, :-1], windows[:, 1:]


def decode(ids, chars: list[str]) -> str:
    """Characters of the indices ``ids``."""
    return "".join(chars[int(i)] for i in ids)


def lr_at(step: int, args) -> float:
    """The training schedule: linear warm-up over ``args.warmup`` steps to ``args.lr``, then cosine
    decay to 10% of it at ``args.steps``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------------------------------- training
def powersgd_bytes(model: torch.nn.Module, rank: int) -> int:
    """Bytes one rank contributes per step under ``powerSGD_hook`` at ``rank``: P (m x r) and Q
    (n x r) in float32 for every matrix it compresses (a tensor viewed as shape[0] x rest, compressed
    when that saves at least its min_compression_rate of 2), the rest in float32."""
    total = 0
    for p in model.parameters():
        if p.dim() < 2:
            total += 4 * p.numel()
            continue
        m, n = p.shape[0], p.numel() // p.shape[0]
        r = min(rank, m, n)
        total += 4 * (m + n) * r if (m + n) * r * 2 <= m * n else 4 * m * n
    return total


def quantized_bytes(model: torch.nn.Module, bits: int, bucket_size: int, min_size: int) -> float:
    """Bytes of one rank's payload at ``bits`` per coordinate plus a float32 norm per bucket;
    tensors below ``min_size`` in float32."""
    total = 0.0
    for p in model.parameters():
        n = p.numel()
        total += 4 * n if n < min_size else n * bits / 8 + 4 * math.ceil(n / bucket_size)
    return total


def matched_rank(model: torch.nn.Module, bits: int, bucket_size: int, min_size: int) -> int:
    """The PowerSGD rank whose bytes per step are closest to the ``bits``-bit quantized payload."""
    target = quantized_bytes(model, bits, bucket_size, min_size)
    return min(range(1, 65), key=lambda r: abs(powersgd_bytes(model, r) - target))


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: torch.Tensor, args) -> float:
    """Mean cross-entropy (nats per character) over ``--eval-windows`` evenly spaced held-out windows."""
    model.eval()
    starts = torch.linspace(0, len(val) - args.context - 2, args.eval_windows).long()
    losses = []
    for chunk in starts.split(64):
        offsets = chunk[:, None] + torch.arange(args.context + 1)
        w = val[offsets]
        losses.append(model.loss(w[:, :-1], w[:, 1:]) * len(chunk))
    model.train()
    return float(torch.stack(losses).sum() / len(starts))


def make_optimizer(model: torch.nn.Module, args) -> torch.optim.Optimizer:
    """``--optimizer``: AdamW (betas 0.9, 0.95, decoupled weight decay), the same with its second
    moment frozen after the ``--warmup`` steps (``adamw-frozen``), or SGD with momentum 0.9 (weight
    decay added to the gradient), all at ``--lr`` (the schedule sets it every step)."""
    kind = getattr(args, "optimizer", "adamw")
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    if kind == "adamw-frozen":
        from horovod_alq.torch.optim import FrozenVarianceAdamW

        return FrozenVarianceAdamW(
            model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95), freeze_step=args.warmup
        )
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
