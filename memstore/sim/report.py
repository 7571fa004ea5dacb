"""Reports of the fetch-latency simulator: results.json, a Markdown table and PNG figures.

`write_report` takes one `ProfileResults` per hardware profile (single fetch,
session and sweep, as `memtree memstore simulate-fetch` runs them) and writes them under
an output directory; `format_table` is the Markdown it prints. Figures are bare
matplotlib `Figure`s rendered with Agg, so nothing here touches pyplot's state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memtree.config import to_dict
from memtree.geometry import human, human_bytes
from memtree.io import atomic_path, atomic_write_json, atomic_write_text
from memtree.memstore.sim.latency import FetchResult, SessionResult
from memtree.memstore.sim.profiles import HardwareProfile


@dataclass(frozen=True, kw_only=True)
class ProfileResults:
    """Everything simulated for one hardware profile, as `write_report` consumes it."""

    profile: HardwareProfile
    fetch: FetchResult
    session: SessionResult | None = None
    sweep: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": to_dict(self.profile),
            "fetch": self.fetch.to_dict(),
            "session": self.session.to_dict() if self.session else None,
            "sweep": list(self.sweep),
        }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}"


def format_table(results: Sequence[ProfileResults]) -> str:
    """Markdown summary: placement, single fetch, session and sweep per profile."""
    lines: list[str] = []
    for r in results:
        f = r.fetch
        lines += [f"## {r.profile.name}: {r.profile.description}".rstrip(": "), ""]
        tiers = ", ".join(
            f"L{lv.level} ({human_bytes(lv.bank_bytes)}) → {lv.tier}" for lv in f.levels
        )
        flat_bank = (
            f"flat bank ({human_bytes(f.flat.bank_bytes)}, "
            f"{f.flat.n_blocks:,} blocks) → {f.flat.tier}"
        )
        lines += [f"placement ({f.policy}): {tiers}; {flat_bank}", ""]
        per_level = " + ".join(f"L{lv.level} {_ms(lv.seconds)}" for lv in f.levels)
        head = "| bank | fetch | single fetch (ms) |"
        rule = "|---|---:|---:|"
        hier = f"| hierarchical | {human_bytes(f.fetch_bytes)} | {_ms(f.seconds)} ({per_level}) |"
        flat = f"| flat | {human_bytes(f.flat.block_bytes)} | {_ms(f.flat.seconds)} |"
        if r.session is not None:
            s = r.session.summary()
            head += (
                " session mean (ms) | warm mean (ms) | p50 "
                "(ms) | p95 (ms) | hit rate | read/query |"
            )
            rule += "---:|---:|---:|---:|---:|---:|"

            def cols(st: dict[str, Any]) -> str:
                return (
                    f" {_ms(st['mean_s'])} | {_ms(st['warm_mean_s'])} | {_ms(st['p50_s'])} | "
                    f"{_ms(st['p95_s'])} | {st['hit_rate']:.1%} | "
                    f"{human_bytes(st['bytes_read_mean'])} |"
                )

            hier += cols(s["hierarchical"])
            flat += cols(s["flat"])
        lines += [head, rule, hier, flat, ""]
        lines.append(
            f"single-fetch speedup (flat / hierarchical): {f.speedup:.1f}×"
            + (
                f"; session mean speedup: {r.session.summary()['speedup_mean']:.1f}× over "
                f"{r.session.hier_seconds.size} queries, cache {human_bytes(r.session.cache_bytes)}"
                if r.session is not None
                else ""
            )
        )
        lines.append("")
        if r.sweep:
            has_session = "session" in r.sweep[0]
            lines += [
                "| config | fetched params | fetch | bank | flat "
                "bank | hierarchical (ms) | flat (ms) | speedup |"
                + (" session hier (ms) | session flat (ms) |" if has_session else ""),
                "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if has_session else ""),
            ]
            for row in r.sweep:
                line = (
                    f"| ({row['config']}) | {human(row['fetch_params'])} | "
                    f"{human_bytes(row['fetch_bytes'])} | {human_bytes(row['bank_bytes'])} | "
                    f"{human_bytes(row['flat_bank_bytes'])} | {_ms(row['hierarchical_s'])} | "
                    f"{_ms(row['flat_s'])} | {row['speedup']:.1f}× |"
                )
                if has_session:
                    line += (
                        f" {_ms(row['session']['hierarchical_mean_s'])} | "
                        f"{_ms(row['session']['flat_mean_s'])} |"
                    )
                lines.append(line)
            lines.append("")
    return "\n".join(lines)


def _tier_colors(results: Sequence[ProfileResults]) -> dict[str, str]:
    palette = [
        "#4C72B0",
        "#DD8452",
        "#55A868",
        "#C44E52",
        "#8172B3",
        "#937860",
        "#DA8BC3",
        "#8C8C8C",
    ]
    names: list[str] = []
    for r in results:
        names += [t.name for t in r.profile.tiers if t.name not in names]
    return {n: palette[i % len(palette)] for i, n in enumerate(names)}


def _save(fig: Any, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)


def _plot_fetch(results: Sequence[ProfileResults], path: Path) -> None:
    # A bare Figure renders with Agg and touches no global pyplot state.
    from matplotlib.figure import Figure

    colors = _tier_colors(results)
    fig = Figure(figsize=(4.2 * len(results), 4.5), layout="constrained")
    axes = fig.subplots(1, len(results), squeeze=False)[0]
    for ax, r in zip(axes, results):
        f = r.fetch
        top = max(f.seconds, f.flat.seconds) * 1e3
        bottom = 0.0
        for lv in f.levels:
            h = lv.seconds * 1e3
            ax.bar(0, h, bottom=bottom, color=colors[lv.tier], edgecolor="white", width=0.6)
            if h > 0.05 * top:  # a label in a sliver would overprint its neighbours
                ax.text(
                    0,
                    bottom + h / 2,
                    f"L{lv.level}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white",
                )
            bottom += h
        ax.text(0, bottom, f"{bottom:.1f} ms", ha="center", va="bottom", fontsize=9)
        flat_ms = f.flat.seconds * 1e3
        ax.bar(1, flat_ms, color=colors[f.flat.tier], edgecolor="white", width=0.6)
        ax.text(1, flat_ms, f"{flat_ms:.1f} ms", ha="center", va="bottom", fontsize=9)
        ax.set_xticks([0, 1], ["hierarchical", "flat"])
        ax.set_ylabel("single fetch latency (ms)")
        ax.set_title(f"{r.profile.name}: fetch {human_bytes(f.fetch_bytes)}")
        ax.margins(y=0.12)
        used = [
            t.name
            for t in r.profile.tiers
            if t.name in {lv.tier for lv in f.levels} | {f.flat.tier}
        ]
        ax.legend(handles=[_patch(colors[n], n) for n in used], title="tier", fontsize=8)
    _save(fig, path)


def _patch(color: str, label: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(facecolor=color, label=label)


def _plot_session(results: Sequence[ProfileResults], path: Path) -> None:
    from matplotlib.figure import Figure

    sessions = [(r.profile.name, r.session) for r in results if r.session is not None]
    fig = Figure(figsize=(9, 3.2 * len(sessions)), layout="constrained")
    axes = fig.subplots(len(sessions), 1, squeeze=False)[:, 0]
    for ax, (name, s) in zip(axes, sessions):
        q = np.arange(s.hier_seconds.size)
        summ = s.summary()
        # Flat first, so the (much lower) hierarchical trace is drawn on top of it.
        for bank, sec, color in (
            ("flat", s.flat_seconds, "#C44E52"),
            ("hierarchical", s.hier_seconds, "#4C72B0"),
        ):
            mean_ms = summ[bank]["mean_s"] * 1e3
            ax.plot(q, sec * 1e3, lw=0.7, color=color, label=f"{bank} (mean {mean_ms:.2f} ms)")
            ax.axhline(mean_ms, color=color, ls="--", lw=1)
        ax.set_xlabel("query")
        ax.set_ylabel("fetch latency (ms)")
        ax.set_title(f"{name}: session, cache {human_bytes(s.cache_bytes)}")
        ax.legend(fontsize=8, loc="upper right")
    _save(fig, path)


def _plot_sweep(results: Sequence[ProfileResults], path: Path) -> None:
    from matplotlib.figure import Figure

    rs = [r for r in results if r.sweep]
    fig = Figure(figsize=(5 * len(rs), 4.5), layout="constrained")
    axes = fig.subplots(1, len(rs), squeeze=False)[0]
    for ax, r in zip(axes, rs):
        x = [row["fetch_params"] for row in r.sweep]
        ax.vlines(
            x,
            [row["hierarchical_s"] * 1e3 for row in r.sweep],
            [row["flat_s"] * 1e3 for row in r.sweep],
            color="#BBBBBB",
            lw=1,
            zorder=0,
        )
        ax.scatter(
            x,
            [row["hierarchical_s"] * 1e3 for row in r.sweep],
            marker="o",
            color="#4C72B0",
            label="hierarchical",
        )
        ax.scatter(
            x, [row["flat_s"] * 1e3 for row in r.sweep], marker="s", color="#C44E52", label="flat"
        )
        for row in r.sweep:
            ax.annotate(
                f"({row['config']})",
                (row["fetch_params"], row["hierarchical_s"] * 1e3),
                fontsize=7,
                textcoords="offset points",
                xytext=(4, 4),
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("fetched parameters")
        ax.set_ylabel("single fetch latency (ms)")
        ax.set_title(f"{r.profile.name}: sweep")
        ax.legend(fontsize=8)
    _save(fig, path)


def write_report(
    results: Sequence[ProfileResults], out_dir: str | Path, *, meta: Mapping[str, Any] | None = None
) -> dict[str, Path]:
    """Write results.json, report.md and PNGs (fetch; session and sweep when present) → {name:
    path}."""
    if not results:
        raise ValueError("write_report: no results")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out / "results.json",
        "table": out / "report.md",
        "fetch_png": out / "fetch.png",
    }
    atomic_write_json(
        paths["json"], {"meta": dict(meta or {}), "results": [r.to_dict() for r in results]}
    )
    atomic_write_text(paths["table"], format_table(results) + "\n")
    _plot_fetch(results, paths["fetch_png"])
    if any(r.session is not None for r in results):
        paths["session_png"] = out / "session.png"
        _plot_session(results, paths["session_png"])
    if any(r.sweep for r in results):
        paths["sweep_png"] = out / "sweep.png"
        _plot_sweep(results, paths["sweep_png"])
    return paths
