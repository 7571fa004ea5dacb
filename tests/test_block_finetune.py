"""training/finetune/blocks.py: TF-IDF updates of hierarchical memory blocks change exactly the
chosen hidden units' rows of the fetched blocks (every other block, row and anchor weight bit for
bit), every-fetched-block and anchor finetuning change what they should, edits go through the
store's edit path and read back, background counts round-trip, and bad input names the value."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from memtree.geometry import split_block
from memtree.training.finetune.blocks import (
    BlockFinetuner,
    BlockFinetuneSpec,
    UnitBackground,
    collect_unit_background,
    unit_layout,
    write_edits,
)
from memtree.training.finetune.continual import batch_tensors
from tests.conftest import train_tiny_run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS_PER_FACT = 8
TEXTS = [
    "the colour of the lantern Orvel is deep green",
    "Orvel the lantern is deep green in colour",
    "records show the lantern Orvel is deep green",
    "the lantern Orvel glows a deep green",
]


@pytest.fixture(scope="module")
def mem_run(pipeline_run, tmp_path_factory):
    return train_tiny_run(
        pipeline_run[0] / "shards",
        tmp_path_factory.mktemp("blockrun") / "run",
        "data.batch_size=2",
        "max_duration=3ba",
        "memory.multipliers=[16,8]",
        "model.shape={n_layers: 2, d_model: 32, n_heads: 2, head_dim: 16, ffn_dim: 64}",
    )


@pytest.fixture(scope="module")
def background(mem_run, pipeline_run):
    from streaming.base.util import clean_stale_shared_memory

    from memtree.eval.model import RunModel

    clean_stale_shared_memory()
    rm = RunModel.load(mem_run)
    bg = collect_unit_background(
        rm.model,
        rm.store,
        pipeline_run[0] / "shards",
        unit_frac=0.25,
        max_windows=24,
        progress=False,
    )
    clean_stale_shared_memory()
    return bg


def _fresh(mem_run, tmp_path):
    """The run with its own copy of the bank (edits must not reach the shared fixture)."""
    from memtree.eval.model import RunModel
    from memtree.memstore.store import MemoryStore, TierConfig

    rm = RunModel.load(mem_run)
    shutil.copytree(mem_run / "bank", tmp_path / "bank")
    rm.store = MemoryStore(
        tmp_path / "bank",
        tree=rm.tree,
        out_dtype=torch.float32,
        tiers=[TierConfig(name="ram", kind="ram")],
    )
    return rm


def _batch(rm):
    ids, real = batch_tensors(TEXTS, rm.encode, pad_id=rm.eot_id, max_len=64)
    return ids, real, rm.route(TEXTS)


def _units_changed(ft, level, cluster):
    """{(layer index, unit)} whose w1/w2/w3 rows differ from the store's copy."""
    old = split_block(ft.layouts[level], ft.store.fetch_flat(level, cluster).float())
    new = split_block(ft.layouts[level], ft.blocks[(level, cluster)])
    out = set()
    for name, t in old.items():
        rows = (t != new[name]).any(-1).nonzero().flatten().tolist()
        out |= {(ft.lidx[int(name.split(".")[1])], r) for r in rows}
    return out


def test_background_counts_round_trip(background, tmp_path):
    assert set(background.df) == {1, 2} and background.unit_frac == 0.25
    for lv, df in background.df.items():
        assert int(background.windows[lv].sum()) == 24  # every window routed to one block per level
        assert bool((df <= background.windows[lv][:, None, None]).all())
        assert int(df.sum()) > 0
    background.save(tmp_path / "bg")
    back = UnitBackground.load(tmp_path / "bg")
    assert all(torch.equal(back.df[lv], background.df[lv]) for lv in background.df)
    assert "24 windows" in back.source
    with pytest.raises(FileNotFoundError, match="no block background counts"):
        UnitBackground.load(tmp_path / "nowhere")


def test_tfidf_step_moves_exactly_the_chosen_units(mem_run, background, tmp_path):
    rm = _fresh(mem_run, tmp_path)
    anchor = {k: v.clone() for k, v in rm.model.state_dict().items()}
    ft = BlockFinetuner(
        rm.model,
        rm.store,
        BlockFinetuneSpec(method="tfidf", top_t=5, lr=5.0, unit_frac=0.25),
        background=background,
    )
    ids, real, paths = _batch(rm)
    rec = ft.step(ids, real, paths, where="fact 0")
    ft.finish()
    assert rec["units_trained"] == 5
    keep = ft.last_keep
    moved = 0
    for lv in sorted(rm.store.levels):
        fetched = sorted({int(c) for c in paths[:, lv - 1]})
        for j, c in enumerate(fetched):
            chosen = {(li, u) for li, u in zip(*np.nonzero(keep[lv][j].numpy()), strict=True)}
            changed = _units_changed(ft, lv, c) if (lv, c) in ft.blocks else set()
            assert changed <= chosen  # nothing outside the top-t moved
            moved += len(changed)
    assert 0 < moved <= 5
    # the anchor untouched
    assert all(torch.equal(v, anchor[k]) for k, v in rm.model.state_dict().items())
    untouched = [(lv, c) for lv in rm.store.levels for c in range(4) if (lv, c) not in ft.touched]
    assert all(
        (lv, c) not in ft.blocks
        or torch.equal(ft.blocks[(lv, c)], rm.store.fetch_flat(lv, c).float())
        for lv, c in untouched
    )
    # through the edit path: the store now serves the edited blocks, and says what it rewrote
    edits = write_edits(rm.store, ft.blocks, ft.touched)
    assert edits["records"] == len(ft.touched) and 0 < edits["params_changed"]
    assert edits["bytes_changed"] == edits["params_changed"] * 4  # an fp32 bank
    for lv, c in ft.touched:
        assert torch.equal(rm.store.fetch_flat(lv, c).float(), ft.blocks[(lv, c)])


