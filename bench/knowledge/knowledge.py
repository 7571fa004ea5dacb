"""The demo's knowledge experiment over N seeds: the table with mean ± sd and 95 % intervals.

Each seed is a whole `memtree demo` (corpus, pipeline, anchor, co-training, evaluation) under
`--root/seed-K` (reruns resume). The baseline of every figure is measured in the same run: the
generic memory (anchor + a memory of the same size fetched for every query), against which the
fetched memory's gain is the paper's claim; blocking is compared with its random control.

    .venv/bin/python -m bench.knowledge.knowledge --seeds 0 1 2
    # reuse `make demo`
    .venv/bin/python -m bench.knowledge.knowledge --seeds 1 2 --existing 0=runs/demo
    .venv/bin/python -m bench.knowledge.knowledge --seeds 0 --root /tmp/kn --train data.batch_size=4
    .venv/bin/python -m bench.knowledge.knowledge --seeds 0 1 2 --pipeline tree.strict_balance=true
    .venv/bin/python -m bench.knowledge.knowledge --seeds 1 2 --corpus common_initial=0.5
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from bench.common import REPO, finish, log, results_dir, results_path, run_meta
from memtree.config import from_dict
from memtree.eval.demo import run_main_job
from memtree.io import read_json
from memtree.pipeline.corpus.bios import BiosSpec

MODES = ("none", "generic", "fetched", "rag")


def _lo(bucket: str) -> int:
    return int(re.match(r"\d+", bucket).group())


def _avg(rows: list[dict], lo: int, hi: int) -> float | None:
    """Probe-weighted accuracy over buckets whose lower bound is in [lo, hi]."""
    sel = [r for r in rows if r["n"] and lo <= _lo(r["bucket"]) <= hi]
    n = sum(r["n"] for r in sel)
    return sum(r["n"] * r["accuracy"] for r in sel) / n if n else None


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    """The figures the issue's targets are stated in, from one demo report."""
    k, b = report["knowledge"], report["blocking"]
    modes = k["modes"]
    top = max(_lo(r["bucket"]) for r in modes["fetched"]["by_bucket"] if r["n"])
    out: dict[str, Any] = {"n_choices": k["n_choices"], "routing_leaf": k["routing"]["all"][-1]}
    for m in MODES:
        if m not in modes:
            continue
        rows = modes[m]["by_bucket"]
        out[m] = {
            "acc_1_7": _avg(rows, 1, 7),
            "acc_0": _avg(rows, 0, 0),
            "acc_top": _avg(rows, top, top),
            "perplexity": modes[m].get("perplexity"),
            "by_bucket": {r["bucket"]: r["accuracy"] for r in rows},
        }
    out["gap_1_7"] = 100 * (out["fetched"]["acc_1_7"] - out["generic"]["acc_1_7"])
    out["gap_top"] = 100 * (out["fetched"]["acc_top"] - out["generic"]["acc_top"])
    adv, rnd = b["settings"]["adversarial"], b["settings"]["random"]
    out["blocking"] = {
        "n_target": b["n_target"],
        "target_drop": 100 * (adv["accuracy_target"]["before"] - adv["accuracy_target"]["after"]),
        "other_change": 100 * (adv["accuracy_other"]["after"] - adv["accuracy_other"]["before"]),
        "random_target_change": 100
        * (rnd["accuracy_target"]["after"] - rnd["accuracy_target"]["before"]),
    }
    out["seconds"] = report["meta"].get("total_s")
    return out


def tree_purity(root: Path) -> dict[str, Any]:
    """The run's tree against the corpus's own structure: per level, the share of documents in
    their cluster's majority field / domain / subtopic (level 1 / 2 / 3 of the demo's 3 × 4 tree),
    from the assign stage's paths (`pipeline/README.md`) and corpus.jsonl's labels."""
    import json

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bench.pipeline.tree import purity

    assign = pa.concat_tables(
        [pq.read_table(p) for p in sorted((root / "pipeline" / "assign").glob("part-*.parquet"))]
    )
    docs = assign["doc_ordinal"].to_numpy()
    paths = np.stack(assign["path"].to_numpy(zero_copy_only=False))
    with open(root / "corpus.jsonl") as f:
        records = [json.loads(line) for line in f]
    out: dict[str, Any] = {
        "method": read_json(root / "pipeline" / "tree" / "tree.json")["config"].get(
            "method", "topdown"
        )
    }
    for level, key in enumerate(("field", "domain", "topic")[: paths.shape[1]]):
        labels = np.array([records[d][key] for d in docs])
        out[f"purity_l{level + 1}_{key}"] = purity(labels, paths[:, level])
    return out


