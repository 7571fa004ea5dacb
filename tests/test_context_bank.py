"""The context bank store (memstore/context/bank.py): capacity and weighted merging, cluster
retrieval, blocking / deletion with audit, versioned persistence with fallback and crash safety."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memtree.memstore.context.bank import (
    FORMAT,
    SAVE_PAUSE_ENV,
    ContextBank,
    ContextBankConfig,
)

ROOT = Path(__file__).resolve().parents[1]


def cfg(**kw) -> ContextBankConfig:
    base = {
        "dim": 2,
        "n_latent": 1,
        "capacity": 4,
        "n_clusters": 2,
        "top_k": 1,
        "merge_importance_weight": 0.0,
        "merge_age_weight": 0.0,
    }
    base.update(kw)
    return ContextBankConfig(**base)


def tok(*v: float) -> torch.Tensor:
    return torch.tensor([list(v)], dtype=torch.float32)  # (1, d)


def filled(bank: ContextBank, pts) -> list[int]:
    return [bank.append(tok(*p), session="s") for p in pts]


# -- config ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,value",
    [
        ("dim", 0),
        ("n_latent", -1),
        ("capacity", 1),
        ("n_clusters", 0),
        ("merge_age_weight", -1.0),
        ("merge_rule", "max"),
        ("top_k", 3),
        ("merge_scope", "tree"),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        cfg(**{field: value})


def test_append_checks_shape():
    bank = ContextBank(cfg())
    with pytest.raises(ValueError, match="n_latent"):
        bank.append(torch.zeros(2, 2), session="s")
    with pytest.raises(ValueError, match="dim"):
        bank.append(torch.zeros(1, 3), session="s")


# -- capacity and merging ----------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_capacity_never_exceeded(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    c = ContextBankConfig(
        dim=4,
        n_latent=3,
        capacity=rng.randint(2, 9),
        n_clusters=3,
        top_k=2,
        merge_rule=rng.choice(["sum", "mean"]),
        recluster_every=rng.choice([0, 7]),
    )
    bank = ContextBank(c)
    last = -1
    for _ in range(120):
        eid = bank.append(torch.randn(3, 4), session=f"s{rng.randint(0, 3)}")
        assert eid > last  # ids are monotonic, never reused
        last = eid
        assert len(bank) <= c.capacity
        if rng.random() < 0.3:
            ids = list(bank.meta)
            bank.record_attention(
                rng.sample(ids, k=min(2, len(ids))), [rng.random()] * min(2, len(ids))
            )
        if rng.random() < 0.05 and len(bank) > 2:
            bank.delete([rng.choice(list(bank.meta))])
        # cluster bookkeeping stays consistent with the entries
        assert int(bank.counts.sum()) == len(bank)
        for k in range(c.n_clusters):
            assert int(bank.counts[k]) == sum(m.cluster == k for m in bank.meta.values())
    assert bank.stats["merges"] > 0
    merges = [r for r in bank.log if r["action"] == "merge"]
    assert len(merges) == bank.stats["merges"]


def test_merge_plain_closest_pair_is_summed():
    bank = ContextBank(cfg())
    a, b, *_ = filled(bank, [(0, 0), (1, 0), (10, 0), (10, 2)])  # d²: ab=1, cd=4
    new = bank.append(tok(5, 5), session="t")
    assert a not in bank.meta and b not in bank.meta
    merged = [i for i, m in bank.meta.items() if m.merged_from == [a, b]]
    assert len(merged) == 1
    assert torch.equal(bank.tokens[merged[0]], tok(1, 0))  # (0,0) + (1,0): the seed's sum
    assert new == merged[0] + 1 and len(bank) == 4
    rec = bank.log[-1]
    assert rec["action"] == "merge" and rec["ids"] == [a, b] and rec["new"] == merged[0]
    assert rec["score"] == pytest.approx(1.0)


def test_importance_changes_the_merged_pair():
    # unweighted (a, b) is closest (1 < 4); a's attention makes w(a,b) = 1 + 5·1 = 6 → 6 > 4
    bank = ContextBank(cfg(merge_importance_weight=5.0))
    a, b, c_, d = filled(bank, [(0, 0), (1, 0), (10, 0), (10, 2)])
    bank.record_attention([a], [1.0])
    bank.append(tok(5, 5), session="t")
    assert a in bank.meta and b in bank.meta and c_ not in bank.meta and d not in bank.meta
    rec = [r for r in bank.log if r["action"] == "merge"][-1]
    assert rec["ids"] == [c_, d] and rec["score"] == pytest.approx(4.0)
    assert torch.equal(bank.tokens[rec["new"]], tok(20, 2))


def test_age_changes_the_merged_pair():
    # (c, d) is closer (1 < 4) but young: ages at the 5th write are a3 b2 c1 d0, so
    # score(a,b) = 4 / (1 + 10·2) ≈ 0.19 < score(c,d) = 1 / (1 + 10·0) = 1
    bank = ContextBank(cfg(merge_age_weight=10.0))
    a, b, c_, d = filled(bank, [(0, 0), (2, 0), (10, 0), (11, 0)])
    assert [bank.meta[i].age for i in (a, b, c_, d)] == [3, 2, 1, 0]
    bank.append(tok(5, 5), session="t")
    rec = [r for r in bank.log if r["action"] == "merge"][-1]
    assert rec["ids"] == [a, b] and rec["score"] == pytest.approx(4 / 21)
    # with no age weighting the same bank merges (c, d)
    bank2 = ContextBank(cfg())
    _a2, _b2, c2, d2 = filled(bank2, [(0, 0), (2, 0), (10, 0), (11, 0)])
    bank2.append(tok(5, 5), session="t")
    assert [r for r in bank2.log if r["action"] == "merge"][-1]["ids"] == [c2, d2]


def test_mean_rule_weights_by_importance():
    bank = ContextBank(cfg(merge_rule="mean"))
    _a, b, *_ = filled(bank, [(0, 0), (1, 0), (10, 0), (10, 2)])
    bank.record_attention([b], [3.0])  # weights 1 and 4 → (0·1 + 1·4) / 5
    bank.append(tok(5, 5), session="t")
    new = [r for r in bank.log if r["action"] == "merge"][-1]["new"]
    assert torch.allclose(bank.tokens[new], tok(0.8, 0))
    assert bank.meta[new].attn_sum == 3.0 and bank.meta[new].attn_count == 1


def test_blocked_entries_are_not_merged():
    bank = ContextBank(cfg())
    a, _b, c_, d = filled(bank, [(0, 0), (1, 0), (10, 0), (10, 2)])
    bank.block([a])
    bank.append(tok(5, 5), session="t")
    assert a in bank.meta and c_ not in bank.meta and d not in bank.meta


def test_cluster_scope_merges_the_closest_pair_inside_a_cluster():
    # two clusters seeded by (0,0) and (10,0); (4,0) joins the first (its centroid moves to
    # (2,0)), (6.5,0) the second. Globally closest: (4,0)–(6.5,0) (d² = 6.25) across the
    # clusters; inside them: (0,0)–(4,0) (16) and (6.5,0)–(10,0) (12.25).
    pts = [(0, 0), (10, 0), (4, 0), (6.5, 0)]
    exact = ContextBank(cfg())
    ids = filled(exact, pts)
    exact.append(tok(20, 20), session="t")
    assert exact.log[-1]["ids"] == [ids[2], ids[3]] and exact.log[-1]["distance"] == pytest.approx(
        6.25
    )
    scoped = ContextBank(cfg(merge_scope="cluster"))
    ids = filled(scoped, pts)
    assert [scoped.meta[i].cluster for i in ids] == [0, 1, 0, 1]
    scoped.append(tok(20, 20), session="t")
    rec = scoped.log[-1]
    assert rec["ids"] == [ids[1], ids[3]] and rec["distance"] == pytest.approx(12.25)
    assert rec["scope"] == "cluster" and len(scoped) == 4


def test_cluster_scope_falls_back_to_all_pairs_when_no_cluster_can_merge():
    bank = ContextBank(cfg(capacity=2, n_clusters=2, merge_scope="cluster"))
    a, b = filled(bank, [(0, 0), (10, 0)])  # one entry per cluster
    bank.append(tok(1, 1), session="t")
    assert bank.log[-1]["ids"] == [a, b] and len(bank) == 2


@pytest.mark.parametrize("seed", [0, 1])
def test_cluster_scope_cache_gives_the_uncached_choice(seed):
    """Cached per-cluster distances pick exactly what a fresh computation picks, merge after
    merge, through deletions, blocking, importance, ageing and re-clustering."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    c = ContextBankConfig(
        dim=3,
        n_latent=2,
        capacity=12,
        n_clusters=3,
        merge_scope="cluster",
        merge_importance_weight=0.5,
        merge_age_weight=0.2,
        recluster_every=9,
    )
    bank = ContextBank(c)
    for _ in range(80):
        if len(bank) >= c.capacity:
            cached = bank._closest_pair()  # with whatever the cache holds
            saved = dict(bank._dist_cache)
            bank._dist_cache.clear()
            assert bank._closest_pair() == cached
            bank._dist_cache.update(saved)
        bank.append(torch.randn(2, 3), session="s")
        assert len(bank) <= c.capacity
        if rng.random() < 0.2:
            ids = list(bank.meta)
            bank.record_attention([rng.choice(ids)], [rng.random()])
        if rng.random() < 0.05 and len(bank) > 3:
            bank.delete([rng.choice(list(bank.meta))])
        if rng.random() < 0.05 and len(bank) > 3:
            bank.block([rng.choice(list(bank.meta))])
    assert bank.stats["merges"] > 10 and all(
        r["scope"] == "cluster" for r in bank.log if r["action"] == "merge"
    )


