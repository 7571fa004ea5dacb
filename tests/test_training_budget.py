"""Per-rank training memory (memtree/budget.py, `memtree memstore plan --ranks N --device-memory`).

Expected values are derived here from the Plan's own accounting (`bank_params`, `levels`,
`anchor_params`) and the byte model the issue states (fp32 tables, 8 B/param AdamW state,
16 B/row bookkeeping, 16 B/param anchor), never copied from the module's output. The GB
figures for the replicated bank are bank_params × 12 bytes of Table 1's A2 / B2 / C2.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from memtree.budget import (
    LAYOUTS,
    fits,
    memory_groups,
    min_ranks,
    parse_bytes,
    training_memory,
    training_report,
)
from memtree.cli import main
from memtree.geometry import plan

GiB = 2**30
DEVICE = 80 * GiB
USABLE = 0.8 * DEVICE  # default headroom 0.2

A2 = ("openlm-160m", (256, 64, 16, 0))
B2 = ("openlm-410m", (512, 128, 32, 0))
C2 = ("openlm-1.4b", (768, 256, 16, 0))
TABLE_1 = pytest.mark.parametrize(
    "row, replicated_gb", [(A2, 55), (B2, 152), (C2, 254)], ids=["A2", "B2", "C2"]
)


def _levels(p):
    """Levels that carry memory (m_l > 0), each with one generic row besides its B**l rows."""
    return [lv for lv in p.levels if lv.multiplier]


def _generic_state(p) -> int:
    """Table + AdamW state + bookkeeping of the generic rows, which every rank replicates."""
    return sum(12 * lv.block_params + 16 for lv in _levels(p))


def _state(m) -> int:
    return m.bank_tables + m.bank_optimizer + m.bank_row_state


# --- the bank's resident state -------------------------------------------------------------------


@TABLE_1
def test_replicated_bank_is_twelve_bytes_per_param(row, replicated_gb):
    p = plan(*row)
    m = training_memory(p, ranks=8, bank="replicated", anchor_parallel="ddp")
    generic_params = sum(lv.block_params for lv in _levels(p))
    assert m.bank_tables == 4 * (p.bank_params + generic_params)
    assert m.bank_optimizer == 8 * (p.bank_params + generic_params)
    assert m.bank_row_state == 16 * sum(lv.n_blocks + 1 for lv in _levels(p))
    assert round(12 * p.bank_params / 1e9) == replicated_gb
    # the generic rows (one fetch's worth of params, 12 B each) and the bookkeeping are within
    # 1% of the bank: ≈ bank_params × 12
    assert _state(m) - _generic_state(p) == 12 * p.bank_params + 16 * sum(
        lv.n_blocks for lv in _levels(p)
    )
    assert _state(m) == pytest.approx(12 * p.bank_params, rel=0.01)
    # and every rank holds all of it, whatever the rank count
    for w in (1, 2, 64, 1024):
        assert _state(
            training_memory(p, ranks=w, bank="replicated", anchor_parallel="fsdp")
        ) == _state(m)


@TABLE_1
@pytest.mark.parametrize("ranks, share", [(8, 8), (16, 16), (32, 16), (1024, 16)])
def test_sharded_bank_is_a_subtree_share(row, replicated_gb, ranks, share):
    p = plan(*row)
    full = _state(training_memory(p, ranks=ranks, bank="replicated", anchor_parallel="ddp"))
    m = training_memory(p, ranks=ranks, bank="sharded", anchor_parallel="ddp")
    generic = _generic_state(p)
    # the subtree rows split 1/share exactly; beyond 16 ranks (16 subtrees) the share stops at 1/16
    assert (_state(m) - generic) * share == full - generic
    assert m.rows_held == tuple(
        16**lv.level // share + 1 if lv.multiplier else 0 for lv in p.levels
    )
    assert m.groups == share and m.replicas == ranks // share


def test_memory_groups_are_the_largest_divisor_at_most_the_subtrees():
    assert [memory_groups(w, 16) for w in (1, 7, 8, 12, 16, 17, 24, 32, 48)] == [
        1,
        7,
        8,
        12,
        16,
        1,
        12,
        16,
        16,
    ]
    # 12 groups over 16 subtrees: the fullest rank holds ceil(16/12) = 2 of them
    m = training_memory(plan(*C2), ranks=12, bank="sharded", anchor_parallel="ddp")
    assert m.subtrees_per_rank == 2 and m.rows_held[0] == 2 + 1
    # 17 ranks cannot be cut into subtree groups: one group, every rank a full replica
    m17 = training_memory(plan(*C2), ranks=17, bank="sharded", anchor_parallel="ddp")
    assert (m17.groups, m17.replicas, m17.subtrees_per_rank) == (1, 17, 16)


# --- per-step gradient traffic --------------------------------------------------------------------


def test_sparse_gradient_and_gather():
    p = plan(*C2)
    levels = _levels(p)
    # replicated, 8 ranks: 128 sequences each touch <= 128 rows per level (17 exist at level 1)
    rep = training_memory(p, ranks=8, bank="replicated", anchor_parallel="ddp")
    touched = [min(128, lv.n_blocks + 1) for lv in levels]
    assert touched == [17, 128, 128]
    assert rep.bank_grads == 4 * sum(t * lv.block_params for t, lv in zip(touched, levels))
    gathered = [min(8 * t, lv.n_blocks + 1) for t, lv in zip(touched, levels)]
    assert gathered == [17, 257, 1024]
    assert rep.bank_grad_gather == 4 * sum(g * lv.block_params for g, lv in zip(gathered, levels))
    # one rank has nobody to gather from
    assert (
        training_memory(p, ranks=1, bank="replicated", anchor_parallel="ddp").bank_grad_gather == 0
    )
    # sharded, 8 ranks: 2 subtrees + the generic row per level; one replica per group sends nothing
    sh = training_memory(p, ranks=8, bank="sharded", anchor_parallel="ddp")
    held = [2 * 16 ** (lv.level - 1) + 1 for lv in levels]
    assert held == [3, 33, 513]
    assert sh.bank_grads == 4 * sum(min(128, h) * lv.block_params for h, lv in zip(held, levels))
    assert sh.bank_grad_gather == 0
    # sharded, 32 ranks: 16 groups × 2 replicas; the group gathers 2 × the per-rank gradient
    sh32 = training_memory(p, ranks=32, bank="sharded", anchor_parallel="ddp")
    held32 = [16 ** (lv.level - 1) + 1 for lv in levels]
    per_rank = [min(32, h) for h in held32]
    assert sh32.bank_grads == 4 * sum(r * lv.block_params for r, lv in zip(per_rank, levels))
    assert sh32.bank_grad_gather == 2 * sh32.bank_grads


# --- the anchor -----------------------------------------------------------------------------------


def test_fsdp_anchor_share_shrinks_with_ranks():
    p = plan(*C2)
    a = p.anchor
    unit = max(a.block_params(), a.vocab_size * a.d_model)
    assert unit == a.vocab_size * a.d_model  # 1.4B: the embedding table is the largest unit
    ddp = training_memory(p, ranks=8, bank="sharded", anchor_parallel="ddp")
    assert ddp.anchor_total == 16 * p.anchor_params and ddp.anchor_fsdp_units == 0
    shares = []
    for w in (1, 2, 4, 8, 16, 64):
        m = training_memory(p, ranks=w, bank="sharded", anchor_parallel="fsdp")
        shard = math.ceil(p.anchor_params / w)
        assert (m.anchor_weights, m.anchor_grads, m.anchor_optimizer) == (
            4 * shard,
            4 * shard,
            8 * shard,
        )
        assert m.anchor_fsdp_units == 2 * 4 * unit
        shares.append(m.anchor_weights + m.anchor_grads + m.anchor_optimizer)
    assert shares == sorted(shares, reverse=True) and len(set(shares)) == len(shares)


# --- verdicts on 8 × 80 GiB -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "row, replicated_fits", [(A2, False), (B2, False), (C2, False)], ids=["A2", "B2", "C2"]
)
def test_verdicts_on_eight_80gib_gpus(row, replicated_fits):
    p = plan(*row)
    for bank in ("replicated", "sharded"):
        for par in ("ddp", "fsdp"):
            m = training_memory(p, ranks=8, bank=bank, anchor_parallel=par)
            assert m.total == sum(m.components().values())
            assert fits(m, DEVICE) == (m.total <= USABLE)
    rep = training_memory(p, ranks=8, bank="replicated", anchor_parallel="ddp")
    sh = training_memory(p, ranks=8, bank="sharded", anchor_parallel="ddp")
    assert fits(rep, DEVICE) is replicated_fits
    assert fits(sh, DEVICE)  # all three Table 1 rows train sharded on 8 × 80 GiB
    # the sharded total, summed by hand: DDP anchor + 1/8 of the bank + the per-step gradient
    held = [(2 * 16 ** (lv.level - 1) + 1, lv.block_params) for lv in _levels(p)]
    by_hand = (
        16 * p.anchor_params
        + sum(12 * h * b + 16 * h for h, b in held)
        + sum(4 * min(128, h) * b for h, b in held)
    )
    assert sh.total == by_hand


def test_a2_replicated_misses_by_its_gradient_all_gather():
    p = plan(*A2)
    m = training_memory(p, ranks=8, bank="replicated", anchor_parallel="ddp")
    # the 55 GB bank state fits the 68.7 GB usable; the gathered gradients tip it over
    assert _state(m) + m.anchor_total <= USABLE < m.total
    assert m.total - m.bank_grad_gather <= USABLE
    # FSDP's smaller anchor share makes room
    assert fits(training_memory(p, ranks=8, bank="replicated", anchor_parallel="fsdp"), DEVICE)


@pytest.mark.parametrize("row", [B2, C2], ids=["B2", "C2"])
def test_b2_c2_never_fit_replicated(row):
    p = plan(*row)
    assert 12 * p.bank_params > USABLE  # the table + AdamW state alone, on every rank
    found = min_ranks(p, device_bytes=DEVICE)
    for par in ("ddp", "fsdp"):
        assert found[("replicated", par)].ranks is None
        assert "whole bank" in found[("replicated", par)].reason
        assert found[("sharded", par)].ranks is not None


# --- the minimum rank count -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "row, device", [(A2, 24 * GiB), (B2, 40 * GiB), (C2, DEVICE), (C2, 40 * GiB)]
)
def test_min_ranks_is_the_smallest_that_fits(row, device):
    p = plan(*row)
    found = min_ranks(p, device_bytes=device)
    assert set(found) == set(LAYOUTS)
    for (bank, par), mr in found.items():
        if mr.ranks is None:
            continue
        assert fits(training_memory(p, ranks=mr.ranks, bank=bank, anchor_parallel=par), device)
        for w in range(1, mr.ranks):
            assert not fits(training_memory(p, ranks=w, bank=bank, anchor_parallel=par), device)
    # C2 sharded under DDP needs 8 ranks on 80 GiB: on 7, 7 groups hold up to 3 subtrees each
    if row == C2 and device == DEVICE:
        assert found[("sharded", "ddp")].ranks == 8
        seven = training_memory(p, ranks=7, bank="sharded", anchor_parallel="ddp")
        assert seven.subtrees_per_rank == 3 and seven.total > USABLE


def test_sharded_stops_shrinking_at_one_subtree_per_rank():
    p = plan(*C2)
    small = 16 * GiB  # one subtree of C2's bank with its AdamW state is ~1/16 of 254 GB ≈ 14.8 GiB
    one_subtree = (12 * p.bank_params) / 16
    assert one_subtree > 0.8 * small
    found = min_ranks(p, device_bytes=small)
    for par in ("ddp", "fsdp"):
        mr = found[("sharded", par)]
        assert mr.ranks is None
        assert "level-1 subtrees" in mr.reason and "beyond 16 ranks" in mr.reason


def test_ranks_beyond_the_global_batch_are_refused():
    with pytest.raises(ValueError, match="global batch"):
        training_memory(plan(*A2), ranks=9, bank="sharded", anchor_parallel="ddp", global_batch=8)
    with pytest.raises(ValueError, match="bank"):
        training_memory(plan(*A2), ranks=8, bank="mirrored", anchor_parallel="ddp")


# --- sizes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80GiB", 80 * 2**30),
        ("80Gi", 80 * 2**30),
        ("80gib", 80 * 2**30),
        ("80 GiB", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("80G", 80 * 10**9),
        ("512MiB", 512 * 2**20),
        ("512MB", 512 * 10**6),
        ("1TiB", 2**40),
        ("1TB", 10**12),
        ("1.5GiB", 3 * 2**29),
        ("4096", 4096),
        ("4096B", 4096),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text", ["", "GiB", "80GX", "eighty", "80 Gibibytes", "-1GB", "0", "1e3GB"]
)
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        parse_bytes(text)


# --- the CLI --------------------------------------------------------------------------------------

C2_ARGS = [
    "memstore",
    "plan",
    "--anchor",
    "openlm-1.4b",
    "--memory",
    "768,256,16,0",
    "--ranks",
    "8",
    "--device-memory",
    "80GiB",
]


def test_cli_prints_the_per_rank_table(capsys):
    assert main(C2_ARGS) == 0
    out = capsys.readouterr().out
    assert "bank params" in out  # the plan table comes first, as before
    assert all(len(line) <= 100 for line in out.splitlines())
    lines = {line.split("  ")[0]: line.split() for line in out.splitlines() if line.strip()}
    assert lines["per rank"][-4:] == [
        "replicated+DDP",
        "replicated+FSDP",
        "sharded+DDP",
        "sharded+FSDP",
    ]
    assert lines["fits on 8 × 80GiB"][-4:] == ["no", "no", "yes", "yes"]
    fits_from = next(line for line in out.splitlines() if line.startswith("fits from"))
    assert fits_from.split()[2:] == ["never", "(1)", "never", "(2)", "8", "ranks", "6", "ranks"]
    assert "(1) replicated+DDP: every rank holds the whole bank" in out
    assert "activations and workspace" in out and "GiB = 2^30 bytes" in out
    rep = training_memory(plan(*C2), ranks=8, bank="replicated", anchor_parallel="ddp")
    total = next(line for line in out.splitlines() if line.startswith("total")).split()
    assert total[1:3] == [f"{rep.total / GiB:.1f}", "GiB"]


def test_cli_json(capsys):
    assert main([*C2_ARGS, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bank_params"] == plan(*C2).bank_params
    tm = out["training_memory"]
    assert (tm["ranks"], tm["device_memory_bytes"], tm["headroom"]) == (8, 80 * GiB, 0.2)
    assert (tm["global_batch"], tm["seq_len"]) == (1024, 2048)
    assert list(tm["layouts"]) == [
        "replicated+ddp",
        "replicated+fsdp",
        "sharded+ddp",
        "sharded+fsdp",
    ]
    p = plan(*C2)
    for key, layout in tm["layouts"].items():
        bank, par = key.split("+")
        m = training_memory(p, ranks=8, bank=bank, anchor_parallel=par)
        assert layout["total"] == m.total
        assert layout["fits"] == (m.total <= USABLE)
    assert tm["layouts"]["sharded+ddp"]["min_ranks"] == 8
    assert tm["layouts"]["replicated+ddp"]["min_ranks"] is None
    assert "whole bank" in tm["layouts"]["replicated+ddp"]["min_ranks_reason"]
    # without --ranks the JSON is the plan alone
    assert main(C2_ARGS[:6] + ["--json"]) == 0
    assert "training_memory" not in json.loads(capsys.readouterr().out)


def test_cli_options_change_the_budget(capsys):
    assert main([*C2_ARGS, "--headroom", "0.5", "--global-batch", "256", "--json"]) == 0
    tm = json.loads(capsys.readouterr().out)["training_memory"]
    assert tm["usable_bytes"] == 40 * GiB
    assert tm["layouts"]["sharded+ddp"]["sequences_per_rank"] == 32
    report = training_report(
        plan(*C2), ranks=8, device_bytes=80 * GiB, headroom=0.5, global_batch=256
    )
    assert tm["layouts"]["sharded+ddp"]["fits"] == report.fit[("sharded", "ddp")]


def test_cli_ranks_need_device_memory(capsys):
    assert main(C2_ARGS[:8]) == 1
    assert "--device-memory" in capsys.readouterr().err
    assert main([*C2_ARGS[:8], "--device-memory", "80 furlongs"]) == 1
    assert "80 furlongs" in capsys.readouterr().err


def test_cli_explains_a_fit_on_fewer_ranks_only(capsys):
    # A2 replicated+DDP fits on 1 rank (nothing to all-gather) but not on 8: a footnote says why
    args = [
        "memstore",
        "plan",
        "--anchor",
        "openlm-160m",
        "--memory",
        "256,64,16,0",
        "--ranks",
        "8",
        "--device-memory",
        "80GiB",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    fits_from = next(line for line in out.splitlines() if line.startswith("fits from"))
    assert fits_from.split()[2:6] == ["1,", "not", "8", "(1)"]
    assert "(1) replicated+DDP: fits on 1 but not on 8 ranks" in out
