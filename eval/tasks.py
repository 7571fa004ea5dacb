"""Task scorers: multiple choice and schema by log-likelihood, perplexity, and generation with
answer extraction.

Every scorer takes a `RunModel` and a memory mode ("none" = anchor only,
"generic", "fetched") and routes each item exactly as App. B says: the
question/context for multiple choice and generation, the options' common
prefix for schema tasks, the whole document for perplexity. Items are LLM-Foundry-style dicts:

  multiple choice  {"context": str, "choices": [str, …], "gold": int}   (+ optional "query":
                   the text to route when the context holds more than the question)
  schema           {"context_options": [str, …], "continuation": str, "gold": int}   (+ optional
  "query") generation       {"context": str, "answer": str}
  perplexity       {"text": str}

Schema items are routed with the part of the text every option shares (App. B):
their longest common prefix, cut back to a word boundary so a half-word does not
steer the embedding; when the options share nothing, the continuation.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from memtree.eval.model import MemoryMode, RunModel


def retrieval_query(item: dict[str, Any]) -> str:
    """The text memories are retrieved with: the question itself, not few-shot examples."""
    if "query" in item:
        return item["query"]
    if "context_options" in item:
        return schema_query(item["context_options"], item["continuation"])
    return item["context"]


def schema_query(options: Sequence[str], continuation: str) -> str:
    """The options' longest common prefix (whole words only), or the continuation when it is
    empty."""
    prefix = os.path.commonprefix(list(options))
    if any(len(o) > len(prefix) and not o[len(prefix)].isspace() for o in options):
        prefix = re.sub(r"\S+$", "", prefix)  # the prefix ends inside a word: drop that word
    return prefix.strip() or continuation.strip()


def _paths(
    rm: RunModel, texts: list[str], mode: MemoryMode, paths: np.ndarray | None
) -> np.ndarray | None:
    if mode != "fetched" or not rm.has_memory:
        return None
    return paths if paths is not None else rm.route(texts)


def _continuation(rm: RunModel, text: str) -> list[int]:
    return rm.encode(text) if text.startswith(" ") else rm.encode(" " + text.strip())


def _ranked(
    rm: RunModel,
    items: Sequence[dict[str, Any]],
    pairs: list[list[tuple[list[int], list[int]]]],
    p: np.ndarray | None,
    mode: MemoryMode,
    batch_size: int,
) -> dict[str, Any]:
    """Score each item's (context, continuation) pairs by Σ log p(continuation | context); pick the
    best.

    Scored through `RunModel.choice_scores`, batch_size units per forward: an item whose options
    share one context (multiple choice) is one unit, all its continuations in one row; otherwise
    (schema) every pair is its own unit."""
    cont_lens = [len(cont) for options in pairs for _, cont in options]
    if all(ctx == options[0][0] for options in pairs for ctx, _ in options):
        units = [(options[0][0], [cont for _, cont in options]) for options in pairs]
        owners = list(range(len(pairs)))
    else:
        units = [(ctx, [cont]) for options in pairs for ctx, cont in options]
        owners = [i for i, options in enumerate(pairs) for _ in options]
    flat: list[float] = []
    for s in range(0, len(units), batch_size):
        rows = None if p is None else p[np.asarray(owners[s : s + batch_size])]
        flat += [
            sc
            for unit in rm.choice_scores(units[s : s + batch_size], paths=rows, mode=mode)
            for sc in unit
        ]
    scores = np.asarray(flat)
    preds, preds_norm, per_item, k = [], [], [], 0
    for options in pairs:
        sc = scores[k : k + len(options)]
        ln = np.asarray(cont_lens[k : k + len(options)], dtype=float)
        preds.append(int(sc.argmax()))
        preds_norm.append(int((sc / ln).argmax()))
        per_item.append(sc.tolist())
        k += len(options)
    gold = np.asarray([int(it["gold"]) for it in items])
    correct, correct_norm = np.asarray(preds) == gold, np.asarray(preds_norm) == gold
    return {
        "n": len(items),
        "accuracy": float(correct.mean()),
        "accuracy_norm": float(correct_norm.mean()),
        "predictions": preds,
        "predictions_norm": preds_norm,
        "scores": per_item,
        "correct": correct.tolist(),
        "correct_norm": correct_norm.tolist(),
    }


def _check_gold(i: int, it: dict[str, Any], options_key: str) -> None:
    if not it[options_key] or not 0 <= int(it["gold"]) < len(it[options_key]):
        raise ValueError(f"item {i}: needs {options_key} and a gold index inside them, got {it}")


def multiple_choice(
    rm: RunModel,
    items: Sequence[dict[str, Any]],
    *,
    mode: MemoryMode = "fetched",
    paths: np.ndarray | None = None,
    batch_size: int = 16,
) -> dict[str, Any]:
    """Accuracy of argmax Σ log p(choice | context) (and per-token normalised).

    Returns {"accuracy", "accuracy_norm", "n", "predictions", "scores"} (scores: per item, per
    choice)."""
    p = _paths(rm, [retrieval_query(it) for it in items], mode, paths)
    pairs = []
    for i, it in enumerate(items):
        _check_gold(i, it, "choices")
        ctx = rm.encode(it["context"])
        pairs.append([(ctx, _continuation(rm, ch)) for ch in it["choices"]])
    return _ranked(rm, items, pairs, p, mode, batch_size)


def schema(
    rm: RunModel,
    items: Sequence[dict[str, Any]],
    *,
    mode: MemoryMode = "fetched",
    paths: np.ndarray | None = None,
    batch_size: int = 16,
) -> dict[str, Any]:
    """Accuracy of argmax Σ log p(continuation | context option) (and per-token normalised).

    Memories are fetched with `retrieval_query` (the options' common prefix). Returns the same
    keys as `multiple_choice`; scores are per item, per context option."""
    p = _paths(rm, [retrieval_query(it) for it in items], mode, paths)
    pairs = []
    for i, it in enumerate(items):
        _check_gold(i, it, "context_options")
        cont = _continuation(rm, it["continuation"])
        pairs.append([(rm.encode(opt), cont) for opt in it["context_options"]])
    return _ranked(rm, items, pairs, p, mode, batch_size)


def perplexity(
    rm: RunModel,
    docs: Sequence[dict[str, Any]],
    *,
    mode: MemoryMode = "fetched",
    paths: np.ndarray | None = None,
    batch_size: int = 8,
) -> dict[str, Any]:
    """Token-level perplexity over documents (each truncated to the model's context)."""
    p = _paths(rm, [d["text"] for d in docs], mode, paths)
    limit = rm.max_seq_len
    seqs = [rm.encode(d["text"])[:limit] for d in docs]
    return {
        "n_docs": len(docs),
        **sequence_perplexity(rm, seqs, mode=mode, paths=p, batch_size=batch_size),
    }


def sequence_perplexity(
    rm: RunModel,
    seqs: Sequence[list[int]],
    *,
    mode: MemoryMode = "none",
    paths: np.ndarray | None = None,
    batch_size: int = 8,
) -> dict[str, Any]:
    """Token-level perplexity over token sequences, each within the model's context (text already
    cut into pieces); paths (n, L): each sequence's route, for fetched memories. Per sequence
    too: "seq_nll" (summed) and "seq_tokens" (0 for a sequence under two tokens), which
    `gated_result` combines."""
    seq_nll, seq_tokens = [0.0] * len(seqs), [0] * len(seqs)
    for s in range(0, len(seqs), batch_size):
        chunk = seqs[s : s + batch_size]
        keep = [i for i, q in enumerate(chunk) if len(q) >= 2]
        if not keep:
            continue
        rows = None if paths is None else paths[s : s + batch_size][keep]
        for i, lp in zip(keep, rm.logprobs([chunk[i] for i in keep], paths=rows, mode=mode)):
            seq_nll[s + i], seq_tokens[s + i] = -float(lp.sum()), len(lp)
    return _perplexity_of(seq_nll, seq_tokens)


def _perplexity_of(seq_nll: Sequence[float], seq_tokens: Sequence[int]) -> dict[str, Any]:
    n = int(sum(seq_tokens))
    if n == 0:
        raise ValueError("perplexity: no document has two or more tokens")
    nll = float(sum(seq_nll)) / n
    return {
        "tokens": n,
        "nll": nll,
        "perplexity": math.exp(nll),
        "seq_nll": list(seq_nll),
        "seq_tokens": list(seq_tokens),
    }


# per-item fields of the scorers' results, which `gated_result` reads (reports leave them out)
PER_ITEM = ("scores", "correct", "correct_norm", "predictions_norm", "seq_nll", "seq_tokens")


def gated_result(
    none: dict[str, Any], fetched: dict[str, Any], admitted: np.ndarray
) -> dict[str, Any]:
    """A scorer's result with the domain gate (`memtree.clustering.gate`): item i as scored with
    fetched memory where admitted[i], as scored by the anchor alone elsewhere, so no extra
    forward pass is needed. `none` and `fetched`: the same scorer's results on the same items
    (multiple choice / schema, generation or perplexity). Adds "admitted": how many items read
    memory."""
    adm = np.asarray(admitted, dtype=bool)

    def pick(key: str) -> list:
        a, b = none[key], fetched[key]
        if len(a) != len(adm) or len(b) != len(adm):
            raise ValueError(f"gated_result: {key} holds {len(a)}/{len(b)} items, gate {len(adm)}")
        return [bv if g else av for av, bv, g in zip(a, b, adm.tolist())]

    if "seq_nll" in none:
        out = {k: v for k, v in none.items() if k not in ("seq_nll", "seq_tokens")}
        out.update(_perplexity_of(pick("seq_nll"), pick("seq_tokens")))
    else:
        out = dict(none)
        per_item = (
            "predictions",
            "predictions_norm",
            "scores",
            "correct",
            "correct_norm",
            "outputs",
        )
        for key in per_item:
            if key in none:
                out[key] = pick(key)
        out["accuracy"] = float(np.mean(out["correct"])) if len(adm) else 0.0
        if "correct_norm" in out:
            out["accuracy_norm"] = float(np.mean(out["correct_norm"])) if len(adm) else 0.0
    out["admitted"] = int(adm.sum())
    return out


INTEGER = re.compile(r"-?\d[\d,]*")


def extract_integer(text: str) -> str | None:
    """The first integer in text, without thousands separators ('5,812 kelvin' → '5812')."""
    m = INTEGER.search(text)
    return m.group(0).replace(",", "") if m else None


def generation(
    rm: RunModel,
    items: Sequence[dict[str, Any]],
    *,
    mode: MemoryMode = "fetched",
    paths: np.ndarray | None = None,
    extract: Callable[[str], str | None] = extract_integer,
    max_new_tokens: int = 8,
) -> dict[str, Any]:
    """Greedy continuation of each context; correct when extract(output) == extract(answer)."""
    p = _paths(rm, [retrieval_query(it) for it in items], mode, paths)
    outputs, correct = [], []
    for i, it in enumerate(items):
        out = rm.decode(
            rm.greedy(
                rm.encode(it["context"]),
                max_new_tokens=max_new_tokens,
                paths=None if p is None else p[i : i + 1],
                mode=mode,
                stop=rm.eot_id,
            )
        )
        outputs.append(out)
        got, want = extract(out), extract(it["answer"])
        correct.append(got is not None and got == want)
    return {
        "n": len(items),
        "accuracy": sum(correct) / max(len(items), 1),
        "outputs": outputs,
        "correct": correct,
    }


def few_shot(
    items: Sequence[dict[str, Any]], shots: Sequence[dict[str, Any]], *, sep: str = "\n"
) -> list[dict]:
    """Prefix each item's context (each context option, for schema items) with solved examples."""

    def solved(ex: dict[str, Any]) -> str:
        if "context_options" in ex:
            return f"{ex['context_options'][int(ex['gold'])]} {ex['continuation'].strip()}"
        ans = ex["choices"][int(ex["gold"])] if "choices" in ex else ex["answer"]
        return f"{ex['context']} {ans}"

    prefix = sep.join(solved(s) for s in shots)

    def shot(text: str) -> str:
        return f"{prefix}{sep}{text}" if prefix else text

    out = []
    for it in items:
        if "context_options" in it:  # schema: every option gets the examples
            options = [shot(o) for o in it["context_options"]]
            out.append({**it, "query": retrieval_query(it), "context_options": options})
        else:
            out.append({**it, "query": retrieval_query(it), "context": shot(it["context"])})
    return out
