"""Per-subtree banks, merge, relocation, adversarial blocking and the bank CLI."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from memtree.cli import main
from memtree.geometry import AnchorShape, MemoryConfig
from memtree.memstore.blocking import adversarial_block, random_block, rank_clusters, subtree_share
from memtree.memstore.format import GENERIC, BankError, read_manifest, verify_bank
from memtree.memstore.journal import audit_log
from memtree.memstore.merge import merge_banks, relocate_level, split_bank
from memtree.memstore.store import MemoryStore, TierConfig
from memtree.memstore.writer import write_bank

ANCHOR = AnchorShape(
    name="tiny", n_layers=3, d_model=16, n_heads=2, head_dim=8, ffn_dim=32, vocab_size=100
)
MEM = MemoryConfig(multipliers=(8, 4, 2), branching=4)


def _values(level: int, cluster: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * level + cluster + 7)
    return torch.randn(n, generator=g)


def _bank(path, dtype="bf16", **kw):
    return write_bank(
        path,
        anchor=ANCHOR,
        memory=MEM,
        dtype=dtype,
        init=lambda lv, c, codec: _values(lv, c, codec.params),
        **kw,
    )


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.parametrize("dtype", ["bf16", "int4"])
def test_split_then_merge_is_byte_identical(tmp_path, dtype):
    full = _bank(tmp_path / "full", dtype)
    parts = [split_bank(full.root, s, tmp_path / f"p{s}").root for s in range(4)]
    for s, p in enumerate(parts):
        info = read_manifest(p)
        assert info.subtree == s
        # subtree s owns clusters [s·4^(l-1), (s+1)·4^(l-1)) at level l
        assert {lv: (x.first_cluster, x.n_blocks) for lv, x in info.levels.items()} == {
            1: (s, 1),
            2: (4 * s, 4),
            3: (16 * s, 16),
        }
        verify_bank(p)
    merged = merge_banks(list(reversed(parts)), tmp_path / "merged", generic="first")
    for lv in (1, 2, 3):
        assert _sha(full.root / f"level-{lv}.bin") == _sha(merged.root / f"level-{lv}.bin")
        assert _sha(full.root / f"level-{lv}.sums") == _sha(merged.root / f"level-{lv}.sums")
    verify_bank(merged.root)


def test_per_subtree_bank_serves_only_its_clusters(tmp_path):
    full = _bank(tmp_path / "full", "fp32")
    part = split_bank(full.root, 2, tmp_path / "p2")
    with MemoryStore(part.root) as st:
        got = st.fetch([2, 9, 37], flat=True)
        assert torch.equal(got[2], _values(2, 9, st.codec(2).params))
        assert torch.equal(got[3], _values(3, 37, st.codec(3).params))
        with pytest.raises(BankError, match="cluster 1 is not in this bank"):
            st.fetch([1, 4, 16])


def test_merge_trained_parts_equals_bank_trained_with_same_updates(tmp_path):
    """Per-subtree jobs scatter their own updates; the merge equals one bank that got them all."""
    full = _bank(tmp_path / "full", "fp32")
    parts = [split_bank(full.root, s, tmp_path / f"p{s}").root for s in range(4)]
    updates = {s: (3, 16 * s + 5, torch.full((1, 288), float(s + 1))) for s in range(4)}
    for s, (lv, c, v) in updates.items():
        with MemoryStore(parts[s]) as st:
            st.scatter(lv, [c], v)
    with MemoryStore(full.root) as st:
        for lv, c, v in updates.values():
            st.scatter(lv, [c], v)
    merged = merge_banks(parts, tmp_path / "merged", generic="first")
    for lv in (1, 2, 3):
        assert _sha(full.root / f"level-{lv}.bin") == _sha(merged.root / f"level-{lv}.bin")


def test_merge_generic_mean_and_errors(tmp_path):
    full = _bank(tmp_path / "full", "fp32")
    parts = [split_bank(full.root, s, tmp_path / f"p{s}").root for s in range(4)]
    for s in range(4):
        with MemoryStore(parts[s]) as st:
            st.scatter(1, [GENERIC], torch.full((1, st.codec(1).params), float(s)))
    merged = merge_banks(parts, tmp_path / "m", generic="mean")
    with MemoryStore(merged.root) as st:
        assert torch.allclose(st.fetch_flat(1, GENERIC), torch.full((st.codec(1).params,), 1.5))
    with pytest.raises(BankError, match=r"subtrees \[3\] are missing"):
        merge_banks(parts[:3], tmp_path / "bad")
    with pytest.raises(BankError, match="given twice"):
        merge_banks(parts + parts[:1], tmp_path / "bad")
    other = write_bank(tmp_path / "other", anchor=ANCHOR, memory=MEM, dtype="bf16", subtree=3)
    with pytest.raises(BankError, match="dtype differs"):
        merge_banks(parts[:3] + [other.root], tmp_path / "bad")


def test_merge_carries_deletions_and_blocks(tmp_path):
    full = _bank(tmp_path / "full")
    with MemoryStore(full.root) as st:
        st.delete(3, [21])
        st.block(2, [13])
    parts = [split_bank(full.root, s, tmp_path / f"p{s}").root for s in range(4)]
    merged = merge_banks(parts, tmp_path / "m")
    assert read_manifest(merged.root).manifest["deleted"] == {"3": [[21, 22]]}
    with MemoryStore(merged.root) as st:
        assert st.is_refused(3, 21) and st.is_refused(2, 13) and not st.is_refused(2, 12)


def test_relocate_level_to_directory_and_url(tmp_path):
    full = _bank(tmp_path / "full", "fp32")
    new = relocate_level(full.root, 3, str(tmp_path / "external"))
    assert new == str((tmp_path / "external" / "level-3.bin").resolve())
    assert not (full.root / "level-3.bin").exists()
    url = relocate_level(full.root, 2, "memory://bank-test")
    assert url == "memory://bank-test/level-2.bin"
    verify_bank(full.root)
    tiers = [TierConfig(name="flash", kind="flash"), TierConfig(name="disk", kind="disk")]
    with MemoryStore(full.root, tiers=tiers, placement={1: "flash", 2: "disk", 3: "flash"}) as st:
        got = st.fetch([1, 6, 25], flat=True)
        assert torch.equal(got[2], _values(2, 6, st.codec(2).params))
        assert torch.equal(got[3], _values(3, 25, st.codec(3).params))
        assert st.stats()["tiers"]["disk"]["reads"] == 1
        # deleting on a local relocated file works; a remote one is read-only here
        st.delete(3, [25])
        with pytest.raises(BankError, match="read-only"):
            st.scatter(2, [6], torch.zeros(1, st.codec(2).params))
    assert (
        _values(3, 25, 288).numpy().tobytes()
        not in (tmp_path / "external" / "level-3.bin").read_bytes()
    )


def test_adversarial_block_takes_the_subtree_queries_route_to(tmp_path):
    full = _bank(tmp_path / "full")
    # 7 queries in level-1 subtree 2, 3 in subtree 0
    paths = np.array([[2, 9, 37]] * 7 + [[0, 1, 5]] * 3)
    assert rank_clusters(paths, 1) == [(2, 7), (0, 3)]
    with MemoryStore(full.root) as st:
        assert subtree_share(st, 1) == pytest.approx(1 / 4)
        report = adversarial_block(st, paths=paths, fraction=1 / 4, level=1)
        assert report["clusters"] == [2]
        assert report["bank_fraction_blocked"] == pytest.approx(1 / 4)
        assert report["queries_blocked"] == 7
        st.reset_stats()
        out = st.fetch([2, 9, 37], flat=True)
        assert all(float(t.abs().sum()) == 0 for t in out.values())
        assert sum(s["reads"] for s in st.stats()["tiers"].values()) == 0
        assert float(st.fetch([0, 1, 5], flat=True)[3].abs().sum()) > 0
    with MemoryStore(full.root) as st:  # persisted
        assert st.is_refused(3, 37) and not st.is_refused(3, 5)
    assert [e["action"] for e in audit_log(full.root)] == ["block"]


def test_random_block_control_blocks_the_same_share(tmp_path):
    full = _bank(tmp_path / "full")
    with MemoryStore(full.root) as st:
        r = random_block(st, fraction=0.5, level=1, seed=3)
        assert len(r["clusters"]) == 2
        assert st.blocked_fraction() == pytest.approx(0.5)


def test_cli_init_block_delete_verify_merge(tmp_path, capsys):
    bank = str(tmp_path / "bank")
    shape = "n_layers=3,d_model=16,n_heads=2,head_dim=8,ffn_dim=32,vocab_size=100"
    assert (
        main(
            [
                "memstore",
                "init",
                bank,
                "--anchor",
                shape,
                "--memory",
                "8,4,2",
                "--branching",
                "4",
                "--dtype",
                "int8",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "memstore",
                "block",
                bank,
                "--level",
                "1",
                "--clusters",
                "1",
                "--subtree",
                "--reason",
                "test",
            ]
        )
        == 0
    )
    assert main(["memstore", "delete", bank, "--level", "3", "--clusters", "2"]) == 0
    assert main(["memstore", "verify", bank]) == 0
    capsys.readouterr()
    assert main(["memstore", "info", bank, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["policy"]["blocked"] == {"1": [[1, 2]], "2": [[4, 8]], "3": [[16, 32]]}
    assert info["manifest"]["deleted"] == {"3": [[2, 3]]}
    assert main(["memstore", "fetch", bank, "--path", "1,4,16"]) == 0
    assert "refused" in capsys.readouterr().out
    assert main(["memstore", "split", bank, "--out", str(tmp_path / "parts")]) == 0
    # not the lock files
    parts = sorted(str(p) for p in (tmp_path / "parts").iterdir() if not p.name.startswith("."))
    assert (
        main(["memstore", "merge", *parts, "--out", str(tmp_path / "merged"), "--generic", "first"])
        == 0
    )
    assert _sha(tmp_path / "merged" / "level-2.bin") == _sha(tmp_path / "bank" / "level-2.bin")
    assert main(["memstore", "block", bank, "--queries", str(tmp_path / "q.txt")]) == 1
    assert "--tree" in capsys.readouterr().err
