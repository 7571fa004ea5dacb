"""A generation session held against the fetch-latency simulator, prompt by prompt.

`memtree generate --prompts FILE --session --profile PROFILE.yaml` answers the prompts through the
real store (tiers, session caches) and replays the same trace of paths through
`memstore.sim.latency.simulate_session` with the same level placement and cache budget, on a
hardware profile (`memtree memstore calibrate` measures this machine's tiers into one). Per prompt:
the levels served from the cache, measured and predicted (they must agree: the store's caches and
the simulator's are the same LRU policy over the same keys when the memory levels share one
cached tier), and the fetch time, measured (read, checksum, decode, and the copy the cache hands
out: `fetch_s`) against predicted (the tiers' read times, and the cache's copies with
`count_cache_copy`). Attaching is compared apart: the simulator's `tensor_us` per block tensor
against the measured `attach_s` (splitting the blocks and joining the levels per layer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from memtree.geometry import plan as make_plan
from memtree.memstore.sim.latency import attach_seconds, simulate_session
from memtree.memstore.sim.profiles import HardwareProfile


def simulate_generations(
    generations: Sequence[Any],
    *,
    store,
    anchor,
    memory_config,
    profile: HardwareProfile,
    cache_bytes: int,
) -> dict[str, Any]:
    """Measured against predicted, per prompt, for `generations` (fetched memory, in order) read
    through `store`; `cache_bytes`: the store's cached tier's budget, which the simulator's one
    cache gets. Profile tiers must carry the store's tier names (a calibrated profile's: ram,
    flash)."""
    if not generations or any(g.path is None for g in generations):
        raise ValueError(
            "--session with --profile: every prompt needs fetched memory (--memory fetched)"
        )
    missing = sorted({t for t in store.placement.values()} - {t.name for t in profile.tiers})
    if missing:
        raise ValueError(
            f"--profile {profile.name}: no tier named {', '.join(missing)} (the store places "
            f"levels on {sorted(set(store.placement.values()))}; `memtree memstore calibrate` "
            "writes ram / flash)"
        )
    trace = np.asarray([g.path for g in generations], dtype=np.int64)  # (n, L)
    p = make_plan(anchor, memory_config)
    placement = {lv: store.placement[lv] for lv in store.levels}
    # fetch alone (no attach term), with the copies the store's cache hands out
    sim = simulate_session(
        p,
        dataclasses.replace(profile, tensor_us=0.0),
        trace,
        dtype=store.info.dtype,
        cache_bytes=cache_bytes,
        policy=placement,
        count_cache_copy=True,
    )
    attach_pred = sum(attach_seconds(p, lv, profile) for lv in sim.levels)
    rows = []
    for i, g in enumerate(generations):
        hits = [f.source == "cache" for f in g.fetches]
        measured = g.timing.get("fetch_s", 0.0)
        predicted = float(sim.hier_seconds[i])
        rows.append(
            {
                "prompt": i + 1,
                "path": g.path,
                "cached_levels": [f.level for f in g.fetches if f.source == "cache"],
                "predicted_cached_levels": [
                    lv for lv, h in zip(sim.levels, sim.hier_level_hit[i], strict=True) if h
                ],
                "hits_agree": hits == [bool(h) for h in sim.hier_level_hit[i]],
                "bytes_fetched": sum(f.bytes_read for f in g.fetches),
                "predicted_bytes": int(sim.hier_bytes[i]),
                "measured_s": measured,
                "predicted_s": predicted,
                "ratio": measured / predicted if predicted > 0 else None,
                "attach_s": g.timing.get("attach_s", 0.0),
                "predicted_attach_s": attach_pred,
            }
        )
    misses = [r for r in rows if r["predicted_cached_levels"] != list(sim.levels)]
    measured_miss = sum(r["measured_s"] for r in misses)
    predicted_miss = sum(r["predicted_s"] for r in misses)
    return {
        "profile": profile.name,
        "placement": {str(k): v for k, v in placement.items()},
        "cache_bytes": cache_bytes,
        "dtype": store.info.dtype,
        "per_prompt": rows,
        "hit_rate": {
            "measured": float(
                np.mean([lv in r["cached_levels"] for r in rows for lv in sim.levels])
            ),
            "predicted": sim.summary()["hierarchical"]["hit_rate"],
        },
        "hits_agree": all(r["hits_agree"] for r in rows),
        "attach": {
            "measured_s": float(np.median([r["attach_s"] for r in rows])),
            "predicted_s": attach_pred,
        },
        # prompts that read at least one block: where a fetch time is there to be predicted
        "fetching_prompts": {
            "measured_s": measured_miss,
            "predicted_s": predicted_miss,
            "ratio": measured_miss / predicted_miss if predicted_miss > 0 else None,
        },
    }


def format_simulation(sim: dict[str, Any]) -> str:
    lines = [
        (
            f"simulator ({sim['profile']}, placement {sim['placement']}, cache "
            f"{sim['cache_bytes']:,} B): measured against predicted, per prompt"
        ),
        (
            f"{'prompt':>6}  {'cached (measured / predicted)':<30} {'measured':>10} "
            f"{'predicted':>10} {'ratio':>6}"
        ),
    ]
    for r in sim["per_prompt"]:
        cached = (
            f"{','.join(map(str, r['cached_levels'])) or '-'} / "
            f"{','.join(map(str, r['predicted_cached_levels'])) or '-'}"
        )
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        lines.append(
            f"{r['prompt']:>6}  {cached:<30} {1e3 * r['measured_s']:>8.2f}ms "
            f"{1e3 * r['predicted_s']:>8.2f}ms {ratio:>6}"
        )
    f = sim["fetching_prompts"]
    ratio = f"{f['ratio']:.2f}" if f["ratio"] is not None else "-"
    lines.append(
        f"hit rate measured {sim['hit_rate']['measured']:.2f}, predicted "
        f"{sim['hit_rate']['predicted']:.2f} "
        f"({'equal per prompt' if sim['hits_agree'] else 'DIFFER'}); prompts that fetched: "
        f"measured {1e3 * f['measured_s']:.2f} ms, predicted {1e3 * f['predicted_s']:.2f} ms "
        f"(ratio {ratio})"
    )
    a = sim["attach"]
    lines.append(
        f"attach per prompt: measured {1e3 * a['measured_s']:.2f} ms (median), the profile's "
        f"tensor_us predicts {1e3 * a['predicted_s']:.2f} ms"
    )
    return "\n".join(lines)
