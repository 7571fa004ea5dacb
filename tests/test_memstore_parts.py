"""The parts `MemoryStore` is a facade over, each on its own: the blocking policy and its session
layer (memstore.policy), the open levels and their tier reads (memstore.levels, memstore.tiers),
the reload decisions (memstore.sync), deletion's writes (memstore.commit), the audit line
(memstore.audit) and the counters (memstore.stats)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from memtree.geometry import AnchorShape, MemoryConfig
from memtree.memstore.audit import append_audit, audit_log, blocked_as_subtree
from memtree.memstore.commit import erase_writes
from memtree.memstore.format import GENERIC, BankError, read_manifest
from memtree.memstore.levels import OpenLevels
from memtree.memstore.policy import (
    BlockPolicy,
    apply_blocked,
    expand_targets,
    id_runs,
    read_policy,
    refused_mask,
)
from memtree.memstore.stats import StoreStats, blocked_fraction
from memtree.memstore.sync import BankSync
from memtree.memstore.tiers import DiskReader, FlashReader, RamReader, TierConfig
from memtree.memstore.writer import write_bank

TINY = AnchorShape(
    name="tiny", n_layers=1, d_model=16, n_heads=2, head_dim=8, ffn_dim=32, vocab_size=100
)
MEM = MemoryConfig(multipliers=(4, 2), branching=4)  # level 1: 4 blocks, level 2: 16


@pytest.fixture
def bank(tmp_path) -> Path:
    def blocks(level):
        n = 4**level
        params = 3 * 16 * MEM.multipliers[level - 1]
        for c in range(n):
            yield c, torch.full((params,), float(c))
        yield GENERIC, torch.full((params,), -1.0)

    write_bank(tmp_path / "bank", anchor=TINY, memory=MEM, dtype="fp32", blocks=blocks)
    return tmp_path / "bank"


def test_policy_runs_masks_and_expansion(bank):
    assert id_runs([5, 1, 2, 3, 3, 9]) == [[1, 4], [5, 6], [9, 10]]
    policy = read_policy(bank)
    assert policy["fallback"] == "zeros" and policy["blocked"] == {}
    apply_blocked(policy, "block", {2: [4, 5, 6]})
    apply_blocked(policy, "unblock", {2: [5]})
    assert policy["blocked"] == {"2": [[4, 5], [6, 7]]}
    levels = read_manifest(bank).levels
    mask = refused_mask(levels[2], policy, {"2": [[10, 12]]})
    assert np.flatnonzero(mask).tolist() == [4, 6, 10, 11]
    assert expand_targets(levels, 4, 1, [1], True) == {1: [1], 2: [4, 5, 6, 7]}
    with pytest.raises(ValueError, match="generic memory cannot be blocked"):
        expand_targets(levels, 4, 1, [GENERIC], False)


def test_block_policy_session_layer_never_reaches_the_file(bank):
    p = BlockPolicy(bank)
    p.load()
    p.session += [("block", {1: [2]}), ("fallback", "generic")]
    p.combine()
    assert p.effective["blocked"] == {"1": [[2, 3]]} and p.fallback == "generic"
    assert p.session_entries() == [{"action": "block", "targets": {"1": [[2, 3]]}}]
    p.disk["blocked"]["2"] = [[0, 1]]
    p.save()
    again = BlockPolicy(bank)
    again.load()
    assert again.effective["blocked"] == {"2": [[0, 1]]} and again.fallback == "zeros"


def test_open_levels_read_cache_verify_and_written(bank):
    info = read_manifest(bank)
    tiers = {
        "ram": TierConfig(name="ram", kind="ram", capacity_bytes=info.levels[1].file_bytes),
        "flash": TierConfig(name="flash", kind="flash", cache_bytes=1 << 20),
    }
    stats = StoreStats(tiers)
    opened = OpenLevels(
        bank, info, tiers, "hierarchical", stats.tiers, lambda lv: np.zeros(lv.n_blocks, bool)
    )
    try:
        assert opened.placement == {1: "ram", 2: "flash"} and set(opened.caches) == {"flash"}
        assert isinstance(opened.levels[1].reader, RamReader)
        assert isinstance(opened.levels[2].reader, FlashReader)
        L2 = opened.levels[2]
        for _ in range(2):
            assert torch.equal(
                opened.read(L2, 7, "always", None), torch.full((L2.info.params,), 7.0)
            )
        assert (stats.tiers["flash"].reads, L2.hits, L2.misses) == (1, 1, 1)
        report = stats.report(opened.placement, opened.caches, opened.levels)
        assert report["levels"]["2"]["hit_rate"] == 0.5
        stats.reset(opened.caches, opened.levels)
        assert stats.tiers["flash"].reads == 0 and stats.refused_served == {1: 0, 2: 0}

        L1 = opened.levels[1]
        L1.sums[0] ^= 0xFF  # the digest no longer matches the record
        with pytest.raises(BankError, match="level 1"):
            opened.read(L1, 0, "always", None)
        assert torch.equal(opened.read(L1, 0, "never", None), torch.zeros(L1.info.params))
        record = np.full(L1.info.params, 3.5, dtype="<f4").tobytes()
        opened.written(info, [(1, 0, record)])  # digest, verified set and the RAM copy patched
        assert torch.equal(opened.read(L1, 0, "always", None), torch.full((L1.info.params,), 3.5))

        opened.remask(lambda lv: np.ones(lv.n_blocks, bool), [1])
        assert blocked_fraction(opened.levels) == pytest.approx(4 * 192 / (4 * 192 + 16 * 96))
    finally:
        opened.close()
    assert opened.levels == {}


def test_disk_reader_and_sync_reload_decisions(bank):
    info = read_manifest(bank)
    stats = StoreStats(["disk"])
    disk = {"disk": TierConfig(name="disk", kind="disk")}
    opened = OpenLevels(
        bank, info, disk, "flat", stats.tiers, lambda lv: np.zeros(lv.n_blocks, bool)
    )
    assert isinstance(opened.levels[1].reader, DiskReader)
    L1 = opened.levels[1]
    assert torch.equal(opened.read(L1, 3, "once", None), torch.full((L1.info.params,), 3.0))
    opened.close()

    sync = BankSync(bank)
    loads = []
    sync.open(lambda: loads.append("open"))
    sync.note(info)
    assert not sync.files_changed() and not sync.refresh(lambda: loads.append("reload"))
    with sync.publishing():
        pass  # this store's own change: it has seen the counter it set
    assert not sync.refresh(lambda: loads.append("reload"))
    sync.seen = -1  # as if another process had changed the bank since
    assert sync.refresh(lambda: loads.append("reload")) and loads == ["open", "reload"]
    sync.close()


def test_erase_writes_and_audit_lines(bank):
    info = read_manifest(bank)
    writes, manifest = erase_writes(info, info.levels, {2: [3, 4]})
    assert [(lv, slot, len(rec), any(rec)) for lv, slot, rec in writes] == [
        (2, 3, info.levels[2].record_bytes, False),
        (2, 4, info.levels[2].record_bytes, False),
    ]
    assert manifest["deleted"] == {"2": [[3, 5]]} and "deleted" not in info.manifest

    append_audit(
        bank,
        user="ann",
        action="block",
        targets={1: [1], 2: [4, 5, 6, 7]},
        reason="why",
        generation=info.generation,
        request={"level": 1, "clusters": [1], "subtree": True},
    )
    (entry,) = audit_log(bank)
    assert entry["user"] == "ann" and entry["targets"] == {"1": [[1, 2]], "2": [[4, 8]]}
    assert blocked_as_subtree([entry], 1) == [1]
