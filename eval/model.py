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

from memtree.clustering.route import route_texts
from memtree.eval.runinfo import run_config
from memtree.memstore.store import MemoryStore, TierConfig
from memtree.training.config import TrainConfig
from memtree.training.generate.generator import decode_tokens
from memtree.training.model import AnchorLM, assemble_memories
from memtree.training.runfolder import finished_run, open_tree
from memtree.training.train import load_run

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
             tiers: list[TierConfig] | None = None, bank: bool = True, tree_key: str = "--tree") -> RunModel:
        """The run's model and (`bank`, when the run has one) its bank. Paths stored in the run's
        config resolve relative to the run when it was moved (`eval.runinfo.resolve_stored`); the tree
        is `tree_dir`, else `tree/` beside the run's shards; errors name it as `tree_key` (the caller's
        flag or config key for it)."""
        folder = Path(save_folder)
        # the stored config with its paths resolved (a run moved from where it trained)
        cfg = run_config(finished_run(folder))
        composer_model, cfg, manifest, tokenizer = load_run(folder, cfg)
        model = composer_model.model
        store = None
        if bank and (folder / "bank").exists():
            tree = open_tree(tree_dir, cfg, folder, tree_key)
            store = MemoryStore(folder / "bank", tree=tree, out_dtype=torch.float32,
                                tiers=tiers or [TierConfig(name="ram", kind="ram")])
        else:
            tree = open_tree(tree_dir, cfg, folder, tree_key) if tree_dir else None
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
    def choice_scores(self, items: list[tuple[list[int], list[list[int]]]], *, paths: np.ndarray | None = None,
                      mode: MemoryMode = "fetched", pack: bool | None = None) -> list[list[float]]:
        """Per (prefix, choices) item, Σ log p(choice | prefix) for each choice; paths (n, L) for fetched memories.

        A `packable` model scores an item in one row, prefix + choice 1 + … + choice k: each choice's
        tokens take the positions that follow the prefix and see only the prefix and their own
        choice, so a score equals that of the separate sequence prefix + choice (up to float
        rounding) for a k-th of the prefix's compute. pack=False (and other models, and empty
        prefixes) score the separate sequences."""
        if pack is None:
            pack = self.model.packable and all(prefix for prefix, _ in items)
        if not pack:
            seqs = [prefix + c for prefix, choices in items for c in choices]
            rows = None if paths is None else np.repeat(paths, [len(ch) for _, ch in items], axis=0)
            lps = iter(self.logprobs(seqs, paths=rows, mode=mode))
            return [[float(next(lps)[-len(c):].sum()) for c in choices] for _, choices in items]
        S = max(len(prefix) + sum(map(len, choices)) for prefix, choices in items)
        n = len(items)
        ids = torch.full((n, S), self.eot_id, dtype=torch.long)
        pos = torch.zeros((n, S), dtype=torch.long)
        seg = torch.full((n, S), -1, dtype=torch.long)  # 0: prefix, k + 1: choice k, −1: padding
        # token j of a choice is predicted at the position before it (the prefix's last for j = 0):
        # the head runs on those positions only, a few per item instead of the whole row
        rows, at, target = [], [], []
        for i, (prefix, choices) in enumerate(items):
            P = o = len(prefix)
            ids[i, :P], pos[i, :P], seg[i, :P] = torch.tensor(prefix), torch.arange(P), 0
            for k, c in enumerate(choices):
                ids[i, o : o + len(c)], pos[i, o : o + len(c)] = torch.tensor(c), torch.arange(P, P + len(c))
                seg[i, o : o + len(c)] = k + 1
                rows += [i] * len(c)
                at += [P - 1, *range(o, o + len(c) - 1)]
                target += c
                o += len(c)
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        # a query sees the prefix and its own segment; padding sees itself, so no softmax row is empty
        sees = (seg[:, None, :] == 0) | (seg[:, :, None] == seg[:, None, :])
        mask = (sees & causal & (seg[:, None, :] >= 0)) | torch.eye(S, dtype=torch.bool)
        h = self.model(ids, positions=pos, attn_mask=mask, memories=self.memories(paths, n, mode), hidden=True)
        logits = self.model.logits(h[torch.tensor(rows), torch.tensor(at)]).float()  # (M, V)
        lp = F.log_softmax(logits, dim=-1).gather(-1, torch.tensor(target)[:, None])[:, 0].tolist()  # (M,)
        out, k = [], 0
        for _, choices in items:
            out.append([])
            for c in choices:
                out[-1].append(float(sum(lp[k : k + len(c)])))
                k += len(c)
        return out

    @torch.no_grad()
    def greedy(self, prompt: list[int], *, max_new_tokens: int, paths: np.ndarray | None = None,
               mode: MemoryMode = "fetched", stop: int | None = None) -> list[int]:
        """Greedy tokens after `prompt`, decoded as `memtree generate` decodes (a KV cache,
        `training.generate.generator.decode_tokens`); a prompt that fills the context keeps its
        last tokens, leaving room for the answer."""
        room = self.model.config.max_seq_len - max_new_tokens
        ids = list(prompt)[-max(room, 1):]
        out, _, _, _ = decode_tokens(self.model, ids, self.memories(paths, 1, mode), max_new_tokens=max_new_tokens,
                                     eot_id=stop, context=self.model.config.max_seq_len)
        return out
