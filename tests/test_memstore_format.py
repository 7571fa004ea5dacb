"""memstore.format: the on-disk bank (records, codecs, manifest, checksums, atomic creation).

Every bank here is a real directory under tmp_path, written by `write_bank` from values
the test generated itself. Expected values are derived independently: block layouts,
record sizes, strides and file sizes by hand from the tiny geometry below; quantisation
bounds from the group absmax of the values we wrote; low-rank results from our own
`torch.linalg.svd` truncation.

Tiny geometry (hand-derived): 3 layers, d_model 16, FFN memory, uniform placement,
multipliers (8, 4, 2), branching 4. Level l has 4**l blocks of 3 layers x (w1, w2, w3),
each tensor (m_l, 16):

    level 1: 4 blocks, 9 x 8 x 16 = 1152 params
    level 2: 16 blocks, 9 x 4 x 16 = 576 params
    level 3: 64 blocks, 9 x 2 x 16 = 288 params
"""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from memtree.geometry import QUANT_GROUP, AnchorShape, MemoryConfig, block_layout
from memtree.memstore.format import (
    GENERIC,
    BankError,
    RecordCodec,
    read_manifest,
    verify_bank,
)
from memtree.memstore.locking import lock_paths
from memtree.memstore.store import MemoryStore, TierConfig
from memtree.memstore.writer import paper_init, write_bank

REPO = Path(__file__).resolve().parents[1]

TINY = AnchorShape(
    name="tiny", n_layers=3, d_model=16, n_heads=2, head_dim=8, ffn_dim=32, vocab_size=100
)
MEM = MemoryConfig(multipliers=(8, 4, 2), branching=4)
D = 16
WIDTH = {1: 8, 2: 4, 3: 2}
N_BLOCKS = {1: 4, 2: 16, 3: 64}
PARAMS = {1: 1152, 2: 576, 3: 288}
DTYPES = ("fp32", "bf16", "fp16", "int8", "int4")
TORCH_DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
FLASH = [TierConfig(name="flash", kind="flash")]


def hand_layout(level: int, kind: str = "ffn") -> list[tuple[str, tuple[int, int]]]:
    """Tensor names/shapes of one block of the tiny anchor, written out by hand."""
    w, d, f, kv = WIDTH[level], D, 32, 16
    per_layer = {
        "ffn": [("w1", (w, d)), ("w2", (w, d)), ("w3", (w, d))],
        "lora-ffn": [
            ("w1_a", (w, d)),
            ("w1_b", (f, w)),
            ("w2_a", (w, d)),
            ("w2_b", (f, w)),
            ("w3_a", (w, f)),
            ("w3_b", (d, w)),
        ],
        "kv": [("k", (w, kv)), ("v", (w, kv))],
    }[kind]
    return [(f"layers.{i}.{n}", s) for i in range(3) for n, s in per_layer]


def split(flat: torch.Tensor, layout) -> dict[str, torch.Tensor]:
    out, off = {}, 0
    for name, (a, b) in layout:
        out[name] = flat[off : off + a * b].reshape(a, b)
        off += a * b
    assert off == flat.numel()
    return out


def random_values(seed: int = 0, scale: float = 1.0) -> dict[int, torch.Tensor]:
    """{level: (n_blocks + 1, params)}; the last row is the generic memory."""
    g = torch.Generator().manual_seed(seed)
    return {lv: torch.randn(N_BLOCKS[lv] + 1, PARAMS[lv], generator=g) * scale for lv in (1, 2, 3)}


def blocks_of(values: dict[int, torch.Tensor]):
    def blocks(level: int):
        v = values[level]
        for c in range(N_BLOCKS[level]):
            yield c, v[c]
        yield GENERIC, v[-1]

    return blocks


def write(root: Path, values: dict[int, torch.Tensor], dtype: str = "fp32", **kw):
    return write_bank(root, anchor=TINY, memory=MEM, dtype=dtype, blocks=blocks_of(values), **kw)


def row(values, level: int, cluster: int) -> torch.Tensor:
    return values[level][-1 if cluster == GENERIC else cluster]


def all_ids(level: int) -> list[int]:
    return list(range(N_BLOCKS[level])) + [GENERIC]


