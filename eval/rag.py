"""Vanilla RAG baseline (App. H): the nearest training window in the query's cluster, prepended.

The datastore is the pipeline run the model was trained on, read through its
documented run-directory format (pipeline/README.md): `assign/` gives every
window's cluster path, `embed/embeddings.npy` its all-MiniLM-L6-v2 embedding
(row = window ordinal), `window/` its text. A query is embedded with the tree's
own embedder settings and routed with `clustering.route.route` — the greedy
traversal that assigned the training data and that fetches memories — so RAG
and fetched memories look in the same cluster. Inside the query's cluster at
`level` (default: the leaf; App. H uses the deepest memory level) the window
with the highest cosine similarity wins (ties: the lowest window ordinal).

"Document" here is a training window: the unit the tree clusters and the
pipeline embeds (App. C), which is the whole document when it is shorter than
`window.window_tokens`.

The retrieved text is prepended to the 0-shot question (App. H: no few-shot
examples with RAG), separated by a blank line. When context + longest
continuation would exceed the model's `max_seq_len`, the window is cut from the
right: its head is kept, because the head is what the embedder read (the
`truncate` strategy embeds the first word pieces) and so what matched the
query. Memories, when combined with RAG, are still fetched with the question
alone (App. B).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memtree.clustering.embed import embed_texts, embedder_from_meta
from memtree.clustering.route import route
from memtree.clustering.tree import load_tree
from memtree.eval.longtail import BUCKETS, bucket_label
from memtree.eval.model import RunModel
from memtree.eval.tasks import retrieval_query
from memtree.io import read_json

SEPARATOR = "\n\n"


def nearest_in_cluster(
    queries: np.ndarray,
    query_paths: np.ndarray,
    paths: np.ndarray,
    embeddings: np.ndarray,
    *,
    level: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Per query, the stored row in the query's level-`level` cluster with the largest cosine
    similarity.

    queries (n, dim) and embeddings (W, dim) are L2-normalised, so the dot product is the cosine;
    query_paths (n, L) and paths (W, L) are cluster ids per level. Returns (rows (n,) int64, −1
    where the cluster holds no row; similarities (n,) float32, NaN where there is none)."""
    col = paths[:, level - 1]
    order = np.argsort(col, kind="stable")  # rows grouped by cluster, ascending row inside each
    sorted_ids = col[order]
    rows = np.full(len(queries), -1, dtype=np.int64)
    sims = np.full(len(queries), np.nan, dtype=np.float32)
    for i, c in enumerate(query_paths[:, level - 1]):
        lo, hi = np.searchsorted(sorted_ids, c, "left"), np.searchsorted(sorted_ids, c, "right")
        if lo == hi:
            continue
        members = order[lo:hi]
        s = np.asarray(embeddings[members], dtype=np.float32) @ np.asarray(
            queries[i], dtype=np.float32
        )  # (k,)
        j = int(np.argmax(s))  # first maximum: the lowest ordinal among ties
        rows[i], sims[i] = members[j], s[j]
    return rows, sims


@dataclass
class RagIndex:
    """A pipeline run's windows as a datastore: paths (W, L), embeddings (W, dim), texts by
    ordinal."""

    root: Path
    tree: Any
    paths: np.ndarray  # (W, L) int64
    embeddings: np.ndarray  # (W, dim) float32, memory-mapped
    parts: list[dict[str, Any]]  # window parts: file, offset, n

    @classmethod
    def open(cls, run_dir: str | Path) -> RagIndex:
        import pyarrow.parquet as pq

        root = Path(run_dir)
        for stage in ("window", "embed", "tree", "assign"):
            if not (root / stage / "_stage.json").exists():
                raise FileNotFoundError(
                    f"{root}: no finished `{stage}` stage; the RAG datastore is a pipeline "
                    "run directory (memtree pipeline run … out=RUN)"
                )
        tree = load_tree(root / "tree")
        embeddings = np.load(root / "embed" / "embeddings.npy", mmap_mode="r")
        paths = np.full((embeddings.shape[0], tree.levels), -1, dtype=np.int64)
        for p in read_json(root / "assign" / "_stage.json")["stats"]["parts"]:
            t = pq.read_table(root / "assign" / p["file"], columns=["window_ordinal", "path"])
            ords = t["window_ordinal"].to_numpy()
            paths[ords] = np.asarray(t["path"].combine_chunks().flatten(), dtype=np.int64).reshape(
                len(ords), -1
            )
        if (paths < 0).any():
            raise ValueError(
                f"{root}/assign: {(paths[:, 0] < 0).sum()} windows have no assigned path"
            )
        parts = read_json(root / "window" / "_stage.json")["stats"]["parts"]
        return cls(root=root, tree=tree, paths=paths, embeddings=embeddings, parts=parts)

    def texts(self, ordinals: Sequence[int]) -> list[str]:
        """The windows' exact text spans (what the pipeline embedded), in the order asked."""
        import pyarrow.parquet as pq

        offsets = np.asarray([p["offset"] for p in self.parts])
        out: dict[int, str] = {}
        by_part: dict[int, list[int]] = {}
        for o in {int(o) for o in ordinals}:
            by_part.setdefault(int(np.searchsorted(offsets, o, "right") - 1), []).append(o)
        for k, ords in by_part.items():
            part = self.parts[k]
            col = pq.read_table(self.root / "window" / part["file"], columns=["text"])["text"]
            for o in ords:
                out[o] = col[o - part["offset"]].as_py()
        return [out[int(o)] for o in ordinals]

    def retrieve(self, texts: Sequence[str], *, level: int | None = None) -> dict[str, np.ndarray]:
        """Embed and route the texts, then pick each one's nearest window inside its cluster.

        Returns {"paths": (n, L), "ordinals": (n,) (−1: empty cluster), "similarity": (n,)}."""
        level = level or self.tree.levels
        if not 1 <= level <= self.tree.levels:
            raise ValueError(f"rag level {level} must be in [1, {self.tree.levels}]")
        emb = self.tree.meta.get("embedder", {})
        model = embedder_from_meta(emb, self.tree.path)
        x = embed_texts(
            model,
            list(texts),
            strategy=emb.get("strategy", "truncate"),
            batch_size=int(emb.get("batch_size", 64)),
        )  # (n, dim)
        paths = route(self.tree, x)
        rows, sims = nearest_in_cluster(x, paths, self.paths, self.embeddings, level=level)
        return {"paths": paths, "ordinals": rows, "similarity": sims}


