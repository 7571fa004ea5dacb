"""`memtree eval context-bank`: cross-session recall through the context bank (seed 004 §9).

The experiment. A frozen anchor (a bios demo run's `train/anchor`) gets, in `sessions` separate
sessions, one document each about `n_entities` entities it has never seen (a bios world drawn
with another seed: new names and new values; names that also occur in the training corpus are
skipped). Each prompt is compressed (training/context/vae.py) into entries of the context bank
(memstore/context/bank.py), which is saved at the end of each session and opened again from disk
at the start of the next: nothing else carries over. In a final session the model answers
4-way probes about every fact those documents stated, "The {label} of {reference} is",
with distractors drawn uniformly from the attribute's closed value set (so a model that does not
know the fact is at chance, 25 %, in expectation). The question is the only input: it is
compressed into a query vector, the bank returns the entries of the top-k clusters by
centroid · query, and the reader attends to their tokens while each choice is scored.

Settings, side by side:
- no bank: the anchor alone (the facts are new, so this is the chance control);
- bank, capacity ≥ entries written: nothing is ever merged ("never merges");
- bank, capacity = f × entries written for each f < 1: the bank fills past capacity and merges
  its closest pairs (§9.4–§9.5) to make room; recall as a function of the fill ratio 1/f;
- own entry: the probe reads exactly the entry (or entries) written from its document, no
  retrieval: what the compression keeps, separate from what retrieval finds;
- in context: the document itself before the question, anchor alone: what the anchor can do with
  the uncompressed text.
Reported per setting: accuracy (with 95 % Wilson interval), accuracy by the session that wrote
the entity, retrieval hit rate (a retrieved entry holds the document's chunk, merged or not),
merges, entries read per probe. JSON + markdown + PNG.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from memtree.config import from_dict, is_int, load_config, to_dict
from memtree.eval.longtail import build_probes, wilson
from memtree.eval.plots import new_figure, save_png
from memtree.io import atomic_write_json, atomic_write_text, iter_jsonl, read_json, sha256_file
from memtree.memstore.context.bank import ContextBank, ContextBankConfig
from memtree.pipeline.corpus.bios import BiosSpec, bios_facts, generate_bios, recall_pairs
from memtree.training.context.vae import (
    chunk_ids,
    compress,
    load_vae,
    pad,
    query_vector,
    reading,
    writer_id,
)

TRAIN_YAML = Path(__file__).resolve().parents[2] / "training" / "yamls" / "context-vae.yaml"


@dataclass(frozen=True, kw_only=True)
class ContextRecallConfig:
    """root: a bios demo run (corpus.json, corpus.jsonl, facts.jsonl, train/anchor); out: the
    report directory (default ROOT/context-bank); vae: a trained compressor, used as given (default
    OUT/vae, trained there with training/yamls/context-vae.yaml + `train` overrides and reused only
    from the same inputs: `ensure_compressor`);
    n_entities: new entities, one document each; sessions: how many sessions write them;
    capacities: bank capacity as a fraction of the entries written (≥ 1: never merges);
    n_clusters / top_k / merge_*: the bank's (memstore.context.bank.ContextBankConfig);
    world_seed: the bios seed of the new entities (default: the corpus seed + 1000);
    train_worlds / train_on_corpus: what the compressor trains on (`training_pairs`)."""

    root: str
    out: str = ""
    vae: str = ""
    train: tuple[str, ...] = ()
    n_entities: int = 192
    sessions: int = 4
    capacities: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125)
    n_clusters: int = 16
    top_k: int = 2
    merge_rule: str = "sum"
    merge_scope: str = "all"
    merge_importance_weight: float = 1.0
    merge_age_weight: float = 0.1
    world_seed: int = -1
    train_worlds: int = 2
    train_on_corpus: bool = False
    seed: int = 0
    batch_size: int = 32

    def __post_init__(self) -> None:
        for name in ("n_entities", "sessions", "n_clusters", "top_k", "batch_size"):
            v = getattr(self, name)
            if not is_int(v) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not self.capacities or any(not c > 0 for c in self.capacities):
            raise ValueError(
                "capacities must be positive fractions of the entries written, got "
                f"{self.capacities}"
            )


def load_recall_config(
    path: str | Path | None, overrides: Sequence[str] = ()
) -> ContextRecallConfig:
    return load_config(ContextRecallConfig, str(path) if path else None, list(overrides))


# -- data --------------------------------------------------------------------------------------


def _world_spec(root: Path, seed: int):
    spec_rec = BiosSpec.stored(read_json(root / "corpus.json")["spec"])
    return from_dict(BiosSpec, {**spec_rec, "seed": seed}, where="corpus.json spec")


def _eval_seed(root: Path, cfg: ContextRecallConfig) -> int:
    return (
        cfg.world_seed
        if cfg.world_seed >= 0
        else int(read_json(root / "corpus.json")["spec"]["seed"]) + 1000
    )


def training_pairs(root: Path, out: Path, cfg: ContextRecallConfig) -> Path:
    """The compressor's training pairs, written once: documents of `train_worlds` fresh bios worlds
    (seeds eval seed + 1000·k, k ≥ 1), so answers can only come from the compressed document, never
    from what the anchor learnt; entities of the run's corpus or of the evaluation world are left
    out. `train_on_corpus` adds the run's own corpus (facts the anchor partly knows)."""
    path, marker = out / "pairs.jsonl", out / "pairs_inputs.json"
    inputs = {
        "corpus": read_json(root / "corpus.json")["spec"],
        "eval_seed": _eval_seed(root, cfg),
        "train_worlds": cfg.train_worlds,
        "train_on_corpus": cfg.train_on_corpus,
    }
    if path.exists() and marker.is_file() and read_json(marker) == json.loads(json.dumps(inputs)):
        return path
    held_out = {r["entity"] for _, r in iter_jsonl(root / "facts.jsonl")}
    held_out |= {f["entity"] for f in bios_facts(_world_spec(root, _eval_seed(root, cfg)))}
    pairs = []
    for k in range(1, cfg.train_worlds + 1):
        spec = _world_spec(root, _eval_seed(root, cfg) + 1000 * k)
        pairs += [
            p
            for p in recall_pairs(generate_bios(spec), bios_facts(spec))
            if p["entity"] not in held_out
        ]
    if cfg.train_on_corpus:
        pairs += recall_pairs(
            (r for _, r in iter_jsonl(root / "corpus.jsonl")),
            [r for _, r in iter_jsonl(root / "facts.jsonl")],
        )
    if not pairs:
        raise ValueError("no training pairs: set train_worlds >= 1 or train_on_corpus: true")
    atomic_write_text(path, "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs))
    atomic_write_json(marker, inputs)
    return path


def ensure_compressor(
    root: Path, out: Path, cfg: ContextRecallConfig, *, log=print
) -> tuple[Path, str]:
    """The compressor for the run's anchor; returns (its folder, "given" | "reused" | "trained" |
    "retrained").

    `vae=` holding a trained compressor is the user's: used as given. Otherwise (default OUT/vae) it
    is reused only when it was trained from the same inputs (recorded in its
    `compressor_inputs.json`): the training config (training/yamls/context-vae.yaml + `train`), the
    training pairs and the anchor's weights; a compressor trained from other inputs, or with no
    record of them, is retrained."""
    from memtree.training.context.train import load_context_config, train_context_vae

    anchor_dir = root / "train" / "anchor"
    vae_dir = Path(cfg.vae) if cfg.vae else out / "vae"
    if cfg.vae and (vae_dir / "context_vae.json").exists():
        log(f"[context-bank] compressor: {vae_dir} as given (vae=; --train settings not applied)")
        return vae_dir, "given"
    pairs = training_pairs(root, out, cfg)
    tcfg = load_context_config(
        TRAIN_YAML,
        [f"anchor={anchor_dir}", f"data.pairs={pairs}", f"save_folder={vae_dir}", *cfg.train],
    )
    config = to_dict(tcfg)
    for key in (
        "anchor",
        "save_folder",
        "progress_bar",
        "log_interval",
    ):  # where, not what, it trains
        config.pop(key, None)
    config["data"] = {k: v for k, v in config["data"].items() if k != "pairs"}
    inputs = {
        "config": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16],
        "pairs": sha256_file(pairs),
        "anchor": sha256_file(anchor_dir / "anchor.safetensors"),
    }
    marker = vae_dir / "compressor_inputs.json"
    old = read_json(marker) if marker.is_file() else None
    action = "trained"
    if old is not None and old.get("inputs") == inputs and (vae_dir / "context_vae.json").exists():
        log(f"[context-bank] compressor: reused ({vae_dir} was trained from these inputs)")
        return vae_dir, "reused"
    if vae_dir.exists() and any(vae_dir.iterdir()) and (old is not None or not cfg.vae):
        if old is None:
            why = "it holds a compressor with no record of what it was trained from"
        else:
            changed = sorted(k for k in inputs if old.get("inputs", {}).get(k) != inputs[k])
            why = f"it was trained from other inputs ({', '.join(changed) or 'unfinished'} changed)"
        log(f"[context-bank] compressor: retraining {vae_dir}: {why}")
        shutil.rmtree(vae_dir)
        action = "retrained"
    vae_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(marker, {"inputs": inputs})
    log(f"[context-bank] compressor: training ({tcfg.max_duration}) → {vae_dir}")
    train_context_vae(tcfg)
    return vae_dir, action


