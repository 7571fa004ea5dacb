"""Stage 8, report: reconciled counts, cluster-size histograms, balance, timings.

Writes `report.json` (machine-readable), `report.md` (for people) and
`cluster_sizes.png` (one histogram of cluster sizes per level) into the run's
`report/` directory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from memtree.io import atomic_path, atomic_write_json, atomic_write_text


def _balance(sizes: np.ndarray, valid: np.ndarray) -> dict:
    s = sizes[valid]
    mean = float(s.mean()) if s.size else 0.0
    return {
        "n_valid": int(valid.sum()),
        "n_nonempty": int((s > 0).sum()),
        "min": int(s.min()) if s.size else 0,
        "max": int(s.max()) if s.size else 0,
        "mean": round(mean, 3),
        "balance_ratio": round(float(s.max()) / mean, 4) if mean else None,
    }


def write_report(root: Path, markers: dict[str, dict], out: Path) -> dict:
    st = {k: v["stats"] for k, v in markers.items() if k != "report"}
    ing, win, emb, tree, asg, sh = (
        st[k] for k in ("ingest", "window", "embed", "tree", "assign", "shards")
    )
    checks = {
        "ingest: records_in == kept + rejected": ing["records_in"] == ing["kept"] + ing["rejected"],
        "window: docs_in == ingest.kept": win["docs_in"] == ing["kept"],
        "embed: embeddings == windows": emb["n"] == win["n_windows"],
        "assign: assigned == windows": asg["n_windows"] == win["n_windows"],
        "shards: packed windows == windows": sh["n_windows"] == win["n_windows"],
        "tree: built on all windows": tree["n_points"] == win["n_windows"],
    }
    levels = []
    sizes_all = []
    for lv in range(1, tree["levels"] + 1):
        sizes = np.load(root / "assign" / f"sizes-l{lv}.npy")
        valid = np.load(root / "tree" / f"valid-l{lv}.npy")
        sizes_all.append(sizes[valid])
        levels.append({"level": lv, **_balance(sizes, valid)})
    timing = {k: {"seconds": v["seconds"]} for k, v in markers.items() if k != "report"}
    n_docs, n_win = ing["kept"], win["n_windows"]
    for k, per in (
        ("ingest", ing["records_in"]),
        ("window", n_docs),
        ("embed", n_win),
        ("tree", n_win),
        ("assign", n_win),
        ("shards", n_win),
    ):
        s = timing[k]["seconds"]
        timing[k]["items_per_second"] = round(per / s, 1) if s > 0 else None
    report = {
        "counts": {
            "records_in": ing["records_in"],
            "docs_kept": n_docs,
            "docs_rejected": ing["rejected"],
            "rejects_by_reason": ing["rejects_by_reason"],
            "windows": n_win,
            "tokens": win["n_tokens"],
            "samples": sh["n_samples"],
            "streams": sh["n_streams"],
            "packed_tokens": sh["n_tokens"],
        },
        "reconciled": all(checks.values()),
        "checks": checks,
        "tree": {
            "tree_id": tree["tree_id"],
            "levels": tree["levels"],
            "branching": tree["branching"],
        },
        "levels": levels,
        "timing": timing,
        "embed": {
            k: emb[k]
            for k in ("model_resolved", "strategy", "max_seq_length", "windows_per_second")
        },
        "host": tree.get("host"),  # the BLAS check before the tree stage (clustering.blas)
    }
    atomic_write_json(out / "report.json", report)
    _plot(sizes_all, out / "cluster_sizes.png")
    atomic_write_text(out / "report.md", _markdown(report))
    return {
        "reconciled": report["reconciled"],
        "report": "report.md",
        "balance_ratio": [lv["balance_ratio"] for lv in levels],
    }


def _plot(sizes: list[np.ndarray], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sizes), figsize=(4 * len(sizes), 3.2), squeeze=False)
    for i, (ax, s) in enumerate(zip(axes[0], sizes), start=1):
        ax.hist(s, bins=min(50, max(5, len(s) // 4)), color="#3b6ea5")
        if len(s):
            ax.axvline(s.mean(), color="k", ls="--", lw=1, label=f"mean {s.mean():.1f}")
            ax.legend(fontsize=8)
        ax.set_title(
            f"level {i}: {len(s)} clusters, max/mean {s.max() / max(s.mean(), 1e-9):.2f}",
            fontsize=9,
        )
        ax.set_xlabel("windows per cluster")
        ax.set_ylabel("clusters")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def _markdown(r: dict) -> str:
    c = r["counts"]
    lines = [
        "# Pipeline report (memtree)",
        "",
        (
            f"Tree `{r['tree']['tree_id']}`: {r['tree']['levels']} levels "
            f"× branching {r['tree']['branching']}."
        ),
        "",
        "## Counts",
        "",
        f"- records in: {c['records_in']} = kept {c['docs_kept']} + rejected {c['docs_rejected']}",
        f"- rejects by reason: {c['rejects_by_reason'] or 'none'}",
        (
            f"- windows: {c['windows']} ({c['tokens']} tokens) → {c['samples']} samples "
            f"in {c['streams']} streams"
        ),
        f"- all counts reconciled: **{r['reconciled']}**",
        "",
        "| check | ok |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in r["checks"].items()],
        "",
        "## Cluster sizes",
        "",
        "![cluster sizes](cluster_sizes.png)",
        "",
        "| level | clusters (valid) | non-empty | min | mean | max | max/mean |",
        "|---|---|---|---|---|---|---|",
        *[
            f"| {lv['level']} | {lv['n_valid']} | {lv['n_nonempty']} | {lv['min']} "
            f"| {lv['mean']} | {lv['max']} | {lv['balance_ratio']} |"
            for lv in r["levels"]
        ],
        "",
        "## Time per stage",
        "",
        "| stage | seconds | items/s |",
        "|---|---|---|",
        *[
            f"| {k} | {v['seconds']} | {v.get('items_per_second')} |"
            for k, v in r["timing"].items()
        ],
        "",
        *_host_lines(r.get("host")),
    ]
    return "\n".join(lines)


def _host_lines(h: dict | None) -> list[str]:
    """The BLAS check's section: FAISS's kernel and speed, what memtree changed, the node fits'
    GEMM."""
    if not h or "faiss_kernel" not in h:
        return [
            "## BLAS",
            "",
            (
                "Not checked (dask.blas=off, or a tree built before the check existed); node fits "
                f"on {(h or {}).get('gemm_used', 'numpy')}'s GEMM."
            ),
            "",
        ]
    lines = [
        "## BLAS",
        "",
        h["message"],
        "",
        "| | kernel | GFLOP/s |",
        "|---|---|---|",
        f"| FAISS's OpenBLAS (flat search) | {h['faiss_kernel']} | {h['faiss_gflops']} |",
        f"| numpy's OpenBLAS (sgemm) | {h['numpy_kernel']} | {h['sgemm_gflops']} |",
    ]
    if h.get("before"):
        b = h["before"]
        lines.append(
            f"| FAISS before memtree's fix | {b['faiss_kernel']} | {b['faiss_search_gflops']} |"
        )
    lines += [
        "",
        (
            f"Node fits' GEMM: **{h.get('gemm_used', h['gemm'])}** (`tree.gemm`); "
            f"the fastest here: {h['gemm']} (a sample of node fits took, in seconds, "
            f"{h['gemm_fit_seconds']}; the GEMMs ran at {h['gemm_gflops']} GFLOP/s; "
            f"{h['gemm_threads']} caller(s) at one BLAS thread each)."
        ),
        "",
    ]
    return lines
