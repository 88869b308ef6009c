"""The project's own text conditioning: a word tokenizer and a small transformer text encoder.

Real systems condition a DiT on a large pretrained text encoder fetched from a model hub; none can
be fetched here, so Spotlight owns a small one, trained jointly with the DiT during `pretrain` and
frozen during RL. Its output has the shape a diffusers DiT expects from a text encoder:
hidden states [B, L, dim] plus a 0/1 mask [B, L].
"""

from __future__ import annotations

import re

import torch
from torch import nn


class WordTokenizer:
    """Whitespace tokenizer over a fixed vocabulary; id 0 = pad, 1 = unknown word.

    Text inside double quotes is spelled out: its i-th of n characters c becomes the token `"c@k`,
    k = 2i − (n − 1) its offset from the text's centre in half characters — a letter and where it
    stands, so a word the vocabulary never listed is still given to the encoder letter by letter and
    each image column finds its letter by content, not by counting (the text task).
    """

    PAD, UNK = 0, 1

    def __init__(self, vocabulary: list[str] | tuple[str, ...], max_length: int = 12):
        self.vocabulary = list(vocabulary)
        self.max_length = max_length
        self._ids = {w: i + 2 for i, w in enumerate(self.vocabulary)}

    def __len__(self) -> int:
        return len(self.vocabulary) + 2

    def words(self, prompt: str) -> list[str]:
        """The tokens ``prompt`` becomes, before the cut at ``max_length``: lower-cased words, the
        quoted text spelled out as ``"c@k`` tokens."""
        return _QUOTED.sub(_spell, prompt.lower()).split()

    def __call__(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros(len(prompts), self.max_length, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            words = self.words(prompt)[: self.max_length]
            ids[row, : len(words)] = torch.tensor([self._ids.get(w, self.UNK) for w in words])
        return ids, (ids != self.PAD).long()


_QUOTED = re.compile(r'"([^"]*)"')


def _spell(found: re.Match) -> str:
    letters = [c for c in found.group(1) if not c.isspace()]
    return " " + " ".join(f'"{c}@{2 * i - (len(letters) - 1)}' for i, c in enumerate(letters)) + " "


class TextEncoder(nn.Module):
    """Token + position embeddings, then a few pre-norm transformer encoder layers."""

    def __init__(self, vocab_size: int, dim: int = 64, layers: int = 2, heads: int = 4, max_length: int = 12):
        super().__init__()
        self.config = dict(vocab_size=vocab_size, dim=dim, layers=layers, heads=heads, max_length=max_length)
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Parameter(torch.randn(max_length, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            dim, heads, dim * 4, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.positions[: ids.shape[1]]
        h = self.encoder(h, src_key_padding_mask=mask == 0)
        return self.norm(h) * mask.unsqueeze(-1)