def truncated_svd(flat: torch.Tensor, level: int, r: int) -> torch.Tensor:
    """Best rank-r approximation of every tensor of the layout (Eckart–Young), fp64."""
    parts = []
    for t in split(flat.double(), hand_layout(level)).values():
        u, s, vh = torch.linalg.svd(t, full_matrices=False)
        k = min(r, *t.shape)
        parts.append(((u[:, :k] * s[:k]) @ vh[:k]).reshape(-1))
    return torch.cat(parts).float()


def quant_bound(x: torch.Tensor, qmax: int) -> torch.Tensor:
    """Per-element bound absmax(group)/qmax/2 over groups of QUANT_GROUP of the flat vector."""
    assert QUANT_GROUP == 128
    n = x.numel()
    groups = math.ceil(n / 128)
    padded = torch.zeros(groups * 128)
    padded[:n] = x.abs()
    absmax = padded.view(groups, 128).amax(dim=1)
    return (absmax / qmax / 2).repeat_interleave(128)[:n]


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_full_rank(tmp_path, dtype):
    values = random_values(1)
    write(tmp_path / "b", values, dtype)
    with MemoryStore(tmp_path / "b", tiers=FLASH) as st:
        for level in (1, 2, 3):
            for c in all_ids(level):
                x = row(values, level, c)
                got = st.fetch_flat(level, c)
                assert got.shape == (PARAMS[level],)
                if dtype == "fp32":
                    assert got.dtype == torch.float32
                    assert torch.equal(got, x), (level, c)
                elif dtype in ("bf16", "fp16"):
                    assert got.dtype == TORCH_DT[dtype]
                    assert torch.equal(got, x.to(TORCH_DT[dtype])), (level, c)
                else:
                    qmax = 127 if dtype == "int8" else 7
                    bound = quant_bound(x, qmax)
                    err = (got.float() - x).abs()
                    assert got.dtype == torch.float32
                    # fp32 arithmetic slack: a few ulps of the group scale
                    assert (err <= bound * (1 + 1e-5) + 1e-7).all(), (
                        level,
                        c,
                        float((err - bound).max()),
                    )
                    # and quantisation actually happened at the documented resolution
                    assert err.max() > 0


# relative Frobenius error of a fetched rank-2 block against our own SVD truncation comes
# from rounding the two stored factors only: at most 2^-9 (bf16) / 2^-12 (fp16) relative per
# value, or half a quantisation step absmax/127 (int8) / absmax/7 (int4), where absmax is
# ~3x the RMS of a 128-value group; a product of two factors roughly doubles it.
RANK_TOL = {"fp32": 1e-5, "bf16": 0.01, "fp16": 1.5e-3, "int8": 0.03, "int4": 0.35}


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_rank2_is_best_rank2_approximation(tmp_path, dtype):
    values = random_values(2)
    write(tmp_path / "b", values, dtype, rank=2)
    with MemoryStore(tmp_path / "b", tiers=FLASH) as st:
        for level in (1, 2, 3):
            for c in all_ids(level):
                x = row(values, level, c)
                expect = truncated_svd(x, level, 2)
                got = st.fetch_flat(level, c)
                assert got.dtype == torch.float32 and got.shape == (PARAMS[level],)
                rel = float((got - expect).norm() / expect.norm())
                assert rel <= RANK_TOL[dtype], (level, c, rel)
                if level < 3:  # w > 2: rank 2 really truncates, so the block is not x itself
                    assert float((got - x).norm() / x.norm()) > 0.1


@pytest.mark.parametrize("dtype", DTYPES)
def test_rank2_block_that_is_rank2_round_trips(tmp_path, dtype):
    g = torch.Generator().manual_seed(3)
    values = {}
    for level in (1, 2, 3):
        rows = []
        for _ in range(N_BLOCKS[level] + 1):
            rows.append(
                torch.cat(
                    [
                        (torch.randn(a, 2, generator=g) @ torch.randn(2, b, generator=g)).reshape(
                            -1
                        )
                        for _n, (a, b) in hand_layout(level)
                    ]
                )
            )
        values[level] = torch.stack(rows)
    write(tmp_path / "b", values, dtype, rank=2)
    with MemoryStore(tmp_path / "b", tiers=FLASH) as st:
        for level in (1, 2, 3):
            for c in all_ids(level):
                x = row(values, level, c)
                got = st.fetch_flat(level, c)
                if dtype == "fp32":
                    torch.testing.assert_close(got, x, atol=1e-4, rtol=1e-4)
                else:
                    rel = float((got - x).norm() / x.norm())
                    assert rel <= RANK_TOL[dtype], (level, c, rel)


