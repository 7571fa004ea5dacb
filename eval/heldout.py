"""Held-out scoring shared by the real-text and forgetting experiments (`eval.realtext`,
`eval.forgetting`): pages cut into windows, each window's nll, per-page sums, and paired intervals
(per probe or per page) between two settings scored on the same items."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from memtree.eval.model import RunModel

Z95 = 1.959963984540054


def paired_interval(a: Sequence[bool], b: Sequence[bool], z: float = 1.96) -> dict[str, Any]:
    """Paired difference of two rows' per-probe correctness on the same probes: mean of d = a - b
    and its normal-approximation interval mean ± z · sd(d) / √n (sample sd, n - 1); None when
    n < 2."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    n = len(d)
    if n == 0:
        return {"n": 0, "diff": None, "ci95": None}
    mean = float(d.mean())
    if n < 2:
        return {"n": n, "diff": mean, "ci95": None}
    half = z * float(d.std(ddof=1)) / math.sqrt(n)
    return {"n": n, "diff": mean, "ci95": [mean - half, mean + half]}


def heldout_windows(
    rm: RunModel, docs: Sequence[dict[str, Any]], window_tokens: int
) -> list[dict[str, Any]]:
    """Each document's tokens cut into windows of ≤ window_tokens: {"doc": index, "ids", "text"}.
    Windows shorter than 2 tokens score nothing and are left out (counted by `score_run`'s
    caller)."""
    limit = min(window_tokens, rm.max_seq_len)
    out = []
    for i, d in enumerate(docs):
        if "text" not in d:
            raise ValueError(f"held-out document {i}: no 'text' field")
        ids = rm.encode(d["text"])
        for s in range(0, len(ids), limit):
            piece = ids[s : s + limit]
            if len(piece) >= 2:
                out.append({"doc": i, "ids": piece, "text": rm.decode(piece)})
    return out


def window_nll(
    rm: RunModel,
    windows: Sequence[dict[str, Any]],
    *,
    mode: str,
    paths: np.ndarray | None,
    batch_size: int = 16,
) -> np.ndarray:
    """Σ −log p over each window's tokens after the first: (n_windows,) float64."""
    out = np.zeros(len(windows))
    for s in range(0, len(windows), batch_size):
        chunk = windows[s : s + batch_size]
        rows = None if paths is None else paths[s : s + batch_size]
        for j, lp in enumerate(rm.logprobs([w["ids"] for w in chunk], paths=rows, mode=mode)):
            out[s + j] = -float(lp.double().sum())
    return out


def per_doc(
    windows: Sequence[dict[str, Any]], nll: np.ndarray, n_docs: int
) -> tuple[np.ndarray, np.ndarray]:
    """(Σ nll, tokens scored) per document."""
    doc = np.array([w["doc"] for w in windows])
    tok = np.array([len(w["ids"]) - 1 for w in windows], dtype=np.float64)
    return np.bincount(doc, nll, minlength=n_docs), np.bincount(doc, tok, minlength=n_docs)


def paired_doc_interval(a: np.ndarray, b: np.ndarray, tokens: np.ndarray) -> dict[str, Any]:
    """Δ nll/token (a − b) per document, its mean and a normal-approximation 95 % interval on the
    mean over documents (`paired_interval`; documents with no scored token left out)."""
    keep = tokens > 0
    p = paired_interval(a[keep] / tokens[keep], b[keep] / tokens[keep], z=Z95)
    out = {"n_docs": p["n"], "mean": p["diff"], "ci95": p["ci95"]}
    if p["ci95"] is not None:
        out["worse_docs"] = int((a[keep] / tokens[keep] > b[keep] / tokens[keep]).sum())
    return out
