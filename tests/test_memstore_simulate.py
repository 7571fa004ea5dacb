"""Fetch-latency simulator (memstore.sim): hand-checked costs, placement, sessions, traces, §3
claims."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from memtree.config import ConfigError
from memtree.geometry import AnchorShape, plan, stored_bytes
from memtree.memstore.cli import add_simulate_arguments, run_simulate
from memtree.memstore.sim.latency import (
    load_trace,
    pinned,
    simulate_fetch,
    simulate_session,
    validate_trace,
    zipf_trace,
)
from memtree.memstore.sim.profiles import HardwareProfile, TierProfile, load_profile

# 2 layers × 3 SwiGLU tensors × (m × d_model=8) → a level block holds 48·m parameters.
TINY = AnchorShape(
    name="tiny", n_layers=2, d_model=8, n_heads=2, head_dim=4, ffn_dim=16, vocab_size=32
)
# Multipliers (4, 2, 1), branching 2 → bf16 blocks of 384, 192, 96 B; each level's bank is 768 B;
# fetch 672 B; flat bank 2³ × 672 = 5376 B.
TINY_PLAN = plan(TINY, (4, 2, 1), type="ffn", branching=2)

TWO_TIERS_YAML = """\
format: memtree-hw-profile
version: 1
name: tiny
description: two slow tiers so the arithmetic is readable
tiers:
  - name: fast
    bandwidth_gbps: 1.0e-6   # 1000 B/s
    latency_us: 1000         # 1 ms
    capacity_gb: 1.0e-6      # 1000 B
    source: made up
  - name: slow
    bandwidth_gbps: 1.0e-7   # 100 B/s
    latency_us: 10000        # 10 ms
    capacity_gb: null
    source: made up
