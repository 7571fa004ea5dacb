"""Tier calibration (memstore.sim.calibrate): the fit on hand-made timings, a tiny real calibration,
validate, CLI."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from memtree.geometry import AnchorShape, plan
from memtree.memstore.cli import add_calibrate_arguments, parse_size, run_calibrate
from memtree.memstore.format import read_manifest
from memtree.memstore.sim.calibrate import (
    calibrate,
    fit_latency_bandwidth,
    fit_tier,
    measure,
    validate,
    write_calibration_bank,
)
from memtree.memstore.sim.latency import simulate_fetch
from memtree.memstore.sim.profiles import load_profile
from memtree.memstore.store import MemoryStore, TierConfig

KiB = 1024
# Sizes far enough apart that even RAM reads (~25 µs at 4 KiB) grow clearly with size on a busy
# machine.
TINY_SIZES = (4 * KiB, 256 * KiB, 4096 * KiB)
# 2 layers × 3 SwiGLU tensors × (m × 64) → 384·m params: bf16 blocks of 12,288 / 6,144 / 3,072 B for
# (16, 8, 4).
TINY = AnchorShape(
    name="tiny", n_layers=2, d_model=64, n_heads=2, head_dim=32, ffn_dim=128, vocab_size=32
)


# --------------------------------------------------------------------------- fitting


def test_fit_recovers_latency_and_bandwidth_from_exact_timings():
    # 80 µs + bytes / 2 GB/s, by hand: 4 KiB → 82.048 µs, 1 MiB → 604.288 µs, 32 MiB → 16,857.216 µs
    sizes = [4096, 65536, 1 << 20, 32 << 20]
    secs = [82.048e-6, 112.768e-6, 604.288e-6, 16857.216e-6]
    lat, bw = fit_latency_bandwidth(sizes, secs)
    assert lat == pytest.approx(80e-6, rel=1e-9)
    assert bw == pytest.approx(2e9, rel=1e-9)


def test_fit_tier_takes_medians_so_outliers_do_not_move_it():
    # 50 µs + bytes / 1 GB/s; each size has one wild outlier (a stall) and small jitter around the
    # truth.
    truth = {4096: 54.096e-6, 65536: 115.536e-6, 1 << 20: 1098.576e-6}
    samples = {n: [t * 0.98, t, t * 1.02, t * 40, t] for n, t in truth.items()}
    fit = fit_tier("flash", samples, method="hand-made")
    assert fit.kind == "flash" and fit.method == "hand-made"
    assert [t.median_s for t in fit.timings] == pytest.approx(list(truth.values()))
    assert fit.latency_s == pytest.approx(50e-6, rel=1e-9)
    assert fit.bandwidth_bps == pytest.approx(1e9, rel=1e-9)
    assert fit.max_rel_error == pytest.approx(0, abs=1e-9)
    assert fit.timings[0].n == 5 and fit.timings[0].min_s == pytest.approx(54.096e-6 * 0.98)


def test_fit_weighs_sizes_relatively_and_clamps_negative_latency():
    # Pure bandwidth with a little noise that, fitted in absolute seconds, would give a negative
    # intercept.
    sizes = [1000, 2000, 4000]
    secs = [0.9e-6, 2.0e-6, 4.2e-6]  # ~1 GB/s
    lat, bw = fit_latency_bandwidth(sizes, secs)
    assert lat == 0.0
    assert 0.9e9 < bw < 1.1e9


@pytest.mark.parametrize(
    "sizes,secs,match",
    [
        ([4096, 4096], [1e-5, 2e-5], "two or more distinct sizes"),
        ([4096, 8192], [2e-5, 1e-5], "does not grow with size"),
        ([4096, 8192], [0.0, 1e-5], "positive"),
    ],
)
def test_fit_rejects_unresolvable_data(sizes, secs, match):
    with pytest.raises(ValueError, match=match):
        fit_latency_bandwidth(sizes, secs)


def test_parse_size():
    assert parse_size("4K") == 4096
    assert parse_size("32MiB") == 32 << 20
    assert parse_size("1.5M") == 3 << 19
    assert parse_size("8192") == 8192
    with pytest.raises(ValueError, match="expected bytes"):
        parse_size("lots")


# --------------------------------------------------------------------------- real measurement


def test_calibration_bank_blocks_are_exactly_the_target_size(tmp_path: Path):
    info = write_calibration_bank(tmp_path / "b", 16 * KiB, 5)
    lv = info.level(1)
    assert (lv.record_bytes, lv.stride, lv.n_blocks, lv.has_generic) == (
        16 * KiB,
        16 * KiB,
        5,
        False,
    )
    with MemoryStore(
        info.root, tiers=(TierConfig(name="flash", kind="flash", direct=True),)
    ) as store:
        assert store.fetch_flat(1, 4).numel() * 2 == 16 * KiB
    with pytest.raises(ValueError, match="multiple of 4096"):
        write_calibration_bank(tmp_path / "c", 5000, 4)


def test_calibrate_writes_a_loadable_profile(tmp_path: Path):
    out = tmp_path / "prof" / "this-machine.yaml"
    work = tmp_path / "work"
    prof = calibrate(work, sizes=TINY_SIZES, repeats=5, bank_bytes=1024 * KiB, out=out)
    loaded = load_profile(out)
    assert loaded == prof
    assert [t.name for t in loaded.tiers] == ["ram", "flash"]
    for t in loaded.tiers:
        assert t.bandwidth_gbps > 0 and math.isfinite(t.bandwidth_gbps)
        assert t.latency_us >= 0
        assert t.source.startswith("measured by memtree memstore calibrate on ")
    ram, flash = loaded.tier("ram"), loaded.tier("flash")
    if (
        "O_DIRECT pread" in flash.source
    ):  # a filesystem refusing O_DIRECT (tmpfs) serves "flash" from RAM
        assert flash.read_seconds(4096 * KiB) > ram.read_seconds(4096 * KiB)
    assert "# settings:" in out.read_text()
    # the slowest tier is unbounded, as in shipped ones
    assert ram.capacity_gb > 0 and flash.capacity_gb is None
    # usable as is by simulate-fetch's defaults (the flat baseline of the 160M config is ~148 GB)
    assert simulate_fetch(plan("openlm-160m", (256, 64, 16, 0)), loaded).seconds > 0
    assert not list(work.glob("calibrate-*")), "calibration banks are removed unless keep=True"


def test_measure_disk_tier_via_relocation(tmp_path: Path):
    with pytest.raises(ValueError, match="disk_dir"):
        measure(tmp_path / "w", tiers=("ram", "disk"), sizes=TINY_SIZES)
    disk = tmp_path / "disk"
    cal = measure(
        tmp_path / "w",
        tiers=("disk", "flash"),
        sizes=TINY_SIZES[::2],
        repeats=5,
        bank_bytes=64 * KiB,
        disk_dir=disk,
        keep=True,
    )
    # fastest first, whatever order they were asked in
    assert [f.name for f in cal.fits] == ["flash", "disk"]
    disk_fit = cal.fits[1]
    assert disk_fit.kind == "disk" and "DONTNEED" in disk_fit.method
    assert [t.nbytes for t in disk_fit.timings] == [4 * KiB, 4096 * KiB]
    assert (
        cal.profile.tier("disk").capacity_gb is None and cal.profile.tier("flash").capacity_gb > 0
    )
    moved = read_manifest(tmp_path / "w" / f"calibrate-{4 * KiB}-disk").level(1).file
    assert Path(moved).is_relative_to(disk.resolve())
    assert cal.to_dict()["fits"][1]["timings"][0]["n"] == 5
    measure(
        tmp_path / "w2",
        tiers=("flash",),
        sizes=TINY_SIZES[::2],
        repeats=5,
        bank_bytes=64 * KiB,
        disk_dir=tmp_path / "disk2",
    )
    assert not list((tmp_path / "disk2").iterdir()) and not list((tmp_path / "w2").iterdir())


def test_validate_returns_a_ratio(tmp_path: Path):
    prof = calibrate(tmp_path / "w", sizes=TINY_SIZES, repeats=5, bank_bytes=512 * KiB)
    v = validate(
        prof,
        tmp_path / "w",
        anchor=TINY,
        multipliers=(16, 8, 4),
        branching=2,
        n_fetches=5,
        warmup=1,
    )
    # fast_levels=1: level 1 alone fits in RAM
    assert v.placement == {1: "ram", 2: "flash", 3: "flash"}
    assert v.fetch_bytes == 12288 + 6144 + 3072
    assert math.isfinite(v.ratio) and v.ratio > 0 and v.ratio_flat > 0
    assert [r["level"] for r in v.levels] == [1, 2, 3]
    assert [r["n_tensors"] for r in v.levels] == [6, 6, 6] and v.unflatten_mean_s > 0
    # a level costs its read plus one view per layer tensor (6 here) handed to the model
    assert v.levels[0]["simulated_s"] == pytest.approx(
        prof.tier("ram").read_seconds(12288) + 6 * prof.tensor_us * 1e-6
    )
    assert v.simulated_s == pytest.approx(sum(r["simulated_s"] for r in v.levels))
    assert not (tmp_path / "w" / "validate-bank").exists()
    d = v.to_dict()
    assert d["ratio"] == v.ratio and d["placement"] == {"1": "ram", "2": "flash", "3": "flash"}


def test_cli_writes_profile(tmp_path: Path, capsys):
    parser = argparse.ArgumentParser()
    add_calibrate_arguments(parser)
    out = tmp_path / "p.yaml"
    args = parser.parse_args(
        [
            "--out",
            str(out),
            "--workdir",
            str(tmp_path / "w"),
            "--sizes",
            "4K,4M",
            "--repeats",
            "5",
            "--bank-mb",
            "4",
            "--tiers",
            "ram,flash",
        ]
    )
    assert run_calibrate(args) == 0
    printed = capsys.readouterr().out
    assert "fit: latency" in printed and f"profile: {out}" in printed
    assert [t.name for t in load_profile(out).tiers] == ["ram", "flash"]
