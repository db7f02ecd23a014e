"""Whole PyTorch models for the capture tests (issue 17): a residual block, GPT-style decoders, integer ops."""

from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F


class ResidualBlock(nn.Module):
    """conv-bn-relu-conv-bn + skip, relu; batch norm in eval mode with non-trivial running statistics."""

    def __init__(self, channels: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        with torch.no_grad():
            for bn in (self.bn1, self.bn2):
                bn.running_mean.uniform_(-0.5, 0.5)
                bn.running_var.uniform_(0.5, 2.0)
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.uniform_(-0.2, 0.2)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + x)


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, context: int, explicit_mask: bool):
        super().__init__()
        self.heads, self.explicit_mask = heads, explicit_mask
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.register_buffer("mask", torch.tril(torch.ones(context, context, dtype=torch.bool)))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.explicit_mask:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
            att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
            y = att.softmax(dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class DecoderBlock(nn.Module):
    def __init__(self, d: int, heads: int, context: int, explicit_mask: bool):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, context, explicit_mask)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned position embeddings, decoder blocks with causal self-attention, final layer norm, LM head."""

    def __init__(self, vocab: int = 17, d: int = 16, heads: int = 2, context: int = 8, layers: int = 2,
                 explicit_mask: bool = False, arange_positions: bool = False):
        super().__init__()
        self.arange_positions = arange_positions
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(DecoderBlock(d, heads, context, explicit_mask) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        t = ids.shape[1]
        if self.arange_positions:  # nanoGPT's form: the position embedding looked up at arange(t)
            x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        else:  # the same numbers: rows 0..t-1 of the position embedding
            x = self.tok(ids) + self.pos.weight[:t]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class IntegerOps(nn.Module):
    """Token ids through integer arithmetic: floor division, remainder, bitwise ops, casts, argmax/argmin, cumsum."""

    def __init__(self):
        super().__init__()
        self.register_buffer("weights", torch.tensor([3, -1, 4, 1, -5, 9], dtype=torch.int64))

    def forward(self, ids):
        hi, lo = ids // 7, ids % 7
        mixed = (ids & 0b1011) | (hi * 2) ^ lo  # hi * 2, not hi << 1: the capture table has no row for aten.__lshift__
        scored = mixed * self.weights - torch.remainder(-ids, 5)
        small = scored.to(torch.int32)
        return (
            scored,
            hi - lo,
            small.cumsum(1),
            scored.argmax(1),
            scored.argmin(1),
            torch.bitwise_not(ids) & 0xFF,
            (scored > 0).to(torch.int64).sum(1),
            torch.div(scored, 3, rounding_mode="trunc"),
            torch.div(scored, 3, rounding_mode="floor"),
            small % 11 - small // 13,
        )
