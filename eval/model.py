"""A trained run, ready to score text with anchor-only, generic or fetched memories.

`RunModel.load(save_folder)` rebuilds the anchor from the run's config and
`anchor.safetensors`, and opens the run's bank through `memstore.MemoryStore`,
so evaluation fetches memories the way inference does: by cluster path, from
the store's tiers, with blocking enforced inside the store. Queries are routed
by `clustering.route.route_texts` — the same traversal that assigned the
training data (App. B: the question for multiple choice, the context for LM
tasks, the whole document for perplexity).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from clustering.route import route_texts
from clustering.tree import load_tree
from memstore.store import MemoryStore, TierConfig
from training.config import TrainConfig
from training.model import AnchorLM, assemble_memories
from training.train import load_run

MemoryMode = Literal["none", "generic", "fetched"]


@dataclass
class RunModel:
    config: TrainConfig
    model: AnchorLM
    store: MemoryStore | None
    tokenizer: Any
    eot_id: int
    tree: Any | None

    @classmethod
    def load(cls, save_folder: str | Path, *, tree_dir: str | Path | None = None,
             tiers: list[TierConfig] | None = None) -> RunModel:
        folder = Path(save_folder)
        composer_model, cfg, manifest, tokenizer = load_run(folder)
        model = composer_model.model
        store = None
        if (folder / "bank").exists():
            tree_dir = Path(tree_dir) if tree_dir else Path(cfg.data.shards).parent / "tree"
            tree = load_tree(tree_dir)
            store = MemoryStore(folder / "bank", tree=tree, out_dtype=torch.float32,
                                tiers=tiers or [TierConfig(name="ram", kind="ram")])
        else:
            tree = load_tree(tree_dir) if tree_dir else None
        return cls(config=cfg, model=model, store=store, tokenizer=tokenizer, eot_id=int(manifest["eot_id"]),
                   tree=tree)

    @property
    def has_memory(self) -> bool:
        return self.store is not None

    def route(self, texts: list[str]) -> np.ndarray:
        if self.tree is None:
            raise ValueError("routing needs the clustering tree (pass tree_dir)")
        return route_texts(self.tree, texts)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def memories(self, paths: np.ndarray | None, batch: int, mode: MemoryMode):
        if mode == "none" or self.store is None:
            return None
        if mode == "generic":
            blocks = {lv: t.unsqueeze(0).expand(batch, -1) for lv, t in self.store.fetch_generic(flat=True).items()}
        else:
            if paths is None:
                raise ValueError("fetched memories need each query's path")
            blocks = self.store.gather(paths)
        return assemble_memories(blocks, self.model.config.anchor, self.model.config.memory)

    @torch.no_grad()
    def logprobs(self, sequences: list[list[int]], *, paths: np.ndarray | None = None,
                 mode: MemoryMode = "fetched") -> list[torch.Tensor]:
        """Per sequence, log p(token_t | tokens_<t) for t ≥ 1: a (len − 1,) tensor each."""
        S = max(len(s) for s in sequences)
        if S > self.model.config.max_seq_len:
            raise ValueError(f"a sequence of {S} tokens exceeds the model's {self.model.config.max_seq_len}")
        ids = torch.full((len(sequences), S), self.eot_id, dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, : len(s)] = torch.tensor(s)
        logits = self.model(ids, memories=self.memories(paths, len(sequences), mode)).float()
        lp = F.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, S-1)
        return [lp[i, : len(s) - 1] for i, s in enumerate(sequences)]

    @torch.no_grad()
    def greedy(self, prompt: list[int], *, max_new_tokens: int, paths: np.ndarray | None = None,
               mode: MemoryMode = "fetched", stop: int | None = None) -> list[int]:
        mems = self.memories(paths, 1, mode)
        out = list(prompt)
        for _ in range(max_new_tokens):
            ids = torch.tensor([out[-self.model.config.max_seq_len :]])
            nxt = int(self.model(ids, memories=mems)[0, -1].argmax())
            if stop is not None and nxt == stop:
                break
            out.append(nxt)
        return out[len(prompt) :]