cache_gb: 1.0e-3
"""


@pytest.fixture
def tiny_profile(tmp_path: Path) -> HardwareProfile:
    path = tmp_path / "tiny.yaml"
    path.write_text(TWO_TIERS_YAML)
    return load_profile(path)


def _tiers(*caps_bytes: int | None) -> HardwareProfile:
    names = ["ram", "flash", "disk"]
    return HardwareProfile(
        name="caps",
        tiers=tuple(
            TierProfile(
                name=names[i],
                bandwidth_gbps=10.0 ** -(6 + i),
                latency_us=10.0 ** (3 + i),
                capacity_gb=None if c is None else c / 1e9,
            )
            for i, c in enumerate(caps_bytes)
        ),
    )


def test_tiny_plan_geometry_is_what_the_hand_numbers_assume():
    assert [stored_bytes(lv.block_params, "bf16") for lv in TINY_PLAN.levels] == [384, 192, 96]
    assert [lv.n_blocks for lv in TINY_PLAN.levels] == [2, 4, 8]
    assert TINY_PLAN.fetch_bytes("bf16") == 672


def test_single_fetch_latency_by_hand(tiny_profile):
    r = simulate_fetch(TINY_PLAN, tiny_profile, "bf16")
    # L1's 768 B bank fits the 1000 B fast tier; L2 (768 B) then does not, nor L3.
    assert [(lv.level, lv.tier) for lv in r.levels] == [(1, "fast"), (2, "slow"), (3, "slow")]
    expected = [1e-3 + 384 / 1000, 1e-2 + 192 / 100, 1e-2 + 96 / 100]  # 0.385, 1.93, 0.97 s
    assert [lv.seconds for lv in r.levels] == pytest.approx(expected)
    assert r.seconds == pytest.approx(3.285)
    assert r.fetch_bytes == 672
    # Flat: 8 blocks of 672 B = 5376 B, too big for the fast tier; one 672 B read on the slow one.
    assert (r.flat.level, r.flat.n_blocks, r.flat.bank_bytes, r.flat.tier) == (3, 8, 5376, "slow")
    assert r.flat.seconds == pytest.approx(1e-2 + 672 / 100)
    assert r.speedup == pytest.approx(6.73 / 3.285)


def test_more_bandwidth_is_faster_and_more_latency_is_slower(tiny_profile):
    base = simulate_fetch(TINY_PLAN, tiny_profile).seconds

    def scaled(bw: float = 1.0, lat: float = 0.0) -> float:
        tiers = tuple(
            dataclasses.replace(
                t, bandwidth_gbps=t.bandwidth_gbps * bw, latency_us=t.latency_us + lat
            )
            for t in tiny_profile.tiers
        )
        return simulate_fetch(TINY_PLAN, dataclasses.replace(tiny_profile, tiers=tiers)).seconds

    assert scaled(bw=2.0) < base < scaled(bw=0.5)
    assert scaled(lat=500.0) > base
    assert scaled(bw=2.0, lat=500.0) > scaled(bw=2.0)


def test_placement_spills_to_the_next_tier_and_flat_takes_the_tier_that_fits():
    # ram 1600 B holds L1 + L2 (1536 B) but not L3 too; flash 6000 B holds the 5376 B flat bank.
    r = simulate_fetch(TINY_PLAN, _tiers(1600, 6000, None))
    assert [lv.tier for lv in r.levels] == ["ram", "ram", "flash"]
    assert r.flat.tier == "flash"
    assert simulate_fetch(TINY_PLAN, _tiers(1600, 5000, None)).flat.tier == "disk"
    # The flat bank pinned on a tier too small for it is refused.
    with pytest.raises(ValueError, match="does not fit on tier 'ram'"):
        simulate_fetch(TINY_PLAN, _tiers(1600, 6000, None), flat_tier="ram")
    with pytest.raises(ValueError, match="flat bank"):
        simulate_fetch(TINY_PLAN, _tiers(1600, 5000, 5000))
    with pytest.raises(ValueError, match="level 1"):
        simulate_fetch(TINY_PLAN, _tiers(500, 500, 500))


def test_session_hits_counted_by_hand(tiny_profile):
    trace = np.array(
        [
            [0, 0, 0],  # cold: 3 misses
            [0, 0, 1],  # same L1, L2: 2 hits, L3 miss
            [0, 1, 2],  # same L1: 1 hit
            [1, 2, 4],  # new topic: 0 hits
            [0, 0, 1],  # everything seen before (cache of 1 MB keeps all): 3 hits
        ]
    )
    s = simulate_session(TINY_PLAN, tiny_profile, trace, "bf16", 10**6)
    assert s.hier_hits.tolist() == [0, 2, 1, 0, 3]
    assert s.hier_misses.tolist() == [3, 1, 2, 3, 0]
    l1, l2, l3 = 0.385, 1.93, 0.97
    assert s.hier_seconds.tolist() == pytest.approx([l1 + l2 + l3, l3, l2 + l3, l1 + l2 + l3, 0.0])
    assert s.hier_bytes.tolist() == [672, 96, 288, 672, 0]
    # Flat is keyed by the level-3 cluster: 0, 1, 2, 4, 1 → only the last query hits.
    assert s.flat_hit.tolist() == [False, False, False, False, True]
    assert s.flat_seconds.tolist() == pytest.approx([6.73] * 4 + [0.0])
    summary = s.summary()
    assert summary["hierarchical"]["hit_rate"] == pytest.approx(6 / 15)
    assert summary["flat"]["hit_rate"] == pytest.approx(1 / 5)
    assert summary["hierarchical"]["bytes_read_total"] == 672 + 96 + 288 + 672
    # Without a cache every query pays the full fetch.
    cold = simulate_session(TINY_PLAN, tiny_profile, trace, "bf16", 0)
    assert cold.hier_seconds.tolist() == pytest.approx([3.285] * 5)
    assert not cold.hier_level_hit.any() and not cold.flat_hit.any()


def test_repeated_queries_hit_after_the_first(tiny_profile):
    trace = np.tile([[1, 3, 7]], (6, 1))
    s = simulate_session(TINY_PLAN, tiny_profile, trace)  # profile cache: 1e-3 GB = 1 MB
    assert s.hier_hits.tolist() == [0, 3, 3, 3, 3, 3]
    assert s.hier_seconds.tolist() == pytest.approx([3.285, 0, 0, 0, 0, 0])
    assert s.flat_seconds.tolist() == pytest.approx([6.73, 0, 0, 0, 0, 0])
    # Charging hits a copy at the fast tier's 1000 B/s: 672 B → 0.672 s for both banks.
    c = simulate_session(TINY_PLAN, tiny_profile, trace, count_cache_copy=True)
    assert c.hier_seconds[1:].tolist() == pytest.approx([0.672] * 5)
    assert c.flat_seconds[1:].tolist() == pytest.approx([0.672] * 5)
    # the misses that fill the cache are handed out as copies too, as the store's cache does
    assert c.hier_seconds[0] == pytest.approx(3.285 + 0.672) and c.flat_seconds[0] == pytest.approx(
        6.73 + 0.672
    )
    # a cache too small to keep a block copies nothing out
    z = simulate_session(TINY_PLAN, tiny_profile, trace, cache_bytes=0, count_cache_copy=True)
    assert z.hier_seconds.tolist() == pytest.approx([3.285] * 6)


def test_traces_that_do_not_fit_the_tree_are_rejected():
    with pytest.raises(ValueError, match="not a nested path"):
        validate_trace(TINY_PLAN, np.array([[0, 0, 0], [0, 2, 4]]))
    with pytest.raises(ValueError, match="level-3 ids must lie in"):
        validate_trace(TINY_PLAN, np.array([[0, 0, 8]]))
    with pytest.raises(ValueError, match="shape"):
        validate_trace(TINY_PLAN, np.zeros((3, 2), dtype=np.int64))


def test_zipf_trace_is_deterministic_nested_and_topical():
    a = zipf_trace(2000, 4, 3, seed=7)
    assert a.shape == (2000, 3) and a.dtype == np.int64
    np.testing.assert_array_equal(a, zipf_trace(2000, 4, 3, seed=7))
    assert not np.array_equal(a, zipf_trace(2000, 4, 3, seed=8))
    for lv in range(1, 4):
        assert a[:, lv - 1].min() >= 0 and a[:, lv - 1].max() < 4**lv
    assert (a[:, 1] // 4 == a[:, 0]).all() and (a[:, 2] // 4 == a[:, 1]).all()
    # Popularity is skewed: the top leaf is far above the uniform share of 1/64.
    assert np.bincount(a[:, 2], minlength=64).max() > 3 * 2000 / 64
    # stay=1 never leaves the first query's level-1/level-2 topic.
    s = zipf_trace(200, 4, 3, stay=1.0, seed=1)
    assert (s[:, :2] == s[0, :2]).all() and len(set(s[:, 2])) > 1
    # Consecutive queries share their shallow levels more often than independent draws would.
    b = zipf_trace(2000, 4, 3, stay=0.0, seed=7)
    assert (a[1:, 1] == a[:-1, 1]).mean() > 0.7 > (b[1:, 1] == b[:-1, 1]).mean()


def test_load_trace_npy_and_jsonl(tmp_path):
    t = zipf_trace(20, 2, 3, seed=0)
    np.save(tmp_path / "t.npy", t)
    np.testing.assert_array_equal(load_trace(tmp_path / "t.npy"), t)
    lines = [
        json.dumps(row) if i % 2 else json.dumps({"path": row}) for i, row in enumerate(t.tolist())
    ]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    np.testing.assert_array_equal(load_trace(tmp_path / "t.jsonl"), t)
    (tmp_path / "bad.jsonl").write_text("[0, 0, 0]\n[0, 1]\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_trace(tmp_path / "bad.jsonl")


def test_paper_claims_on_the_phone_profile():
    """§3 / Fig. 5 on openlm-160m (256,64,16,0) FFN bf16: hierarchical beats flat, cold and in a
    session."""
    p = plan("openlm-160m", (256, 64, 16, 0), type="ffn")
    assert p.bank_bytes("bf16") / 1e9 == pytest.approx(9.25, abs=0.01)
    phone = load_profile("phone")
    f = simulate_fetch(p, phone, "bf16")
    order = [t.name for t in phone.tiers]
    tier_rank = [order.index(lv.tier) for lv in f.levels]
    assert tier_rank == sorted(tier_rank) and tier_rank[0] == 0  # shallow levels on faster tiers
    # the flat bank's excessive total size leaves only the external disk
    assert f.flat.tier == "disk"
    assert f.flat.seconds > 5 * f.seconds
    trace = zipf_trace(500, 16, 4, seed=0)
    s = simulate_session(p, phone, trace, "bf16").summary()
    assert s["hierarchical"]["mean_s"] * 5 < s["flat"]["mean_s"]
    assert s["hierarchical"]["hit_rate"] > s["flat"]["hit_rate"]
    # Both banks on the external disk: only the deep levels are swapped, still much faster than flat
    # reloads.
    d = simulate_session(
        p, phone, trace, "bf16", policy=pinned(p, "disk"), flat_tier="disk"
    ).summary()
    assert d["hierarchical"]["warm_mean_s"] * 2 < d["flat"]["warm_mean_s"]


def test_shipped_profiles_load_with_sources():
    for name in ("phone", "laptop"):
        prof = load_profile(name)
        assert prof.name == name and len(prof.tiers) == 3 and prof.cache_gb > 0
        assert all(t.source for t in prof.tiers)
        bws = [t.bandwidth_gbps for t in prof.tiers]
        assert bws == sorted(bws, reverse=True)  # fastest first
        assert prof.tiers[-1].capacity_gb is None


def test_profile_errors_name_the_key(tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text(TWO_TIERS_YAML.replace("bandwidth_gbps: 1.0e-7", "bandwith_gbps: 1.0e-7"))
    with pytest.raises(ConfigError, match="bandwith_gbps"):
        load_profile(bad)
    bad.write_text(TWO_TIERS_YAML + "ram_gb: 4\n")
    with pytest.raises(ConfigError, match="ram_gb"):
        load_profile(bad)
    bad.write_text(TWO_TIERS_YAML.replace("bandwidth_gbps: 1.0e-6", "bandwidth_gbps: 0"))
    with pytest.raises(ConfigError, match="bandwidth_gbps must be positive"):
        load_profile(bad)
    bad.write_text(TWO_TIERS_YAML.replace("latency_us: 1000 ", "latency_us: -1 "))
    with pytest.raises(ConfigError, match="latency_us must be non-negative"):
        load_profile(bad)
    bad.write_text(TWO_TIERS_YAML.replace("version: 1", "version: 2"))
    with pytest.raises(ConfigError, match="version 2"):
        load_profile(bad)
    with pytest.raises(ConfigError, match="unknown hardware profile"):
        load_profile("toaster")


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    return parser.parse_args(argv)


def test_run_simulate_end_to_end(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = run_simulate(
        _cli(
            ["--n-queries", "200", "--sweep", "256,64,16,0;0,16,4,1;5376,0,0,0", "--out", str(out)]
        )
    )
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert [r["profile"]["name"] for r in data["results"]] == ["phone", "laptop"]
    phone = data["results"][0]
    assert phone["fetch"]["flat"]["tier"] == "disk"
    assert len(phone["session"]["per_query"]["hierarchical"]["seconds"]) == 200
    assert [row["config"] for row in phone["sweep"]] == ["256,64,16,0", "0,16,4,1", "5376,0,0,0"]
    # A single-level config is its own flat bank: no advantage either way.
    assert phone["sweep"][2]["speedup"] == pytest.approx(1.0)
    for png in ("fetch.png", "session.png", "sweep.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "hierarchical" in (out / "report.md").read_text()
    printed = capsys.readouterr().out
    assert "phone" in printed and str(out / "results.json") in printed
    # Rerunning gives the same numbers.
    run_simulate(
        _cli(
            ["--n-queries", "200", "--sweep", "256,64,16,0;0,16,4,1;5376,0,0,0", "--out", str(out)]
        )
    )
    assert json.loads((out / "results.json").read_text()) == data


def test_run_simulate_with_a_trace_file_and_pinned_tier(tmp_path):
    np.save(tmp_path / "trace.npy", zipf_trace(50, 16, 4, seed=3))
    out = tmp_path / "pinned"
    rc = run_simulate(
        _cli(
            [
                "--profile",
                "phone",
                "--trace",
                str(tmp_path / "trace.npy"),
                "--pin-tier",
                "disk",
                "--out",
                str(out),
            ]
        )
    )
    assert rc == 0
    res = json.loads((out / "results.json").read_text())["results"][0]
    assert {lv["tier"] for lv in res["fetch"]["levels"]} == {"disk"} and res["fetch"]["flat"][
        "tier"
    ] == "disk"
    assert res["session"]["summary"]["hierarchical"]["n_queries"] == 50
    assert not (out / "sweep.png").exists()
    with pytest.raises(ValueError, match="needs --tree"):
        run_simulate(_cli(["--queries", str(tmp_path / "q.txt"), "--out", str(out)]))


def _tiny_tree(tmp_path: Path):
    from memtree.clustering.tree import build_tree, load_tree, save_tree

    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 384)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    tree, _ = build_tree(x, levels=2, branching=4, batch_size=256, steps=5, seed=0, n_jobs=1)
    save_tree(tree, tmp_path / "tree", config={"levels": 2}, embedder={"model": None})
    return load_tree(tmp_path / "tree")


def test_routed_paths_replay_as_a_session(tmp_path):
    from memtree.clustering.route import route

    tree = _tiny_tree(tmp_path)
    q = np.random.default_rng(1).normal(size=(30, 384)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    paths = route(tree, np.repeat(q, 2, axis=0))  # each query asked twice in a row
    p = plan(TINY, (2, 1), type="ffn", branching=tree.branching)
    validate_trace(p, paths)
    s = simulate_session(p, load_profile("phone"), paths)
    assert s.hier_level_hit[1::2].all() and s.flat_hit[1::2].all()


@pytest.mark.slow
def test_trace_from_texts_routes_real_queries(tmp_path):
    from memtree.memstore.sim.latency import trace_from_texts

    _tiny_tree(tmp_path)
    texts = ["the atomic number of carbon", "the atomic number of carbon", "a recipe for bread"]
    paths = trace_from_texts(tmp_path / "tree", texts, device="cpu")
    assert paths.shape == (3, 2) and (paths[0] == paths[1]).all()
    validate_trace(plan(TINY, (2, 1), type="ffn", branching=4), paths)
