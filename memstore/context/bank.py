"""The context bank (seed 004 §9, §10.2): a runtime memory written at inference time.

The trained memory bank (`memstore.format` / `memstore.store`) is static after training; the
context bank is a separate store that grows while the model runs and is kept across sessions
(conversations), so inference-time writes never touch the trained bank. This module is only the
store: what an entry is, how the bank stays within capacity, how entries are found again, how
they are blocked / deleted, and how the bank lies on disk. The compressor (§9.2, a VAE that turns
a prompt's hidden states into a few latent tokens), the model hookup and the evaluation are not
here.

Entries. One entry is one written block of latent tokens, (n_latent, d) float32, with metadata
(`EntryMeta`): a monotonic integer id (never reused, also not by merges), the session that wrote
it, the write step and UTC time it was created, its age, its importance statistics, the ids it
was merged from, and a blocked flag.

- step: the bank's write counter; every `append` is one write (one prompt processed, §9.5).
- age: writes since the entry was last touched, where touched = created (or produced by a
  merge). Each append ages every existing entry by one; the new entry starts at 0. Attention
  does not reset age: it is counted separately as importance, so the two §9.5 signals stay
  independent.
- importance: `record_attention(ids, weights)` adds each softmax weight to the entry's
  `attn_sum` and 1 to its `attn_count` (how often referenced; attn_sum / attn_count is the
  mean contribution per reference). The merge weighting uses I = attn_sum = count × mean,
  which rises with both signals of §9.5.

Capacity (§9.4, §9.5). `append` never lets the bank hold more than `capacity` entries: when it
is full, the closest pair of existing, non-blocked entries is merged into one first. For
entries a, b with token blocks A, B (n_latent, d):

    score(a, b) = ||A − B||²_F · (1 + β·(I_a + I_b)) / (1 + γ·min(age_a, age_b))

β = `merge_importance_weight`, γ = `merge_age_weight`. The pair of lowest score is merged
(ties: the pair of lowest ids). ||A − B||² is the information lost by merging (§9.4: merge
only what is already close); importance makes attended pairs dearer; age makes old pairs
cheaper, and a pair is as young as its younger member, so a freshly written entry is protected
even when it lies next to an old one. With β = γ = 0 this is the seed's plain closest pair. For
large banks (§10.2), `merge_scope= "cluster"` looks for the pair only inside each k-means cluster
(the IVF lists retrieval reads):
O(N²/k) per merge instead of O(N²), with each cluster's distance matrix cached until the cluster
gains or loses an entry (weights still change every write, through age, so only distances are
cached); when no cluster holds two mergeable entries it falls back to every pair.
Blocked entries are never merged (their content would leak into a servable entry). The merged
entry gets a new id, tokens A + B (`merge_rule="sum"`, the seed's element-wise addition) or the
importance-weighted mean ((1 + I_a)·A + (1 + I_b)·B) / (2 + I_a + I_b) (`"mean"`), attn_sum and
attn_count summed, age 0, merged_from = [a, b], and the session of the newer member. Every
merge is an audit record (both ids, the new id, distance, weight, score).

Retrieval (§9.3, §10.2). Entries are clustered by k-means on their mean latent (d,), with
k = `n_clusters`. Online: a new entry seeds an empty cluster if there is one, else joins the
nearest centroid (Euclidean), which moves by a running mean; a removed entry (merged away or
deleted) is taken out of its centroid's running mean. `recluster()` runs full k-means
(k-means++ init, Lloyd iterations) over every stored entry; `recluster_every` > 0 does so
automatically every that many writes. `retrieve(query (d,), top_k)` scores the non-empty
clusters by centroid · query, takes the top_k (ties: lowest cluster), and returns their
non-blocked entries' tokens in id order. Blocked entries are withheld and counted
(`stats["blocked_refused"]`); deleted entries are gone from the bank.

Blocking and deletion: `block` / `unblock` / `delete` per entry, each an audit record. Audit
records go to `audit.jsonl` in the bank directory (append-only, one line per record, fsynced):
merges and appends' records are buffered until the next `save`; block / unblock / delete are
written at once when the bank is bound to a directory (opened or saved), since they must hold
even if the process dies before the next save.

On disk: format `memtree-context-bank` v1, see memstore/README.md. Each `save` writes a new
version directory `v<generation>` under a temp name and renames it into place; the previous
version is kept as the fallback, so a corrupt or truncated current version (checksum mismatch)
is detected by `open`, which loads the newest good version and warns (and records it).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from memtree.clustering.kmeans import kmeans_pp
from memtree.config import from_dict, is_int, is_number, to_dict
from memtree.io import (
    atomic_dir,
    atomic_write_json,
    check_format,
    iter_jsonl,
    read_json,
    sha256_file,
    utc_timestamp,
)

FORMAT = "memtree-context-bank"
VERSION = 1
_TENSOR_FILE = "entries.safetensors"
_AUDIT_FILE = "audit.jsonl"
_KEEP_VERSIONS = 2  # the current version and its fallback
# Test hook: seconds to sleep after a new version is fully written under its temp name and
# before it is renamed into place (lets a test kill a save at its most delicate instant).
SAVE_PAUSE_ENV = "MEMTREE_CONTEXT_BANK_SAVE_PAUSE"


@dataclass(frozen=True, kw_only=True)
class ContextBankConfig:
    """dim: d of a latent token; n_latent: tokens per entry; capacity: most entries held;
    n_clusters: k of the k-means; top_k: clusters a retrieval reads (default of `retrieve`);
    merge_importance_weight β, merge_age_weight γ: the merge score's weighting (module
    docstring); merge_rule: "sum" (seed §9.4) or "mean" (importance-weighted); merge_scope:
    which pairs are candidates, "all" (exact) or "cluster" (pairs inside one k-means cluster,
    §10.2: O(N²/k) per merge, distances cached per cluster, for large banks);
    recluster_every: full k-means every that many writes (0: only on request);
    kmeans_iters: Lloyd iterations of a full re-cluster; seed: its k-means++ init;
    writer: what writes the entries (e.g. a compressor's id, `training.context.vae.writer_id`):
    a bank is only opened by the writer that made it."""

    dim: int
    n_latent: int
    capacity: int
    n_clusters: int = 16
    top_k: int = 2
    merge_importance_weight: float = 1.0
    merge_age_weight: float = 0.1
    merge_rule: Literal["sum", "mean"] = "sum"
    merge_scope: Literal["all", "cluster"] = "all"
    recluster_every: int = 0
    kmeans_iters: int = 20
    seed: int = 0
    writer: str = ""

    def __post_init__(self) -> None:
        for name in ("dim", "n_latent", "n_clusters", "top_k", "kmeans_iters"):
            v = getattr(self, name)
            if not is_int(v) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not is_int(self.capacity) or self.capacity < 2:
            # a full bank makes room by merging a pair, so it must be able to hold two
            raise ValueError(f"capacity must be an integer >= 2, got {self.capacity!r}")
        if self.top_k > self.n_clusters:
            raise ValueError(f"top_k={self.top_k} exceeds n_clusters={self.n_clusters}")
        for name in ("merge_importance_weight", "merge_age_weight"):
            v = getattr(self, name)
            if not is_number(v) or not v >= 0 or v == float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.merge_rule not in ("sum", "mean"):
            raise ValueError(f"merge_rule {self.merge_rule!r} is not one of 'sum', 'mean'")
        if self.merge_scope not in ("all", "cluster"):
            raise ValueError(f"merge_scope {self.merge_scope!r} is not one of 'all', 'cluster'")
        if not is_int(self.recluster_every) or self.recluster_every < 0:
            raise ValueError(
                f"recluster_every must be a non-negative integer, got {self.recluster_every!r}"
            )
        if not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")


@dataclass
class EntryMeta:
    """Metadata of one entry (module docstring); `cluster` is its k-means cluster."""

    id: int
    session: str
    created_step: int
    created_time: str
    age: int = 0
    attn_sum: float = 0.0
    attn_count: int = 0
    merged_from: list[int] = field(default_factory=list)
    blocked: bool = False
    cluster: int = -1

    @property
    def importance(self) -> float:
        return self.attn_sum

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "session": self.session,
            "created_step": self.created_step,
            "created_time": self.created_time,
            "age": self.age,
            "attn_sum": self.attn_sum,
            "attn_count": self.attn_count,
            "merged_from": list(self.merged_from),
            "blocked": self.blocked,
            "cluster": self.cluster,
        }


@dataclass(frozen=True)
class Retrieved:
    """What `retrieve` returns: tokens (m·n_latent, d) float32, the entries' tokens
    concatenated in id order; ids (m,) int64 the entries; clusters (≤ top_k,) int64 the
    clusters read, best first; scores (≤ top_k,) float32 their centroid · query."""

    tokens: Tensor
    ids: Tensor
    clusters: Tensor
    scores: Tensor


class ContextBank:
    """The runtime context bank (module docstring). Tensors live on the CPU."""

    def __init__(self, cfg: ContextBankConfig) -> None:
        self.cfg = cfg
        self.step = 0  # writes so far
        self.next_id = 0
        self.tokens: dict[int, Tensor] = {}  # id → (n_latent, d) float32, in id order
        self.meta: dict[int, EntryMeta] = {}
        self.centroids = torch.zeros(cfg.n_clusters, cfg.dim)  # (k, d) float32
        self.counts = torch.zeros(cfg.n_clusters, dtype=torch.int64)  # (k,) entries per cluster
        self.stats = {
            "appends": 0,
            "merges": 0,
            "deleted": 0,
            "reads": 0,
            "entries_served": 0,
            "blocked_refused": 0,
            "attention_records": 0,
            "attention_dropped": 0,
            "reclusters": 0,
        }
        self.root: Path | None = None  # bound directory (after open / save)
        self.generation = 0  # version directory this state was loaded from / saved as
        self.log: list[dict[str, Any]] = []  # this process's audit records
        self._pending = 0  # records at the tail of `log` not yet in audit.jsonl
        self.recovered: list[tuple[str, str]] = []  # (version, why skipped) from `open`
        # merge_scope "cluster": cluster → (member ids, their (n, n) distances); dropped when
        # the cluster gains or loses an entry (tokens never change in place)
        self._dist_cache: dict[int, tuple[list[int], Tensor]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    # -- writing --------------------------------------------------------------------------
    @torch.no_grad()
    def append(self, tokens: Tensor, *, session: str) -> int:
        """Write one entry, tokens (n_latent, d); merge first when full. Returns its id."""
        x = self._check_tokens(tokens)
        if not isinstance(session, str):
            raise TypeError(f"session must be a string, got {session!r}")
        if len(self) >= self.cfg.capacity:
            self._merge_closest()
        for m in self.meta.values():
            m.age += 1
        eid = self._add(x, session, merged_from=[])
        self.step += 1
        self.stats["appends"] += 1
        if self.cfg.recluster_every and self.step % self.cfg.recluster_every == 0:
            self.recluster()
        return eid

    def _check_tokens(self, tokens: Tensor) -> Tensor:
        t = torch.as_tensor(tokens)
        if t.ndim != 2:
            raise ValueError(f"tokens must be (n_latent, dim), got shape {tuple(t.shape)}")
        if t.shape[0] != self.cfg.n_latent:
            raise ValueError(
                f"tokens have {t.shape[0]} rows, the bank has n_latent={self.cfg.n_latent}"
            )
        if t.shape[1] != self.cfg.dim:
            raise ValueError(f"tokens have dimension {t.shape[1]}, the bank has dim={self.cfg.dim}")
        t = t.detach().to("cpu", torch.float32).clone()
        if not bool(torch.isfinite(t).all()):
            raise ValueError("tokens contain NaN or inf")  # would poison k-means and merges
        return t

    def _add(
        self,
        x: Tensor,
        session: str,
        *,
        merged_from: list[int],
        attn_sum: float = 0.0,
        attn_count: int = 0,
    ) -> int:
        eid = self.next_id
        self.next_id += 1
        self.tokens[eid] = x
        self.meta[eid] = EntryMeta(
            id=eid,
            session=session,
            created_step=self.step,
            created_time=utc_timestamp(),
            merged_from=merged_from,
            attn_sum=attn_sum,
            attn_count=attn_count,
        )
        self._join_cluster(eid)
        return eid

    def _remove(self, eid: int) -> None:
        self._leave_cluster(eid)
        del self.tokens[eid], self.meta[eid]

    def _gram_dist(self, ids: list[int]) -> Tensor:
        """(N, N) float64 ||A − B||²_F between the entries `ids`."""
        x = (
            torch.stack([self.tokens[i].flatten() for i in ids]).double()
            if ids
            else torch.zeros(0, self.cfg.n_latent * self.cfg.dim, dtype=torch.float64)
        )  # (N, L·d)
        sq = (x * x).sum(1)
        # Gram form: O(N²) memory instead of O(N²·L·d); float64 keeps it exact enough
        return (sq[:, None] + sq[None, :] - 2.0 * (x @ x.T)).clamp(min=0.0)

    def _weighted(self, ids: list[int], dist: Tensor) -> tuple[Tensor, Tensor]:
        """(weight, score) (N, N) of the pairs among `ids` given their distances; the diagonal
        and every pair with a blocked member score +inf."""
        imp = torch.tensor([self.meta[i].importance for i in ids], dtype=torch.float64)
        age = torch.tensor([self.meta[i].age for i in ids], dtype=torch.float64)
        weight = (1.0 + self.cfg.merge_importance_weight * (imp[:, None] + imp[None, :])) / (
            1.0 + self.cfg.merge_age_weight * torch.minimum(age[:, None], age[None, :])
        )
        score = dist * weight
        score.fill_diagonal_(float("inf"))
        blocked = torch.tensor([self.meta[i].blocked for i in ids], dtype=torch.bool)
        if bool(blocked.any()):
            score[blocked, :] = float("inf")
            score[:, blocked] = float("inf")
        return weight, score

    def pair_scores(self) -> tuple[list[int], Tensor, Tensor, Tensor]:
        """The merge score of every pair of non-blocked entries: (ids (N,), dist (N, N),
        weight (N, N), score (N, N)) float64, dist = ||A − B||²_F, score = dist · weight
        (module docstring); the diagonal is +inf in score."""
        ids = [i for i, m in self.meta.items() if not m.blocked]
        dist = self._gram_dist(ids)
        weight, score = self._weighted(ids, dist)
        return ids, dist, weight, score

    def _cluster_dist(self, c: int) -> tuple[list[int], Tensor]:
        """Cluster c's members (id order) and their distances, cached until the cluster changes."""
        hit = self._dist_cache.get(c)
        if hit is None:
            ids = [i for i, m in self.meta.items() if m.cluster == c]
            hit = self._dist_cache[c] = (ids, self._gram_dist(ids))
        return hit

    def _closest_pair(self) -> tuple[int, int, float, float, float]:
        """(a, b, distance, weight, score) of the pair to merge, a < b; ties: the lowest ids."""
        best = None
        if self.cfg.merge_scope == "cluster":
            for c in (self.counts >= 2).nonzero().flatten().tolist():
                ids, dist = self._cluster_dist(c)
                weight, score = self._weighted(ids, dist)
                flat = int(torch.argmin(score))
                i, j = divmod(flat, len(ids))
                cand = (
                    float(score[i, j]),
                    min(ids[i], ids[j]),
                    max(ids[i], ids[j]),
                    float(dist[i, j]),
                    float(weight[i, j]),
                )
                if cand[0] < float("inf") and (best is None or cand[:3] < best[:3]):
                    best = cand
        if best is None:  # exact search (also when no cluster holds two mergeable entries)
            ids, dist, weight, score = self.pair_scores()
            if len(ids) < 2:
                raise RuntimeError(
                    f"context bank full (capacity={self.cfg.capacity}) and fewer than two "
                    "unblocked entries to merge: unblock or delete some"
                )
            flat = int(torch.argmin(score))  # row-major: ties go to the lowest ids
            i, j = divmod(flat, len(ids))
            best = (float(score[i, j]), ids[i], ids[j], float(dist[i, j]), float(weight[i, j]))
        score, a, b, d, w = best
        return min(a, b), max(a, b), d, w, score

    def _merge_closest(self) -> int:
        a, b, distance, weight, score = self._closest_pair()
        ma, mb = self.meta[a], self.meta[b]
        xa, xb = self.tokens[a], self.tokens[b]
        if self.cfg.merge_rule == "sum":
            x = xa + xb
        else:
            wa, wb = 1.0 + ma.importance, 1.0 + mb.importance
            x = (wa * xa + wb * xb) / (wa + wb)
        session = mb.session  # b is the newer (ids are monotonic)
        attn_sum, attn_count = ma.attn_sum + mb.attn_sum, ma.attn_count + mb.attn_count
        rec = {
            "a": a,
            "b": b,
            "distance": distance,
            "weight": weight,
            "score": score,
            "rule": self.cfg.merge_rule,
            "scope": self.cfg.merge_scope,
        }
        self._remove(a)
        self._remove(b)
        new = self._add(x, session, merged_from=[a, b], attn_sum=attn_sum, attn_count=attn_count)
        self.stats["merges"] += 1
        self._audit("merge", ids=[a, b], new=new, **rec)
        return new

    def record_attention(self, entry_ids, weights) -> int:
        """Add attention weights to entries' importance: entry_ids (n,) and weights (n,), one
        softmax weight per reference (repeats accumulate). Ids no longer in the bank (merged
        away or deleted since they were retrieved) are skipped and counted. Returns how many
        references were recorded."""
        ids = torch.as_tensor(entry_ids).flatten().tolist()
        ws = torch.as_tensor(weights, dtype=torch.float64).flatten().tolist()
        if len(ids) != len(ws):
            raise ValueError(f"{len(ids)} entry ids but {len(ws)} weights")
        done = 0
        for i, w in zip(ids, ws, strict=True):
            m = self.meta.get(int(i))
            if m is None:
                self.stats["attention_dropped"] += 1
                continue
            m.attn_sum += w
            m.attn_count += 1
            done += 1
        self.stats["attention_records"] += done
        return done

    # -- clustering ------------------------------------------------------------------------
    def _mean(self, eid: int) -> Tensor:
        return self.tokens[eid].mean(0)  # (d,)

    def _join_cluster(self, eid: int) -> None:
        x = self._mean(eid)
        empty = (self.counts == 0).nonzero().flatten()
        if len(empty):  # seed an empty cluster before crowding a filled one
            c = int(empty[0])
            self.centroids[c] = x
        else:
            c = int(torch.argmin(((self.centroids - x) ** 2).sum(1)))
            n = int(self.counts[c]) + 1
            self.centroids[c] += (x - self.centroids[c]) / n  # running mean
        self.counts[c] += 1
        self.meta[eid].cluster = c
        self._dist_cache.pop(c, None)

    def _leave_cluster(self, eid: int) -> None:
        c = self.meta[eid].cluster
        n = int(self.counts[c])
        if n > 1:  # undo the running mean: c' = (n·c − x) / (n − 1)
            self.centroids[c] = (n * self.centroids[c] - self._mean(eid)) / (n - 1)
        self.counts[c] = n - 1  # an emptied centroid stays put; the next new entry re-seeds it
        self._dist_cache.pop(c, None)

    @torch.no_grad()
    def recluster(self) -> None:
        """Full k-means over every stored entry's mean latent (k-means++ init seeded by
        (seed, step), then up to kmeans_iters Lloyd iterations). Clusters beyond the number
        of entries stay empty."""
        ids = list(self.tokens)
        k = self.cfg.n_clusters
        self.centroids.zero_()
        self.counts.zero_()
        self._dist_cache.clear()
        self.stats["reclusters"] += 1
        if not ids:
            return
        x = torch.stack([self._mean(i) for i in ids])  # (N, d)
        rng = np.random.default_rng(self.cfg.seed * 1_000_003 + self.step)
        # the tree's k-means++ seeding; with fewer distinct points than clusters the duplicate
        # seeds get no members and read as empty clusters
        c = torch.from_numpy(kmeans_pp(x.numpy(), min(k, len(ids)), rng))  # (k', d)
        assign = torch.cdist(x, c).argmin(1)
        for _ in range(self.cfg.kmeans_iters):
            for j in range(len(c)):
                members = assign == j
                if bool(members.any()):
                    c[j] = x[members].mean(0)
            new = torch.cdist(x, c).argmin(1)
            if bool((new == assign).all()):
                break
            assign = new
        self.centroids[: len(c)] = c
        self.counts[: len(c)] = torch.bincount(assign, minlength=len(c))
        for i, a in zip(ids, assign.tolist(), strict=True):
            self.meta[i].cluster = a

    # -- reading ---------------------------------------------------------------------------
    @torch.no_grad()
    def retrieve(self, query: Tensor, top_k: int | None = None) -> Retrieved:
        """query (d,) → the non-blocked entries of the top_k non-empty clusters by
        centroid · query (module docstring)."""
        q = torch.as_tensor(query).detach().to("cpu", torch.float32).flatten()
        if q.numel() != self.cfg.dim:
            raise ValueError(f"query has dimension {q.numel()}, the bank has dim={self.cfg.dim}")
        top_k = self.cfg.top_k if top_k is None else top_k
        if not is_int(top_k) or top_k <= 0:
            raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
        self.stats["reads"] += 1
        live = (self.counts > 0).nonzero().flatten()  # (k',)
        scores = self.centroids[live] @ q  # (k',)
        # stable sort by descending score: ties keep the lower cluster first
        order = torch.sort(-scores, stable=True).indices[:top_k]
        clusters, best = live[order], scores[order]
        chosen = set(clusters.tolist())
        ids, refused = [], 0
        for i, m in self.meta.items():
            if m.cluster in chosen:
                if m.blocked:
                    refused += 1
                else:
                    ids.append(i)
        self.stats["blocked_refused"] += refused
        self.stats["entries_served"] += len(ids)
        toks = torch.cat([self.tokens[i] for i in ids]) if ids else torch.zeros(0, self.cfg.dim)
        return Retrieved(
            tokens=toks,
            ids=torch.tensor(ids, dtype=torch.int64),
            clusters=clusters.to(torch.int64),
            scores=best,
        )

    def get(self, eid: int) -> Tensor:
        """One entry's tokens (n_latent, d); KeyError if absent, PermissionError if blocked
        (counted as a refused blocked hit)."""
        m = self.meta.get(eid)
        if m is None:
            raise KeyError(f"context bank has no entry {eid} (deleted, merged or never written)")
        if m.blocked:
            self.stats["blocked_refused"] += 1
            raise PermissionError(f"context bank entry {eid} is blocked")
        return self.tokens[eid].clone()

    # -- blocking / deletion ----------------------------------------------------------------
    def _targets(self, ids) -> list[int]:
        out = sorted({int(i) for i in ids})
        missing = [i for i in out if i not in self.meta]
        if missing:
            raise KeyError(f"context bank has no entries {missing}")
        return out

    def block(self, ids, *, reason: str = "") -> None:
        """Refuse these entries to every read (and to merging) until unblocked."""
        ids = self._targets(ids)
        for i in ids:
            self.meta[i].blocked = True
        self._audit("block", ids=ids, reason=reason, durable=True)

    def unblock(self, ids, *, reason: str = "") -> None:
        ids = self._targets(ids)
        for i in ids:
            self.meta[i].blocked = False
        self._audit("unblock", ids=ids, reason=reason, durable=True)

    def delete(self, ids, *, reason: str = "") -> None:
        """Remove entries for good: out of their clusters and out of the next saved version
        (versions written before keep them until pruned: at most the fallback version)."""
        ids = self._targets(ids)
        for i in ids:
            self._remove(i)
        self.stats["deleted"] += len(ids)
        self._audit("delete", ids=ids, reason=reason, durable=True)

    # -- audit ------------------------------------------------------------------------------
    def _audit(self, action: str, *, durable: bool = False, **fields: Any) -> None:
        self.log.append(
            {
                "time": utc_timestamp(),
                "host": socket.gethostname(),
                "action": action,
                "step": self.step,
                **fields,
            }
        )
        self._pending += 1
        if durable and self.root is not None:
            self.flush_audit()

    def flush_audit(self) -> None:
        """Append the records not yet on disk to <root>/audit.jsonl (one write, fsynced)."""
        if self.root is None or not self._pending:
            return
        lines = "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.log[-self._pending :])
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / _AUDIT_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, lines.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self._pending = 0

    @staticmethod
    def audit_log(root: str | os.PathLike) -> list[dict[str, Any]]:
        path = Path(root) / _AUDIT_FILE
        return [r for _, r in iter_jsonl(path)] if path.exists() else []

    # -- on disk ----------------------------------------------------------------------------
    @staticmethod
    def _versions(root: Path) -> list[tuple[int, Path]]:
        """(generation, dir) of the published versions, newest first."""
        out = []
        for p in root.glob("v*"):
            if p.is_dir() and p.name[1:].isdigit():
                out.append((int(p.name[1:]), p))
        return sorted(out, reverse=True)

    def save(self, root: str | os.PathLike) -> Path:
        """Write the bank as a new version under `root` and bind it there; keeps the version
        this state came from (or the newest before) as the fallback, prunes older ones."""
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".v*.tmp-*"):  # temp dirs of saves killed mid-way
            shutil.rmtree(stale, ignore_errors=True)
        versions = self._versions(root)
        keep = (
            self.generation
            if self.root == root and self.generation
            else (versions[0][0] if versions else 0)
        )
        gen = (versions[0][0] if versions else 0) + 1
        self.root = root
        self.flush_audit()  # the log names everything the new state reflects
        ids = list(self.tokens)
        tensors = {
            "tokens": torch.stack([self.tokens[i] for i in ids])
            if ids
            else torch.zeros(0, self.cfg.n_latent, self.cfg.dim),  # (N, n_latent, d) float32
            "ids": torch.tensor(ids, dtype=torch.int64),  # (N,)
            "centroids": self.centroids.contiguous(),  # (k, d) float32
            "counts": self.counts.contiguous(),  # (k,) int64
        }
        with atomic_dir(root / f"v{gen:08d}") as tmp:
            save_file(tensors, str(tmp / _TENSOR_FILE))
            atomic_write_json(
                tmp / "manifest.json",
                {
                    "format": FORMAT,
                    "version": VERSION,
                    "generation": gen,
                    "config": to_dict(self.cfg),
                    "dim": self.cfg.dim,
                    "n_latent": self.cfg.n_latent,
                    "n_entries": len(ids),
                    "step": self.step,
                    "next_id": self.next_id,
                    "stats": dict(self.stats),
                    "entries": [self.meta[i].to_json() for i in ids],
                    "tensors": {"file": _TENSOR_FILE, "sha256": sha256_file(tmp / _TENSOR_FILE)},
                },
            )
            pause = float(os.environ.get(SAVE_PAUSE_ENV, "0") or 0)
            if pause > 0:
                time.sleep(pause)
        self.generation = gen
        for g, p in self._versions(root):
            if g not in (gen, keep):
                shutil.rmtree(p, ignore_errors=True)
        return root / f"v{gen:08d}"

    @classmethod
    def open(
        cls, root: str | os.PathLike, *, config: ContextBankConfig | None = None
    ) -> ContextBank:
        """Load the newest good version under `root`. A version whose files are missing,
        unreadable or fail the checksum is skipped (warning; `bank.recovered` and an audit
        record say which and why); one of another format, version or (with `config`) other
        dims raises ValueError naming the field."""
        root = Path(root)
        versions = cls._versions(root)
        if not versions:
            raise FileNotFoundError(f"{root}: no {FORMAT} versions (v<generation> directories)")
        skipped: list[tuple[str, str]] = []
        for _, path in versions:
            try:
                bank = cls._load_version(path, config)
            except _Corrupt as e:
                skipped.append((path.name, str(e)))
                continue
            bank.root = root
            if skipped:
                bank.recovered = skipped
                warnings.warn(
                    f"{root}: loaded {path.name}, skipped newer corrupt version(s): "
                    + "; ".join(f"{n}: {why}" for n, why in skipped),
                    stacklevel=2,
                )
                bank._audit(
                    "recover",
                    loaded=path.name,
                    skipped=[{"version": n, "reason": w} for n, w in skipped],
                    durable=True,
                )
            return bank
        raise ValueError(
            f"{root}: no readable version: " + "; ".join(f"{n}: {why}" for n, why in skipped)
        )

    @classmethod
    def _load_version(cls, path: Path, expect: ContextBankConfig | None) -> ContextBank:
        try:
            man = read_json(path / "manifest.json")
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise _Corrupt(f"manifest unreadable ({e})") from None
        if not isinstance(man, dict):
            raise _Corrupt("manifest is not a JSON object")
        check_format(man, FORMAT, VERSION, path)
        try:
            tfile = path / man["tensors"]["file"]
            ok = sha256_file(tfile) == man["tensors"]["sha256"]
        except (OSError, KeyError, TypeError) as e:
            raise _Corrupt(f"tensor file unreadable ({e!r})") from None
        if not ok:
            raise _Corrupt(
                f"{tfile.name}: sha256 does not match the manifest (corrupt or truncated)"
            )
        cfg = from_dict(ContextBankConfig, man["config"], where="config")
        for name in ("dim", "n_latent"):
            if man.get(name) != getattr(cfg, name):
                raise ValueError(
                    f"{path}: manifest {name}={man.get(name)!r} "
                    f"disagrees with config {name}={getattr(cfg, name)!r}"
                )
        if expect is not None:
            for name in ("dim", "n_latent", "capacity", "n_clusters", "writer"):
                if getattr(expect, name) != getattr(cfg, name):
                    raise ValueError(
                        f"{path}: bank was written with {name}={getattr(cfg, name)}, expected "
                        f"{name}={getattr(expect, name)}"
                    )
            cfg = expect  # the caller's merge / retrieval settings apply from now on
        t = load_file(str(tfile))
        n = int(man["n_entries"])
        shapes = {
            "tokens": (n, cfg.n_latent, cfg.dim),
            "ids": (n,),
            "centroids": (cfg.n_clusters, cfg.dim),
            "counts": (cfg.n_clusters,),
        }
        for name, shape in shapes.items():
            if name not in t or tuple(t[name].shape) != shape:
                got = tuple(t[name].shape) if name in t else None
                raise ValueError(f"{tfile}: tensor {name} has shape {got}, expected {shape}")
        bank = cls(cfg)
        bank.step, bank.next_id = int(man["step"]), int(man["next_id"])
        bank.stats.update(man["stats"])
        bank.generation = int(man["generation"])
        bank.centroids.copy_(t["centroids"])
        bank.counts.copy_(t["counts"])
        entries = man["entries"]
        if [e["id"] for e in entries] != t["ids"].tolist():
            raise ValueError(f"{path}: entry ids in the manifest disagree with {tfile.name}")
        for k, e in enumerate(entries):
            bank.tokens[e["id"]] = t["tokens"][k].clone()
            bank.meta[e["id"]] = EntryMeta(**e)
        return bank


class _Corrupt(Exception):
    """A version directory that is damaged (as opposed to valid but incompatible)."""