def _ms(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"


def table(per_seed: dict[int, dict[str, Any]]) -> str:
    runs = list(per_seed.values())
    pct = lambda m, key: [100 * r[m][key] for r in runs if m in r and r[m][key] is not None]
    lines = [
        f"Knowledge experiment over seeds {sorted(per_seed)} (mean ± sd across seeds, points):",
        "",
        "| figure | value | target |",
        "|---|---:|---|",
    ]
    lines.append(
        f"| fetched − generic on 1–7 exposures | {_ms([r['gap_1_7'] for r in runs])} | ≥ +10 |"
    )
    lines.append(
        f"| fetched − generic on the top bucket | {_ms([r['gap_top'] for r in runs])} | within ±5 |"
    )
    for m in ("none", "generic", "fetched"):
        lines.append(
            f"| {m}: unseen facts (chance {100 / runs[0]['n_choices']:.0f}) | "
            f"{_ms(pct(m, 'acc_0'))} | "
            "at chance |"
        )
    lines.append(
        f"| blocking: target domain drop | {_ms([r['blocking']['target_drop'] for r in runs])} | "
        "to within 3 of generic |"
    )
    lines.append(
        f"| blocking: other domains change | {_ms([r['blocking']['other_change'] for r in runs])} "
        "| ≤ 2 |"
    )
    lines.append(
        f"| random blocking: target change | "
        f"{_ms([r['blocking']['random_target_change'] for r in runs])} | ≤ 3 |"
    )
    lines.append(f"| demo wall time (s) | {_ms([r['seconds'] for r in runs])} | ≤ 900 |")
    if all("tree" in r for r in runs):
        purity = [r["tree"]["purity_l2_domain"] for r in runs]
        lines.append(
            f"| level-2 domain purity (per seed: {', '.join(f'{p:.3f}' for p in purity)}) | "
            f"{min(purity):.3f} (lowest) | ≥ 0.95 |"
        )
    buckets = list(runs[0]["fetched"]["by_bucket"])
    lines += [
        "",
        "Accuracy by exposure bucket (%, mean ± sd across seeds):",
        "",
        "| setting | " + " | ".join(buckets) + " |",
        "|---|" + "---:|" * len(buckets),
    ]
    for m in MODES:
        if all(m in r for r in runs):
            cells = [
                _ms(
                    [
                        None if r[m]["by_bucket"][b] is None else 100 * r[m]["by_bucket"][b]
                        for r in runs
                    ]
                )
                for b in buckets
            ]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    ppl = [
        (m, [r[m]["perplexity"] for r in runs if m in r]) for m in ("none", "generic", "fetched")
    ]
    lines += ["", "Held-out perplexity: " + ", ".join(f"{m} {_ms(v)}" for m, v in ppl)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--root", default=str(REPO / "runs" / "knowledge"))
    ap.add_argument(
        "--out", default=None, help="JSON (default bench/knowledge/results/knowledge-DATE.json)"
    )
    ap.add_argument("--train", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--pipeline",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a pipeline config override, e.g. tree.strict_balance=true (repeatable)",
    )
    ap.add_argument(
        "--corpus",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a pipeline.corpus.bios.BiosSpec field, e.g. common_initial=0.5 (repeatable)",
    )
    ap.add_argument(
        "--existing",
        action="append",
        default=[],
        metavar="SEED=ROOT",
        help="a finished demo of that seed with the same settings (e.g. 0=runs/demo): its "
        "report is summarised, not rerun (repeatable)",
    )
    args = ap.parse_args(argv)
    out = results_path(
        args.out, f"knowledge-{time.strftime('%Y-%m-%d')}.json", results_dir(__file__)
    )
    corpus = OmegaConf.to_container(OmegaConf.from_dotlist(args.corpus))
    existing = {}
    for item in args.existing:
        seed, _, root = item.partition("=")
        if not seed.isdigit() or not (Path(root) / "report" / "results.json").exists():
            ap.error(f"--existing {item!r}: expected SEED=ROOT with ROOT/report/results.json")
        existing[int(seed)] = Path(root) / "report" / "results.json"
    # run_meta records the BLAS / OpenMP kernels and OPENBLAS_* variables the run had; the demo's
    # numerics follow them, so they are recorded but not changed (no prepare_blas_env here).
    results: dict[str, Any] = {"seeds": {}, "meta": run_meta(args, argv=sys.argv[1:])}
    for seed in sorted(set(args.seeds) | set(existing)):
        t = time.time()
        if seed in existing:
            log(f"seed {seed}: the finished demo report {existing[seed]}")
            data = read_json(existing[seed])
            root = existing[seed].parent.parent
            if data["meta"]["corpus"]["spec"]["seed"] != seed:
                raise SystemExit(
                    f"{existing[seed]} was run with corpus seed "
                    f"{data['meta']['corpus']['spec']['seed']}, not {seed}"
                )
            # the whole spec, as `memtree demo` refuses a root of another corpus (pipeline/demo.py)
            have = BiosSpec.stored(data["meta"]["corpus"]["spec"])
            want = from_dict(BiosSpec, {**corpus, "seed": seed}, where="--corpus").record()
            off = {
                k: (want.get(k), have.get(k))
                for k in want.keys() | have.keys()
                if want.get(k) != have.get(k)
            }
            if off:
                raise SystemExit(
                    f"{existing[seed]} was run with another corpus (asked, there): {off}"
                )
        else:
            log(f"seed {seed}: memtree demo under {args.root}/seed-{seed}")
            root = Path(args.root) / f"seed-{seed}"
            report = run_main_job(
                root,
                seed=seed,
                train_overrides=args.train,
                pipeline_overrides=args.pipeline,
                corpus=corpus,
            )
            data = read_json(Path(report).with_name("results.json"))
        results["seeds"][seed] = summarise(data)
        results["seeds"][seed]["tree"] = tree_purity(root)
        results["seeds"][seed]["bench_seconds"] = time.time() - t
    per_seed = results["seeds"]
    results["rows"] = table(per_seed)
    results["ratio_fetched_over_generic_1_7"] = [
        r["fetched"]["acc_1_7"] / r["generic"]["acc_1_7"] for r in per_seed.values()
    ]
    if not all(math.isfinite(x) for x in results["ratio_fetched_over_generic_1_7"]):
        raise SystemExit("a generic accuracy of 0 on 1–7 exposures: no ratio")
    ratios = ", ".join(f"{x:.2f}" for x in results["ratio_fetched_over_generic_1_7"])
    return finish(
        results,
        out,
        lambda rows: print(
            rows + f"\n\nratio fetched / generic accuracy on 1–7 exposures, per seed: {ratios}"
        ),
    )


if __name__ == "__main__":
    raise SystemExit(main())
