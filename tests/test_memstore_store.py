"""memstore.store: tiers and placement, fetch/gather/scatter, the block cache, blocking,
deletion, edits, and crash safety of in-place edits.

Banks are real directories written by `write_bank` from values generated here; expected
values, read counts, cache hits, level-file sizes and blocked fractions are derived by
hand from the tiny geometry:

    3 layers, d_model 16, FFN memory, multipliers (8, 4, 2), branching 4
    level 1: 4 blocks of 1152 params, level 2: 16 x 576, level 3: 64 x 288
    bf16 records 2304 / 1152 / 576 bytes, fp32 4608 / 2304 / 1152 bytes
    bf16 strides 4096 everywhere → level files (n + 1 generic) x 4096 =
        20,480 / 69,632 / 266,240 bytes
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from memtree.geometry import AnchorShape, MemoryConfig, block_layout
from memtree.memstore.format import GENERIC, BankError, read_manifest, verify_bank
from memtree.memstore.journal import audit_log
from memtree.memstore.store import MemoryStore, TierConfig
from memtree.memstore.writer import write_bank

REPO = Path(__file__).resolve().parents[1]

TINY = AnchorShape(
    name="tiny", n_layers=3, d_model=16, n_heads=2, head_dim=8, ffn_dim=32, vocab_size=100
)
MEM = MemoryConfig(multipliers=(8, 4, 2), branching=4)
WIDTH = {1: 8, 2: 4, 3: 2}
N_BLOCKS = {1: 4, 2: 16, 3: 64}
PARAMS = {1: 1152, 2: 576, 3: 288}
FP32_RECORD = {1: 4608, 2: 2304, 3: 1152}
FP32_STRIDE = {1: 8192, 2: 4096, 3: 4096}
BF16_FILE_BYTES = {1: 5 * 4096, 2: 17 * 4096, 3: 65 * 4096}

FLASH = [TierConfig(name="flash", kind="flash")]
RAM = TierConfig(name="ram", kind="ram")
DISK = TierConfig(name="disk", kind="disk")


def hand_layout(level: int) -> list[tuple[str, tuple[int, int]]]:
    return [(f"layers.{i}.{n}", (WIDTH[level], 16)) for i in range(3) for n in ("w1", "w2", "w3")]


def random_values(seed: int = 0) -> dict[int, torch.Tensor]:
    """{level: (n_blocks + 1, params)}; the last row is the generic memory."""
    g = torch.Generator().manual_seed(seed)
    return {lv: torch.randn(N_BLOCKS[lv] + 1, PARAMS[lv], generator=g) for lv in (1, 2, 3)}


def version_values(k: int) -> dict[int, torch.Tensor]:
    """Block c of version k is constant k*1000 + c (generic: k*1000 + 999): exact in fp32."""
    return {
        lv: torch.stack(
            [torch.full((PARAMS[lv],), float(k * 1000 + c)) for c in [*range(N_BLOCKS[lv]), 999]]
        )
        for lv in (1, 2, 3)
    }


def write(root: Path, values, dtype: str = "fp32", **kw):
    def blocks(level):
        v = values[level]
        for c in range(N_BLOCKS[level]):
            yield c, v[c]
        yield GENERIC, v[-1]

    return write_bank(root, anchor=TINY, memory=MEM, dtype=dtype, blocks=blocks, **kw)


def reads(st: MemoryStore) -> dict[str, int]:
    return {n: s["reads"] for n, s in st.stats()["tiers"].items()}


def total_reads(st: MemoryStore) -> int:
    return sum(reads(st).values())


def slot_bytes(root: Path, level: int, slot: int, stride: int, n: int) -> bytes:
    with open(root / f"level-{level}.bin", "rb") as f:
        f.seek(slot * stride)
        return f.read(n)


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture
def bank(tmp_path):
    values = random_values(100)
    root = tmp_path / "bank"
    write(root, values)
    return root, values


# --------------------------------------------------------------------------- placement


def test_hierarchical_placement_spills_deeper_levels(tmp_path):
    values = random_values(1)
    root = tmp_path / "b"
    info = write(root, values, "bf16")
    assert {lv: info.levels[lv].file_bytes for lv in (1, 2, 3)} == BF16_FILE_BYTES
    tiers = [
        TierConfig(name="ram", kind="ram", capacity_bytes=30_000),
        TierConfig(name="flash", kind="flash", capacity_bytes=100_000),
        DISK,
    ]
    with MemoryStore(root, tiers=tiers) as st:
        # 20,480 B fits the 30,000 B RAM; 69,632 B fits flash; 266,240 B only disk
        assert st.placement == {1: "ram", 2: "flash", 3: "disk"}
        assert st.stats()["placement"] == {"1": "ram", "2": "flash", "3": "disk"}
        assert st.stats()["tiers"]["ram"]["load_bytes"] == 20_480
        out = st.fetch([2, 9, 37], flat=True)
        assert reads(st) == {"ram": 1, "flash": 1, "disk": 1}
        for level, c in ((1, 2), (2, 9), (3, 37)):
            assert torch.equal(out[level], values[level][c].bfloat16())
    tiers = [
        TierConfig(name="ram", kind="ram", capacity_bytes=100_000),
        TierConfig(name="flash", kind="flash"),
    ]
    with MemoryStore(root, tiers=tiers) as st:  # 20,480 + 69,632 = 90,112 ≤ 100,000
        assert st.placement == {1: "ram", 2: "ram", 3: "flash"}


def test_ram_too_small_for_anything_puts_all_on_flash(tmp_path):
    write(tmp_path / "b", random_values(2), "bf16")
    tiers = [
        TierConfig(name="ram", kind="ram", capacity_bytes=20_479),
        TierConfig(name="flash", kind="flash"),
    ]
    with MemoryStore(tmp_path / "b", tiers=tiers) as st:
        assert st.placement == {1: "flash", 2: "flash", 3: "flash"}
        assert st.stats()["tiers"]["ram"]["load_bytes"] == 0


def test_flat_policy_puts_all_levels_on_one_tier(tmp_path):
    write(tmp_path / "b", random_values(3), "bf16")
    total = sum(BF16_FILE_BYTES.values())  # 356,352
    small = [
        TierConfig(name="ram", kind="ram", capacity_bytes=100_000),
        TierConfig(name="flash", kind="flash"),
    ]
    with MemoryStore(tmp_path / "b", tiers=small, placement="flat") as st:
        assert st.placement == {1: "flash", 2: "flash", 3: "flash"}
    big = [
        TierConfig(name="ram", kind="ram", capacity_bytes=total),
        TierConfig(name="flash", kind="flash"),
    ]
    with MemoryStore(tmp_path / "b", tiers=big, placement="flat") as st:
        assert st.placement == {1: "ram", 2: "ram", 3: "ram"}


def test_explicit_placement_is_honoured(tmp_path):
    values = random_values(4)
    write(tmp_path / "b", values, "bf16")
    tiers = [RAM, TierConfig(name="flash", kind="flash"), DISK]
    with MemoryStore(
        tmp_path / "b", tiers=tiers, placement={1: "disk", 2: "ram", 3: "flash"}
    ) as st:
        assert st.placement == {1: "disk", 2: "ram", 3: "flash"}
        st.fetch([0, 1, 4])
        assert reads(st) == {"ram": 1, "flash": 1, "disk": 1}
        assert st.stats()["tiers"]["ram"]["load_bytes"] == BF16_FILE_BYTES[2]
        assert torch.equal(st.fetch_flat(1, 3), values[1][3].bfloat16())
    tight = [
        TierConfig(name="ram", kind="ram", capacity_bytes=50_000),
        TierConfig(name="flash", kind="flash"),
    ]
    with pytest.raises(ValueError, match="level 2"):
        MemoryStore(tmp_path / "b", tiers=tight, placement={1: "flash", 2: "ram", 3: "flash"})
    with pytest.raises(ValueError, match="level 3"):
        MemoryStore(tmp_path / "b", tiers=tight, placement={1: "flash", 2: "flash"})


def test_level_file_on_an_fsspec_url(tmp_path):
    """A level whose manifest `file` is a URL is read through fsspec (disk or RAM tier);
    its digests stay in the bank directory; it cannot be read by flash or edited."""
    import fsspec

    values = random_values(5)
    root = tmp_path / "b"
    write(root, values, "bf16")
    url = f"memory://{tmp_path.name}/level-3.bin"
    fs = fsspec.filesystem("memory")
    fs.pipe(url, (root / "level-3.bin").read_bytes())
    m = json.loads((root / "manifest.json").read_text())
    m["levels"]["3"]["file"] = url
    (root / "manifest.json").write_text(json.dumps(m))
    (root / "level-3.bin").unlink()
    try:
        verify_bank(root)
        tiers = [TierConfig(name="flash", kind="flash"), DISK]
        with MemoryStore(root, tiers=tiers, placement={1: "flash", 2: "flash", 3: "disk"}) as st:
            assert torch.equal(st.fetch_flat(3, 37), values[3][37].bfloat16())
            assert reads(st) == {"flash": 0, "disk": 1}
            with pytest.raises(BankError, match="read-only"):
                st.scatter(3, [37], torch.zeros(1, 288))
            assert torch.equal(st.fetch_flat(3, 37), values[3][37].bfloat16())
        with MemoryStore(root, tiers=[RAM]) as st:
            assert torch.equal(st.fetch_generic(flat=True)[3], values[3][-1].bfloat16())
        with pytest.raises(BankError, match="local file"):
            MemoryStore(root, tiers=FLASH)
        # a corrupted record on the URL is caught and named by its URL
        data = bytearray(fs.cat(url))
        data[37 * 4096 + 10] ^= 0xFF
        fs.pipe(url, bytes(data))
        with pytest.raises(BankError, match=f"level 3, cluster 37 .*{url}"):
            verify_bank(root)
        with MemoryStore(root, tiers=[DISK]) as st, pytest.raises(BankError, match="cluster 37"):
            st.fetch([2, 9, 37])
    finally:
        fs.rm(f"memory://{tmp_path.name}", recursive=True)


# --------------------------------------------------------------------------- fetch and gather


def test_fetch_shapes_follow_block_layout(bank):
    root, values = bank
    with MemoryStore(root, tiers=FLASH) as st:
        out = st.fetch([3, 14, 57])
        assert sorted(out) == [1, 2, 3]
        for level, c in ((1, 3), (2, 14), (3, 57)):
            names = [(n, tuple(t.shape)) for n, t in out[level].items()]
            assert names == hand_layout(level)
            assert names == [(t.name, t.shape) for t in block_layout(TINY, MEM, level)]
            assert torch.equal(
                torch.cat([t.reshape(-1) for t in out[level].values()]), values[level][c]
            )
        gen = st.fetch_generic()
        for level in (1, 2, 3):
            assert [(n, tuple(t.shape)) for n, t in gen[level].items()] == hand_layout(level)
            assert torch.equal(
                torch.cat([t.reshape(-1) for t in gen[level].values()]), values[level][-1]
            )
        flat = st.fetch_generic(flat=True)
        assert {lv: tuple(t.shape) for lv, t in flat.items()} == {1: (1152,), 2: (576,), 3: (288,)}
        with pytest.raises(ValueError, match="3 levels|needs 3"):
            st.fetch([1, 2])
        with pytest.raises(BankError, match="cluster 16"):
            st.fetch_flat(2, 16)


def test_gather_reads_each_distinct_block_once(bank):
    root, values = bank
    paths = np.array(
        [[1, 5, 21], [1, 5, 22], [0, 0, 0], [1, 6, 25], [-1, -1, -1], [1, 5, 21], [0, 0, 0]]
    )
    with MemoryStore(root, tiers=FLASH) as st:
        out = st.gather(paths)
        # distinct ids: level 1 {1, 0, -1}, level 2 {5, 0, 6, -1}, level 3 {21, 22, 0, 25, -1}
        assert reads(st) == {"flash": 3 + 4 + 5}
        for level in (1, 2, 3):
            assert out[level].shape == (7, PARAMS[level])
            for i, p in enumerate(paths):
                c = int(p[level - 1])
                assert torch.equal(out[level][i], values[level][-1 if c == GENERIC else c]), (
                    level,
                    i,
                )
        st.reset_stats()
        out2 = st.gather(torch.from_numpy(paths))
        assert all(torch.equal(out[lv], out2[lv]) for lv in (1, 2, 3))
        assert reads(st) == {"flash": 12}
        with pytest.raises(ValueError, match="gather"):
            st.gather(np.array([1, 2, 3]))


# --------------------------------------------------------------------------- scatter


TIER_CHOICES = {
    "ram": [TierConfig(name="ram", kind="ram")],
    "flash-cached": [TierConfig(name="flash", kind="flash", cache_bytes=1 << 20)],
    "flash-direct": [TierConfig(name="flash", kind="flash", direct=True)],
    "disk-cached": [TierConfig(name="disk", kind="disk", cache_bytes=1 << 20)],
}


@pytest.mark.parametrize("tiers", list(TIER_CHOICES))
def test_scatter_writes_only_its_blocks(bank, tiers):
    root, values = bank
    before = {lv: (root / f"level-{lv}.bin").read_bytes() for lv in (1, 2, 3)}
    sums_before = {lv: (root / f"level-{lv}.sums").read_bytes() for lv in (1, 2, 3)}
    new = torch.randn(3, 576, generator=torch.Generator().manual_seed(7))
    ids = [3, 7, GENERIC]
    with MemoryStore(root, tiers=TIER_CHOICES[tiers]) as st:
        assert torch.equal(st.fetch_flat(2, 3), values[2][3])  # fill any cache first
        assert st.info.generation == 0
        st.scatter(2, ids, new)
        assert st.info.generation == 1
        for i, c in enumerate(ids):
            assert torch.equal(st.fetch_flat(2, c), new[i]), c
        assert torch.equal(st.fetch_flat(2, 4), values[2][4])
    assert read_manifest(root).generation == 1
    assert verify_bank(root)["generation"] == 1
    with MemoryStore(root, tiers=FLASH) as st:
        for i, c in enumerate(ids):
            assert torch.equal(st.fetch_flat(2, c), new[i])
    # level 2: slots 3, 7 and 16 (generic) changed, every other byte is as before
    after = (root / "level-2.bin").read_bytes()
    written = {3, 7, 16}
    for s in range(17):
        seg = slice(s * 4096, (s + 1) * 4096)
        if s in written:
            assert after[seg] != before[2][seg]
            assert after[seg][:2304] == new[[3, 7, 16].index(s)].numpy().astype("<f4").tobytes()
            assert after[seg][2304:] == before[2][seg][2304:]  # padding untouched
        else:
            assert after[seg] == before[2][seg], s
    sums = (root / "level-2.sums").read_bytes()
    for s in range(17):
        assert (sums[s * 16 : s * 16 + 16] == sums_before[2][s * 16 : s * 16 + 16]) == (
            s not in written
        )
    for lv in (1, 3):
        assert (root / f"level-{lv}.bin").read_bytes() == before[lv]
        assert (root / f"level-{lv}.sums").read_bytes() == sums_before[lv]
    assert not list((root / "journal").glob("*"))  # applied and removed


def test_scatter_refuses_bad_shapes(bank):
    root, _ = bank
    with MemoryStore(root, tiers=FLASH) as st:
        with pytest.raises(ValueError, match="scatter"):
            st.scatter(2, [1, 2], torch.zeros(1, 576))
        with pytest.raises(BankError, match="575"):
            st.scatter(2, [1], torch.zeros(1, 575))
        with pytest.raises(BankError, match="NaN"):
            st.scatter(2, [1], torch.full((1, 576), float("nan")))
        assert st.info.generation == 0
    verify_bank(root)


# --------------------------------------------------------------------------- cache


def test_cache_hits_on_a_session_trace(bank):
    root, values = bank
    trace = [[1, 5, 21], [1, 5, 22], [1, 6, 25], [2, 9, 37], [1, 5, 21]]
    # by hand: q1 3 misses; q2 hits l1 1, l2 5 (2); q3 hits l1 1 (1); q4 none; q5 hits all 3
    tiers = [TierConfig(name="flash", kind="flash", cache_bytes=1 << 20)]
    with MemoryStore(root, tiers=tiers) as st:
        for path in trace:
            out = st.fetch(path, flat=True)
            for level, c in zip((1, 2, 3), path, strict=True):
                assert torch.equal(out[level], values[level][c])
        s = st.stats()["tiers"]["flash"]
        assert (s["cache_hits"], s["cache_misses"], s["reads"]) == (6, 9, 9)
        # misses per level: l1 {1, 2}, l2 {5, 6, 9}, l3 {21, 22, 25, 37}; buffered reads fetch
        # records
        assert s["bytes_read"] == 2 * FP32_RECORD[1] + 3 * FP32_RECORD[2] + 4 * FP32_RECORD[3]
    with MemoryStore(root, tiers=[TierConfig(name="flash", kind="flash", cache_bytes=0)]) as st:
        for path in trace:
            st.fetch(path)
        s = st.stats()["tiers"]["flash"]
        assert (s["cache_hits"], s["reads"]) == (0, 15)
        assert st.stats()["caches"] == {}


@pytest.mark.parametrize("slack, hits", [(0, 2), (-1, 0)])
def test_lru_with_a_one_block_budget(bank, slack, hits):
    root, values = bank
    one_block = 576 * 4  # a decoded fp32 level-2 block
    tiers = [TierConfig(name="flash", kind="flash", cache_bytes=one_block + slack)]
    with MemoryStore(root, tiers=tiers) as st:
        # 5 miss, 5 hit, 6 miss (evicts 5), 5 miss (evicts 6), 5 hit, 6 miss (evicts 5)
        for c in (5, 5, 6, 5, 5, 6):
            assert torch.equal(st.fetch_flat(2, c), values[2][c])
        s = st.stats()["tiers"]["flash"]
        assert (s["cache_hits"], s["reads"]) == (hits, 6 - hits)
        if slack == 0:
            assert st.stats()["caches"]["flash"]["evictions"] == 3
            assert st.stats()["caches"]["flash"]["entries"] == 1


def test_mutating_a_fetched_block_does_not_poison_the_cache(bank):
    root, values = bank
    with MemoryStore(
        root, tiers=[TierConfig(name="flash", kind="flash", cache_bytes=1 << 20)]
    ) as st:
        a = st.fetch_flat(2, 5)
        a.add_(1.0)
        assert torch.equal(st.fetch_flat(2, 5), values[2][5])


# --------------------------------------------------------------------------- blocking


def _is_zero_path(out) -> bool:
    return all(torch.count_nonzero(t) == 0 for t in out.values())


def test_block_subtree_refuses_without_reading(bank):
    root, values = bank
    tiers = [RAM, TierConfig(name="flash", kind="flash"), DISK]
    placement = {1: "ram", 2: "flash", 3: "disk"}
    with MemoryStore(root, tiers=tiers, placement=placement, user="alice") as st:
        counts = st.block(1, [1], subtree=True, reason="takedown #1")
        assert counts == {1: 1, 2: 4, 3: 16}
        # level-1 cluster 1 owns level-2 clusters 4..7 and level-3 clusters 16..31
        # (1152 + 4·576 + 16·288) / 32256
        assert st.blocked_fraction() == pytest.approx(0.25, abs=0)
        st.reset_stats()
        for path in ([1, 4, 16], [1, 5, 21], [1, 7, 31]):
            out = st.fetch(path, flat=True)
            assert _is_zero_path(out)
            assert out[1].shape == (1152,) and out[1].dtype == torch.float32
        assert reads(st) == {"ram": 0, "flash": 0, "disk": 0}
        assert st.stats()["refused_served"] == {"1": 3, "2": 3, "3": 3}
        g = st.gather(np.array([[1, 5, 21], [0, 3, 15]]))
        assert all(torch.count_nonzero(g[lv][0]) == 0 for lv in (1, 2, 3))
        assert reads(st) == {"ram": 1, "flash": 1, "disk": 1}  # only the [0, 3, 15] row
        # other subtrees unaffected
        for path in ([0, 3, 15], [2, 8, 32], [3, 15, 63]):
            out = st.fetch(path, flat=True)
            for level, c in zip((1, 2, 3), path, strict=True):
                assert torch.equal(out[level], values[level][c])
        assert st.is_refused(2, 6) and not st.is_refused(2, 8)

        st.set_fallback("generic")
        st.reset_stats()
        out = st.fetch([1, 5, 21], flat=True)
        for level in (1, 2, 3):
            assert torch.equal(out[level], values[level][-1])
        assert reads(st) == {"ram": 1, "flash": 1, "disk": 1}  # the generic slots only

    with MemoryStore(root, tiers=FLASH) as st:  # persisted in policy.json, fallback too
        assert st.fallback == "generic"
        assert st.blocked_fraction() == 0.25
        st.set_fallback("zeros")
        assert _is_zero_path(st.fetch([1, 6, 26], flat=True))
        assert total_reads(st) == 0
        st.unblock(1, [1], subtree=True, reason="appeal granted")
        assert st.blocked_fraction() == 0.0
        out = st.fetch([1, 6, 26], flat=True)
        assert torch.equal(out[3], values[3][26])
    with MemoryStore(root, tiers=FLASH) as st:
        assert st.blocked_fraction() == 0.0
        assert torch.equal(st.fetch_flat(2, 5), values[2][5])
    verify_bank(root)


def test_block_single_level_only(bank):
    root, values = bank
    with MemoryStore(root, tiers=FLASH) as st:
        assert st.block(2, [5, 6]) == {2: 2}
        assert st.blocked_fraction() == pytest.approx(2 * 576 / 32256)
        out = st.fetch([1, 5, 21], flat=True)
        assert torch.equal(out[1], values[1][1]) and torch.equal(out[3], values[3][21])
        assert torch.count_nonzero(out[2]) == 0
        assert reads(st) == {"flash": 2}
        with pytest.raises(BankError, match="blocked"):
            st.scatter(2, [5], torch.zeros(1, 576))
        st.unblock(2, [5])
        assert torch.equal(st.fetch_flat(2, 5), values[2][5])
        assert st.is_refused(2, 6)


@pytest.mark.parametrize(
    "dtype, rank, want",
    [
        ("bf16", None, torch.bfloat16),
        ("fp16", None, torch.float16),
        ("int8", None, torch.float32),
        ("bf16", 2, torch.float32),
    ],
)
def test_zero_fallback_has_the_fetch_dtype(tmp_path, dtype, rank, want):
    write(tmp_path / "b", random_values(7), dtype, rank=rank)
    with MemoryStore(tmp_path / "b", tiers=FLASH) as st:
        st.block(2, [3])
        assert st.fetch_flat(2, 4).dtype == want
        z = st.fetch_flat(2, 3)
        assert z.dtype == want and z.shape == (576,) and torch.count_nonzero(z) == 0
    with MemoryStore(tmp_path / "b", tiers=FLASH, out_dtype=torch.float64) as st:
        assert (
            st.fetch_flat(2, 3).dtype == torch.float64
            and st.fetch_flat(2, 4).dtype == torch.float64
        )


def test_audit_log_entries(bank, monkeypatch):
    root, _ = bank
    t0 = dt.datetime.now(dt.UTC)
    with MemoryStore(root, tiers=FLASH, user="alice") as st:
        st.block(1, [1], subtree=True, reason="takedown #1")
    monkeypatch.setenv("MEMTREE_USER", "bob")
    with MemoryStore(root, tiers=FLASH) as st:
        st.unblock(2, [5], reason="partial appeal")
        st.delete(3, [40], reason="gdpr")
        st.edit(3, 41, torch.zeros(288), reason="fix")
    log = audit_log(root)
    assert [e["action"] for e in log] == ["block", "unblock", "delete", "edit"]
    assert [e["user"] for e in log] == ["alice", "bob", "bob", "bob"]
    assert [e["reason"] for e in log] == ["takedown #1", "partial appeal", "gdpr", "fix"]
    assert log[0]["targets"] == {"1": [[1, 2]], "2": [[4, 8]], "3": [[16, 32]]}
    assert log[1]["targets"] == {"2": [[5, 6]]}
    assert log[2]["targets"] == {"3": [[40, 41]]}
    assert log[3]["targets"] == {"3": [[41, 42]]}
    for e in log:
        t = dt.datetime.fromisoformat(e["time"])
        assert t.tzinfo is not None and t0 - dt.timedelta(seconds=1) <= t <= dt.datetime.now(dt.UTC)
    # the file is JSON lines, one entry per line
    assert len((root / "audit.jsonl").read_text().splitlines()) == 4


def test_is_refused_generic(bank):
    root, _ = bank
    with MemoryStore(root, tiers=FLASH) as st:
        assert st.is_refused(2, GENERIC) is False


def test_blocking_the_generic_memory_is_refused_or_effective(bank):
    root, values = bank
    with MemoryStore(root, tiers=FLASH) as st:
        try:
            st.block(2, [GENERIC], reason="x")
        except ValueError:
            return  # refusing to block the generic slot is fine too
        assert not torch.equal(st.fetch_flat(2, GENERIC), values[2][-1])


# --------------------------------------------------------------------------- delete


def test_delete_erases_the_bytes(bank):
    root, values = bank
    level_file = root / "level-3.bin"
    orig = slot_bytes(root, 3, 30, 4096, FP32_RECORD[3])
    assert orig == values[3][30].numpy().astype("<f4").tobytes()  # fp32 records are raw LE floats
    sha_before = sha256(level_file)
    other_before = {s: slot_bytes(root, 3, s, 4096, 4096) for s in range(65) if s != 30}
    with MemoryStore(
        root, tiers=[TierConfig(name="flash", kind="flash", cache_bytes=1 << 20)]
    ) as st:
        assert torch.equal(st.fetch_flat(3, 30), values[3][30])  # cached before the delete
        assert st.delete(3, [30], reason="gdpr") == {3: 1}
        st.reset_stats()
        assert torch.count_nonzero(st.fetch_flat(3, 30)) == 0
        out = st.fetch([1, 7, 30], flat=True)  # 30 // 4 = 7, 7 // 4 = 1
        assert torch.count_nonzero(out[3]) == 0
        assert torch.equal(out[2], values[2][7])
        s = st.stats()["tiers"]["flash"]
        assert s["reads"] + s["cache_hits"] == 2  # levels 1 and 2 only
        with pytest.raises(BankError, match="deleted"):
            st.scatter(3, [30], values[3][30:31])
        st.unblock(3, [30])  # unblocking does not undelete
        assert torch.count_nonzero(st.fetch_flat(3, 30)) == 0
        assert st.blocked_fraction() == pytest.approx(288 / 32256)
    data = level_file.read_bytes()
    assert orig not in data and orig[:64] not in data
    for p in root.rglob("*"):
        if p.is_file():
            assert orig[:64] not in p.read_bytes(), p
    assert slot_bytes(root, 3, 30, 4096, FP32_RECORD[3]) == bytes(FP32_RECORD[3])
    assert sha256(level_file) != sha_before
    for s, b in other_before.items():
        assert slot_bytes(root, 3, s, 4096, 4096) == b, s
    m = json.loads((root / "manifest.json").read_text())
    assert m["deleted"] == {"3": [[30, 31]]}
    assert m["generation"] == 1
    assert verify_bank(root)["generation"] == 1
    with MemoryStore(root, tiers=FLASH) as st:
        assert st.is_refused(3, 30)
        assert torch.count_nonzero(st.fetch_flat(3, 30)) == 0
        assert total_reads(st) == 0
        st.set_fallback("generic")
        assert torch.equal(st.fetch_flat(3, 30), values[3][-1])


def test_failed_delete_leaves_no_phantom_deletion(tmp_path):
    import fsspec

    values = random_values(6)
    root = tmp_path / "b"
    write(root, values)
    url = f"memory://{tmp_path.name}/level-3.bin"
    fs = fsspec.filesystem("memory")
    fs.pipe(url, (root / "level-3.bin").read_bytes())
    m = json.loads((root / "manifest.json").read_text())
    m["levels"]["3"]["file"] = url
    (root / "manifest.json").write_text(json.dumps(m))
    try:
        tiers = [TierConfig(name="flash", kind="flash"), DISK]
        with MemoryStore(root, tiers=tiers, placement={1: "flash", 2: "flash", 3: "disk"}) as st:
            with pytest.raises(BankError, match="read-only"):
                st.delete(3, [5], reason="gdpr")
            st.scatter(2, [1], torch.zeros(1, 576))  # an unrelated edit that succeeds
        deleted = read_manifest(root).manifest.get("deleted", {})
        assert "3" not in deleted or not deleted["3"], deleted
    finally:
        fs.rm(f"memory://{tmp_path.name}", recursive=True)


def test_delete_subtree(bank):
    root, values = bank
    with MemoryStore(root, tiers=[RAM]) as st:
        assert st.delete(1, [2], subtree=True) == {1: 1, 2: 4, 3: 16}
        assert st.blocked_fraction() == 0.25
        st.reset_stats()
        assert _is_zero_path(st.fetch([2, 10, 42], flat=True))
        assert total_reads(st) == 0
        assert torch.equal(st.fetch_flat(3, 48), values[3][48])
    m = read_manifest(root).manifest
    assert m["deleted"] == {"1": [[2, 3]], "2": [[8, 12]], "3": [[32, 48]]}
    data = (root / "level-3.bin").read_bytes()
    for c in range(32, 48):
        assert values[3][c].numpy().astype("<f4").tobytes()[:64] not in data
    verify_bank(root)


# --------------------------------------------------------------------------- edit


def test_edit_by_tensor_names(bank):
    root, values = bank
    new = {name: torch.full(shape, float(i)) for i, (name, shape) in enumerate(hand_layout(2))}
    expect = torch.cat([t.reshape(-1) for t in new.values()])
    with MemoryStore(root, tiers=FLASH) as st:
        st.edit(2, 5, new, reason="patch")
        assert torch.equal(st.fetch_flat(2, 5), expect)
        got = st.fetch([1, 5, 21])[2]
        assert all(torch.equal(got[n], new[n]) for n in new)
        missing = dict(new)
        missing.pop("layers.1.w2")
        with pytest.raises(ValueError, match="layers.1.w2"):
            st.edit(2, 6, missing)
        with pytest.raises(ValueError, match="edit"):
            st.edit(2, 6, {**new, "layers.9.w1": torch.zeros(4, 16)})
        assert torch.equal(st.fetch_flat(2, 6), values[2][6])
        st.edit(3, GENERIC, torch.ones(288))
        assert torch.equal(st.fetch_generic(flat=True)[3], torch.ones(288))
    verify_bank(root)
    assert read_manifest(root).generation == 2


def test_edit_refuses_wrong_tensor_shape(bank):
    root, _ = bank
    new = {name: torch.zeros(shape) for name, shape in hand_layout(2)}
    new["layers.0.w1"] = torch.zeros(16, 4)
    with MemoryStore(root, tiers=FLASH) as st, pytest.raises(ValueError, match="layers.0.w1"):
        st.edit(2, 5, new)


# --------------------------------------------------------------------------- crash safety


SCATTER_LOOP = f"""
import sys, pathlib
sys.path.insert(0, {str(REPO)!r})
import torch
from memtree.memstore.store import MemoryStore, TierConfig
root, marker = sys.argv[1], sys.argv[2]
st = MemoryStore(root, tiers=[TierConfig(name="flash", kind="flash")])
k = st.info.generation
ids = list(range(64))
pathlib.Path(marker).write_text(str(k))
while True:
    k += 1
    st.scatter(3, ids, torch.stack([torch.full((288,), float(k * 1000 + c)) for c in ids]))
