"""Generate text with a trained run: route the prompt, fetch its path's blocks, attach, decode.

Seed 002's inference (§2.2, §3, Fig. 5): only the anchor lives in fast memory; for each prompt
the blocks of one cluster path are fetched from the bank's tiers and attached, and within a
session the shallow levels stay cached while deep blocks are swapped. `Generator` is that path:

1. route: the prompt is embedded by the network the tree's windows were embedded with
   (`tree.json`'s embedder entry) and routed by `clustering.route.route`, the traversal that
   assigned the training windows, so identical text fetches identical blocks;
2. fetch: one block per memory level through `memstore.MemoryStore` (its tier placement, per-slot
   checksums, blocking policy and per-tier session caches); a blocked block is never read, it
   is served as the bank's policy says (zeros or the generic memory);
3. attach: the flat blocks are split into per-layer tensors (`training.model.assemble_memories`);
4. prefill and decode: the prompt once, then one token per forward with a KV cache
   (`training.model.KVCache`; a Hugging Face anchor uses its own cache with the memories hooked
   in, `training.hf.HFMemoryModel.use_memories`), greedy or temperature / top-p sampling from a
   seeded generator, until end-of-text, `max_new_tokens` or the context.

Every step is timed; `Generation.timing` and `.resident` hold the figures `memtree generate`
prints. Generation only reads the bank: its audit log and policy are untouched.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from memtree.clustering.embed import embed_texts, embedder_from_meta
from memtree.clustering.gate import Gate, similarities
from memtree.memstore.format import GENERIC
from memtree.memstore.store import DEFAULT_TIERS, MemoryStore, TierConfig
from memtree.training.model import KVCache, assemble_memories, widen_ffn_memories
from memtree.training.runfolder import finished_run, open_tree, run_config
from memtree.training.train import load_run

MemoryChoice = Literal["fetched", "generic", "none"]
MEMORY_CHOICES: tuple[str, ...] = ("fetched", "generic", "none")


def check_sampling(*, max_new_tokens: int, temperature: float, top_p: float) -> None:
    """The sampling arguments' errors, named as the command's flags, before anything loads."""
    if int(max_new_tokens) != max_new_tokens or max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens: must be a positive integer, got {max_new_tokens}")
    if not temperature >= 0:  # also refuses NaN
        raise ValueError(f"--temperature: must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"--top-p: must be in (0, 1], got {top_p}")


def check_memory(memory: str) -> None:
    if memory not in MEMORY_CHOICES:
        raise ValueError(f"--memory: {memory!r} is not one of {', '.join(MEMORY_CHOICES)}")


@dataclass
class LevelFetch:
    """One level's fetch for one prompt: which block, from where, and what it cost."""

    level: int
    cluster: int  # global id on the prompt's path, or GENERIC (-1)
    tier: str
    source: Literal[
        "read", "cache", "refused"
    ]  # read from the tier, hit its session cache, or blocked
    bytes_read: int  # bytes read from the tier (0 for a cache hit or a refused block)
    block_bytes: int  # bytes of the decoded block attached
    seconds: float


@dataclass
class Generation:
    """One prompt's answer and what producing it took."""

    prompt: str
    text: str
    tokens: list[int]
    memory: str
    path: list[int] | None
    stop: Literal["eot", "limit", "context"]
    prompt_tokens: int
    fetches: list[LevelFetch] = field(default_factory=list)
    timing: dict[str, float] = field(default_factory=dict)
    resident: dict[str, int] = field(default_factory=dict)
    # with a domain gate (fetched memory only): the prompt's similarity to its cluster at the
    # gate's level, and whether that admitted it (False: answered by the anchor alone, no fetch)
    similarity: float | None = None
    admitted: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_context(composer_model, cfg, manifest: dict[str, Any]) -> int:
    """The most tokens a prompt and its answer (or a scored sequence) may take on a loaded run
    (`training.train.load_run`): the anchor's max_seq_len; for a Hugging Face anchor the window it
    trained with, within what its positions allow."""
    model = composer_model.model
    if composer_model.hf is None:
        return model.config.max_seq_len
    context = int(cfg.model.max_seq_len or manifest["seq_len"])
    return min(context, int(getattr(model.config, "max_position_embeddings", context)))