def _fit(rm: RunModel, doc: str, query: str, reserve: int) -> tuple[str, int]:
    """The longest head of `doc` such that doc + separator + query + `reserve` tokens fits
    max_seq_len."""
    limit = rm.max_seq_len
    ids = rm.encode(doc)
    k = min(len(ids), limit - reserve - len(rm.encode(SEPARATOR + query)))
    while k > 0:
        head = rm.decode(ids[:k])
        over = len(rm.encode(head + SEPARATOR + query)) + reserve - limit
        if over <= 0:
            return head, k
        k -= over  # re-tokenising across the cut can merge or split a few tokens
    return "", 0


def rag_items(
    rm: RunModel, index: RagIndex, items: Sequence[dict[str, Any]], *, level: int | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Items whose context is (retrieved window head + blank line + the 0-shot question).

    Multiple-choice items reserve room for their longest choice, generation items for their answer.
    Each new item keeps the question as its `query`, so fetched memories are still retrieved with
    the question alone. Returns (items, retrieval record: per item the window ordinal, its cluster
    path, cosine similarity and the tokens of it kept)."""
    if rm.tree is not None and rm.tree.tree_id != index.tree.tree_id:
        raise ValueError(
            f"rag: the datastore {index.root} was clustered with tree {index.tree.tree_id}, the "
            f"run's memories with tree {rm.tree.tree_id}; use the pipeline run the model was "
            "trained on"
        )
    queries = [retrieval_query(it) for it in items]
    hit = index.retrieve(queries, level=level)
    found = hit["ordinals"] >= 0
    docs = dict(
        zip(
            hit["ordinals"][found].tolist(),
            index.texts(hit["ordinals"][found].tolist()),
            strict=True,
        )
    )
    out, kept = [], []
    for it, q, o in zip(items, queries, hit["ordinals"].tolist(), strict=True):
        conts = it["choices"] if "choices" in it else [it["answer"]]
        reserve = max(
            len(rm.encode(c if c.startswith(" ") else " " + c.strip())) for c in conts
        )  # as scored
        head, k = _fit(rm, docs[o], q, reserve) if o >= 0 else ("", 0)
        kept.append(k)
        out.append({**it, "query": q, "context": f"{head}{SEPARATOR}{q}" if head else q})
    record = {
        "level": level or index.tree.levels,
        "datastore": str(index.root.resolve()),
        "ordinals": hit["ordinals"].tolist(),
        "paths": hit["paths"].tolist(),
        "similarity": [None if np.isnan(s) else float(s) for s in hit["similarity"]],
        "kept_tokens": kept,
    }
    return out, record


def routing_agreement(
    window_texts: Sequence[str],
    window_paths: np.ndarray,
    probes: Sequence[dict[str, Any]],
    probe_paths: np.ndarray,
) -> dict[str, Any]:
    """How often a probe is routed to a cluster that holds a training window stating its fact.

    A window states the fact when it contains both the probe's entity and its gold answer.
    Per level l: the share of probes (that have a stating window) whose level-l cluster holds
    at least one such window, over all probes and per mention bucket. A fetched memory can only
    carry a fact it was trained on, so this bounds what fetched memory can add per level.

    window_paths (W, L), probe_paths (n, L): cluster ids per level."""
    levels = window_paths.shape[1]
    by_entity: dict[str, list[int]] = {}
    for p in probes:
        ent = p.get("entity")
        if ent and ent not in by_entity:
            by_entity[ent] = [w for w, t in enumerate(window_texts) if ent in t]
    hits, mentions = [], []
    for p, path in zip(probes, probe_paths, strict=True):
        gold = p["choices"][p["gold"]].strip()
        stating = [w for w in by_entity.get(p.get("entity") or "", []) if gold in window_texts[w]]
        if stating:
            hits.append((window_paths[stating] == path[None, :]).any(axis=0))  # (L,)
            mentions.append(int(p["mentions"]))
    hit = np.asarray(hits, dtype=bool).reshape(-1, levels)
    m = np.asarray(mentions)

    def rates(sel: np.ndarray) -> list[float | None]:
        return [float(hit[sel, lv].mean()) if sel.any() else None for lv in range(levels)]

    return {
        "n_probes": len(probes),
        "n_with_stating_window": len(hit),
        "all": rates(np.ones(len(hit), dtype=bool)),
        "by_bucket": [
            {
                "bucket": bucket_label(lo, hi),
                "n": int(((m >= lo) & (m < hi)).sum()),
                "rates": rates((m >= lo) & (m < hi)),
            }
            for lo, hi in BUCKETS
        ],
    }
