"""Task scorers: multiple choice by log-likelihood, perplexity, and generation with answer extraction.

Every scorer takes a `RunModel` and a memory mode ("none" = anchor only,
"generic", "fetched") and routes each item exactly as App. B says: the
question/context for multiple choice and generation, the whole document for
perplexity. Items are LLM-Foundry-style dicts:

  multiple choice  {"context": str, "choices": [str, …], "gold": int}   (+ optional "query":
                   the text to route when the context holds more than the question)
  generation       {"context": str, "answer": str}
  perplexity       {"text": str}
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from eval.model import MemoryMode, RunModel


def retrieval_query(item: dict[str, Any]) -> str:
    """The text memories are retrieved with: the question itself, not few-shot examples."""
    return item.get("query", item["context"])


def _paths(rm: RunModel, texts: list[str], mode: MemoryMode, paths: np.ndarray | None) -> np.ndarray | None:
    if mode != "fetched" or not rm.has_memory:
        return None
    return paths if paths is not None else rm.route(texts)


def multiple_choice(rm: RunModel, items: Sequence[dict[str, Any]], *, mode: MemoryMode = "fetched",
                    paths: np.ndarray | None = None, batch_size: int = 16) -> dict[str, Any]:
    """Accuracy of argmax Σ log p(choice | context) (and per-token normalised).

    Returns {"accuracy", "accuracy_norm", "n", "predictions"}."""
    p = _paths(rm, [retrieval_query(it) for it in items], mode, paths)
    seqs, owners, cont_lens = [], [], []
    for i, it in enumerate(items):
        ctx = rm.encode(it["context"])
        if not it["choices"] or not 0 <= int(it["gold"]) < len(it["choices"]):
            raise ValueError(f"item {i}: needs choices and a gold index inside them, got {it}")
        for ch in it["choices"]:
            cont = rm.encode(" " + ch.strip()) if not ch.startswith(" ") else rm.encode(ch)
            seqs.append(ctx + cont)
            owners.append(i)
            cont_lens.append(len(cont))
    scores = np.zeros(len(seqs))
    for s in range(0, len(seqs), batch_size):
        chunk = seqs[s : s + batch_size]
        rows = None if p is None else p[np.asarray(owners[s : s + batch_size])]
        for j, lp in enumerate(rm.logprobs(chunk, paths=rows, mode=mode)):
            scores[s + j] = float(lp[-cont_lens[s + j] :].sum())
    preds, preds_norm, k = [], [], 0
    for it in items:
        n = len(it["choices"])
        sc = scores[k : k + n]
        ln = np.asarray(cont_lens[k : k + n], dtype=float)
        preds.append(int(sc.argmax()))
        preds_norm.append(int((sc / ln).argmax()))
        k += n
    gold = np.asarray([int(it["gold"]) for it in items])
    return {"n": len(items), "accuracy": float((np.asarray(preds) == gold).mean()),
            "accuracy_norm": float((np.asarray(preds_norm) == gold).mean()), "predictions": preds}


def perplexity(rm: RunModel, docs: Sequence[dict[str, Any]], *, mode: MemoryMode = "fetched",
               paths: np.ndarray | None = None, batch_size: int = 8) -> dict[str, Any]:
    """Token-level perplexity over documents (each truncated to the model's context)."""
    p = _paths(rm, [d["text"] for d in docs], mode, paths)
    limit = rm.model.config.max_seq_len
    seqs = [rm.encode(d["text"])[:limit] for d in docs]
    nll, n = 0.0, 0
    for s in range(0, len(seqs), batch_size):
        chunk = seqs[s : s + batch_size]
        keep = [i for i, q in enumerate(chunk) if len(q) >= 2]
        if not keep:
            continue
        rows = None if p is None else p[s : s + batch_size][keep]
        for lp in rm.logprobs([chunk[i] for i in keep], paths=rows, mode=mode):
            nll -= float(lp.sum())
            n += len(lp)
    if n == 0:
        raise ValueError("perplexity: no document has two or more tokens")
    return {"n_docs": len(docs), "tokens": n, "nll": nll / n, "perplexity": math.exp(nll / n)}


INTEGER = re.compile(r"-?\d[\d,]*")


def extract_integer(text: str) -> str | None:
    """The first integer in text, without thousands separators ('5,812 kelvin' → '5812')."""
    m = INTEGER.search(text)
    return m.group(0).replace(",", "") if m else None


def generation(rm: RunModel, items: Sequence[dict[str, Any]], *, mode: MemoryMode = "fetched",
               paths: np.ndarray | None = None, extract: Callable[[str], str | None] = extract_integer,
               max_new_tokens: int = 8) -> dict[str, Any]:
    """Greedy continuation of each context; correct when extract(output) == extract(answer)."""
    p = _paths(rm, [retrieval_query(it) for it in items], mode, paths)
    outputs, correct = [], 0
    for i, it in enumerate(items):
        out = rm.decode(rm.greedy(rm.encode(it["context"]), max_new_tokens=max_new_tokens,
                                  paths=None if p is None else p[i : i + 1], mode=mode, stop=rm.eot_id))
        outputs.append(out)
        got, want = extract(out), extract(it["answer"])
        correct += int(got is not None and got == want)
    return {"n": len(items), "accuracy": correct / max(len(items), 1), "outputs": outputs}


def few_shot(items: Sequence[dict[str, Any]], shots: Sequence[dict[str, Any]], *, sep: str = "\n") -> list[dict]:
    """Prefix each item's context with solved examples (their context + gold answer)."""
    def solved(ex: dict[str, Any]) -> str:
        ans = ex["choices"][int(ex["gold"])] if "choices" in ex else ex["answer"]
        return f"{ex['context']} {ans}"

    prefix = sep.join(solved(s) for s in shots)
    return [{**it, "query": retrieval_query(it), "context": f"{prefix}{sep}{it['context']}" if prefix else it["context"]}
            for it in items]
