"""What a training run folder records, read for evaluation.

- Stored paths resolve for a moved run as `training.runfolder` says (`run_config`,
  `resolve_stored`).
- Epochs: the run's `max_duration` plus, along `anchor_checkpoint`, the runs it started from (the
  demo's co-training run: anchor 2 ep + co-training 5 ep = 7), in epochs over its shards.
- The demo layout (`memtree demo`): `facts.jsonl` and `heldout.jsonl` beside the pipeline run
  (ROOT/pipeline/shards → ROOT/facts.jsonl).
- The bank's policy: blocked blocks (and deleted ones), read through memstore's public API.
- A named pretrained anchor: which model, quantisation, licence and folder hash the run trained on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memtree.io import read_json
from memtree.tpp import GENERALISES_DOWN_TO, bank_lr_ratio, table_from_dict

# the run folder's own readers live beside the trainer that writes it; eval's callers import them
# here too
from memtree.training.runfolder import CONFIG_FILE, resolve_stored, run_config, stored_config


def demo_root(cfg) -> Path:
    """The folder `memtree demo` lays out around a pipeline run: ROOT/pipeline/shards → ROOT."""
    return Path(cfg.data.shards).resolve().parent.parent


def _n_samples(shards: str | Path) -> int:
    return sum(int(s["n_samples"]) for s in read_json(Path(shards) / "manifest.json")["streams"])


def duration_epochs(duration: str, cfg) -> float | None:
    """A Composer duration in epochs over the run's shards; None when it is not countable (wall
    clock, dur)."""
    d = str(duration).strip()
    n = _n_samples(cfg.data.shards)
    try:
        if d.endswith("ep"):
            return float(d[:-2])
        if d.endswith("ba"):
            return float(d[:-2]) * cfg.data.batch_size / max(n, 1)
        if d.endswith("sp"):
            return float(d[:-2]) / max(n, 1)
        if d.endswith("tok"):
            seq = int(read_json(Path(cfg.data.shards) / "manifest.json")["seq_len"])
            return float(d[:-3]) / max(n * seq, 1)
    except ValueError:
        return None
    return None


def trained_epochs(run: str | Path) -> tuple[float | None, str]:
    """(epochs over the corpus, how they were counted) from the run's config and, along
    `anchor_checkpoint`, the runs it continued from; (None, why) when the chain cannot be
    counted."""
    parts, seen, folder = [], set(), Path(run)
    while True:
        try:
            cfg = run_config(folder)
        except FileNotFoundError as e:
            return None, str(e)
        ep = duration_epochs(cfg.max_duration, cfg)
        if ep is None:
            return (
                None,
                (
                    f"{folder / CONFIG_FILE}: max_duration {cfg.max_duration!r} is not countable "
                    "in epochs"
                ),
            )
        parts.append((f"{folder.name} {cfg.max_duration}", ep))
        seen.add(folder.resolve())
        if not cfg.anchor_checkpoint:
            break
        try:
            folder = resolve_stored(
                folder, "anchor_checkpoint", cfg.anchor_checkpoint, must=CONFIG_FILE
            )
        except FileNotFoundError as e:
            return None, str(e)
        if folder.resolve() in seen:
            break
    total = sum(ep for _, ep in parts)
    how = " + ".join(label for label, _ in reversed(parts))
    return total, f"from the run: {how}"


def bank_state(bank: str | Path) -> dict[str, Any] | None:
    """The bank's blocked and deleted blocks ({level: [[start, stop)…]}), its fallback and the audit
    log's block / unblock / delete entries; None when nothing is refused."""
    from memtree.memstore.format import read_manifest
    from memtree.memstore.journal import audit_log
    from memtree.memstore.store import read_policy

    bank = Path(bank)
    policy = read_policy(bank)
    deleted = read_manifest(bank).manifest.get("deleted", {})
    blocked = {lv: runs for lv, runs in policy.get("blocked", {}).items() if runs}
    deleted = {lv: runs for lv, runs in deleted.items() if runs}
    if not blocked and not deleted:
        return None
    audit = [
        {k: e.get(k) for k in ("time", "user", "action", "level", "clusters", "reason")}
        for e in audit_log(bank)
        if e.get("action") in ("block", "unblock", "delete")
    ]
    return {
        "blocked": blocked,
        "deleted": deleted,
        "fallback": policy["fallback"],
        "audit": audit[-5:],
    }


def run_pretrained(run: str | Path) -> dict[str, Any] | None:
    """The named pretrained anchor a run trained on (`memtree.pretrained`: name, title,
    quantisation, licence, upstream, hash, …): what the trainer recorded beside its config, else the
    converted folder's manifest; None for a run whose anchor is not a named pretrained model."""
    meta = read_json(Path(run) / CONFIG_FILE)
    if meta.get("pretrained"):
        return meta["pretrained"]
    cfg = run_config(run)
    if not cfg.pretrained:
        return None
    from memtree.pretrained import provenance

    return provenance(cfg.model.hf_dir)


def describe_runs(runs: dict[str, list[list[int]]]) -> str:
    """{"2": [[4, 8]]} → "level 2: 4–7 (4 blocks)"."""
    out = []
    for lv in sorted(runs, key=int):
        ids = ", ".join(str(a) if b - a == 1 else f"{a}–{b - 1}" for a, b in runs[lv])
        out.append(f"level {lv}: {ids} ({sum(b - a for a, b in runs[lv])} blocks)")
    return "; ".join(out)


def run_tpp_table(run: str | Path) -> dict[str, Any] | None:
    """A run's tokens-per-parameter table (tpp.json, written by `memtree train`) re-read under
    today's measured rule (memtree/tpp.py), so that a run trained before the rule changed warns as a
    new one would; the bank / anchor LR ratio comes from the run's config when the table predates
    it. None when the run has no table."""
    folder = Path(run)
    f = folder / "tpp.json"
    if not f.is_file():
        return None
    t = read_json(f)
    ratio = None
    if t.get("lr_ratio") is None and (folder / CONFIG_FILE).is_file():
        c = stored_config(folder)
        ratio = bank_lr_ratio(
            bank_lr=c["memory"]["lr"],
            lr_by_level=c["memory"].get("lr_by_level") or [],
            multipliers=c["memory"]["multipliers"],
            anchor_lr=c["optim"]["lr"],
        )
    return table_from_dict(t, threshold=GENERALISES_DOWN_TO, lr_ratio=ratio, where=f).to_dict()