# --------------------------------------------------------------------------- sizes


def hand_record_bytes(n: int, dtype: str) -> int:
    if dtype == "int8":
        return n + 4 * math.ceil(n / 128)
    if dtype == "int4":
        return math.ceil(n / 2) + 4 * math.ceil(n / 128)
    return n * ITEMSIZE[dtype]


# stored values with rank 2: 9 tensors of (m, 16) → 2·(m + 16) each
RANK2_VALUES = {1: 9 * 2 * (8 + 16), 2: 9 * 2 * (4 + 16), 3: 9 * 2 * (2 + 16)}
# spelled out for the full-rank case, so a wrong formula above cannot hide a wrong codec
LITERAL_RECORD_BYTES = {
    "fp32": {1: 4608, 2: 2304, 3: 1152},
    "bf16": {1: 2304, 2: 1152, 3: 576},
    "fp16": {1: 2304, 2: 1152, 3: 576},
    "int8": {1: 1188, 2: 596, 3: 300},
    "int4": {1: 612, 2: 308, 3: 156},
}


@pytest.mark.parametrize("rank", [None, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_record_sizes_strides_and_file_sizes(tmp_path, dtype, rank):
    info = write(tmp_path / "b", random_values(4), dtype, rank=rank)
    for level in (1, 2, 3):
        n = PARAMS[level] if rank is None else RANK2_VALUES[level]
        expect = hand_record_bytes(n, dtype)
        if rank is None:
            assert expect == LITERAL_RECORD_BYTES[dtype][level]
        codec = RecordCodec(tuple(block_layout(TINY, MEM, level)), dtype, rank)
        assert codec.record_bytes == expect
        assert info.codec(level).record_bytes == expect
        lv = info.levels[level]
        assert lv.record_bytes == expect
        assert lv.stride % 4096 == 0 and expect <= lv.stride < expect + 4096
        assert lv.n_blocks == N_BLOCKS[level]
        level_file = tmp_path / "b" / f"level-{level}.bin"
        assert level_file.stat().st_size == (N_BLOCKS[level] + 1) * lv.stride
        assert (tmp_path / "b" / f"level-{level}.sums").stat().st_size == (N_BLOCKS[level] + 1) * 16
    if dtype == "fp32" and rank is None:
        assert info.levels[1].stride == 8192  # 4608 bytes need two pages


def test_fetch_is_one_tier_read_per_level(tmp_path):
    values = random_values(5)
    write(tmp_path / "b", values, "bf16")
    tiers = [
        TierConfig(name="ram", kind="ram"),
        TierConfig(name="flash", kind="flash"),
        TierConfig(name="disk", kind="disk"),
    ]
    with MemoryStore(
        tmp_path / "b", tiers=tiers, placement={1: "ram", 2: "flash", 3: "disk"}
    ) as st:
        for k, path in enumerate(([1, 5, 21], [3, 13, 55], [1, 5, 21]), start=1):
            out = st.fetch(path, flat=True)
            reads = {n: s["reads"] for n, s in st.stats()["tiers"].items()}
            assert reads == {"ram": k, "flash": k, "disk": k}
            for level, c in zip((1, 2, 3), path, strict=True):
                assert torch.equal(out[level], values[level][c].bfloat16())


# --------------------------------------------------------------------------- manifest


def edit_manifest(root: Path, fn) -> None:
    path = root / "manifest.json"
    m = json.loads(path.read_text())
    fn(m)
    path.write_text(json.dumps(m))


def test_manifest_fields(tmp_path):
    write(tmp_path / "b", random_values(6), "int8", rank=2, tree_id="abc123", extra={"note": "x"})
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert m["format"] == "memtree-bank"
    assert m["version"] == 1
    assert m["generation"] == 0
    assert m["dtype"] == "int8" and m["rank"] == 2
    assert m["tree_id"] == "abc123" and m["subtree"] is None
    assert m["anchor"]["d_model"] == 16 and m["anchor"]["n_layers"] == 3
    assert m["memory"]["multipliers"] == [8, 4, 2] and m["memory"]["branching"] == 4
    assert sorted(m["levels"]) == ["1", "2", "3"]
    assert m["levels"]["2"]["n_blocks"] == 16 and m["levels"]["2"]["file"] == "level-2.bin"
    assert m["extra"] == {"note": "x"}
    info = read_manifest(tmp_path / "b")
    assert info.anchor == TINY and info.memory == MEM and info.generation == 0


def test_read_manifest_refuses_other_version_and_format(tmp_path):
    write(tmp_path / "b", random_values(7))
    edit_manifest(tmp_path / "b", lambda m: m.update(version=2))
    with pytest.raises(BankError, match="version 2"):
        read_manifest(tmp_path / "b")
    with pytest.raises(BankError, match="version 2"):
        MemoryStore(tmp_path / "b", tiers=FLASH)
    edit_manifest(tmp_path / "b", lambda m: m.update(version=1, format="something-else"))
    with pytest.raises(BankError, match="something-else"):
        read_manifest(tmp_path / "b")


def test_read_manifest_missing(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        read_manifest(tmp_path / "empty")


@pytest.mark.parametrize(
    "field, value",
    [
        ("stride", 8192),
        ("record_bytes", 1000),
        ("n_blocks", 15),
        ("first_cluster", 1),
        ("params", 100),
    ],
)
def test_read_manifest_refuses_hand_edited_level_table(tmp_path, field, value):
    write(tmp_path / "b", random_values(8), "bf16")
    edit_manifest(tmp_path / "b", lambda m: m["levels"]["2"].update({field: value}))
    with pytest.raises(BankError, match="level table"):
        read_manifest(tmp_path / "b")


@pytest.mark.parametrize("section, key", [("anchor", "n_expertz"), ("memory", "bogus_key")])
def test_read_manifest_refuses_unknown_config_keys(tmp_path, section, key):
    write(tmp_path / "b", random_values(9))
    edit_manifest(tmp_path / "b", lambda m: m[section].update({key: 1}))
    with pytest.raises(ValueError, match=f"manifest.{section}.{key}"):
        read_manifest(tmp_path / "b")


# --------------------------------------------------------------------------- checksums


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


TIER_SETS = {
    "ram": [TierConfig(name="ram", kind="ram")],
    "flash": [TierConfig(name="flash", kind="flash")],
    "flash-direct-cached": [
        TierConfig(name="flash", kind="flash", direct=True, cache_bytes=1 << 20)
    ],
    "disk": [TierConfig(name="disk", kind="disk")],
}


@pytest.mark.parametrize("tiers", list(TIER_SETS))
def test_corrupt_record_is_named_by_verify_and_fetch(tmp_path, tiers):
    values = random_values(10)
    root = tmp_path / "b"
    info = write(root, values, "bf16")
    lv = info.levels[2]
    assert lv.record_bytes == 1152 and lv.stride == 4096
    flip_byte(root / "level-2.bin", 5 * 4096 + 700)  # inside cluster 5's record

    with pytest.raises(BankError) as e:
        verify_bank(root)
    msg = str(e.value)
    assert "level 2" in msg and "cluster 5" in msg and str(root / "level-2.bin") in msg

    with MemoryStore(root, tiers=TIER_SETS[tiers]) as st:
        with pytest.raises(BankError) as e2:
            st.fetch([1, 5, 21])
        assert str(e2.value) == msg
        # paths that do not touch cluster 5 of level 2 still work
        for path in ([1, 6, 25], [0, 0, 0], [3, 15, 63]):
            out = st.fetch(path, flat=True)
            for level, c in zip((1, 2, 3), path, strict=True):
                assert torch.equal(out[level], values[level][c].bfloat16())
        with pytest.raises(BankError, match="cluster 5"):  # still refused on a second try
            st.fetch_flat(2, 5)


def test_corrupt_generic_record_is_named(tmp_path):
    root = tmp_path / "b"
    write(root, random_values(11), "fp32")
    # level 3 fp32: 1152-byte records, 4096 stride; generic slot = 64
    flip_byte(root / "level-3.bin", 64 * 4096 + 3)
    with pytest.raises(BankError, match="level 3, generic memory"):
        verify_bank(root)
    with MemoryStore(root, tiers=FLASH) as st, pytest.raises(BankError, match="generic memory"):
        st.fetch_generic()


def test_corrupting_padding_is_not_an_error(tmp_path):
    values = random_values(12)
    root = tmp_path / "b"
    write(root, values, "bf16")
    for off in (1152, 2000, 4095):  # level 2 bf16: record 1152 bytes, stride 4096
        flip_byte(root / "level-2.bin", 5 * 4096 + off)
    assert verify_bank(root)["blocks_checked"] == 4 + 16 + 64 + 3
    for tiers in TIER_SETS.values():
        with MemoryStore(root, tiers=tiers) as st:
            assert torch.equal(st.fetch_flat(2, 5), values[2][5].bfloat16())


def test_truncated_level_file(tmp_path):
    root = tmp_path / "b"
    write(root, random_values(13), "bf16")
    p = root / "level-3.bin"
    os.truncate(p, p.stat().st_size - 1)
    with pytest.raises(BankError) as e:
        MemoryStore(root, tiers=FLASH)
    assert str(p) in str(e.value) and "truncated" in str(e.value)
    with pytest.raises(BankError, match="truncated"):
        verify_bank(root)


def test_level_file_with_extra_bytes(tmp_path):
    root = tmp_path / "b"
    write(root, random_values(14), "bf16")
    with open(root / "level-1.bin", "ab") as f:
        f.write(b"\0")
    with pytest.raises(BankError, match="level-1.bin"):
        MemoryStore(root, tiers=FLASH)


def test_missing_sums_file(tmp_path):
    root = tmp_path / "b"
    write(root, random_values(15), "bf16")
    (root / "level-2.sums").unlink()
    with pytest.raises(BankError) as e:
        MemoryStore(root, tiers=FLASH)
    assert str(root / "level-2.sums") in str(e.value) and "missing" in str(e.value)
    with pytest.raises(BankError, match="level-2.sums"):
        verify_bank(root)


# --------------------------------------------------------------------------- tree binding


def _tree(data_seed: int, build_seed: int):
    from memtree.clustering.tree import build_tree

    rng = np.random.default_rng(data_seed)
    x = rng.standard_normal((1200, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    tree, _ = build_tree(
        x,
        levels=3,
        branching=4,
        seed=build_seed,
        batch_size=512,
        steps=5,
        equalize_steps=0,
        n_jobs=1,
    )
    return tree


def test_tree_binding(tmp_path):
    from memtree.clustering.tree import compute_tree_id

    tree, other = _tree(0, 0), _tree(1, 1)
    tid, other_id = compute_tree_id(tree), compute_tree_id(other)
    assert tid != other_id
    values = random_values(16)
    root = tmp_path / "b"
    write(root, values, "fp32", tree_id=tid)
    assert read_manifest(root).tree_id == tid
    with MemoryStore(root, tiers=FLASH, tree=tree) as st:
        assert torch.equal(st.fetch_flat(3, 7), values[3][7])
    with pytest.raises(BankError) as e:
        MemoryStore(root, tiers=FLASH, tree=other)
    assert tid in str(e.value) and other_id in str(e.value)

    unbound = tmp_path / "unbound"
    write(unbound, values, "fp32")
    with pytest.raises(BankError, match="not bound"):
        MemoryStore(unbound, tiers=FLASH, tree=tree)


# --------------------------------------------------------------------------- write refusals


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_write_refuses_non_finite_and_leaves_nothing(tmp_path, bad):
    values = random_values(17)
    values[2][9, 100] = bad
    with pytest.raises(BankError, match="NaN or inf"):
        write(tmp_path / "b", values)
    assert not (tmp_path / "b").exists()
    assert list(tmp_path.iterdir()) == []  # no temp directory left behind


def test_failed_write_keeps_old_bank(tmp_path):
    root = tmp_path / "b"
    old = random_values(18)
    write(root, old)
    bad = random_values(19)
    bad[3][5, 0] = float("nan")
    with pytest.raises(BankError, match="NaN"):
        write(root, bad)
    verify_bank(root)
    with MemoryStore(root, tiers=FLASH) as st:
        assert torch.equal(st.fetch_flat(3, 5), old[3][5])


def test_write_refuses_missing_slots(tmp_path):
    def blocks(level):
        for c in range(N_BLOCKS[level]):
            if (level, c) != (2, 7):
                yield c, torch.zeros(PARAMS[level])
        yield GENERIC, torch.zeros(PARAMS[level])

    with pytest.raises(BankError, match=r"level 2: no values given for slots \[7\]"):
        write_bank(tmp_path / "b", anchor=TINY, memory=MEM, blocks=blocks)
    assert not (tmp_path / "b").exists()


def test_write_refuses_values_that_overflow_fp16(tmp_path):
    values = random_values(20)
    values[1][0, 0] = 70000.0  # > 65504, the largest fp16
    with pytest.raises(BankError):
        write(tmp_path / "b", values, "fp16")


# --------------------------------------------------------------------------- nothing is pickled


def test_no_pickle_on_disk_or_on_load(tmp_path, monkeypatch):
    values = random_values(21)
    root = tmp_path / "b"
    write(root, values, "int8")
    with MemoryStore(root, tiers=FLASH) as st:  # creates policy/audit/journal files too
        st.block(3, [1], reason="x")
        st.scatter(2, [3], values[2][4:5])
    files = [p for p in root.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {
        "manifest.json",
        "level-1.bin",
        "level-1.sums",
        "policy.json",
        "audit.jsonl",
    }
    for p in files:
        head = p.read_bytes()[:4]
        assert not head.startswith(b"\x80"), p  # pickle protocol >= 2
        assert not head.startswith(b"PK\x03\x04"), p  # torch.save zip archive

    def refuse(*a, **k):
        raise AssertionError("the bank loader must not unpickle anything")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    read_manifest(root)
    verify_bank(root)
    tiers = [
        TierConfig(name="ram", kind="ram"),
        TierConfig(name="flash", kind="flash"),
        TierConfig(name="disk", kind="disk"),
    ]
    with MemoryStore(root, tiers=tiers, placement={1: "ram", 2: "flash", 3: "disk"}) as st:
        st.fetch([1, 3, 2])
        st.gather(np.array([[0, 1, 2], [-1, -1, -1]]))
        st.fetch_generic()


# --------------------------------------------------------------------------- crash while writing


CHILD_PRELUDE = f"""
import os, signal, sys, time
sys.path.insert(0, {str(REPO)!r})
import torch
from memtree.memstore.writer import write_bank
from memtree.geometry import AnchorShape, MemoryConfig
TINY = AnchorShape(name="tiny", n_layers=3, d_model=16, n_heads=2, head_dim=8, ffn_dim=32,
                   vocab_size=100)
MEM = MemoryConfig(multipliers=(8, 4, 2), branching=4)
root, marker = sys.argv[1], sys.argv[2]
"""

SLOW_WRITER = (
    CHILD_PRELUDE
    + """
n = [0]
def init(level, cluster, codec):
    n[0] += 1
    if n[0] == 30:  # level 1 and part of level 2 written into the temp dir
        open(marker, "w").close()
        time.sleep(120)
    return torch.full((codec.params,), 7.0)
write_bank(root, anchor=TINY, memory=MEM, dtype="fp32", init=init)
"""
)

# Dies at the one instant between the two renames of memtree.io.replace_dir: the old bank
# has been moved aside, the new one not yet moved in.
DIE_BETWEEN_RENAMES = (
    CHILD_PRELUDE
    + """
real_replace = os.replace
def replace(src, dst, *a, **k):
    real_replace(src, dst, *a, **k)
    if str(dst).endswith(".tmp-old"):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
write_bank(root, anchor=TINY, memory=MEM, dtype="fp32",
           init=lambda level, cluster, codec: torch.full((codec.params,), 7.0))
"""
)


def _run_child(script: str, root: Path, marker: Path, *, kill_on_marker: bool) -> int:
    p = subprocess.Popen(
        [sys.executable, "-c", script, str(root), str(marker)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 90
        while not marker.exists():
            if p.poll() is not None:
                break
            assert time.monotonic() < deadline, "child never reached the crash point"
            time.sleep(0.02)
        if kill_on_marker and p.poll() is None:
            p.send_signal(signal.SIGKILL)
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    out = p.stdout.read().decode(errors="replace") if p.stdout else ""
    p.stdout and p.stdout.close()
    assert marker.exists(), f"child exited (rc={rc}) before the crash point:\n{out}"
    return rc


def _assert_old_bank(root: Path, old) -> None:
    verify_bank(root)
    assert read_manifest(root).generation == 0
    with MemoryStore(root, tiers=FLASH) as st:
        for level in (1, 2, 3):
            for c in (0, N_BLOCKS[level] - 1, GENERIC):
                assert torch.equal(st.fetch_flat(level, c), row(old, level, c))


def test_sigkill_during_write_keeps_old_bank(tmp_path):
    root = tmp_path / "bank"
    old = random_values(22)
    write(root, old)
    rc = _run_child(SLOW_WRITER, root, tmp_path / "marker", kill_on_marker=True)
    assert rc == -signal.SIGKILL
    # the half-written temp dir
    assert any(p.name.startswith(".bank.tmp-") for p in tmp_path.iterdir())
    _assert_old_bank(root, old)
    # the next write replaces the bank and clears the debris
    new = random_values(23)
    write(root, new)
    locks = {p.name for p in lock_paths(root)}  # the writer / reader locks beside the bank stay
    assert sorted(p.name for p in tmp_path.iterdir() if p.name not in locks) == ["bank", "marker"]
    with MemoryStore(root, tiers=FLASH) as st:
        assert torch.equal(st.fetch_flat(2, 3), new[2][3])


def test_sigkill_between_the_two_renames_keeps_a_bank(tmp_path):
    root = tmp_path / "bank"
    old = random_values(24)
    write(root, old)
    rc = _run_child(DIE_BETWEEN_RENAMES, root, tmp_path / "marker", kill_on_marker=False)
    assert rc == -signal.SIGKILL
    # the contract: the old bank or the complete new one, never none
    verify_bank(root)
    with MemoryStore(root, tiers=FLASH) as st:
        got = st.fetch_flat(2, 3)
        assert torch.equal(got, old[2][3]) or torch.equal(got, torch.full((576,), 7.0))


# --------------------------------------------------------------------------- paper_init


def _paper_bank(root: Path, kind: str, seed: int):
    mem = MemoryConfig(multipliers=(8, 4, 2), branching=4, type=kind)
    write_bank(root, anchor=TINY, memory=mem, dtype="fp32", init=paper_init(seed))
    return MemoryStore(root, tiers=FLASH)


def test_paper_init_ffn(tmp_path):
    with _paper_bank(tmp_path / "b", "ffn", 3) as st:
        for level in (1, 2, 3):
            for c in (0, N_BLOCKS[level] - 1, GENERIC):
                t = split(st.fetch_flat(level, c), hand_layout(level))
                for name, x in t.items():
                    role = name.rsplit(".", 1)[1]
                    if role == "w3":
                        assert torch.count_nonzero(x) == 0, name
                    else:
                        assert torch.count_nonzero(x) == x.numel(), name
                        assert x.abs().max() <= 2 * 0.02 + 1e-7, name
        w1 = torch.cat([st.fetch_flat(1, c)[:128] for c in range(4)])
        assert 0.01 < float(w1.std()) < 0.021  # N(0, 0.02) truncated at ±2σ: σ ≈ 0.0176


def test_paper_init_is_deterministic_per_seed(tmp_path):
    codec = RecordCodec(tuple(block_layout(TINY, MEM, 2)), "fp32")
    a, b, c = paper_init(5), paper_init(5), paper_init(6)
    assert torch.equal(a(2, 3, codec), b(2, 3, codec))
    assert not torch.equal(a(2, 3, codec), c(2, 3, codec))
    assert not torch.equal(a(2, 3, codec), a(2, 4, codec))
    for name, seed in (("x", 5), ("y", 5), ("z", 6)):
        _paper_bank(tmp_path / name, "ffn", seed).close()
    for level in (1, 2, 3):
        f = f"level-{level}.bin"
        assert (tmp_path / "x" / f).read_bytes() == (tmp_path / "y" / f).read_bytes()
        assert (tmp_path / "x" / f).read_bytes() != (tmp_path / "z" / f).read_bytes()


def test_paper_init_lora_b_zero(tmp_path):
    with _paper_bank(tmp_path / "b", "lora-ffn", 0) as st:
        for level in (1, 2, 3):
            layout = hand_layout(level, "lora-ffn")
            flat = st.fetch_flat(level, 1)
            assert flat.numel() == sum(a * b for _n, (a, b) in layout)
            for name, x in split(flat, layout).items():
                if name.endswith("_b"):
                    assert torch.count_nonzero(x) == 0, name
                else:
                    assert name.endswith("_a") and torch.count_nonzero(x) == x.numel(), name


def test_paper_init_kv_values_zero(tmp_path):
    with _paper_bank(tmp_path / "b", "kv", 0) as st:
        for level in (1, 2, 3):
            layout = hand_layout(level, "kv")
            for name, x in split(st.fetch_flat(level, 2), layout).items():
                if name.endswith(".v"):
                    assert torch.count_nonzero(x) == 0, name
                else:
                    assert torch.count_nonzero(x) == x.numel(), name
                    assert x.abs().max() <= 0.04 + 1e-7, name


# --------------------------------------------------------------------------- per-subtree banks


def test_per_subtree_bank_layout_and_ids(tmp_path):
    # subtree 2 of a branching-4 tree holds level l clusters 2·4^(l-1) … 3·4^(l-1) - 1
    owned = {1: range(2, 3), 2: range(8, 12), 3: range(32, 48)}
    g = torch.Generator().manual_seed(30)
    values = {
        lv: {c: torch.randn(PARAMS[lv], generator=g) for c in [*owned[lv], GENERIC]} for lv in owned
    }
    root = tmp_path / "sub"
    info = write_bank(
        root,
        anchor=TINY,
        memory=MEM,
        dtype="fp32",
        subtree=2,
        blocks=lambda level: values[level].items(),
    )
    m = json.loads((root / "manifest.json").read_text())
    assert m["subtree"] == 2
    for level, ids in owned.items():
        lv = m["levels"][str(level)]
        assert (lv["n_blocks"], lv["first_cluster"]) == (len(ids), ids[0])
        stride = {1: 8192, 2: 4096, 3: 4096}[level]  # fp32 records 4608 / 2304 / 1152 bytes
        assert (root / f"level-{level}.bin").stat().st_size == (len(ids) + 1) * stride
        assert info.levels[level].stride == stride
    assert verify_bank(root)["blocks_checked"] == (1 + 1) + (4 + 1) + (16 + 1)
    with MemoryStore(root, tiers=FLASH) as st:
        out = st.fetch([2, 9, 37], flat=True)
        assert all(torch.equal(out[lv], values[lv][c]) for lv, c in ((1, 2), (2, 9), (3, 37)))
        assert torch.equal(st.fetch_flat(3, GENERIC), values[3][GENERIC])
        with pytest.raises(
            BankError, match=r"level 1: cluster 1 is not in this bank \(holds 2…2\)"
        ):
            st.fetch([1, 5, 21])
        with pytest.raises(BankError, match="cluster 48"):
            st.fetch_flat(3, 48)
        st.block(1, [2], subtree=True)
        assert st.blocked_fraction() == 1.0
        assert all(torch.count_nonzero(t) == 0 for t in st.fetch([2, 11, 47], flat=True).values())


def test_file_truncated_while_open_is_a_clear_error(tmp_path):
    root = tmp_path / "b"
    write(root, random_values(31), "bf16")
    with MemoryStore(
        root,
        tiers=[TierConfig(name="flash", kind="flash"), TierConfig(name="disk", kind="disk")],
        placement={1: "flash", 2: "flash", 3: "disk"},
    ) as st:
        os.truncate(root / "level-2.bin", 4096 * 10)
        os.truncate(root / "level-3.bin", 4096 * 10)
        with pytest.raises(BankError, match="truncated"):
            st.fetch_flat(2, 12)
        with pytest.raises(BankError, match="truncated"):
            st.fetch_flat(3, 40)