# -- retrieval --------------------------------------------------------------------------------
def test_retrieval_picks_top_clusters():
    bank = ContextBank(cfg(dim=4, n_latent=2, capacity=10, n_clusters=3, top_k=2))
    e = torch.eye(4)
    ids = [bank.append(torch.stack([e[k], e[k]]), session="s") for k in range(3)]
    # the first three entries seed the three empty clusters: centroids e0, e1, e2
    assert torch.equal(bank.centroids, e[:3])
    extra = bank.append(torch.stack([e[1], e[1] * 0.9]), session="s")  # joins cluster 1
    out = bank.retrieve(torch.tensor([1.0, 3.0, 2.0, 0.0]))  # scores 1, ~2.9, 2
    assert out.clusters.tolist() == [1, 2]
    assert out.ids.tolist() == [ids[1], ids[2], extra]
    assert out.tokens.shape == (6, 4)
    assert torch.equal(out.tokens[:2], torch.stack([e[1], e[1]]))
    assert bank.retrieve(torch.tensor([5.0, 0, 0, 0]), top_k=1).ids.tolist() == [ids[0]]


def test_recluster_keeps_bookkeeping():
    bank = ContextBank(cfg(dim=3, n_latent=2, capacity=30, n_clusters=4))
    torch.manual_seed(0)
    for _ in range(20):
        bank.append(torch.randn(2, 3), session="s")
    bank.recluster()
    assert int(bank.counts.sum()) == 20
    for k in range(4):
        members = [i for i, m in bank.meta.items() if m.cluster == k]
        if members:
            mean = torch.stack([bank.tokens[i].mean(0) for i in members]).mean(0)
            assert torch.allclose(bank.centroids[k], mean, atol=1e-5)


