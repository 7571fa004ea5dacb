"""`memory.read: auto` settled by a timed probe (training/read_choice.py): the choice rule, the
cache file, the probe on a real (tiny, CPU) model and the decision. On the CPU the fused ops run
their pure-torch reference; timings are injected where a test needs them to be known."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch.utils.data import DataLoader

from memtree.geometry import AnchorShape, MemoryConfig
from memtree.training.composer_model import MemorySettings, MemtreeLM
from memtree.training.model import ModelConfig
from memtree.training.read_choice import (
    CACHE_FORMAT,
    CACHE_VERSION,
    ReadProbeCache,
    choose_read,
    default_cache_path,
    key_id,
    peek_batch,
    probe_key,
    probe_read,
    resolve_read,
)

ANCHOR = AnchorShape(
    name="t", n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, vocab_size=64
)
PATHS = torch.tensor([[0, 1], [1, 2], [0, 0], [1, 3]])


def _model(kind: str = "ffn", read: str = "fused", anchor: AnchorShape = ANCHOR) -> MemtreeLM:
    torch.manual_seed(0)
    mem = MemoryConfig(
        multipliers=(1, 2), type=kind, branching=2, placement="uniform", placement_layers=2
    )
    model = MemtreeLM(
        ModelConfig(anchor=anchor, memory=mem, max_seq_len=16),
        memory_settings=MemorySettings(read=read, generic_prob=0.25),
    )
    with torch.no_grad():
        for table in model.bank.tables.values():
            table.normal_(0.0, 0.3)
    return model


def _batch(n: int = 4, seq: int = 16) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, ANCHOR.vocab_size, (n, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids, "paths": PATHS[:n]}


def _never(*_):
    raise AssertionError("the probe must not run here")


# ------------------------------------------------------------------------------ choose_read
def test_choose_read_needs_fused_clearly_faster():
    assert choose_read({"fused": 0.9, "gather": 1.0}) == "fused"
    assert choose_read({"fused": 0.95, "gather": 1.0}) == "fused"  # exactly at the margin
    assert choose_read({"fused": 0.96, "gather": 1.0}) == "gather"
    assert choose_read({"fused": 1.0, "gather": 1.0}) == "gather"  # a tie
    assert choose_read({"fused": 1.2, "gather": 1.0}) == "gather"
    assert choose_read({"fused": 0.99, "gather": 1.0}, margin=1.0) == "fused"
    assert choose_read({"fused": 0.9, "gather": 1.0}, margin=0.8) == "gather"


@pytest.mark.parametrize(
    "timings",
    [
        {"gather": 1.0},
        {"fused": None, "gather": 1.0},
        {"fused": float("nan"), "gather": 1.0},
        {"fused": float("inf"), "gather": 1.0},
        {"fused": 0.0, "gather": 1.0},
        {"fused": 0.5},
        {},
    ],
)
def test_choose_read_missing_or_failed_times_gather(timings):
    assert choose_read(timings) == "gather"


# ---------------------------------------------------------------------------------- cache
def test_cache_round_trip_and_format(tmp_path):
    path = tmp_path / "sub" / "read-probe.json"
    cache = ReadProbeCache(path)
    assert cache.entries() == {} and cache.get("k") is None  # no file yet: empty, no warning
    cache.put("k", {"fused": 0.01, "gather": 0.02, "choice": "fused", "measured_at": "now"})
    cache.put("j", {"fused": 0.03, "gather": 0.02, "choice": "gather", "measured_at": "now"})
    data = json.loads(path.read_text())
    assert data["format"] == CACHE_FORMAT and data["version"] == CACHE_VERSION
    assert set(data["entries"]) == {"k", "j"}
    again = ReadProbeCache(path)
    assert again.get("k")["fused"] == 0.01 and again.get("j")["choice"] == "gather"
    assert not list(path.parent.glob(".*tmp"))  # the temp file was renamed, not left behind


def test_default_cache_path_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMTREE_CACHE_DIR", str(tmp_path))
    assert default_cache_path() == tmp_path / "read-probe.json"
    assert ReadProbeCache().path == tmp_path / "read-probe.json"
    monkeypatch.delenv("MEMTREE_CACHE_DIR")
    assert default_cache_path().parts[-3:] == (".cache", "memtree", "read-probe.json")


@pytest.mark.parametrize(
    "text, reason",
    [
        ("{not json", "not valid JSON"),
        (
            json.dumps({"format": "something-else", "version": 1, "entries": {}}),
            "not a memtree-read-probe file",
        ),
        (json.dumps({"format": CACHE_FORMAT, "version": 99, "entries": {}}), "version 99"),
        (
            json.dumps({"format": CACHE_FORMAT, "version": CACHE_VERSION, "entries": []}),
            "'entries' is not",
        ),
        (json.dumps([1, 2]), "not a memtree-read-probe file"),
    ],
)
def test_corrupt_cache_warns_naming_file_and_reason(tmp_path, text, reason):
    path = tmp_path / "read-probe.json"
    path.write_text(text)
    cache = ReadProbeCache(path)
    with pytest.warns(RuntimeWarning, match=reason) as got:
        assert cache.entries() == {}
    assert str(path) in str(got[0].message)
    with pytest.warns(RuntimeWarning):
        cache.put("k", {"fused": 0.01, "gather": 0.02})  # overwrites the bad file
    assert ReadProbeCache(path).get("k")["gather"] == 0.02


def test_key_changes_with_shape_device_batch_and_precision():
    model, batch = _model(), _batch()
    base = probe_key(model, batch, device_name="NVIDIA H100", precision="amp_bf16")
    assert base["batch"] == 4 and base["seq_len"] == 16 and base["memory"]["type"] == "ffn"
    same = probe_key(_model(), _batch(), device_name="NVIDIA H100", precision="amp_bf16")
    assert key_id(base) == key_id(same)
    wider = AnchorShape(
        name="t",
        n_layers=2,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_dim=96,
        vocab_size=64,
    )
    others = [
        probe_key(model, batch, device_name="NVIDIA H200", precision="amp_bf16"),
        probe_key(model, batch, device_name="NVIDIA H100", precision="fp32"),
        probe_key(model, batch, device_name="NVIDIA H100", precision="amp_bf16", allow_tf32=False),
        probe_key(model, _batch(n=2), device_name="NVIDIA H100", precision="amp_bf16"),
        probe_key(model, _batch(seq=8), device_name="NVIDIA H100", precision="amp_bf16"),
        probe_key(_model("kv"), batch, device_name="NVIDIA H100", precision="amp_bf16"),
        probe_key(_model(anchor=wider), batch, device_name="NVIDIA H100", precision="amp_bf16"),
    ]
    keys = {key_id(base), *(key_id(o) for o in others)}
    assert len(keys) == len(others) + 1


# ---------------------------------------------------------------------------------- probe
@pytest.mark.parametrize("kind", ["ffn", "kv"])
def test_probe_alternates_and_leaves_the_model_as_found(kind):
    model, batch = _model(kind), _batch()
    model.eval()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    reads = []
    real_read = model.bank.read
    model.bank.read = lambda slots: reads.append(1) or real_read(slots)
    clock, order = [0.0], []

    def timer():  # fused steps take 3 ms, gathered ones 1 ms; records the mode of each reading
        order.append("fused" if model.read_in_place else "gather")
        clock[0] += 0.003 if model.read_in_place else 0.001
        return clock[0]

    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    got = probe_read(model, batch, steps=3, warmup=1, timer=timer, allow_tf32=not tf32[0])
    assert got == pytest.approx({"fused": 0.003, "gather": 0.001})
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == tf32
    assert order[::2] == ["fused", "gather", "gather", "fused", "fused", "gather"]  # A B B A A B
    assert order[::2] == order[1::2]  # each step's start and end readings in the same mode
    assert len(reads) == 1 + 3  # the fused path really ran: warmup + timed steps
    assert model.read_in_place and not model.training and int(model.forwards) == 0
    assert all(p.grad is None for p in model.parameters())
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert torch.equal(v, after[k]), k


def test_probe_real_timings_and_a_gather_built_model():
    model, batch = _model("kv", read="gather"), _batch()
    model.train()
    model.forwards.fill_(7)
    got = probe_read(model, batch, steps=2, warmup=1)
    assert set(got) == {"fused", "gather"} and all(t > 0 for t in got.values())
    assert not model.read_in_place and model.training and int(model.forwards) == 7


def test_probe_restores_the_model_when_a_step_raises():
    model = _model()
    bad = {**_batch(), "paths": torch.full((4, 2), 99)}  # cluster ids outside the tree
    with pytest.raises(ValueError, match="outside"):
        probe_read(model, bad, steps=1, warmup=0)
    assert model.read_in_place and int(model.forwards) == 0
    assert all(p.grad is None for p in model.parameters())


def test_probe_refuses_models_without_an_in_place_read():
    with pytest.raises(ValueError, match="no read to compare"):
        probe_read(_model("lora-ffn"), _batch())


# --------------------------------------------------------------------------------- decide
def test_explicit_values_are_returned_unchanged(tmp_path):
    model = _model()
    for read in ("fused", "gather"):
        got = resolve_read(
            read, model, _batch(), on_gpu=True, probe=_never, cache=tmp_path / "c.json"
        )
        assert got == read
        assert resolve_read(read) == read
    assert not (tmp_path / "c.json").exists()
    with pytest.raises(ValueError, match="memory.read"):
        resolve_read("copy", model)


def test_auto_on_the_cpu_gathers_without_probing(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="memtree.training.read_choice")
    assert (
        resolve_read("auto", _model(), _batch(), probe=_never, cache=tmp_path / "c.json")
        == "gather"
    )
    assert (
        resolve_read(
            "auto", _model(), _batch(), on_gpu=False, probe=_never, cache=tmp_path / "c.json"
        )
        == "gather"
    )
    assert "CPU" in caplog.text and not (tmp_path / "c.json").exists()


def test_auto_without_an_in_place_read_gathers_without_probing(tmp_path):
    for model in (_model("lora-ffn"), None):
        assert (
            resolve_read(
                "auto", model, _batch(), on_gpu=True, probe=_never, cache=tmp_path / "c.json"
            )
            == "gather"
        )
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize(
    "timings, want",
    [
        ({"fused": 0.010, "gather": 0.020}, "fused"),
        ({"fused": 0.020, "gather": 0.010}, "gather"),
        ({"fused": 0.0099, "gather": 0.010}, "gather"),
    ],
)
def test_auto_on_a_gpu_picks_the_faster_and_caches_it(tmp_path, caplog, timings, want):
    caplog.set_level(logging.INFO, logger="memtree.training.read_choice")
    cache = ReadProbeCache(tmp_path / "read-probe.json")
    model, batch = _model(), _batch()
    calls = []

    def probe(m, b):
        calls.append(m)
        return timings

    kw = {"on_gpu": True, "device_name": "Test GPU", "precision": "amp_bf16", "cache": cache}
    assert resolve_read("auto", model, batch, probe=probe, **kw) == want
    assert calls == [model]
    line = caplog.records[-1].getMessage()
    assert f"-> {want} [probed, saved to {cache.path}]" in line
    assert (
        f"fused {timings['fused'] * 1e3:.1f} ms vs gather {timings['gather'] * 1e3:.1f} ms" in line
    )
    assert "B4 x S16, Test GPU, amp_bf16" in line
    (entry,) = cache.entries().values()
    assert entry["choice"] == want and entry["key"]["device"] == "Test GPU"
    # the next start reads the cache instead of probing
    assert resolve_read("auto", _model(), _batch(), probe=_never, **kw) == want
    assert f"-> {want} [cached in {cache.path}]" in caplog.records[-1].getMessage()
    # another device or shape is another entry: probed again
    assert (
        resolve_read("auto", model, batch, probe=probe, **{**kw, "device_name": "Other GPU"})
        == want
    )
    assert resolve_read("auto", model, _batch(n=2), probe=probe, **kw) == want
    assert len(calls) == 3 and len(cache.entries()) == 3


def test_a_failed_probe_gathers_and_is_not_cached(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="memtree.training.read_choice")
    cache = ReadProbeCache(tmp_path / "read-probe.json")

    def broken(m, b):
        raise RuntimeError("triton compile error: out of shared memory\nmore detail")

    assert (
        resolve_read(
            "auto",
            _model(),
            _batch(),
            on_gpu=True,
            device_name="Test GPU",
            cache=cache,
            probe=broken,
        )
        == "gather"
    )
    line = caplog.records[-1].getMessage()
    assert "probe failed (RuntimeError: triton compile error: out of shared memory)" in line
    assert line.endswith("-> gather") and not cache.path.exists()


def test_auto_with_the_real_probe_on_a_forced_gpu_decision(tmp_path):
    """The default probe (probe_read) end to end, on the CPU standing in for the GPU."""
    cache = ReadProbeCache(tmp_path / "read-probe.json")
    model = _model("kv")
    got = resolve_read("auto", model, _batch(), on_gpu=True, cache=cache, steps=1, warmup=1)
    (entry,) = cache.entries().values()
    assert got == entry["choice"] == choose_read(entry) and entry["key"]["device"] == "cpu"
    assert entry["fused"] > 0 and entry["gather"] > 0 and entry["batch"] == 4
    assert model.read_in_place  # resolve_read decides; the caller sets the mode


# ------------------------------------------------------------------------- the probe batch
def _samples(n: int = 10) -> list[dict]:
    return [{"tokens": torch.full((3,), i)} for i in range(n)]


def _collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.stack([s["tokens"] for s in samples])}


def test_peek_batch_does_not_advance_the_loader():
    loader = DataLoader(_samples(), batch_size=4, shuffle=False, collate_fn=_collate)
    it = iter(loader)
    peeked = peek_batch(loader, seed=3)
    assert peeked["input_ids"].shape == (4, 3)
    assert len(set(peeked["input_ids"][:, 0].tolist())) == 4  # distinct samples
    assert torch.equal(next(it)["input_ids"][:, 0], torch.arange(4))  # the loader's own first batch
    assert torch.equal(peek_batch(loader, seed=3)["input_ids"], peeked["input_ids"])  # seeded
    assert peek_batch(loader, 2)["input_ids"].shape == (2, 3)  # the micro batch


class _KnownBatches:
    """A batch sampler that can name a step's batch (like training.lanes.LaneBatches)."""

    def rank_samples(self, step: int) -> list[int]:
        return [7, 2, 5]

    def __iter__(self):
        yield from ([7, 2, 5], [0, 1, 3])

    def __len__(self) -> int:
        return 2


def test_peek_batch_takes_a_known_first_batch():
    loader = DataLoader(_samples(), batch_sampler=_KnownBatches(), collate_fn=_collate)
    assert peek_batch(loader)["input_ids"][:, 0].tolist() == [7, 2, 5]
    assert peek_batch(loader, 2)["input_ids"][:, 0].tolist() == [7, 2]