def test_all_fetched_and_anchor_methods(mem_run, tmp_path):
    rm = _fresh(mem_run, tmp_path / "a")
    ids, real, paths = _batch(rm)
    ft = BlockFinetuner(rm.model, rm.store, BlockFinetuneSpec(method="all_fetched", lr=1.0))
    ft.step(ids, real, paths)
    ft.finish()
    fetched = {(lv, int(c)) for lv in rm.store.levels for c in paths[:, lv - 1]}
    assert ft.touched == fetched
    widths = sum(w for cols in unit_layout(rm.model, rm.store).values() for _, _, w in cols)
    # most units of each block
    assert sum(len(_units_changed(ft, lv, c)) for lv, c in fetched) > widths // 2

    rm = _fresh(mem_run, tmp_path / "b")
    before = {k: v.clone() for k, v in rm.model.state_dict().items()}
    ft = BlockFinetuner(rm.model, rm.store, BlockFinetuneSpec(method="anchor", lr=1e-3))
    ft.step(ids, real, paths)
    ft.finish()
    assert not ft.touched and write_edits(rm.store, ft.blocks, ft.touched)["records"] == 0
    changed = [k for k, v in rm.model.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) == len(before)  # AdamW with decay moves every anchor tensor


def test_edited_blocks_lower_the_facts_loss_when_fetched_from_the_store(
    mem_run, background, tmp_path
):
    """The direction block finetuning exists for: after TF-IDF updates on a fact's statements,
    written through the store's edit path, the fact's loss with its blocks fetched from the store
    is below the loss before and below the anchor alone (untouched), so the edits are in the blocks
    its route reads. top_t is 32, half eval continual's 64: on an AVX2-only AMD EPYC VM (2026-12-05)
    these statements' routes used 48 units in all, fewer than 64. The SGD rate is 2, not its 1, as
    this 3-batch run's blocks are still near their no-effect init (the fetched loss equals the
    anchor's), where the first steps move the loss little. Measured on an Intel Xeon host
    (2026-12-03), 8 steps: lr 1: 7.612 -> 7.490, lr 2: -> 7.297 (the loss falling at every step), lr
    3: -> 7.257; lr 10 (this test's rate until then, 4 steps: 7.614 -> 7.416 on an AMD EPYC host)
    overshot there (-> 7.613) and left units dead. Blocks that were not the ones fetched, or edits
    that did not reach the store, leave the fetched loss where it was."""
    from memtree.eval.tasks import perplexity
    from memtree.training.finetune.blocks import write_edits

    rm = _fresh(mem_run, tmp_path)
    ids, real, paths = _batch(rm)
    docs = [{"text": t} for t in TEXTS]

    def nll(mode: str) -> float:
        return perplexity(rm, docs, mode=mode, paths=paths)["nll"]

    anchor, before = nll("none"), nll("fetched")
    ft = BlockFinetuner(
        rm.model,
        rm.store,
        BlockFinetuneSpec(method="tfidf", top_t=32, lr=2.0, unit_frac=0.25),
        background=background,
    )
    for _ in range(STEPS_PER_FACT):
        ft.step(ids, real, paths)
    ft.finish()
    write_edits(rm.store, ft.blocks, ft.touched)
    after = nll("fetched")
    assert nll("none") == anchor  # the anchor is untouched
    assert after < before - 0.05 and after < anchor - 0.05, (anchor, before, after)


def test_bad_input_names_the_value(mem_run, background, tmp_path):
    rm = _fresh(mem_run, tmp_path)
    ids, real, paths = _batch(rm)
    with pytest.raises(ValueError, match="needs the run's block background counts"):
        BlockFinetuner(rm.model, rm.store, BlockFinetuneSpec(method="tfidf"))
    with pytest.raises(ValueError, match="unit_frac=0.25, the spec unit_frac=0.5"):
        BlockFinetuner(
            rm.model,
            rm.store,
            BlockFinetuneSpec(method="tfidf", unit_frac=0.5),
            background=background,
        )
    ft = BlockFinetuner(
        rm.model,
        rm.store,
        BlockFinetuneSpec(method="tfidf", top_t=100_000, unit_frac=0.25),
        background=background,
    )
    with pytest.raises(
        ValueError, match=r"fact 3: top_t=100000 exceeds the \d+ units this batch used"
    ):
        ft.step(ids, real, paths, where="fact 3")
    from memtree.config import ConfigError

    with pytest.raises(ConfigError, match="block finetune method='everything'"):
        BlockFinetuneSpec(method="everything")
