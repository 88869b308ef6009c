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

    def spelling(self) -> dict | None:
        """The spelled-letter tokens of the vocabulary as `TextEncoder(spelling=...)` takes them:
        ``{"letters": str, "places": [k, ...], "tokens": [[id, letter index, place index], ...]}``
        for every ``"c@k`` token; None when the vocabulary spells nothing (the shapes task)."""
        spelled = [(self._ids[w], *lp) for w in self.vocabulary if (lp := parse_spelled(w)) is not None]
        if not spelled:
            return None
        letters = "".join(sorted({c for _, c, _ in spelled}))
        places = sorted({k for _, _, k in spelled})
        tokens = [[i, letters.index(c), places.index(k)] for i, c, k in spelled]
        return {"letters": letters, "places": places, "tokens": tokens}

    def __call__(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros(len(prompts), self.max_length, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            words = self.words(prompt)[: self.max_length]
            ids[row, : len(words)] = torch.tensor([self._ids.get(w, self.UNK) for w in words])
        return ids, (ids != self.PAD).long()


def spelled_token(letter: str, place: int) -> str:
    """The token of quoted text's `letter` at `place` (its offset from the word's centre in half
    letters): ``"c@k``, the one spelling every vocabulary and the tokenizer use."""
    return f'"{letter}@{place}'


def parse_spelled(token: str) -> tuple[str, int] | None:
    """(letter, place) of a `spelled_token`; None for any other token."""
    found = _SPELLED.fullmatch(token)
    return None if found is None else (found.group(1), int(found.group(2)))


_QUOTED = re.compile(r'"([^"]*)"')
_SPELLED = re.compile(r'"(\S)@(-?\d+)')  # spelled_token's inverse


def _spell(found: re.Match) -> str:
    letters = [c for c in found.group(1) if not c.isspace()]
    return " " + " ".join(spelled_token(c, 2 * i - (len(letters) - 1)) for i, c in enumerate(letters)) + " "


class TextEncoder(nn.Module):
    """Token + position embeddings, then `layers` pre-norm transformer encoder layers (0: none —
    each token's vector is its own embedding and position, whatever the prompt around it).

    `spelling` (`WordTokenizer.spelling()`, or None) embeds each spelled-letter token ``"c@k`` as
    letter(c) + place(k) — one vector per letter shared by every place it stands at, one per place —
    instead of a vector of its own: a held-out word's letter at a place few training words put it
    still gets the letter's embedding, which every training word carrying it taught (the text task's
    held-out words; docs/BENCHMARKS.md, "The letter + place embedding"). The other tokens keep one
    embedding each. `config` holds the constructor's arguments (`spelling` only when given), so
    ``TextEncoder(**config)`` rebuilds it: checkpoints and exports store it."""

    def __init__(self, vocab_size: int, dim: int = 64, layers: int = 2, heads: int = 4, max_length: int = 12,
                 spelling: dict | None = None):
        super().__init__()
        self.config = dict(vocab_size=vocab_size, dim=dim, layers=layers, heads=heads, max_length=max_length)
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Parameter(torch.randn(max_length, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            dim, heads, dim * 4, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        if spelling is not None:
            self.config["spelling"] = spelling
            table = torch.tensor(spelling["tokens"], dtype=torch.long).reshape(-1, 3)
            if table.numel() and (table[:, 0].min() < 0 or table[:, 0].max() >= vocab_size):
                raise ValueError(f"TextEncoder: a spelled token id is not below vocab_size {vocab_size}")
            letter = torch.full((vocab_size,), -1, dtype=torch.long)
            place = torch.zeros(vocab_size, dtype=torch.long)
            letter[table[:, 0]], place[table[:, 0]] = table[:, 1], table[:, 2]
            # derived from `config`, so not saved with the weights
            self.register_buffer("letter_of", letter, persistent=False)
            self.register_buffer("place_of", place, persistent=False)
            self.letters = nn.Embedding(len(spelling["letters"]), dim)
            self.places = nn.Embedding(len(spelling["places"]), dim)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embedding of each token id [B, L] -> [B, L, dim] (before positions)."""
        tokens = self.tokens(ids)
        if "spelling" not in self.config:
            return tokens
        letter = self.letter_of[ids]
        spelled = self.letters(letter.clamp(min=0)) + self.places(self.place_of[ids])
        return torch.where((letter >= 0).unsqueeze(-1), spelled, tokens)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.positions[: ids.shape[1]]
        if len(self.encoder.layers):  # layers = 0: every token as embedded, blind to the others
            h = self.encoder(h, src_key_padding_mask=mask == 0)
        return self.norm(h) * mask.unsqueeze(-1)
