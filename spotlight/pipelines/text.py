"""Prompt embeddings of a pipeline's own text encoder(s), computed once and cached.

`PromptEmbeddings.get(prompts)` returns, per prompt, the tensors the family's transformer is
conditioned on — exactly what the pipeline's public `encode_prompt` returns for that prompt:

- qwen-image: `embeds` [L, D] (the chat template's first 34 tokens dropped by the pipeline);
- flux: `embeds` [L, D] (T5) and `pooled` [D'] (CLIP);
- sd3: `embeds` [77 + L, D] (both CLIPs padded to T5's width, then T5) and `pooled` [D'].

Embeddings are looked up in memory, then on disk (one safetensors file per prompt, named by a
hash of the prompt, the sequence length and the encoders' fingerprint: their configs and weight
file sizes), and only on a miss are the text encoders loaded — by the pipeline class itself,
`from_pretrained(folder, transformer=None, vae=None)` — and run. A worker whose prompts were
encoded before (by the trainer, at the start of a run) never loads a text encoder; in the runtime
the driver puts each prompt's embeddings into the tensor store (`publish_prompts`) and a worker
without them takes them from there (`fetch_prompts`).

This module holds no trainable weights and knows nothing of the sampler or RL.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from spotlight.pipelines.folder import PipelineFolder


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "spotlight" / "text-embeddings"


def fingerprint(folder: PipelineFolder) -> str:
    """Identifies the text encoders and tokenizers: their config files and the names and sizes
    of their weight files (cheap for a 7B encoder; a retrained encoder changes them)."""
    h = hashlib.sha256(folder.pipeline_class.encode())
    for sub in sorted(p for p in folder.path.iterdir() if p.name.startswith(("text_encoder", "tokenizer"))):
        for f in sorted(sub.iterdir()):
            h.update(f"{sub.name}/{f.name}:{f.stat().st_size}".encode())
            if f.suffix == ".json" and f.stat().st_size < 1 << 20:
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


class PromptEmbeddings(nn.Module):
    """The cache of one pipeline folder's prompt embeddings (see the module docstring)."""

    def __init__(self, folder: PipelineFolder, max_sequence_length: int, cache_dir: str | Path | None):
        super().__init__()
        self.folder, self.max_sequence_length = folder, max_sequence_length
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.key = fingerprint(folder)
        self.memory: dict[str, dict[str, torch.Tensor]] = {}
        self.encoder = None  # the text-encoder-only pipeline, loaded on the first miss
        self.encoded = 0  # prompts this process ran through the text encoders

    def path(self, prompt: str) -> Path:
        h = hashlib.sha256(json.dumps([self.key, self.max_sequence_length, prompt]).encode()).hexdigest()
        return self.cache_dir / self.key / f"{h[:32]}.safetensors"

    def store_key(self, prompt: str) -> str:
        """The prompt's key in the runtime's tensor store (same hash as its cache file)."""
        return f"text/{self.key}/{self.path(prompt).stem}"

    def missing(self, prompts: list[str]) -> list[str]:
        """The prompts this process has neither in memory nor in its cache folder."""
        return [p for p in dict.fromkeys(prompts) if p not in self.memory and not self.path(p).is_file()]

    def add(self, prompt: str, tensors: dict) -> None:
        """Embeddings computed elsewhere (the driver's, through the tensor store), kept in memory."""
        self.memory[prompt] = {k: torch.as_tensor(np.array(v)) for k, v in tensors.items()}

    def get(self, prompts: list[str]) -> list[dict[str, torch.Tensor]]:
        """Each prompt's embeddings (CPU float32), encoding only the ones never cached."""
        from safetensors.torch import load_file, save_file

        for p in dict.fromkeys(prompts):
            if p in self.memory:
                continue
            f = self.path(p)
            if f.is_file():
                self.memory[p] = load_file(str(f))
                continue
            emb = {k: v.detach().float().contiguous().cpu() for k, v in self._encode(p).items()}
            f.parent.mkdir(parents=True, exist_ok=True)
            tmp = f.with_suffix(f".{os.getpid()}.partial")
            save_file(emb, str(tmp), metadata={"prompt": p, "encoders": self.key})
            tmp.rename(f)  # readers see a whole file or none
            self.memory[p] = emb
        return [self.memory[p] for p in prompts]

    @torch.no_grad()
    def _encode(self, prompt: str) -> dict[str, torch.Tensor]:
        if self.encoder is None:
            import diffusers

            cls = getattr(diffusers, self.folder.pipeline_class)
            self.encoder = cls.from_pretrained(
                self.folder.path, transformer=None, vae=None, local_files_only=True)
        self.encoded += 1
        pipe, n, fam = self.encoder, self.max_sequence_length, self.folder.family
        if fam == "qwen-image":
            embeds, _mask = pipe.encode_prompt([prompt], device="cpu", max_sequence_length=n)
            return {"embeds": embeds[0]}
        if fam == "flux":
            embeds, pooled, _ids = pipe.encode_prompt([prompt], None, device="cpu", max_sequence_length=n)
            return {"embeds": embeds[0], "pooled": pooled[0]}
        embeds, _, pooled, _ = pipe.encode_prompt(
            [prompt], None, None, device="cpu", do_classifier_free_guidance=False, max_sequence_length=n
        )
        return {"embeds": embeds[0], "pooled": pooled[0]}


async def publish_prompts(store, model, prompts: list[str], done: set[str]) -> None:
    """Put the embeddings a pipeline model's jobs for `prompts` need (the CFG negative prompt
    included) into the tensor store, each key once (`done` holds the keys already put); the
    driver encodes them, with its text encoders or its cache. A model without prompt embeddings
    (the embedded model) needs nothing."""
    needed = getattr(model, "conditioning_prompts", None)
    if needed is None:
        return
    for p in needed(prompts):
        key = model.text.store_key(p)
        if key not in done:
            (emb,) = model.text.get([p])
            await store.put(key, {k: v.numpy() for k, v in emb.items()})
            done.add(key)


async def fetch_prompts(store, model, prompts: list[str]) -> None:
    """Take from the tensor store the embeddings this worker has not cached (a worker never loads
    a text encoder when the driver published them)."""
    needed = getattr(model, "conditioning_prompts", None)
    if needed is None:
        return
    for p in model.text.missing(needed(prompts)):
        tensors, _ = await store.get(model.text.store_key(p))
        model.text.add(p, tensors)