def test_blocked_and_deleted_never_returned(tmp_path):
    bank = ContextBank(cfg(dim=2, capacity=10, n_clusters=1))
    ids = filled(bank, [(1, 0), (2, 0), (3, 0)])
    bank.save(tmp_path / "cb")
    bank.block([ids[0]], reason="user asked")
    bank.delete([ids[1]], reason="gdpr")
    out = bank.retrieve(torch.tensor([1.0, 0.0]))
    assert out.ids.tolist() == [ids[2]]
    assert bank.stats["blocked_refused"] == 1 and bank.stats["reads"] == 1
    assert bank.stats["entries_served"] == 1 and bank.stats["deleted"] == 1
    with pytest.raises(PermissionError):
        bank.get(ids[0])
    with pytest.raises(KeyError):
        bank.get(ids[1])
    assert bank.stats["blocked_refused"] == 2
    # block / delete were appended to the log at once (the bank is bound to its directory)
    log = ContextBank.audit_log(tmp_path / "cb")
    assert [(r["action"], r["ids"], r["reason"]) for r in log] == [
        ("block", [ids[0]], "user asked"),
        ("delete", [ids[1]], "gdpr"),
    ]
    bank.unblock([ids[0]])
    assert sorted(bank.retrieve(torch.tensor([1.0, 0.0])).ids.tolist()) == [ids[0], ids[2]]
    bank.save(tmp_path / "cb")
    back = ContextBank.open(tmp_path / "cb")
    assert ids[1] not in back.meta and back.stats == bank.stats
    assert [r["action"] for r in ContextBank.audit_log(tmp_path / "cb")] == [
        "block",
        "delete",
        "unblock",
    ]


# -- persistence ------------------------------------------------------------------------------
def _random_bank(seed: int = 0, n: int = 9) -> ContextBank:
    torch.manual_seed(seed)
    bank = ContextBank(
        ContextBankConfig(
            dim=5,
            n_latent=3,
            capacity=6,
            n_clusters=3,
            top_k=2,
            merge_importance_weight=0.5,
            merge_age_weight=0.2,
        )
    )
    for k in range(n):
        bank.append(torch.randn(3, 5), session=f"s{k % 2}")
        ids = list(bank.meta)[:2]
        bank.record_attention(ids, [0.25, 0.125][: len(ids)])
    bank.block([list(bank.meta)[-1]])
    return bank