def new_entities(
    root: Path, cfg: ContextRecallConfig
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(documents, probes) about n_entities entities of a fresh bios world (one document each;
    probes: every fact the document states, 4-way). Deterministic for the config."""
    seed = _eval_seed(root, cfg)
    spec = _world_spec(root, seed)
    trained = {r["entity"] for _, r in iter_jsonl(root / "facts.jsonl")}
    pairs = recall_pairs(generate_bios(spec), bios_facts(spec))
    by_doc: dict[str, list[dict[str, Any]]] = {}
    for p in pairs:
        by_doc.setdefault(p["doc"], []).append(p)
    first: dict[str, str] = {}  # entity → its first document that states something
    for doc, ps in by_doc.items():
        e = ps[0]["entity"]
        if e not in trained and e not in first and all(q["entity"] == e for q in ps):
            first[e] = doc
    entities = sorted(first)
    random.Random(cfg.seed).shuffle(entities)
    if len(entities) < cfg.n_entities:
        raise ValueError(
            f"the bios world of seed {seed} has {len(entities)} new entities, fewer than "
            f"n_entities={cfg.n_entities}"
        )
    chosen = entities[: cfg.n_entities]
    texts = {d["id"]: d["text"] for d in generate_bios(spec)}
    docs, facts = [], []
    for i, e in enumerate(chosen):
        doc = first[e]
        docs.append(
            {
                "id": doc,
                "entity": e,
                "text": texts[doc],
                "session": i * cfg.sessions // cfg.n_entities,
            }
        )
        facts += [
            {**p, "value": p["answer"], "mentions": 1, "session": docs[-1]["session"]}
            for p in by_doc[doc]
        ]
    probes = build_probes(facts, seed=cfg.seed)
    for p, f in zip(probes, facts, strict=True):  # every fact has 12 values: none is skipped
        p["doc"], p["session"], p["question"] = f["doc"], f["session"], f["question"]
    return docs, probes


# -- scoring -----------------------------------------------------------------------------------


@torch.no_grad()
def score(
    model,
    vae,
    tokenizer,
    probes: Sequence[dict[str, Any]],
    mems: Sequence[torch.Tensor] | None,
    *,
    contexts: Sequence[str] | None = None,
    batch_size: int = 32,
) -> tuple[list[int], list[torch.Tensor]]:
    """Each probe's prediction (argmax over choices of Σ log p(choice | context)), reading mems[i]
    (M_i, e) through the reader (None: anchor alone). `contexts`: text put before each question
    (the in-context setting). Returns (predictions, per probe the attention weight (M_i,) each
    of its memory tokens received, mean over its choices)."""
    limit = model.config.max_seq_len
    preds, weights = [], []
    for s in range(0, len(probes), batch_size):
        chunk = probes[s : s + batch_size]
        seqs, conts, owners = [], [], []
        for i, p in enumerate(chunk):
            ctx_text = p["context"] if contexts is None else f"{contexts[s + i]} {p['context']}"
            ctx = tokenizer.encode(ctx_text).ids
            choices = [tokenizer.encode(" " + c.strip()).ids for c in p["choices"]]
            room = limit - max(len(c) for c in choices)
            if room < 1:
                raise ValueError(
                    f"probe {s + i}: its choices do not fit the model's {limit} tokens"
                )
            ctx = ctx[
                -room:
            ]  # an in-context document longer than the model's window loses its head
            for cont in choices:
                seqs.append(ctx + cont)
                conts.append(len(cont))
                owners.append(i)
        ids, lengths = pad(seqs, 0)
        if mems is None:
            logits = model(ids)
            w_rows = None
        else:
            rows = [mems[s + i] for i in owners]
            M = max(1, max(r.shape[0] for r in rows))
            mem = torch.zeros(len(rows), M, vae.latent_dim)
            mask = torch.zeros(len(rows), M, dtype=torch.bool)
            for j, r in enumerate(rows):
                mem[j, : r.shape[0]] = r
                mask[j, : r.shape[0]] = True
            with reading(model, vae, mem, mask) as st:
                logits = model(ids)
            w_rows = st.weights  # (B·4, M)
        lp = F.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[
            ..., 0
        ]  # (N, S-1)
        sc = [
            float(lp[j, int(lengths[j]) - 1 - conts[j] : int(lengths[j]) - 1].sum())
            for j in range(len(seqs))
        ]
        k = 0
        for i, p in enumerate(chunk):
            n = len(p["choices"])
            preds.append(int(np.argmax(sc[k : k + n])))
            if w_rows is not None:
                m = mems[s + i].shape[0]
                weights.append(w_rows[k : k + n, :m].mean(0))
            k += n
    return preds, weights


def _acc(probes: Sequence[dict[str, Any]], preds: Sequence[int], sessions: int) -> dict[str, Any]:
    ok = np.asarray([int(p == q["gold"]) for p, q in zip(preds, probes, strict=True)])
    by = []
    for s in range(sessions):
        m = np.asarray([q["session"] == s for q in probes])
        by.append(
            {"session": s, "n": int(m.sum()), "accuracy": float(ok[m].mean()) if m.any() else None}
        )
    return {
        "n": len(ok),
        "accuracy": float(ok.mean()),
        "ci95": list(wilson(int(ok.sum()), len(ok))),
        "by_session": by,
    }


def _origins(bank_root: Path) -> dict[int, set[int]]:
    """Current entry id → the written entry ids it holds (itself, or what merges folded into it)."""
    parent: dict[int, int] = {}
    for rec in ContextBank.audit_log(bank_root):
        if rec.get("action") == "merge":
            for a in rec["ids"]:
                parent[int(a)] = int(rec["new"])

    def top(i: int) -> int:
        while i in parent:
            i = parent[i]
        return i

    out: dict[int, set[int]] = {}
    for i in list(parent) + [v for v in parent.values()]:
        out.setdefault(top(i), set()).add(i)
    return out


# -- the experiment ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Written:
    """The new entities' documents, compressed once: what every bank setting writes and asks."""

    docs: list[dict[str, Any]]
    probes: list[dict[str, Any]]
    doc_index: dict[str, int]  # document id → its index in docs
    lat: torch.Tensor  # (n_chunks, n_latent, e) every document's chunks
    owner: list[int]  # chunk → the index of its document
    queries: torch.Tensor  # (n_probes, e) each probe's question vector


def _bank_setting(
    cfg: ContextRecallConfig, out: Path, model, vae, tok, w: _Written, frac: float, writer: str
) -> tuple[str, dict[str, Any]]:
    """One capacity: fill a bank over cfg.sessions sessions (saved and reopened between them),
    then answer every probe from what the bank retrieves for its question alone."""
    n_written = len(w.owner)
    capacity = max(2, min(n_written, round(frac * n_written))) if frac < 1 else n_written
    name = "never_merges" if capacity >= n_written else f"capacity_{frac:g}"
    bank_root = out / "banks" / name
    if bank_root.exists():
        shutil.rmtree(bank_root)
    bcfg = ContextBankConfig(
        dim=vae.latent_dim,
        n_latent=vae.cfg.n_latent,
        capacity=capacity,
        n_clusters=min(cfg.n_clusters, capacity),
        top_k=min(cfg.top_k, cfg.n_clusters, capacity),
        merge_rule=cfg.merge_rule,
        merge_scope=cfg.merge_scope,
        merge_importance_weight=cfg.merge_importance_weight,
        merge_age_weight=cfg.merge_age_weight,
        seed=cfg.seed,
        writer=writer,
    )
    t = time.time()
    written: dict[int, int] = {}  # written entry id → chunk index
    for s in range(cfg.sessions):
        bank = ContextBank(bcfg) if s == 0 else ContextBank.open(bank_root, config=bcfg)
        for j in range(n_written):
            if w.docs[w.owner[j]]["session"] == s:
                written[bank.append(w.lat[j], session=f"session-{s}")] = j
        bank.recluster()  # end of session: a full k-means over what the bank holds
        bank.save(bank_root)
    bank = ContextBank.open(bank_root, config=bcfg)  # the recall session
    origins = _origins(bank_root)
    mems, hits, reads, read_ids = [], [], [], []
    for i, p in enumerate(w.probes):
        r = bank.retrieve(w.queries[i])
        mems.append(r.tokens)
        read_ids.append(r.ids)
        held = set()
        for eid in r.ids.tolist():
            held |= origins.get(eid, {eid})
        hits.append(any(w.owner[written[e]] == w.doc_index[p["doc"]] for e in held if e in written))
        reads.append(len(r.ids))
    preds, weights = score(model, vae, tok, w.probes, mems, batch_size=cfg.batch_size)
    for ids, wi in zip(
        read_ids, weights, strict=True
    ):  # importance (§9.5): what each entry's tokens received
        if len(ids):
            bank.record_attention(ids, wi.view(len(ids), -1).sum(1))
    bank.save(bank_root)
    row = _acc(w.probes, preds, cfg.sessions)
    row.update(
        {
            "capacity": capacity,
            "entries_written": n_written,
            "fill_ratio": n_written / capacity,
            "entries_held": len(bank),
            "merges": int(bank.stats["merges"]),
            "retrieval_hit_rate": float(np.mean(hits)),
            "entries_read_mean": float(np.mean(reads)),
            "seconds": round(time.time() - t, 1),
        }
    )
    return name, row


def run_recall(cfg: ContextRecallConfig) -> Path:
    """Run the experiment (training the compressor first when needed); returns the report path."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Imported once the hub is offline: they load composer / transformers, which read it on import.
    from memtree.training.train import load_run

    root = Path(cfg.root)
    out = Path(cfg.out) if cfg.out else root / "context-bank"
    out.mkdir(parents=True, exist_ok=True)
    anchor_dir = root / "train" / "anchor"
    timings: dict[str, float] = {}
    t0 = time.time()
    vae_dir, compressor_action = ensure_compressor(
        root, out, cfg, log=lambda m: print(m, flush=True)
    )
    timings["train_s"] = round(time.time() - t0, 1)
    composer_model, _, manifest, tok = load_run(anchor_dir)
    model = composer_model.model
    vae = load_vae(vae_dir, model, anchor_folder=anchor_dir)
    pad_id = int(manifest["eot_id"])
    docs, probes = new_entities(root, cfg)
    print(
        f"[context-bank] {len(docs)} new entities in {cfg.sessions} sessions, {len(probes)} probes",
        flush=True,
    )

    # every document's chunks, compressed once (the compressor is deterministic at eval: μ)
    t = time.time()
    doc_chunks = [chunk_ids(tok.encode(d["text"]).ids, vae.cfg.chunk_tokens) for d in docs]
    flat = [c for cs in doc_chunks for c in cs]
    lat = compress(model, vae, flat, pad_id=pad_id)  # (n_chunks, n_latent, e)
    owner = [i for i, cs in enumerate(doc_chunks) for _ in cs]
    queries = query_vector(
        model, vae, [tok.encode(p["question"]).ids for p in probes], pad_id=pad_id
    )
    doc_index = {d["id"]: i for i, d in enumerate(docs)}
    timings["compress_s"] = round(time.time() - t, 1)
    n_written = len(flat)
    results: dict[str, Any] = {}

    t = time.time()
    preds, _ = score(model, vae, tok, probes, None, batch_size=cfg.batch_size)
    results["no_bank"] = _acc(probes, preds, cfg.sessions)
    preds, _ = score(
        model,
        vae,
        tok,
        probes,
        None,
        contexts=[docs[doc_index[p["doc"]]]["text"] for p in probes],
        batch_size=cfg.batch_size,
    )
    results["in_context"] = _acc(probes, preds, cfg.sessions)
    doc_lat = [
        lat[[j for j in range(n_written) if owner[j] == i]].flatten(0, 1) for i in range(len(docs))
    ]
    own = [doc_lat[doc_index[p["doc"]]] for p in probes]  # (chunks·n_latent, e) each
    preds, _ = score(model, vae, tok, probes, own, batch_size=cfg.batch_size)
    results["own_entry"] = _acc(probes, preds, cfg.sessions)
    timings["baselines_s"] = round(time.time() - t, 1)

    written = _Written(
        docs=docs, probes=probes, doc_index=doc_index, lat=lat, owner=owner, queries=queries
    )
    writer = writer_id(vae_dir)
    for frac in cfg.capacities:
        name, row = _bank_setting(cfg, out, model, vae, tok, written, frac, writer)
        results[name] = row
        print(
            f"[context-bank] {name}: accuracy {row['accuracy']:.1%}, hit rate "
            f"{row['retrieval_hit_rate']:.1%}, {row['merges']} merges",
            flush=True,
        )
    timings["total_s"] = round(time.time() - t0, 1)
    report = {
        "format": "memtree-context-recall",
        "version": 1,
        "config": to_dict(cfg),
        "compressor": read_json(vae_dir / "context_vae.json"),
        "compressor_action": compressor_action,
        "n_probes": len(probes),
        "n_entities": len(docs),
        "entries_written": n_written,
        "chance": 0.25,
        "settings": results,
        "timings": timings,
    }
    return write_recall_report(out, report)


def write_recall_report(out: Path, report: dict[str, Any]) -> Path:
    atomic_write_json(out / "results.json", report)
    s = report["settings"]
    lines = [
        "# Context bank: cross-session recall",
        "",
        (
            f"{report['n_entities']} new entities (one document each) written in "
            f"{report['config']['sessions']} sessions as {report['entries_written']} entries; "
            f"{report['n_probes']} 4-way probes asked in a later session from the question alone "
            f"(chance 25 %)."
        ),
        "",
        "| setting | accuracy | 95 % interval | retrieval hit rate | merges | entries read |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in s.items():
        lo, hi = r["ci95"]
        lines.append(
            f"| {name} | {r['accuracy']:.1%} | {lo:.1%}–{hi:.1%} | "
            f"{r.get('retrieval_hit_rate', float('nan')):.1%} | {r.get('merges', '—')} | "
            f"{r.get('entries_read_mean', float('nan')):.1f} |"
        )
    lines += [
        "",
        "By the session that wrote the entity (0 = oldest):",
        "",
        "| setting | "
        + " | ".join(f"session {b['session']}" for b in next(iter(s.values()))["by_session"])
        + " |",
        "|---|" + "---:|" * len(next(iter(s.values()))["by_session"]),
    ]
    for name, r in s.items():
        lines.append(
            f"| {name} | "
            + " | ".join(
                "—" if b["accuracy"] is None else f"{b['accuracy']:.1%}" for b in r["by_session"]
            )
            + " |"
        )
    if report.get("compressor_action"):
        lines += [
            "",
            (
                f"Compressor: {report['compressor_action']} (training/yamls/context-vae.yaml + "
                "`--train`)."
            ),
        ]
    lines += ["", f"Timings: {report['timings']}", ""]
    atomic_write_text(out / "report.md", "\n".join(lines))
    fig = new_figure()
    ax = fig.add_subplot()
    banks = [(r["fill_ratio"], r["accuracy"]) for r in s.values() if "fill_ratio" in r]
    banks.sort()
    ax.plot(
        [b[0] for b in banks], [b[1] for b in banks], marker="o", label="context bank (retrieval)"
    )
    for name, style in (("no_bank", ":"), ("own_entry", "--"), ("in_context", "-.")):
        if name in s:
            ax.axhline(s[name]["accuracy"], ls=style, lw=1, label=name.replace("_", " "))
    ax.axhline(report["chance"], color="grey", lw=0.8, label="chance")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("fill ratio (entries written / capacity)")
    ax.set_ylabel("probe accuracy")
    ax.set_title("Recall through the context bank as it fills past capacity")
    ax.legend(fontsize=8)
    save_png(fig, out / "recall.png")
    return out / "report.md"
