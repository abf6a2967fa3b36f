"""`TextCorpus` (public-domain text shipped with the package, as characters), `MarkovCorpus` (a
learnable synthetic token stream), and the batches of a demo or test run."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources

import torch

DEMO_TEXT = "kjv-genesis-exodus.txt"  # see demo/corpus/SOURCE.md


@dataclass
class Batch:
    """Inputs, next-token targets and the ids of the samples (their start offsets)."""

    x: torch.Tensor
    y: torch.Tensor
    ids: list[int]
    input_scale: float = 1.0
    toxic: bool = field(default=False, compare=False)


class MarkovCorpus:
    """Tokens from a sparse first-order Markov chain: learnable, with a known entropy floor."""

    def __init__(self, vocab_size: int = 64, length: int = 200_000, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        logits = torch.randn(vocab_size, vocab_size, generator=g) * 4.0
        probs = torch.softmax(logits, dim=-1)
        chains = 512  # independent chains, sampled in parallel and joined end to end
        steps = -(-length // chains)
        seq = torch.empty(chains, steps, dtype=torch.long)
        seq[:, 0] = torch.randint(vocab_size, (chains,), generator=g)
        for i in range(1, steps):
            row = probs[seq[:, i - 1]]
            seq[:, i] = torch.multinomial(row, 1, generator=g).squeeze(1)
        tokens = seq.reshape(-1)[:length].clone()
        self.tokens = tokens
        self.entropy = float(-(probs * probs.clamp_min(1e-12).log()).sum(-1).mean())

    def batches(self, batch_size: int, seq_len: int, steps: int, seed: int = 1) -> Iterator[Batch]:
        """`steps` batches of random windows, the same sequence for the same seed."""
        return _windows(self.tokens, batch_size, seq_len, steps, seed)

    def make_toxic(self, batch: Batch, seed: int = 2, input_scale: float = 8.0) -> Batch:
        """The same batch with its targets shuffled and its inputs scaled: one bad batch."""
        return _toxic(batch, seed, input_scale)


class TextCorpus:
    """A text as character tokens, its last `held_out` share kept for evaluation."""

    def __init__(self, text: str, held_out: float = 0.1) -> None:
        self.chars = sorted(set(text))
        self.vocab_size = len(self.chars)
        index = {c: i for i, c in enumerate(self.chars)}
        tokens = torch.tensor([index[c] for c in text], dtype=torch.long)
        cut = int(len(tokens) * (1 - held_out))
        self.tokens, self.held_out = tokens[:cut], tokens[cut:]

    @classmethod
    def load(cls, name: str = DEMO_TEXT) -> TextCorpus:
        """The shipped public-domain corpus (Genesis and Exodus, King James Version)."""
        text = resources.files("trainguard.demo").joinpath("corpus", name).read_text("utf-8")
        return cls(text)

    def batches(
        self, batch_size: int, seq_len: int, steps: int, seed: int = 1, held_out: bool = False
    ) -> Iterator[Batch]:
        """`steps` batches of random windows, the same sequence for the same seed."""
        tokens = self.held_out if held_out else self.tokens
        return _windows(tokens, batch_size, seq_len, steps, seed)

    def make_toxic(self, batch: Batch, seed: int = 2, input_scale: float = 8.0) -> Batch:
        """The same batch with its targets shuffled and its inputs scaled: one bad batch."""
        return _toxic(batch, seed, input_scale)


def corrupted(batch: Batch, vocab_size: int, fraction: float, seed: int = 3) -> Batch:
    """`batch` with `fraction` of its tokens replaced by random ones of the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    windows = torch.cat((batch.x, batch.y[:, -1:]), dim=1)
    noisy = torch.rand(windows.shape, generator=g) < fraction
    random = torch.randint(vocab_size, windows.shape, generator=g)
    windows = torch.where(noisy, random, windows)
    return Batch(x=windows[:, :-1], y=windows[:, 1:], ids=batch.ids, toxic=True)


def _toxic(batch: Batch, seed: int, input_scale: float) -> Batch:
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(batch.y.numel(), generator=g)
    y = batch.y.reshape(-1)[perm].reshape(batch.y.shape)
    return Batch(x=batch.x, y=y, ids=batch.ids, input_scale=input_scale, toxic=True)


def _windows(
    tokens: torch.Tensor, batch_size: int, seq_len: int, steps: int, seed: int
) -> Iterator[Batch]:
    """`steps` batches of `batch_size` random windows of `tokens`; ids are the start offsets."""
    g = torch.Generator().manual_seed(seed)
    high = len(tokens) - seq_len - 1
    offsets = torch.arange(seq_len + 1)
    for _ in range(steps):
        starts = torch.randint(high, (batch_size,), generator=g)
        windows = tokens[starts[:, None] + offsets[None, :]]
        yield Batch(x=windows[:, :-1], y=windows[:, 1:], ids=starts.tolist())
