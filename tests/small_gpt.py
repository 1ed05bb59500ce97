"""A small GPT for the tests, the shape mpext.memory's activation formula counts: token and
position embeddings; per layer ``x + attention(norm(x))`` (one QKV projection, causal
``F.scaled_dot_product_attention``) and ``x + mlp(norm(x))`` (4x wide, GELU); a final norm and
a head tied to the token embedding; the cross-entropy in float32. Tests import nothing from
benchmarks/, so this is written here (the benchmarks' character model has the same layout)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class _Layer(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.attn_out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        heads = [t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2)
                 for t in self.qkv(self.attn_norm(x)).split(width, dim=2)]
        mixed = F.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.attn_out(mixed.transpose(1, 2).contiguous().view(batch, seq, width))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class SmallGPT(nn.Module):
    """``SmallGPT(vocab, seq, width, layers, heads)(tokens, targets)`` is the mean loss."""

    def __init__(self, vocab: int, seq: int, width: int, layers: int, heads: int):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.layers = nn.ModuleList(_Layer(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
