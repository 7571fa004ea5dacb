"""A trained run, ready to score text with anchor-only, generic or fetched memories.

`RunModel.load(save_folder)` rebuilds the anchor from the run's config and
`anchor.safetensors`, and opens the run's bank through `memstore.MemoryStore`,
so evaluation fetches memories the way inference does: by cluster path, from
the store's tiers, with blocking enforced inside the store. Queries are routed
by `clustering.route.route_texts` — the same traversal that assigned the
training data (App. B: the question for multiple choice, the context for LM
tasks, the whole document for perplexity).

A run whose anchor is a Hugging Face model (`model.hf_dir`, or a named pretrained anchor: seed 002
Table 2's post-hoc memories) scores the same way: the HF model is the anchor, and the fetched
blocks reach its layers through its `training.hf.HFMemoryModel` hooks (`hf`) for the one forward
that reads them; the anchor-only setting is the pretrained model itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from memtree.clustering.gate import Gate, similarities
from memtree.clustering.route import embed_like_tree, route_texts
from memtree.eval.runinfo import run_config
from memtree.memstore.store import MemoryStore, TierConfig
from memtree.training.config import TrainConfig
from memtree.training.generate.generator import decode_tokens, run_context
from memtree.training.hf import decoder_config
from memtree.training.model import AnchorLM, assemble_memories
from memtree.training.runfolder import finished_run, open_tree
from memtree.training.train import load_run

MemoryMode = Literal["none", "generic", "fetched"]


@dataclass
class RunModel:
    config: TrainConfig
    model: AnchorLM  # or, with `hf`, the Hugging Face causal LM that is the run's anchor
    store: MemoryStore | None
    tokenizer: Any
    eot_id: int
    tree: Any | None
    hf: Any | None = (
        None  # a Hugging Face anchor's `training.hf.HFMemoryModel` (its hooks read memories)
    )
    context: int | None = (
        None  # the most tokens a sequence may take; None: the anchor's max_seq_len
    )
    # the domain gate (`memtree.clustering.gate`): with one, the scorers add a "gated" setting,
    # fetched memory for the queries it admits and the anchor alone for the rest
    gate: Gate | None = None
    # each text's routed path ({text: path}) and the tree they were routed with: the demo routes
    # the same held-out windows once per forgetting owner, and embedding is most of a route's time
    _routes: dict[str, np.ndarray] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _routes_tree: Any = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def load(
        cls,
        save_folder: str | Path,
        *,
        tree_dir: str | Path | None = None,
        tiers: list[TierConfig] | None = None,
        bank: bool = True,
        tree_key: str = "--tree",
    ) -> RunModel:
        """The run's model and (`bank`, when the run has one) its bank. Paths stored in the run's
        config resolve relative to the run when it was moved (`eval.runinfo.resolve_stored`); the
        tree is `tree_dir`, else `tree/` beside the run's shards; errors name it as `tree_key` (the
        caller's flag or config key for it)."""
        folder = Path(save_folder)
        # the stored config with its paths resolved (a run moved from where it trained)
        cfg = run_config(finished_run(folder))
        composer_model, cfg, manifest, tokenizer = load_run(folder, cfg)
        model = composer_model.model
        store = None
        if bank and (folder / "bank").exists():
            tree = open_tree(tree_dir, cfg, folder, tree_key)
            store = MemoryStore(
                folder / "bank",
                tree=tree,
                out_dtype=torch.float32,
                tiers=tiers or [TierConfig(name="ram", kind="ram")],
            )
        else:
            tree = open_tree(tree_dir, cfg, folder, tree_key) if tree_dir else None
        return cls(
            config=cfg,
            model=model,
            store=store,
            tokenizer=tokenizer,
            eot_id=int(manifest["eot_id"]),
            tree=tree,
            hf=composer_model.hf,
            context=run_context(composer_model, cfg, manifest),
        )

    @property
    def has_memory(self) -> bool:
        return self.store is not None

    def route(self, texts: list[str]) -> np.ndarray:
        """Each text's path (n, levels) through the tree, as `route_texts` gives it; a text routed
        before by this model (under the same tree) is not embedded again."""
        if self.tree is None:
            raise ValueError("routing needs the clustering tree (pass tree_dir)")
        if not texts:
            return route_texts(self.tree, texts)
        if self._routes_tree is not self.tree:
            self._routes, self._routes_tree = {}, self.tree
        known = self._routes
        new = [t for t in dict.fromkeys(texts) if t not in known]
        if new:
            known.update(zip(new, route_texts(self.tree, new)))
        return np.stack([known[t] for t in texts])

    def route_admitted(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray | None]:
        """Paths (n, levels) as `route` gives them and, with a gate, which queries it admits
        ((n,) bool; None without a gate)."""
        if self.gate is None:
            return self.route(texts), None
        if self.tree is None:
            raise ValueError("routing needs the clustering tree (pass tree_dir)")
        paths, sims = similarities(self.tree, embed_like_tree(self.tree, texts))
        return paths, self.gate.admit(sims)

    @property
    def max_seq_len(self) -> int:
        return self.context if self.context is not None else self.model.config.max_seq_len

    @property
    def anchor_shape(self):
        """The anchor's `memtree.geometry.AnchorShape`, which the fetched blocks' layout follows."""
        return self.hf.anchor if self.hf is not None else self.model.config.anchor

    @property
    def packable(self) -> bool:
        """Whether `choice_scores` may pack an item's choices into one row (positions and a mask
        per query). A Hugging Face anchor takes a 4-D mask as given in its eager and SDPA cores;
        flash attention would drop it."""
        if self.hf is None:
            return self.model.packable
        return getattr(self.model.config, "_attn_implementation", None) in ("sdpa", "eager")

    def encode(self, text: str) -> list[int]:
        # as the shards were tokenised (pipeline/window.py): a pretrained tokenizer's BOS would
        # otherwise open every choice scored after its context
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def memories(self, paths: np.ndarray | None, batch: int, mode: MemoryMode):
        if mode == "none" or self.store is None:
            return None
        if mode == "generic":
            blocks = {
                lv: t.unsqueeze(0).expand(batch, -1)
                for lv, t in self.store.fetch_generic(flat=True).items()
            }
        else:
            if paths is None:
                raise ValueError("fetched memories need each query's path")
            blocks = self.store.gather(paths)
        memory = self.hf.memory if self.hf is not None else self.model.config.memory
        return assemble_memories(blocks, self.anchor_shape, memory)

    def _hooked(self, memories):
        """An HF anchor's memories for the calls inside (None: the pretrained model alone, which
        `use_memories` would give the generic memory instead)."""
        return self.hf.use_memories(memories) if memories is not None else contextlib.nullcontext()

    def _hidden(
        self,
        ids: torch.Tensor,
        memories,
        *,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states (B, S, d), before the head; `mask` (B, S, S) bool: True where a
        query sees a key."""
        if self.hf is None:
            return self.model(
                ids, positions=positions, attn_mask=mask, memories=memories, hidden=True
            )
        kw: dict[str, Any] = {}
        if positions is not None:
            kw["position_ids"] = positions
        if mask is not None:
            dtype = next(self.model.parameters()).dtype
            kw["attention_mask"] = torch.zeros(mask.shape, dtype=dtype).masked_fill(
                ~mask, torch.finfo(dtype).min
            )[:, None]
        with self._hooked(memories):
            return self.model.get_decoder()(input_ids=ids, use_cache=False, **kw).last_hidden_state

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        if self.hf is None:
            return self.model.logits(h)
        logits = self.model.get_output_embeddings()(h)
        cap = getattr(decoder_config(self.model.config), "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap  # as Gemma's own head

    @torch.no_grad()
    def logprobs(
        self,
        sequences: list[list[int]],
        *,
        paths: np.ndarray | None = None,
        mode: MemoryMode = "fetched",
    ) -> list[torch.Tensor]:
        """Per sequence, log p(token_t | tokens_<t) for t ≥ 1: a (len − 1,) tensor each."""
        S = max(len(s) for s in sequences)
        if S > self.max_seq_len:
            raise ValueError(f"a sequence of {S} tokens exceeds the model's {self.max_seq_len}")
        ids = torch.full((len(sequences), S), self.eot_id, dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, : len(s)] = torch.tensor(s)
        memories = self.memories(paths, len(sequences), mode)
        if self.hf is None:
            logits = self.model(ids, memories=memories).float()
        else:  # the forward training ran (training.composer_model): no mask, right padding unseen
            with self._hooked(memories):
                logits = self.model(input_ids=ids, use_cache=False).logits.float()
        lp = F.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, S-1)
        return [lp[i, : len(s) - 1] for i, s in enumerate(sequences)]

    @torch.no_grad()
    def choice_scores(
        self,
        items: list[tuple[list[int], list[list[int]]]],
        *,
        paths: np.ndarray | None = None,
        mode: MemoryMode = "fetched",
        pack: bool | None = None,
    ) -> list[list[float]]:
        """Per (prefix, choices) item, Σ log p(choice | prefix) for each choice; paths (n, L) for
        fetched memories.

        A `packable` model scores an item in one row, prefix + choice 1 + … + choice k: each
        choice's tokens take the positions that follow the prefix and see only the prefix and their
        own choice, so a score equals that of the separate sequence prefix + choice (up to float
        rounding) for a k-th of the prefix's compute. pack=False (and other models, and empty
        prefixes) score the separate sequences."""
        if pack is None:
            pack = self.packable and all(prefix for prefix, _ in items)
        if not pack:
            seqs = [prefix + c for prefix, choices in items for c in choices]
            rows = None if paths is None else np.repeat(paths, [len(ch) for _, ch in items], axis=0)
            lps = iter(self.logprobs(seqs, paths=rows, mode=mode))
            return [[float(next(lps)[-len(c) :].sum()) for c in choices] for _, choices in items]
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
                ids[i, o : o + len(c)], pos[i, o : o + len(c)] = (
                    torch.tensor(c),
                    torch.arange(P, P + len(c)),
                )
                seg[i, o : o + len(c)] = k + 1
                rows += [i] * len(c)
                at += [P - 1, *range(o, o + len(c) - 1)]
                target += c
                o += len(c)
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        # a query sees the prefix and its own segment; padding sees itself, so no softmax row is
        # empty
        sees = (seg[:, None, :] == 0) | (seg[:, :, None] == seg[:, None, :])
        mask = (sees & causal & (seg[:, None, :] >= 0)) | torch.eye(S, dtype=torch.bool)
        h = self._hidden(ids, self.memories(paths, n, mode), positions=pos, mask=mask)
        logits = self._head(h[torch.tensor(rows), torch.tensor(at)]).float()  # (M, V)
        lp = (
            F.log_softmax(logits, dim=-1).gather(-1, torch.tensor(target)[:, None])[:, 0].tolist()
        )  # (M,)
        out, k = [], 0
        for _, choices in items:
            out.append([])
            for c in choices:
                out[-1].append(float(sum(lp[k : k + len(c)])))
                k += len(c)
        return out

    @torch.no_grad()
    def greedy(
        self,
        prompt: list[int],
        *,
        max_new_tokens: int,
        paths: np.ndarray | None = None,
        mode: MemoryMode = "fetched",
        stop: int | None = None,
    ) -> list[int]:
        """Greedy tokens after `prompt`, decoded as `memtree generate` decodes (a KV cache,
        `training.generate.generator.decode_tokens`); a prompt that fills the context keeps its
        last tokens, leaving room for the answer."""
        room = self.max_seq_len - max_new_tokens
        ids = list(prompt)[-max(room, 1) :]
        out, _, _, _ = decode_tokens(
            self.model,
            ids,
            self.memories(paths, 1, mode),
            max_new_tokens=max_new_tokens,
            eot_id=stop,
            context=self.max_seq_len,
            hf=self.hf,
        )
        return out
