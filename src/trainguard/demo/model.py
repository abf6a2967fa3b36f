"""`TinyGPT`: a small pre-LN decoder-only transformer LM that trains on the CPU in seconds."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TinyGPTConfig:
    vocab_size: int = 64
    seq_len: int = 32
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, c))
        return out


class Block(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class TinyGPT(nn.Module):
    """Token and position embeddings, `n_layer` pre-LN blocks, a final norm and an LM head."""

    def __init__(self, cfg: TinyGPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or TinyGPTConfig()
        c = self.cfg
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, input_scale: float = 1.0) -> torch.Tensor:
        """Logits of shape (batch, time, vocab); `input_scale` multiplies the token embeddings."""
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) * input_scale + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class RecurrentLM(nn.Module):
    """An LSTM language model with TinyGPT's interface: embeddings, `n_layer` LSTM layers, a
    residual MLP, a final norm and an LM head (the second model family of the fault suite)."""

    def __init__(self, cfg: TinyGPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or TinyGPTConfig()
        c = self.cfg
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.rnn = nn.LSTM(c.d_model, c.d_model, num_layers=c.n_layer, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(c.d_model, 4 * c.d_model),
            nn.GELU(),
            nn.Linear(4 * c.d_model, c.d_model),
        )
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, input_scale: float = 1.0) -> torch.Tensor:
        """Logits of shape (batch, time, vocab); `input_scale` multiplies the token embeddings."""
        h, _ = self.rnn(self.tok_emb(idx) * input_scale)
        h = h + self.mlp(h)
        logits: torch.Tensor = self.head(self.ln_f(h))
        return logits

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
