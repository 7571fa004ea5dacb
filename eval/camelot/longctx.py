"""Long-context perplexity of a frozen LM with CAMELoT and its baselines (seed 001, Table 2 /
Fig. 3).

`longctx_eval(model, docs, methods=[...], window=L)` runs every long document through the frozen
model window by window (`training.camelot.longdoc.longdoc_token_nll`) once per method:
- "base": each window of L tokens alone;
- "xl": plus the previous window's keys / values (Transformer-XL's cache);
- "memorizing": plus each token's nearest key among the last M tokens (FIFO kNN cache);
- "camelot": plus each token's nearest associative-memory slot (M slots per layer and head).
Each document starts with a fresh memory. It reports, per method, the test perplexity
(exp of the mean next-token NLL over every scored token of every document), its ratio to base's,
and the perplexity against input length: the NLL averaged per bucket of the position t of the
token the prediction is made at (t predicts t + 1), buckets [0, L), [L, 2L), [2L, 4L),
[4L, 8L), … — the first bucket is what every method sees without memory, later ones show what
the memory adds as the document grows (the seed's Fig. 3 analogue). Bucket edges are multiples
of L, so each bucket holds whole windows. With "camelot" among the methods, the CAMELoT
ablations that `CamelotConfig` switches allow (App. A.2.1) run too: no consolidation (every token
novel), no novelty (every token consolidated), no recency (random replacement), no retrieval
(a random slot is read). Documents with fewer than 2 tokens have nothing to predict: they are
skipped and counted.

`write_longctx_report(out_dir, results)` writes results.json, report.md and ppl_vs_length.png
atomically (keys in eval/README.md, "Long-context perplexity").

Long documents from a memtree run (`long_documents`). The bios corpus's documents are ~110
tokens, shorter than one window, so no memory could matter inside one. A "long document" here
is the records sharing a `group_by` key (default "topic", the subtopic; "entity" is the other
natural choice), in file order, each tokenized with the run's tokenizer and joined with its
end-of-text token (the separator the model saw between packed documents). Documents of one
subtopic share its entity kind, vocabulary and often the same entities and facts, so later parts
repeat earlier content and a memory of the earlier windows can help; records without the key
(a real-text JSONL of `{"text": …}`) are each their own long document. Caveat: training masked
attention at document boundaries, so a window spanning two joined documents is already a little
out of distribution for every method alike; the comparison between methods stays fair.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memtree.config import to_dict
from memtree.eval.plots import new_figure, save_png
from memtree.io import atomic_write_json, atomic_write_text, iter_jsonl
from memtree.memstore.camelot.memory import CamelotConfig
from memtree.training.camelot.longdoc import METHODS, check_window, context_limit, longdoc_token_nll

# CamelotConfig switch → ablation name (App. A.2.1); each turns one switch off.
ABLATIONS: dict[str, str] = {
    "consolidation": "camelot-no-consolidation",
    "novelty": "camelot-no-novelty",
    "recency": "camelot-no-recency",
    "retrieval": "camelot-no-retrieval",
}
METHOD_LABEL = {
    "base": "base (window alone)",
    "xl": "Transformer-XL cache",
    "memorizing": "Memorizing (FIFO kNN)",
    "camelot": "CAMELoT",
}


def frozen_lm(model: Any) -> nn.Module:
    """The network to run: a `RunModel`'s anchor, or the model itself (AnchorLM, HF causal LM)."""
    inner = getattr(model, "model", None)
    if not isinstance(model, nn.Module) and isinstance(inner, nn.Module):
        return inner
    if isinstance(model, nn.Module):
        return model
    raise TypeError(f"{type(model).__name__} is neither a RunModel nor a torch model")


def position_buckets(window: int, length: int) -> list[tuple[int, int]]:
    """[0, L), [L, 2L), [2L, 4L), … until `length` (positions ≥ length are never reached)."""
    edges = [0, window]
    while edges[-1] < length:
        edges.append(edges[-1] * 2)
    return list(itertools.pairwise(edges))


def _ppl(sum_nll: float, n: int) -> float | None:
    return math.exp(sum_nll / n) if n else None


def _score(
    model: nn.Module,
    docs: Sequence[torch.Tensor],
    *,
    method: str,
    window: int,
    cfg: CamelotConfig,
    visibility: str,
    sink: int,
    buckets: Sequence[tuple[int, int]],
) -> dict[str, Any]:
    t0 = time.perf_counter()
    sums = [0.0] * len(buckets)
    counts = [0] * len(buckets)
    for ids in docs:
        nll = longdoc_token_nll(
            model, ids, method=method, window=window, cfg=cfg, visibility=visibility, sink=sink
        )
        nll = nll.double().cpu()  # nll[t]: the prediction made at token t (of token t + 1)
        for b, (lo, hi) in enumerate(buckets):
            part = nll[lo:hi]
            sums[b] += float(part.sum())
            counts[b] += int(part.numel())
    total, n = sum(sums), sum(counts)
    return {
        "perplexity": _ppl(total, n),
        "sum_nll": total,
        "n_tokens": n,
        "seconds": round(time.perf_counter() - t0, 3),
        "by_position": [
            {"start": lo, "end": hi, "n_tokens": c, "sum_nll": s, "perplexity": _ppl(s, c)}
            for (lo, hi), s, c in zip(buckets, sums, counts, strict=True)
        ],
    }