"""


def _check_versioned_bank(root: Path) -> int:
    """Open (which recovers), verify, and check every level-3 block is one whole version,
    the version the manifest generation says. Returns the generation."""
    with MemoryStore(root, tiers=FLASH) as st:
        gen = st.info.generation
        for c in range(64):
            got = st.fetch_flat(3, c)
            vals = torch.unique(got)
            assert vals.numel() == 1, f"cluster {c} is torn: {vals.tolist()[:5]}"
            assert float(vals[0]) == gen * 1000 + c, (c, float(vals[0]), gen)
        assert torch.equal(st.fetch_flat(2, 5), torch.full((576,), 5.0))  # untouched level
    assert not list((root / "journal").glob("*.jnl"))
    verify_bank(root)
    return gen


def test_sigkill_during_scatter_never_tears_blocks(tmp_path):
    root = tmp_path / "bank"
    write(root, version_values(0))
    rng = random.Random(1234)
    gen = 0
    for trial in range(5):
        marker = tmp_path / f"ready-{trial}"
        p = subprocess.Popen(
            [sys.executable, "-c", SCATTER_LOOP, str(root), str(marker)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 90
            while not marker.exists():
                assert p.poll() is None, p.stderr.read().decode()
                assert time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(rng.uniform(0.02, 0.4))
            p.send_signal(signal.SIGKILL)
            assert p.wait(timeout=30) == -signal.SIGKILL
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stderr.close()
        new_gen = _check_versioned_bank(root)
        assert new_gen >= gen
        gen = new_gen
    assert gen > 0, "no scatter ever completed; the test did not exercise anything"


def _journal(manifest: dict, entries: list[tuple[int, int, bytes]]) -> bytes:
    """A journal built by hand from the format described in memstore/store.py."""
    es, body, off = [], b"", 0
    for level, slot, rec in entries:
        es.append({"level": level, "slot": slot, "offset": off, "length": len(rec)})
        body += rec
        off += len(rec)
    head = json.dumps(
        {
            "format": "memtree-bank-journal",
            "version": 1,
            "manifest": manifest,
            "entries": es,
            "body_bytes": off,
        }
    ).encode()
    return len(head).to_bytes(8, "little") + head + body


def test_incomplete_journal_tmp_is_ignored_and_removed(tmp_path):
    root = tmp_path / "bank"
    write(root, version_values(0))
    m = json.loads((root / "manifest.json").read_text())
    m["generation"] = 1
    full = _journal(
        m,
        [(3, c, torch.full((288,), 1000.0 + c).numpy().astype("<f4").tobytes()) for c in range(64)],
    )
    (root / "journal").mkdir()
    tmp = root / "journal" / ".000000000001.jnl.k3j2h1.tmp"
    tmp.write_bytes(full[: len(full) // 2])
    assert _check_versioned_bank(root) == 0
    assert not tmp.exists()


def test_complete_journal_is_replayed_on_open(tmp_path):
    root = tmp_path / "bank"
    write(root, version_values(0))
    m = json.loads((root / "manifest.json").read_text())
    m["generation"] = 1
    recs = [
        (3, c, torch.full((288,), 1000.0 + c).numpy().astype("<f4").tobytes()) for c in range(64)
    ]
    (root / "journal").mkdir()
    (root / "journal" / "000000000001.jnl").write_bytes(_journal(m, recs))
    # half applied already, as after a crash mid-apply: replay must be idempotent
    with open(root / "level-3.bin", "r+b") as f:
        for _, c, rec in recs[:20]:
            f.seek(c * 4096)
            f.write(rec)
    assert _check_versioned_bank(root) == 1


def test_malformed_journal_is_refused(tmp_path):
    root = tmp_path / "bank"
    write(root, version_values(0))
    m = json.loads((root / "manifest.json").read_text())
    m["generation"] = 1
    j = _journal(m, [(3, 0, bytes(1152))])
    (root / "journal").mkdir()
    (root / "journal" / "000000000001.jnl").write_bytes(j[:-10])
    with pytest.raises(BankError, match="malformed journal"):
        MemoryStore(root, tiers=FLASH)
