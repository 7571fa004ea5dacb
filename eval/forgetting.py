"""Forgetting by data owner: block every block a set of documents trained and measure what is gone.

Seed 002 links the ownership of training tokens to the memories they trained, so that an owner's
data can be removed by blocking those memories. `forgetting_eval` does that on the open store only
(the bank on disk is untouched): the blocks come from the pipeline run's assignments
(`memstore.ownership`, as `memtree memstore block --documents` chooses them), and it scores

- **facts**: the facts stated only in the owner's documents (the *owner's facts*) against every
  other fact, with fetched memory before and after, the generic memory beside them (what a blocked
  block falls back to with fallback "generic"), and a random control: as many blocks per level,
  so the same bank fraction, drawn among the blocks the owner's set left open;
- **held-out pages**: perplexity of the owner's held-out pages (records whose `owner_field`, e.g.
  `source` or `entity`, takes a value the owner's documents have in the ingest's kept fields)
  against everyone else's, the same four ways, each page cut into windows routed by their own text.

A document states a fact when its text holds the fact's clause "the {label} of {reference} is
{value}" (case and spacing folded): the form the probes ask in, which every statement of the bios
corpus contains (`pipeline.corpus.bios.canonical_clause`). A fact phrased otherwise can list its
stating documents' ids in `documents`. The counts found are checked against the facts' `mentions`
where the corpus is the one they were counted on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from memtree.eval.heldout import heldout_windows, paired_doc_interval, per_doc, window_nll
from memtree.eval.longtail import wilson
from memtree.eval.model import RunModel
from memtree.eval.plots import new_figure, save_png
from memtree.eval.tasks import multiple_choice
from memtree.memstore.ownership import (
    check_found,
    check_min_share,
    check_run_tree,
    ingest_tables,
    owner_hash,
    owner_report,
    owner_shares,
    owner_table,
    owner_targets,
)

GROUPS = (
    "owner",
    "shared",
    "others_only",
    "unstated",
)  # by who states the fact; "others" = all but owner
GROUP_TEXT = {
    "owner": "stated only in the owner's documents",
    "shared": "stated in the owner's and others'",
    "others_only": "stated only in others' documents",
    "unstated": "stated in no document",
}


def _fold(text: str) -> str:
    return " ".join(text.lower().split())


def fact_clause(fact: Mapping[str, Any]) -> str:
    return _fold(f"the {fact['label']} of {fact['reference']} is {fact['value']}")


def fact_statements(
    facts: Sequence[Mapping[str, Any]], run: str | Path, owner_ids: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    """Documents of the pipeline run stating each fact: (owner's, everyone else's), each
    (n_facts,) int64.

    Reads the ingest's texts part by part; a fact is looked for only in documents naming its
    reference, so the cost is (documents × distinct references) substring tests."""
    owner_set = set(owner_ids)
    clauses = [fact_clause(f) for f in facts]
    by_ref: dict[str, list[int]] = {}
    listed: dict[str, list[int]] = {}
    for i, f in enumerate(facts):
        if f.get("documents") is not None:
            for d in f["documents"]:
                listed.setdefault(str(d), []).append(i)
        else:
            by_ref.setdefault(_fold(str(f["reference"])), []).append(i)
    mine = np.zeros(len(facts), dtype=np.int64)
    theirs = np.zeros(len(facts), dtype=np.int64)
    for t in ingest_tables(run, ["doc_id", "text"]):
        for doc_id, text in zip(t["doc_id"].to_pylist(), t["text"].to_pylist(), strict=True):
            s = _fold(text)
            hit = set(listed.get(doc_id, ()))
            for ref, idx in by_ref.items():
                if ref in s:
                    hit.update(i for i in idx if clauses[i] in s)
            if hit:
                (mine if doc_id in owner_set else theirs)[sorted(hit)] += 1
    return mine, theirs


def owner_values(run: str | Path, owner_ids: Sequence[str], field: str) -> set[str]:
    """The values `field` takes among the owner's documents (the ingest's `meta`, its kept
    fields)."""
    import json

    owner_set, values, kept = set(owner_ids), set(), set()
    for t in ingest_tables(run, ["doc_id", "meta"]):
        for doc_id, meta in zip(t["doc_id"].to_pylist(), t["meta"].to_pylist(), strict=True):
            if doc_id in owner_set:
                m = json.loads(meta) if meta else {}
                kept.update(m)
                if field in m:
                    values.add(str(m[field]))
    if not values:
        raise ValueError(
            f"--owner-field {field}: the owner's documents carry no {field!r} in the pipeline run "
            f"{run} (its ingest kept {sorted(kept) or 'no fields'}: ingest.keep_fields)"
        )
    return values


def random_targets(
    held: Mapping[int, tuple[int, int]], like: Mapping[int, Sequence[int]], seed: int
) -> tuple[dict[int, list[int]] | None, str]:
    """The control: as many blocks per level as `like`, drawn uniformly among the level's blocks not
    in it. (None, why) when the owner's blocks are more than half a level: no disjoint draw of their
    size."""
    rng = np.random.default_rng(seed)
    out = {}
    for lv, (first, n) in sorted(held.items()):
        k = len(like.get(lv, ()))
        pool = np.setdiff1d(
            np.arange(first, first + n), np.asarray(like.get(lv, ()), dtype=np.int64)
        )
        if k > len(pool):
            return None, (
                f"no random control: the owner's {k} blocks at level {lv} leave only {len(pool)} "
                f"of the level's {n} open (raise --min-share)"
            )
        out[lv] = sorted(rng.choice(pool, size=k, replace=False).tolist())
    return out, ""


def _block(store, targets: Mapping[int, Sequence[int]]) -> None:
    for lv, ids in targets.items():
        if ids:
            store.block(lv, ids, persist=False)


def _acc(ok: np.ndarray | None, mask: np.ndarray) -> dict[str, Any]:
    if ok is None:  # a setting not run (no random control)
        return {"n": int(mask.sum()), "accuracy": None, "ci95": None}
    n, k = int(mask.sum()), int(ok[mask].sum())
    return {"n": n, "accuracy": k / n if n else None, "ci95": list(wilson(k, n)) if n else None}


def plan_forgetting(
    rm: RunModel,
    *,
    run: str | Path,
    ids: Sequence[str],
    documents: str | Path = "",
    name: str = "",
    min_share: float = 0.0,
    seed: int = 0,
    allow_missing: bool = False,
    owner_field: str | None = None,
    log=None,
) -> dict[str, Any]:
    """What forgetting the documents `ids` blocks: every block they trained with a share >=
    `min_share` at every level holding memory, the random control, the per-level table, and
    (`owner_field`) the values naming the owner's held-out pages. Everything that can be refused is
    checked here, before anything is scored. `documents` names the id list in messages."""
    if not rm.has_memory:
        raise ValueError("--block-documents: the run has no memory bank to block")
    store = rm.store
    tree_id = check_run_tree(run, store.info.tree_id, store.root, flag="--pipeline-run")
    min_share = check_min_share(min_share)
    if not ids:
        raise ValueError(f"--block-documents {documents}: no document ids")
    shares = owner_shares(run, ids, sorted(store.levels), store.info.memory.branching)
    missing = check_found(
        shares,
        ids,
        documents=documents,
        run=run,
        allow_missing=allow_missing,
        flag="--block-documents",
    )
    if missing and log:
        log(missing)
    held = {lv: (L.info.first_cluster, L.info.n_blocks) for lv, L in store.levels.items()}
    targets = owner_targets(shares, held, min_share)
    control, why = random_targets(held, targets, seed)
    if why and log:
        log(why)
    report = owner_report(shares, targets, store.info)
    total = sum(L.info.n_blocks * L.info.params for L in store.levels.values())
    return {
        "name": name or f"{len(shares.found)} documents",
        "documents": str(documents),
        "owner_sha256": owner_hash(ids),
        "min_share": min_share,
        "pipeline_run": str(Path(run).resolve()),
        "tree_id": tree_id,
        "seed": seed,
        "blocks": report,
        "table": owner_table(report),
        "bank_fraction": report["bank_fraction"],
        "targets": {str(lv): v for lv, v in targets.items()},
        "random": (
            {"targets": None, "bank_fraction": None, "why": why}
            if control is None
            else {
                "targets": {str(lv): v for lv, v in control.items()},
                "bank_fraction": sum(
                    len(v) * store.levels[lv].info.params for lv, v in control.items()
                )
                / total,
            }
        ),
        "owner_field": owner_field,
        "owner_values": sorted(owner_values(run, shares.found, owner_field))
        if owner_field
        else None,
        "_ids": list(shares.found),
        "_run": Path(run),
    }


def forgetting_eval(
    rm: RunModel,
    plan: Mapping[str, Any],
    *,
    probes: Sequence[dict[str, Any]] = (),
    facts: Sequence[Mapping[str, Any]] = (),
    held_out: Sequence[dict[str, Any]] = (),
    fallback: str | None = None,
    predictions: Mapping[str, Sequence[int]] | None = None,
    paths: np.ndarray | None = None,
    window_tokens: int | None = None,
    unblocked: dict[Any, Any] | None = None,
    log=None,
) -> dict[str, Any]:
    """Score `plan_forgetting`'s plan: the owner's facts against the others (`probes`, built from
    `facts` by eval.longtail.build_probes), and the owner's held-out pages against the others'
    (needs the plan's `owner_field`), before / after / random control, beside the generic memory.
    `predictions` may hold the probes' "fetched" and "generic" predictions already made
    (knowledge_eval's, on the same bank policy) and `paths` the probes' routed paths (its "paths"),
    so they are not scored or routed again. `unblocked`: a dict shared by calls on the same `rm` and
    `held_out` (the demo's owners, one after another): the held-out pages' generic and unblocked
    fetched scores are kept in it by the first call and read by the next, whose blocks do not
    change them."""
    store = rm.store
    say = log or (lambda _msg: None)
    out = {k: v for k, v in plan.items() if not k.startswith("_")}
    ids, run = plan["_ids"], plan["_run"]
    targets = {int(lv): v for lv, v in plan["targets"].items()}
    control = plan["random"]["targets"] and {
        int(lv): v for lv, v in plan["random"]["targets"].items()
    }
    if held_out and not plan["owner_field"]:
        raise ValueError(
            "held-out pages need --owner-field FIELD to tell the owner's pages from the others'"
        )
    with store.experiment(fallback=fallback):
        out["fallback"] = store.policy["fallback"]
        if probes:
            say(
                f"{out['name']}: scoring {len(probes)} probes with the owner's blocks and the "
                "control blocked"
            )
            # the caller may have counted the statements already (`_statements`, the CLI's check)
            statements = plan.get("_statements") or fact_statements(facts, run, ids)
            out["facts"] = _facts_part(
                rm, probes, facts, statements, targets, control, predictions or {}, paths
            )
        if held_out:
            say(f"{out['name']}: scoring {len(held_out)} held-out pages the same ways")
            out["held_out"] = _held_out_part(
                rm,
                held_out,
                set(plan["owner_values"]),
                plan["owner_field"],
                targets,
                control,
                window_tokens,
                {} if unblocked is None else unblocked,
            )
    return out


def probe_facts(
    probes: Sequence[Mapping[str, Any]], facts: Sequence[Mapping[str, Any]]
) -> np.ndarray:
    """The index into `facts` of the fact each probe asks, (n_probes,) int64."""
    key = {
        (_fold(f"The {f['label']} of {f['reference']} is"), _fold(str(f["value"]))): i
        for i, f in enumerate(facts)
    }
    idx = []
    for p in probes:
        k = (_fold(p["context"]), _fold(p["choices"][p["gold"]]))
        if k not in key:
            raise ValueError(
                f"probe {p['context']!r}: no fact of the facts file asks it (probes must come from "
                "the same facts)"
            )
        idx.append(key[k])
    return np.asarray(idx, dtype=np.int64)


def owner_probe_count(
    probes: Sequence[Mapping[str, Any]],
    facts: Sequence[Mapping[str, Any]],
    statements: tuple[np.ndarray, np.ndarray],
) -> int:
    """How many of `probes` ask a fact only the owner's documents state (`statements`:
    fact_statements' counts): with none, the owner's row of the report would be empty (an evenly
    spread --max-probes subset can miss them all)."""
    if not probes:
        return 0
    mine, theirs = statements
    idx = probe_facts(probes, facts)
    return int(((mine[idx] > 0) & (theirs[idx] == 0)).sum())


def _facts_part(
    rm: RunModel, probes, facts, statements, targets, control, given, paths
) -> dict[str, Any]:
    mine, theirs = statements
    idx = probe_facts(probes, facts)
    m, o = mine[idx], theirs[idx]
    group = {
        "owner": (m > 0) & (o == 0),
        "shared": (m > 0) & (o > 0),
        "others_only": (m == 0) & (o > 0),
        "unstated": (m == 0) & (o == 0),
    }
    group["others"] = ~group["owner"]
    gold = np.asarray([p["gold"] for p in probes])
    paths = rm.route([p["context"] for p in probes]) if paths is None else np.asarray(paths)

    def score(mode: str) -> np.ndarray:
        return np.asarray(multiple_choice(rm, probes, mode=mode, paths=paths)["predictions"])

    pred = {k: np.asarray(given[k]) if k in given else score(k) for k in ("fetched", "generic")}
    for name, t in (("after", targets), ("random", control)):
        if t is None:
            continue
        with rm.store.experiment():
            _block(rm.store, t)
            pred[name] = score("fetched")
    ok = {k: v == gold for k, v in pred.items()}
    ok.setdefault("random", None)
    touched = np.zeros(
        len(probes), dtype=bool
    )  # the probe's path reads a block the owner's set blocks
    for lv, c in targets.items():
        touched |= np.isin(paths[:, lv - 1], c)
    with_mentions = [
        i for i, f in enumerate(facts) if "mentions" in f and f.get("documents") is None
    ]
    disagree = [i for i in with_mentions if mine[i] + theirs[i] != int(facts[i]["mentions"])]
    owner_rows = [
        {
            "question": probes[i]["context"],
            "answer": probes[i]["choices"][probes[i]["gold"]],
            "reads_blocked": bool(touched[i]),
            **{
                "before" if k == "fetched" else k: probes[i]["choices"][int(v[i])]
                for k, v in pred.items()
            },
        }
        for i in np.flatnonzero(group["owner"])
    ]
    return {
        "n_probes": len(probes),
        "n": {g: int(v.sum()) for g, v in group.items()},
        "owner_probes": owner_rows,
        "accuracy": {
            g: {
                "generic": _acc(ok["generic"], v),
                "before": _acc(ok["fetched"], v),
                "after": _acc(ok["after"], v),
                "random": _acc(ok["random"], v),
            }
            for g, v in group.items()
        },
        "owner_routed_to_blocked": float(touched[group["owner"]].mean())
        if group["owner"].any()
        else None,
        "untouched_predictions_changed": int((pred["after"] != pred["fetched"])[~touched].sum()),
        "statements_checked": len(with_mentions),
        "statements_disagree": len(disagree),
        "statements_disagree_first": [facts[i].get("reference") for i in disagree[:5]],
    }


def _held_out_part(
    rm: RunModel, docs, values: set[str], field, targets, control, window_tokens, unblocked
) -> dict[str, Any]:
    lacking = [i for i, d in enumerate(docs) if field not in d]
    if lacking:
        raise ValueError(
            f"--owner-field {field}: {len(lacking)} of {len(docs)} held-out records have no "
            f"{field!r} (first: record {lacking[0] + 1})"
        )
    is_owner = np.asarray([str(d[field]) in values for d in docs])
    limit = window_tokens or rm.max_seq_len
    windows = heldout_windows(rm, docs, limit)
    paths = rm.route([w["text"] for w in windows])
    sums: dict[str, np.ndarray] = {}
    tokens = None
    for name, mode, t in (
        ("generic", "generic", None),
        ("before", "fetched", None),
        ("after", "fetched", targets),
        ("random", "fetched", control),
    ):
        if name == "random" and control is None:
            continue
        key = (name, limit, len(docs))
        if t is None and key in unblocked:  # no block in this setting: the last owner's scores
            sums[name], tokens = unblocked[key]
            continue
        with rm.store.experiment():
            if t:
                _block(rm.store, t)
            sums[name], tokens = per_doc(
                windows, window_nll(rm, windows, mode=mode, paths=paths), len(docs)
            )
        if t is None:
            unblocked[key] = (sums[name], tokens)

    def part(mask: np.ndarray) -> dict[str, Any]:
        tok = float(tokens[mask].sum())
        ppl = {k: math.exp(float(v[mask].sum()) / tok) if tok else None for k, v in sums.items()}
        ppl.setdefault("random", None)
        return {
            "pages": int(mask.sum()),
            "tokens": int(tok),
            "perplexity": ppl,
            **{
                f"{k} − before": paired_doc_interval(
                    sums[k][mask], sums["before"][mask], tokens[mask]
                )
                for k in ("after", "random")
                if k in sums
            },
        }

    return {
        "field": field,
        "values": sorted(values),
        "windows": len(windows),
        "owner": part(is_owner),
        "others": part(~is_owner),
    }


def _pct(a: Mapping[str, Any]) -> str:
    return "—" if a["accuracy"] is None else f"{a['accuracy']:.1%}"


def forgetting_lines(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """The report's "Forgetting by data owner" section."""
    lines = [
        "## Forgetting by data owner (seed 002 §privacy)",
        "",
        (
            "Every block an owner's documents trained (share of its training tokens ≥ the minimum, "
            "at every level holding memory) is blocked; a blocked block reads as the fallback. "
            "Owner's facts: stated only in the owner's documents; others: every other fact. "
            "Random: as many blocks per level (the same bank fraction), drawn among the blocks the "
            "owner's set left open."
        ),
        "",
    ]
    for r in results:
        f = r.get("facts")
        lines += [
            f"### {r['name']}",
            "",
            (
                f"{r['blocks']['documents_found']} documents (owner sha256 "
                f"{r['owner_sha256'][:16]}…), min share {r['min_share']:g}; blocked "
                f"{r['bank_fraction']:.2%} of the bank ("
                + (
                    r["random"]["why"]
                    if r["random"]["targets"] is None
                    else f"random control {r['random']['bank_fraction']:.2%}"
                )
                + f"); a blocked block reads as {r['fallback']}."
            ),
            "",
            "```",
            r["table"],
            "```",
            "",
        ]
        if f:
            lines += [
                (
                    "| facts | n | generic memory | fetched, before | after blocking the owner's | "
                    "after random |"
                ),
                "|---|---:|---:|---:|---:|---:|",
            ]
            for g in ("owner", "others", "shared", "others_only", "unstated"):
                a = f["accuracy"][g]
                if f["n"][g] or g in ("owner", "others"):
                    text = "all but the owner's" if g == "others" else GROUP_TEXT[g]
                    lines.append(
                        f"| {text} | {f['n'][g]} | {_pct(a['generic'])} | {_pct(a['before'])} | "
                        f"{_pct(a['after'])} | {_pct(a['random'])} |"
                    )
            routed = f["owner_routed_to_blocked"]
            lines += [
                "",
                (
                    "Owner's facts whose question routes to a blocked block: "
                    f"{'—' if routed is None else f'{routed:.0%}'}; predictions changed on probes "
                    f"that read no blocked block: {f['untouched_predictions_changed']}; facts "
                    "whose stating documents found differ from their `mentions`: "
                    f"{f['statements_disagree']} of {f['statements_checked']}."
                ),
                "",
            ]
        h = r.get("held_out")
        if h:
            lines += [
                (
                    f"Held-out pages by `{h['field']}` (owner: {', '.join(h['values'][:3])}"
                    f"{', …' if len(h['values']) > 3 else ''}), perplexity:"
                ),
                "",
                (
                    "| pages | n | tokens | generic | before | after blocking the owner's | after "
                    "random | Δ nll/token after − before [95 % CI] |"
                ),
                "|---|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for g in ("owner", "others"):
                p = h[g]
                ppl = p["perplexity"]
                d = p["after − before"]
                ci = (
                    "—"
                    if d.get("ci95") is None
                    else f"{d['mean']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]"
                )
                fmt = lambda v: "—" if v is None else f"{v:.2f}"
                lines.append(
                    f"| {'owner' if g == 'owner' else 'everyone else'} | {p['pages']} | "
                    f"{p['tokens']:,} | {fmt(ppl['generic'])} | {fmt(ppl['before'])} | "
                    f"{fmt(ppl['after'])} | {fmt(ppl['random'])} | {ci} |"
                )
            lines.append("")
    return lines


def plot_forgetting(results: Sequence[Mapping[str, Any]], path: str | Path) -> bool:
    """Owner's facts and the others' accuracy, generic / before / after / random, one group of bars
    per owner."""
    rows = [r for r in results if r.get("facts")]
    if not rows:
        return False
    fig = new_figure()
    ax = fig.add_subplot()
    settings = ("generic", "before", "after", "random")
    x = np.arange(len(rows) * 2)
    for k, s in enumerate(settings):
        vals = [
            r["facts"]["accuracy"][g][s]["accuracy"] or 0 for r in rows for g in ("owner", "others")
        ]
        ax.bar(
            x + (k - 1.5) * 0.2,
            vals,
            0.18,
            label={
                "generic": "generic memory",
                "before": "fetched",
                "after": "owner's blocks blocked",
                "random": "random blocks (same fraction)",
            }[s],
        )
    short = [
        r["name"].split(" (")[0].replace(" ", "\n", 1) for r in rows
    ]  # "entity\nName": fits under 2 bars
    ax.set_xticks(
        x,
        [
            f"{n}\n{'owner' if g == 'owner' else 'others'}"
            for n in short
            for g in ("owner", "others")
        ],
        fontsize=6,
    )
    ax.set_ylabel("probe accuracy")
    ax.set_title("Forgetting a data owner's documents")
    ax.legend(fontsize=7)
    save_png(fig, path)
    return True


def demo_owners(
    corpus: Sequence[Mapping[str, Any]], domain: str, tail_docs: int = 3
) -> list[dict[str, Any]]:
    """The demo's two data owners in `domain` (bios corpus records): one long-tail entity of the
    domain's first subtopic (the most documents among its entities with at most `tail_docs`, ties by
    name: the tail the bank is for), and that whole subtopic. Each: name, key, ids, owner_field."""
    topics = sorted({r["topic"] for r in corpus if r.get("domain") == domain})
    if not topics:
        raise ValueError(f"forgetting: no document of the corpus is in domain {domain!r}")
    topic = topics[0]
    docs: dict[str, list[str]] = {}
    for r in corpus:
        if r.get("topic") == topic:
            docs.setdefault(r["entity"], []).append(r["id"])
    tail = sorted(
        (e for e, d in docs.items() if len(d) <= tail_docs), key=lambda e: (-len(docs[e]), e)
    )
    owners = []
    if tail:
        e = tail[0]
        owners.append(
            {
                "name": f"entity {e} ({topic}, {len(docs[e])} documents)",
                "key": f"entity-{e}",
                "ids": docs[e],
                "owner_field": "entity",
            }
        )
    ids = [r["id"] for r in corpus if r.get("topic") == topic]
    owners.append(
        {
            "name": f"subtopic {topic} ({len(ids)} documents)",
            "key": f"subtopic-{topic}",
            "ids": ids,
            "owner_field": "topic",
        }
    )
    return owners