def longctx_eval(
    model: Any,
    docs: Iterable[Sequence[int] | torch.Tensor],
    *,
    methods: Sequence[str] = METHODS,
    window: int = 128,
    cfg: CamelotConfig | None = None,
    ablations: bool = True,
    visibility: str = "causal",
    sink: int = 0,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Perplexity per method, per input-length bucket, and CAMELoT's ablations (module docstring).

    model: a `RunModel` (its anchor is used), memtree's AnchorLM or an HF causal LM; it is never
    modified. docs: token-id sequences. cfg: the memories' settings (slots M, threshold R, layers);
    the Memorizing baseline holds the same M entries. ablations: also run the four CAMELoT
    ablations when "camelot" is among `methods`. Ratios are to base's perplexity (None without
    "base" among the methods). sink: the document's first `sink` tokens kept before every later
    window, for every method, base included (`training.camelot.longdoc`, "Attention sink")."""
    methods = list(dict.fromkeys(methods))
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"methods {bad or methods!r}: choose among {list(METHODS)}")
    lm = frozen_lm(model)
    check_window(lm, window, methods, sink)
    cfg = cfg or CamelotConfig()
    kept, skipped, lengths = [], 0, []
    for doc in docs:
        ids = torch.as_tensor(doc, dtype=torch.long).flatten()
        if ids.numel() < 2:
            skipped += 1
            continue
        kept.append(ids)
        lengths.append(int(ids.numel()))
    if not kept:
        raise ValueError(f"no document to score: all {skipped} documents have fewer than 2 tokens")
    buckets = position_buckets(window, max(lengths) - 1)
    runs: list[tuple[str, str, CamelotConfig]] = [(m, m, cfg) for m in methods]
    if ablations and "camelot" in methods:
        runs += [
            (name, "camelot", dataclasses.replace(cfg, **{switch: False}))
            for switch, name in ABLATIONS.items()
        ]
    rows: dict[str, dict[str, Any]] = {}
    for name, method, c in runs:
        rows[name] = _score(
            lm,
            kept,
            method=method,
            window=window,
            cfg=c,
            visibility=visibility,
            sink=sink,
            buckets=buckets,
        )
        if log:
            log(
                f"{name}: perplexity {rows[name]['perplexity']:.4g} ({rows[name]['seconds']:.1f} s)"
            )
    base = rows.get("base", {}).get("perplexity")
    cam = rows.get("camelot", {}).get("perplexity")
    for name, row in rows.items():
        row["ratio_to_base"] = row["perplexity"] / base if base else None
        if name in ABLATIONS.values():
            row["ratio_to_camelot"] = row["perplexity"] / cam if cam else None
    return {
        "window": window,
        "visibility": visibility,
        "sink": sink,
        "camelot_config": to_dict(cfg),
        "context": context_limit(lm),
        "docs": {
            "n_docs": len(kept),
            "skipped_empty": skipped,
            "n_tokens": sum(lengths),
            "min_tokens": min(lengths),
            "mean_tokens": sum(lengths) / len(lengths),
            "max_tokens": max(lengths),
        },
        "buckets": [{"start": lo, "end": hi} for lo, hi in buckets],
        "methods": {m: rows[m] for m in methods},
        "ablations": {n: rows[n] for n in ABLATIONS.values() if n in rows},
    }


# -- documents -------------------------------------------------------------------------------------
def load_records(path: str | Path) -> list[dict[str, Any]]:
    """A JSONL of documents (`{"text": …}` plus any grouping keys); a bad line names file:line."""
    records = []
    for line_no, rec in iter_jsonl(path):
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise ValueError(f"{path}:{line_no}: expected an object with a string 'text'")  # noqa: TRY004
        records.append(rec)
    return records


def group_key(
    records: Sequence[dict[str, Any]], group_by: str | None, path: str | Path
) -> str | None:
    """The key `memtree eval longctx --group-by` joins records by, checked against the records: a
    key some record lacks is refused, naming the record (a record without it would be scored alone
    while the report says grouped). None (not given): `topic` when every record has one, no grouping
    when none has; "none": no grouping."""
    if group_by == "none":
        return None
    key = group_by or "topic"
    lacking = [i for i, r in enumerate(records) if r.get(key) is None]
    if group_by is None and len(lacking) == len(records):
        return None
    if lacking:
        i = lacking[0]
        rid = f" (id {records[i]['id']!r})" if "id" in records[i] else ""
        keys = sorted({k for r in records for k in r} - {"text", "id"})
        raise ValueError(
            f"--group-by {key}: record {i + 1}{rid} of {path} has no {key!r} "
            f"({len(lacking)} of {len(records)} records lack it; keys the records have: {keys}); "
            "pass --group-by KEY that every record has, or --group-by none"
        )
    return key


def long_documents(
    records: Iterable[dict[str, Any]],
    encode: Callable[[str], list[int]],
    *,
    group_by: str | None = "topic",
    separator: int | None = None,
    max_docs: int = 0,
) -> tuple[list[str], list[list[int]]]:
    """(keys, token sequences): the records sharing `group_by`'s value joined in file order, each
    record's tokens followed by `separator` (the end-of-text id) except the last; records without
    the key (or group_by None) stand alone, keyed by their id or line. Groups are in order of first
    appearance; max_docs > 0 keeps the first max_docs. Empty texts give empty parts, so a group of
    only empty records is an empty document (skipped and counted by `longctx_eval`)."""
    groups: dict[str, list[list[int]]] = {}
    for i, rec in enumerate(records):
        value = rec.get(group_by) if group_by else None
        key = f"{group_by}={value}" if value is not None else f"doc={rec.get('id', i)}"
        groups.setdefault(key, []).append(list(encode(rec["text"])) if rec["text"] else [])
    keys, docs = [], []
    for key, parts in groups.items():
        ids: list[int] = []
        for part in (p for p in parts if p):
            if ids and separator is not None:
                ids.append(separator)
            ids.extend(part)
        keys.append(key)
        docs.append(ids)
        if max_docs and len(docs) == max_docs:
            break
    return keys, docs


# -- report ----------------------------------------------------------------------------------------
def _bucket_label(b: dict[str, Any]) -> str:
    return f"{b['start']}-{b['end']}"


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "—" if v is None else format(v, spec)


def write_longctx_report(
    out_dir: str | Path, results: dict[str, Any], meta: dict[str, Any] | None = None
) -> dict[str, str]:
    """OUT/results.json ({"meta", "longctx": results}), OUT/report.md, OUT/ppl_vs_length.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    r, d = results, results["docs"]
    rows = {**r["methods"], **r["ablations"]}
    cfg = r["camelot_config"]
    lines = ["# memtree long-context evaluation (CAMELoT, seed 001)", ""]
    lines += [f"- {k}: {v}" for k, v in (meta or {}).items()]
    sink = r.get("sink", 0)
    lines += [
        (
            f"- window L = {r['window']} tokens (model context {r['context']}), visibility "
            f"{r['visibility']}"
        ),
        (
            f"- attention sink: the document's first {sink} tokens before every later window, "
            "every method (base = window + sink)"
            if sink
            else "- no attention sink (the seed's setting)"
        ),
        (
            f"- memory: M = {cfg['slots']} slots per layer and KV head, R = {cfg['threshold']}, "
            f"layers {cfg['layers'] if cfg['layers'] is not None else 'all'}"
        ),
        (
            f"- documents: {d['n_docs']} scored ({d['n_tokens']} tokens; "
            f"{d['min_tokens']}–{d['max_tokens']}, mean {d['mean_tokens']:.0f} per document), "
            f"{d['skipped_empty']} empty skipped"
        ),
        "",
        "## Perplexity",
        "",
        "| method | perplexity | ratio to base | tokens | seconds |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {METHOD_LABEL.get(name, name)} | {_fmt(row['perplexity'])} | "
            f"{_fmt(row['ratio_to_base'], '.4f')} | {row['n_tokens']} | {row['seconds']:.1f} |"
        )
    labels = [_bucket_label(b) for b in r["buckets"]]
    lines += [
        "",
        ("## Perplexity against input length (Fig. 3 analogue)"),
        "",
        "NLL averaged over the predictions made at positions in each bucket of the long document.",
        "",
        "| method | " + " | ".join(labels) + " |",
        "|---|" + "---:|" * len(labels),
    ]
    for name, row in rows.items():
        lines.append(
            f"| {METHOD_LABEL.get(name, name)} | "
            + " | ".join(_fmt(b["perplexity"]) for b in row["by_position"])
            + " |"
        )
    fig = new_figure()
    ax = fig.add_subplot()
    for name, row in rows.items():
        xs = [i for i, b in enumerate(row["by_position"]) if b["perplexity"] is not None]
        ax.plot(
            xs,
            [row["by_position"][i]["perplexity"] for i in xs],
            marker="o",
            ls="--" if name in r["ablations"] else "-",
            label=METHOD_LABEL.get(name, name),
        )
    ax.set_xticks(range(len(labels)), labels, rotation=30, fontsize=7)
    ax.set_xlabel("position in the long document (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"Perplexity vs input length, window L = {r['window']}")
    ax.legend(fontsize=7)
    png = out / "ppl_vs_length.png"
    save_png(fig, png)
    atomic_write_json(out / "results.json", {"meta": meta or {}, "longctx": results})
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    return {"json": str(out / "results.json"), "markdown": str(out / "report.md"), "png": str(png)}