def _same(a: ContextBank, b: ContextBank) -> None:
    assert a.cfg == b.cfg and a.step == b.step and a.next_id == b.next_id
    assert list(a.tokens) == list(b.tokens)
    for i in a.tokens:
        assert torch.equal(a.tokens[i], b.tokens[i])
        assert a.meta[i] == b.meta[i]
    assert torch.equal(a.centroids, b.centroids) and torch.equal(a.counts, b.counts)
    assert a.stats == b.stats


def test_round_trip_is_bit_identical(tmp_path):
    bank = _random_bank()
    bank.save(tmp_path / "cb")
    back = ContextBank.open(tmp_path / "cb")
    _same(bank, back)
    man = json.loads((tmp_path / "cb" / "v00000001" / "manifest.json").read_text())
    assert man["format"] == FORMAT and man["version"] == 1
    merges = [r for r in ContextBank.audit_log(tmp_path / "cb") if r["action"] == "merge"]
    assert len(merges) == bank.stats["merges"] > 0
    # the reopened bank goes on where the saved one stopped
    x = torch.randn(3, 5)
    assert bank.append(x, session="z") == back.append(x, session="z")
    assert list(bank.tokens) == list(back.tokens)


def test_versions_are_pruned_to_current_and_fallback(tmp_path):
    bank = _random_bank()
    for _ in range(4):
        bank.append(torch.randn(3, 5), session="s")
        bank.save(tmp_path / "cb")
    assert sorted(p.name for p in (tmp_path / "cb").glob("v*")) == ["v00000003", "v00000004"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest"])
def test_corrupt_current_falls_back(tmp_path, damage):
    bank = _random_bank()
    bank.save(tmp_path / "cb")
    good = ContextBank.open(tmp_path / "cb")
    bank.append(torch.randn(3, 5), session="later")
    cur = bank.save(tmp_path / "cb")
    t = cur / "entries.safetensors"
    if damage == "flip":
        data = bytearray(t.read_bytes())
        data[-7] ^= 0xFF
        t.write_bytes(bytes(data))
    elif damage == "truncate":
        t.write_bytes(t.read_bytes()[: t.stat().st_size // 2])
    else:
        (cur / "manifest.json").write_text('{"format": "memtree-context-b')
    with pytest.warns(UserWarning, match="v00000002"):
        back = ContextBank.open(tmp_path / "cb")
    _same(good, back)
    assert back.recovered and back.recovered[0][0] == "v00000002"
    assert ContextBank.audit_log(tmp_path / "cb")[-1]["action"] == "recover"
    # saving again publishes v3 and drops the corrupt v2, keeping v1 as the fallback
    back.save(tmp_path / "cb")
    assert sorted(p.name for p in (tmp_path / "cb").glob("v*")) == ["v00000001", "v00000003"]


def test_crash_mid_write_keeps_previous_version(tmp_path):
    bank = _random_bank()
    bank.save(tmp_path / "cb")
    script = (
        "import torch\n"
        "from memtree.memstore.context.bank import ContextBank\n"
        f"b = ContextBank.open({str(tmp_path / 'cb')!r})\n"
        "b.append(torch.ones(3, 5), session='doomed')\n"
        f"b.save({str(tmp_path / 'cb')!r})\n"
    )
    env = {**os.environ, SAVE_PAUSE_ENV: "60", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=ROOT)
    try:
        deadline = time.time() + 60
        while not list((tmp_path / "cb").glob(".v00000002.tmp-*/manifest.json")):
            assert proc.poll() is None, "save process exited before pausing"
            assert time.time() < deadline, "save never reached its pause"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    back = ContextBank.open(tmp_path / "cb")
    _same(bank, back)
    assert back.recovered == []
    back.save(tmp_path / "cb")  # a later save clears the dead temp dir
    assert not list((tmp_path / "cb").glob(".v*"))


def test_mismatched_bank_errors_name_the_field(tmp_path):
    bank = _random_bank()
    bank.save(tmp_path / "cb")
    for field, value in (("dim", 6), ("n_latent", 4)):
        other = ContextBankConfig(**{**bank.cfg.__dict__, field: value})
        with pytest.raises(ValueError, match=field):
            ContextBank.open(tmp_path / "cb", config=other)
    man_path = tmp_path / "cb" / "v00000001" / "manifest.json"
    man = json.loads(man_path.read_text())
    man["version"] = 2
    man_path.write_text(json.dumps(man))
    with pytest.raises(ValueError, match="version"):
        ContextBank.open(tmp_path / "cb")