def sample_next(
    logits: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator | None
) -> int:
    """The next token from logits (V,): the argmax at temperature 0, else a draw from the
    softmax at `temperature` restricted to the smallest set of tokens whose mass reaches top_p."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        p, order = probs.sort(descending=True)
        # keep a token while the mass before it is below top_p: the first token always stays
        keep = (p.cumsum(0) - p) < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


class Generator:
    """A trained run ready to answer prompts: its anchor, tokenizer, tree, embedder and bank.

    `Generator.from_run(RUN)` loads them once; `generate(prompt, ...)` then routes, fetches,
    attaches and decodes one prompt. Prompts generated one after another share the store's
    session caches (a flash tier's LRU), as on a device; `store.stats()` counts every read.
    `warm()` first keeps one-time costs (the embedder's load, thread pools starting) out of the
    first prompt's timing, as `memtree generate` does.
    """

    def __init__(
        self,
        *,
        model,
        tokenizer,
        eot_id: int,
        memory_config,
        context: int,
        tree,
        store: MemoryStore | None,
        hf=None,
        folder: Path | None = None,
        tokenizer_dir: Path | None = None,
    ) -> None:
        """model: an `AnchorLM`, or a Hugging Face causal LM with `hf` its `HFMemoryModel`;
        context: the most tokens a prompt and its answer may take together; tokenizer_dir: the
        run's tokenizer folder, copied into an export."""
        self.model, self.tokenizer, self.eot_id = model, tokenizer, int(eot_id)
        self.tokenizer_dir = tokenizer_dir
        self.memory_config, self.context = memory_config, int(context)
        self.tree, self.store, self.hf, self.folder = tree, store, hf, folder
        self._embedder = None
        # the domain gate (`memtree.clustering.gate`): a prompt it refuses reads no memory
        self.gate: Gate | None = None

    @classmethod
    def from_run(
        cls,
        run: str | Path,
        *,
        tree_dir: str | Path | None = None,
        tiers: Sequence[TierConfig] = DEFAULT_TIERS,
        verify: Literal["always", "once", "never"] = "once",
        bank: bool = True,
    ) -> Generator:
        """The run folder `run` (a finished `memtree train run`), its bank through memstore with
        `tiers` (fastest first; the bank's levels are placed shallow-first, as on a device) and
        the clustering tree beside its shards (or `tree_dir`). A bank built on another tree is
        refused by the store, naming both ids."""
        folder = finished_run(run)
        cfg = run_config(folder)
        composer_model, cfg, manifest, tokenizer = load_run(folder, cfg)
        store, tree = None, None
        if bank and (folder / "bank").exists():
            tree = open_tree(tree_dir, cfg, folder)
            store = MemoryStore(
                folder / "bank", tree=tree, tiers=tiers, verify=verify, out_dtype=torch.float32
            )
        elif tree_dir:
            tree = open_tree(tree_dir, cfg, folder)
        model, hf = composer_model.model, composer_model.hf
        return cls(
            model=model,
            tokenizer=tokenizer,
            eot_id=int(manifest["eot_id"]),
            memory_config=composer_model.memory,
            context=run_context(composer_model, cfg, manifest),
            tree=tree,
            store=store,
            hf=hf,
            folder=folder,
            tokenizer_dir=(Path(cfg.data.shards) / manifest["tokenizer"]).resolve(),
        )

    # -- the steps --------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        # as the shards were tokenised (pipeline/window.py), so a pretrained tokenizer adds no BOS
        # the memories never saw
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def embedder(self):
        if self._embedder is None:
            if self.tree is None:
                raise ValueError("routing needs the run's clustering tree")
            self._embedder = embedder_from_meta(
                self.tree.meta.get("embedder", {}), self.tree.path, device="cpu"
            )
        return self._embedder

    def warm(self) -> float:
        """Pay once what a session pays once, so that no prompt's timing includes it: load the
        embedder, route a short text (FAISS's and BLAS's thread pools start), run the anchor on one
        token. Returns the seconds it took."""
        t0 = time.perf_counter()
        if self.tree is not None:
            self.route("warm-up")
        with torch.no_grad():
            decode_tokens(
                self.model,
                self.encode("warm-up")[:1] or [self.eot_id],
                None,
                max_new_tokens=1,
                eot_id=None,
                context=self.context,
                hf=self.hf,
            )
        return time.perf_counter() - t0

    def route(self, text: str) -> tuple[np.ndarray, dict[str, float]]:
        """The prompt's path (levels,) of global cluster ids, and {embed_s, traverse_s}."""
        path, _, timing = self.route_scored(text)
        return path, timing

    def route_scored(self, text: str) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
        """`route`, with the prompt's cosine similarity to its cluster at each level (levels,)
        (`clustering.gate.similarities`; the traversal is `clustering.route.route`'s)."""
        emb_meta = self.tree.meta.get("embedder", {}) if self.tree is not None else {}
        model = self.embedder()
        t0 = time.perf_counter()
        x = embed_texts(
            model,
            [text],
            strategy=emb_meta.get("strategy", "truncate"),
            batch_size=int(emb_meta.get("batch_size", 64)),
        )
        t1 = time.perf_counter()
        paths, sims = similarities(self.tree, x)
        t2 = time.perf_counter()
        return paths[0], sims[0], {"embed_s": t1 - t0, "traverse_s": t2 - t1}

    def fetch(
        self, path: Sequence[int] | None, memory: MemoryChoice
    ) -> tuple[dict[int, torch.Tensor], list[LevelFetch]]:
        """{level: (1, P_level)} blocks of `path` (or the generic memory) through the store, and
        what each level's fetch did (tier, read / cache hit / refused, bytes, seconds)."""
        store = self.store
        blocks, fetches = {}, []
        for level in sorted(store.levels):
            cluster = GENERIC if memory == "generic" else int(path[level - 1])
            tier = store.placement[level]
            before = dict(store.tier_stats[tier].as_dict())
            refused_before = store.refused_served.get(level, 0)
            t0 = time.perf_counter()
            flat = store.fetch_flat(level, cluster)  # (P,)
            dt = time.perf_counter() - t0
            after = store.tier_stats[tier].as_dict()
            if store.refused_served.get(level, 0) > refused_before:
                source = "refused"
            elif after["cache_hits"] > before["cache_hits"]:
                source = "cache"
            else:
                source = "read"
            fetches.append(
                LevelFetch(
                    level=level,
                    cluster=cluster,
                    tier=tier,
                    source=source,
                    bytes_read=after["bytes_read"] - before["bytes_read"],
                    block_bytes=flat.numel() * flat.element_size(),
                    seconds=dt,
                )
            )
            blocks[level] = flat[None]
        return blocks, fetches

    @property
    def anchor(self):
        """The anchor's shape (`memtree.geometry.AnchorShape`), which the blocks' layout follows."""
        return self.hf.anchor if self.hf is not None else self.model.config.anchor

    def attach(self, blocks: dict[int, torch.Tensor], *, widen: bool = False):
        """Flat blocks → per-layer memories for the anchor (or the HF model's hooks). `widen`: an
        FFN memory on memtree's anchor joined onto each layer's FFN weights (`WidenedFFN`), so
        that decoding runs as many GEMMs per token as the anchor alone."""
        memories = assemble_memories(blocks, self.anchor, self.memory_config)
        if widen and self.hf is None and self.memory_config.type == "ffn":
            memories = widen_ffn_memories(self.model, memories)
        return memories

    # -- generation -------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompt: str,
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        memory: MemoryChoice = "fetched",
    ) -> Generation:
        """Answer one prompt. `memory`: "fetched" (the prompt's path; with `self.gate`, only when
        the gate admits the prompt, else the anchor alone and nothing fetched), "generic" (the
        bank's generic blocks) or "none" (the anchor alone). Greedy at temperature 0; otherwise
        sampled from a torch generator seeded with `seed`, so the same seed gives the same
        tokens."""
        check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        check_memory(memory)
        if not prompt or not prompt.strip():
            raise ValueError("--prompt: the prompt is empty")
        if memory != "none" and self.store is None:
            where = self.folder / "bank" if self.folder else "the run's bank"
            raise ValueError(
                f"--memory {memory}: {where} does not exist (a run trained without memory); "
                "use --memory none"
            )
        ids = self.encode(prompt)
        if len(ids) >= self.context:
            raise ValueError(
                f"--prompt: {len(ids)} tokens leave no room to generate in the model's context "
                f"of {self.context} tokens"
            )
        timing: dict[str, float] = {}
        t_start = time.perf_counter()
        path, fetches, memories = None, [], None
        similarity = admitted = None
        if memory == "fetched":
            p, sims, route_t = self.route_scored(prompt)
            path = [int(c) for c in p]
            timing.update(route_t)
            if self.gate is not None:
                similarity = float(sims[self.gate.level - 1])
                admitted = bool(self.gate.admit(sims[None])[0])
        if memory != "none" and admitted is not False:
            blocks, fetches = self.fetch(path, memory)
            timing["fetch_s"] = sum(f.seconds for f in fetches)
            t0 = time.perf_counter()
            memories = self.attach(blocks, widen=True)
            timing["attach_s"] = time.perf_counter() - t0
        out, stop, dec, kv_bytes = decode_tokens(
            self.model,
            ids,
            memories,
            max_new_tokens=max_new_tokens,
            eot_id=self.eot_id,
            context=self.context,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            hf=self.hf,
        )
        timing.update(dec)
        timing["ttft_s"] = dec["first_token_at"] - t_start
        timing["total_s"] = dec["end_at"] - t_start
        del timing["first_token_at"], timing["end_at"]
        return Generation(
            prompt=prompt,
            text=self.decode(out),
            tokens=out,
            memory=memory,
            path=path,
            stop=stop,
            prompt_tokens=len(ids),
            fetches=fetches,
            timing=timing,
            resident=self.resident(fetches, kv_bytes),
            similarity=similarity,
            admitted=admitted,
        )

    def export(
        self, out_dir: str | Path, *, prompt: str | None = None, memory: MemoryChoice = "fetched"
    ) -> dict:
        """Write the anchor with `prompt`'s fetched blocks merged (or the generic ones, or none)
        as a Hugging Face model folder (`training.generate.export`); returns what was written,
        with the path the prompt routed to."""
        from memtree.training.generate.export import export_anchor, export_hf_memory

        check_memory(memory)
        path = None
        if memory == "fetched":
            if not prompt or not prompt.strip():
                raise ValueError(
                    "--export: fetched memory is exported for a prompt's path; give --prompt"
                )
            path = [int(c) for c in self.route(prompt)[0]]
        memories = None
        if memory != "none":
            if self.store is None:
                raise ValueError(f"--export with --memory {memory}: the run has no bank")
            memories = self.attach(self.fetch(path, memory)[0])
        if self.hf is not None:
            if memories is None:
                raise ValueError(
                    "--export: a Hugging Face anchor without memory is its own folder already "
                    "(model.hf_dir)"
                )
            info = export_hf_memory(self.hf, memories, out_dir, tokenizer_dir=self.tokenizer_dir)
        else:
            info = export_anchor(
                self.model,
                out_dir,
                memories=memories,
                tokenizer_dir=self.tokenizer_dir,
                eot_id=self.eot_id,
            )
        return {**info, "memory": memory, "route_path": path}

    def resident(self, fetches: Sequence[LevelFetch], kv_bytes: int) -> dict[str, int]:
        """Bytes in fast memory while answering: the anchor, the attached blocks, the KV cache;
        beside the whole bank's bytes on its tiers."""
        anchor = sum(p.numel() * p.element_size() for p in self.model.parameters())
        bank = (
            sum(lv.file_bytes for lv in self.store.info.levels.values())
            if self.store is not None
            else 0
        )
        return {
            "anchor_bytes": anchor,
            "fetched_bytes": sum(f.block_bytes for f in fetches),
            "kv_cache_bytes": int(kv_bytes),
            "bank_bytes": bank,
        }

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def _anchor_steps(model, ids: list[int], memories, max_len: int):
    """Coroutine: yields (the prompt's last logits (V,), the cache's bytes), then for each token
    sent, that token's logits. The head runs on the last position only."""
    cache = KVCache.for_model(model, batch=1, max_len=max_len)
    h = model(torch.tensor([ids]), memories=memories, cache=cache, hidden=True)[0, -1]  # (d,)
    nxt = yield model.logits(h).float(), cache.nbytes
    while True:
        h = model(torch.tensor([[nxt]]), memories=memories, cache=cache, hidden=True)[0, -1]
        nxt = yield model.logits(h).float()


def _hf_steps(model, hf, ids: list[int], memories):
    """`_anchor_steps` for a Hugging Face anchor: its own KV cache, the memories hooked in (None:
    the base model alone; `use_memories` would apply the generic memory instead)."""
    from transformers import DynamicCache

    def hooked():
        return (
            hf.use_memories(memories, batch=1) if memories is not None else contextlib.nullcontext()
        )

    cache = DynamicCache()
    with hooked():
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    nxt = yield out.logits[0, -1].float(), _hf_cache_bytes(out.past_key_values)
    while True:
        with hooked():
            out = model(
                input_ids=torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True
            )
        nxt = yield out.logits[0, -1].float()


@torch.no_grad()
def decode_tokens(
    model,
    ids: list[int],
    memories,
    *,
    max_new_tokens: int,
    eot_id: int | None,
    context: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    hf=None,
) -> tuple[list[int], str, dict[str, float], int]:
    """Prefill `ids` once, then one token per forward with a KV cache, memories attached
    throughout: (new tokens, why it stopped: "eot" | "limit" | "context", timing, KV-cache bytes).

    model: an `AnchorLM`, or a Hugging Face causal LM whose `HFMemoryModel` is `hf`; memories:
    gathered per-layer tensors of batch 1 (`assemble_memories`) or None; eot_id: the token that
    ends the answer (not returned), None for none; context: the most tokens prompt + answer may
    take. Timing: prefill_s, decode_s, decode_tokens (produced after the first), decode_tok_s, and
    the perf_counter instants first_token_at and end_at."""
    if len(ids) >= context:
        raise ValueError(
            f"a prompt of {len(ids)} tokens leaves no room to generate in a context of {context}"
        )
    budget = min(max_new_tokens, context - len(ids))
    gen = torch.Generator().manual_seed(int(seed)) if temperature > 0 else None
    step = (
        _hf_steps(model, hf, ids, memories)
        if hf is not None
        else _anchor_steps(model, ids, memories, len(ids) + budget)
    )
    timing: dict[str, float] = {}
    out, stop = [], "limit"
    t0 = time.perf_counter()
    logits, kv_bytes = next(step)
    timing["prefill_s"] = time.perf_counter() - t0
    t_first = None
    while True:
        nxt = sample_next(logits, temperature=temperature, top_p=top_p, generator=gen)
        if t_first is None:
            t_first = time.perf_counter()
        if nxt == eot_id:
            stop = "eot"
            break
        out.append(nxt)
        if len(out) >= max_new_tokens:
            break
        if len(out) >= budget:
            stop = "context"
            break
        logits = step.send(nxt)
    t_end = time.perf_counter()
    step.close()
    decoded = max(len(out) - 1, 0)
    timing["decode_s"] = t_end - t_first
    timing["decode_tokens"] = decoded
    timing["decode_tok_s"] = (
        decoded / timing["decode_s"] if decoded and timing["decode_s"] > 0 else 0.0
    )
    timing["first_token_at"], timing["end_at"] = t_first, t_end
    return out, stop, timing, kv_bytes


def _hf_cache_bytes(cache) -> int:
    """Bytes of a transformers cache's key / value tensors (its layout differs between versions)."""
    total = 0
    for t in _tensors(cache):
        total += t.numel() * t.element_size()
    return total


def _tensors(obj, depth: int = 0):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, list | tuple):
        for o in obj:
            yield from _tensors(o, depth + 1)
    elif depth < 4 and hasattr(obj, "__dict__"):
        for o in vars(obj).values():
            yield from _tensors(o, depth + 1)
