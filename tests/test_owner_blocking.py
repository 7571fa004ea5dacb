"""Issue 57, the memstore half:
`memtree memstore block | unblock | delete --documents IDS --run RUN`.

On the session's real pipeline run (1,200 topical documents, 2 levels × 8) and a real bank bound to
its tree with memory at both levels. What each block trained is counted here independently, with
pandas from the window and assignment parquet files (the owner found by the window's own `doc_id`,
not through the ingest's ordinals), and compared with what the command chose and reported."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from memtree.cli import main
from memtree.memstore.format import GENERIC, level_path, read_manifest
from memtree.memstore.journal import audit_log
from memtree.memstore.ownership import owner_shares
from memtree.memstore.store import MemoryStore, read_policy
from tests.conftest import cli_on_bank_copy

LEVELS = (1, 2)
B = 8


def _parts(folder: Path, columns: list[str]) -> pd.DataFrame:
    return pd.concat(
        [pd.read_parquet(f, columns=columns) for f in sorted(folder.glob("part-*.parquet"))],
        ignore_index=True,
    )


@pytest.fixture(scope="module")
def made(pipeline_run, tmp_path_factory):
    from memtree.clustering.tree import build_tree, save_tree

    run = pipeline_run[0]
    root = tmp_path_factory.mktemp("owner")
    assert (
        main(
            [
                "memstore",
                "init",
                str(root / "bank"),
                "--anchor",
                "tiny",
                "--memory",
                "4,4",
                "--tree",
                str(run / "tree"),
                "--dtype",
                "int8",
                "--json",
            ]
        )
        == 0
    )
    x = np.random.default_rng(0).normal(size=(300, 384)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    other, _ = build_tree(x, levels=2, branching=B, batch_size=256, steps=3, seed=0, n_jobs=1)
    save_tree(other, root / "other-tree", config={"levels": 2}, embedder={"model": None})
    assert (
        main(
            [
                "memstore",
                "init",
                str(root / "other-bank"),
                "--anchor",
                "tiny",
                "--memory",
                "4,4",
                "--tree",
                str(root / "other-tree"),
                "--dtype",
                "int8",
                "--json",
            ]
        )
        == 0
    )

    # window ordinal = row of the window parts read in order (pipeline/README.md)
    windows = _parts(run / "window", ["doc_id", "n_tokens"])
    assign = _parts(run / "assign", ["window_ordinal", "path"])
    assert (assign["window_ordinal"].to_numpy() == np.arange(len(windows))).all()
    paths = np.stack(assign["path"].to_numpy())
    frame = pd.DataFrame(
        {
            "doc_id": windows["doc_id"],
            "n_tokens": windows["n_tokens"],
            **{f"c{lv}": paths[:, lv - 1] for lv in LEVELS},
        }
    )
    docs = _parts(run / "ingest" / "docs", ["doc_id", "meta"])
    topic = docs["meta"].map(lambda m: json.loads(m)["topic"])
    owners = {
        "topic": docs["doc_id"][topic == topic[0]].tolist(),
        "other": docs["doc_id"][topic == topic[topic != topic[0]].iloc[0]].tolist(),
        "few": docs["doc_id"][[3, 7, 11]].tolist(),
    }
    for name, ids in owners.items():
        (root / f"{name}.txt").write_text("\n".join(ids) + "\n\n")
    (root / "empty.txt").write_text("\n  \n")
    (root / "unknown.txt").write_text(
        "\n".join(owners["few"] + [f"no-such-doc-{i}" for i in range(7)]) + "\n"
    )
    return {"root": root, "run": run, "frame": frame, "owners": owners}


@pytest.fixture
def cli(made, tmp_path, capsys):
    return cli_on_bank_copy(
        made["root"] / "bank",
        tmp_path,
        capsys,
        {
            "run": str(made["run"]),
            "dir": str(made["root"]),
            "other": str(made["root"] / "other-bank"),
        },
    )


def expected(made, owner: str) -> dict[int, pd.DataFrame]:
    """Per level: cluster → tokens routed there, and the owner's part of them (pandas groupby)."""
    f = made["frame"].assign(mine=lambda d: d["doc_id"].isin(made["owners"][owner]))
    f["own"] = f["n_tokens"].where(f["mine"], 0)
    return {
        lv: f.groupby(f"c{lv}").agg(tokens=("n_tokens", "sum"), owner=("own", "sum"))
        for lv in LEVELS
    }


def blocked_ids(bank: Path) -> dict[int, set[int]]:
    return {
        int(lv): {i for a, b in runs for i in range(a, b)}
        for lv, runs in read_policy(bank)["blocked"].items()
        if runs
    }


def owner_block(cli, owner: str, *extra: str, action: str = "block") -> dict:
    rc, out, err = cli(
        "memstore",
        action,
        "{bank}",
        "--documents",
        f"{{dir}}/{owner}.txt",
        "--run",
        "{run}",
        "--json",
        *extra,
    )
    assert rc == 0, err
    return json.loads(out)


def test_shares_equal_an_independent_count_from_the_parquet_files(made):
    want = expected(made, "topic")
    got = owner_shares(made["run"], made["owners"]["topic"], LEVELS, B)
    for lv in LEVELS:
        full = want[lv].reindex(range(B**lv), fill_value=0)
        assert (got.tokens[lv] == full["tokens"].to_numpy()).all()
        assert (got.owner[lv] == full["owner"].to_numpy()).all()
    assert got.owner_tokens == int(want[1]["owner"].sum()) > 0
    assert got.found == made["owners"]["topic"] and got.missing == []


@pytest.mark.parametrize("owner", ["topic", "few"])
def test_min_share_0_blocks_exactly_the_blocks_on_the_documents_paths(made, cli, owner):
    out = owner_block(cli, owner, "--min-share", "0")
    want = expected(made, owner)
    blocked = blocked_ids(cli.bank)
    for lv in LEVELS:
        w = want[lv]
        on_paths = set(
            made["frame"].loc[made["frame"]["doc_id"].isin(made["owners"][owner]), f"c{lv}"]
        )
        assert blocked.get(lv, set()) == on_paths == set(w.index[w["owner"] > 0])
        only_others = set(w.index[(w["owner"] == 0) & (w["tokens"] > 0)])
        assert not blocked.get(lv, set()) & only_others
        rep = out["levels"][str(lv)]
        assert rep["blocks"] == len(on_paths) and rep["covered_fraction"] == 1.0
        assert rep["owner_tokens_covered"] == int(w["owner"].sum())
        assert rep["collateral_tokens"] == int(
            (w.loc[list(on_paths), "tokens"] - w.loc[list(on_paths), "owner"]).sum()
        )
        for b in rep["per_block"]:
            assert (b["tokens"], b["owner_tokens"]) == tuple(
                w.loc[b["cluster"], ["tokens", "owner"]]
            )
        assert rep["share_max"] == pytest.approx((w["owner"] / w["tokens"]).max())
    # some block at the leaves holds only other owners' data, so the test above can fail
    assert any(
        len(set(want[lv].index[(want[lv]["owner"] == 0) & (want[lv]["tokens"] > 0)]))
        for lv in LEVELS
    )
    with MemoryStore(cli.bank) as store:
        assert not any(store.is_refused(lv, GENERIC) for lv in LEVELS)
        total = sum(L.info.n_blocks * L.info.params for L in store.levels.values())
        share = sum(len(blocked[lv]) * store.levels[lv].info.params for lv in blocked) / total
        assert out["bank_fraction"] == pytest.approx(share)
        assert store.blocked_fraction() == pytest.approx(out["bank_fraction"])


def test_a_share_blocks_only_blocks_the_owner_trained_at_least_that_much(made, cli):
    want = expected(made, "topic")
    level2 = np.unique((want[2]["owner"] / want[2]["tokens"])[want[2]["owner"] > 0])
    share = (
        level2[len(level2) // 2 - 1] + level2[len(level2) // 2]
    ) / 2  # between two blocks' shares
    owner_block(cli, "topic", "--min-share", repr(float(share)))
    chosen = {
        lv: set(w.index[(w["owner"] > 0) & (w["owner"] / w["tokens"] >= share)])
        for lv, w in want.items()
    }
    # the share separates blocks here
    assert chosen[2] and len(chosen[2]) < (want[2]["owner"] > 0).sum()
    assert {lv: blocked_ids(cli.bank).get(lv, set()) for lv in LEVELS} == chosen


def test_the_default_share_blocks_every_block_the_documents_trained(made, cli):
    out = owner_block(cli, "few")
    assert out["min_share"] == 0.0
    want = expected(made, "few")
    assert {lv: blocked_ids(cli.bank).get(lv, set()) for lv in LEVELS} == {
        lv: set(w.index[w["owner"] > 0]) for lv, w in want.items()
    }


def test_the_text_summary_is_a_table_per_level(cli):
    rc, out, err = cli(
        "memstore", "block", "{bank}", "--documents", "{dir}/topic.txt", "--run", "{run}"
    )
    assert rc == 0, err
    lines = out.splitlines()
    assert "owner sha256" in lines[0] and "every block they trained" in lines[0]
    assert lines[1].split()[:3] == ["level", "blocks", "bank"] and "collateral tokens" in lines[1]
    assert [ln.split()[0] for ln in lines[2:4]] == ["1", "2"] and "(100.0%)" in lines[2]
    assert lines[-1].startswith("blocked level 1:") and "of the bank refused" in lines[-1]


def test_the_audit_log_round_trips_through_unblock(made, cli):
    w = expected(made, "topic")[1]
    theirs = [int(w.index[w["owner"] > 0][0]), int(w.index[w["owner"] == 0][0])]
    rc, _, _ = cli(
        "memstore", "block", "{bank}", "--level", "1", "--clusters", ",".join(map(str, theirs))
    )
    assert rc == 0  # another request, before: one of its blocks the owner trained too, one not
    before = blocked_ids(cli.bank)
    out = owner_block(cli, "topic")
    assert blocked_ids(cli.bank) != before
    entry = audit_log(cli.bank)[-1]
    ids = made["owners"]["topic"]
    sha = hashlib.sha256("".join(f"{i}\n" for i in sorted(set(ids))).encode()).hexdigest()
    assert (
        entry["action"] == "block" and entry["by"] == "documents" and entry["owner_sha256"] == sha
    )
    assert (
        entry["min_share"] == 0.0
        and entry["documents"] == len(ids)
        and entry["tree_id"] == out["tree_id"]
    )
    assert entry["targets"] == out["targets"]
    back = owner_block(cli, "topic", action="unblock")
    # the other request's blocks stay: the owner did not set them
    assert blocked_ids(cli.bank) == before
    undo = audit_log(cli.bank)[-1]
    assert (
        undo["action"] == "unblock"
        and undo["owner_sha256"] == sha
        and undo["undoes"] == [entry["time"]]
    )
    assert sum(back["changed"].values()) == sum(
        len(range(a, b)) for r in entry["changed"].values() for a, b in r
    )
    rc, _, err = cli(
        "memstore", "unblock", "{bank}", "--documents", "{dir}/topic.txt", "--run", "{run}"
    )
    assert rc == 1 and "nothing to lift" in err and sha in err


def test_unblocking_one_owner_keeps_what_a_later_owner_blocked(made, cli):
    owner_block(cli, "topic")
    owner_block(cli, "other")
    theirs = blocked_ids(cli.bank)
    owner_block(cli, "topic", action="unblock")
    want = expected(made, "other")
    assert {lv: blocked_ids(cli.bank).get(lv, set()) for lv in LEVELS} == {
        lv: set(w.index[w["owner"] > 0]) for lv, w in want.items()
    }
    assert blocked_ids(cli.bank) != theirs  # the first owner's own blocks were lifted


def test_delete_erases_the_bytes_of_exactly_those_blocks(made, cli):
    info = read_manifest(cli.bank)
    before = {lv: Path(level_path(cli.bank, info.levels[lv])).read_bytes() for lv in LEVELS}
    out = owner_block(cli, "few", action="delete")
    info = read_manifest(cli.bank)
    want = expected(made, "few")
    for lv in LEVELS:
        L = info.levels[lv]
        gone = set(want[lv].index[want[lv]["owner"] > 0])
        assert {i for a, b in info.manifest["deleted"][str(lv)] for i in range(a, b)} == gone
        data = Path(level_path(cli.bank, L)).read_bytes()
        for c in range(L.n_blocks + 1):  # the generic slot last
            rec = slice(c * L.stride, c * L.stride + L.record_bytes)
            assert (data[rec] == bytes(L.record_bytes)) == (c in gone), (lv, c)
            if c not in gone:
                assert data[rec] == before[lv][rec]
    assert read_policy(cli.bank)["blocked"] == {} and audit_log(cli.bank)[-1]["by"] == "documents"
    assert out["changed"] == {str(lv): len(want[lv].index[want[lv]["owner"] > 0]) for lv in LEVELS}


def test_unknown_ids_are_named_and_refused_unless_allowed(made, cli):
    rc, _, err = cli(
        "memstore", "block", "{bank}", "--documents", "{dir}/unknown.txt", "--run", "{run}"
    )
    assert rc == 1 and "7 of 10 document ids are not in the pipeline run" in err
    assert "'no-such-doc-0'" in err and "'no-such-doc-4'" in err and "no-such-doc-5" not in err
    assert "--allow-missing" in err and read_policy(cli.bank)["blocked"] == {}
    assert not (cli.bank / "audit.jsonl").exists()
    rc, out, err = cli(
        "memstore",
        "block",
        "{bank}",
        "--documents",
        "{dir}/unknown.txt",
        "--run",
        "{run}",
        "--allow-missing",
        "--json",
    )
    assert rc == 0 and "7 of 10" in err and "going on without them" in err
    assert json.loads(out)["documents_found"] == 3
    want = expected(made, "few")
    assert {lv: blocked_ids(cli.bank).get(lv, set()) for lv in LEVELS} == {
        lv: set(w.index[w["owner"] > 0]) for lv, w in want.items()
    }
    assert audit_log(cli.bank)[-1]["documents"] == 10


@pytest.mark.parametrize(
    "argv, says",
    [
        (
            ("--documents", "{dir}/empty.txt", "--run", "{run}"),
            "empty.txt: no document ids in the file",
        ),
        (
            ("--documents", "{dir}/nope.txt", "--run", "{run}"),
            "--documents {dir}/nope.txt: file not found",
        ),
        (("--documents", "{dir}/topic.txt"), "--documents needs --run"),
        (("--run", "{run}", "--clusters", "1"), "--run is used with --documents"),
        (("--min-share", "0.5", "--clusters", "1"), "--min-share is used with --documents"),
        (
            ("--documents", "{dir}/topic.txt", "--run", "{run}", "--clusters", "1"),
            "not used with --clusters",
        ),
        (
            ("--documents", "{dir}/topic.txt", "--run", "{run}", "--random"),
            "not used with --random",
        ),
        (
            (
                "--documents",
                "{dir}/topic.txt",
                "--run",
                "{run}",
                "--queries",
                "{dir}/topic.txt",
                "--tree",
                "{run}/tree",
            ),
            "not used with --queries",
        ),
        (
            ("--documents", "{dir}/topic.txt", "--run", "{run}", "--level", "2"),
            "not used with --level",
        ),
        (
            ("--documents", "{dir}/topic.txt", "--run", "{run}", "--min-share", "1.5"),
            "--min-share 1.5: must be in [0, 1]",
        ),
        (
            ("--documents", "{dir}/topic.txt", "--run", "{run}", "--min-share", "-0.1"),
            "--min-share -0.1: must be in",
        ),
        (
            ("--documents", "{dir}/topic.txt", "--run", "{run}", "--min-share", "nan"),
            "--min-share nan: must be in",
        ),
        (("--documents", "{dir}/topic.txt", "--run", "{dir}"), "not a pipeline run with a tree"),
        (("--documents", "{dir}/topic.txt", "--run", "{dir}/none"), "--run {dir}/none: not found"),
    ],
)
def test_bad_input_is_refused_naming_it(made, cli, argv, says):
    rc, _, err = cli("memstore", "block", "{bank}", *argv)
    assert rc == 1 and says.format(dir=made["root"]) in err, err
    assert read_policy(cli.bank)["blocked"] == {} and not (cli.bank / "audit.jsonl").exists()


def test_a_run_of_another_tree_is_refused_naming_both(made, cli):
    rc, _, err = cli(
        "memstore", "block", "{other}", "--documents", "{dir}/topic.txt", "--run", "{run}"
    )
    theirs = read_manifest(made["root"] / "other-bank").tree_id
    ours = json.loads((made["run"] / "tree" / "tree.json").read_text())["tree_id"]
    assert rc == 1 and theirs in err and ours in err and theirs != ours
    assert not (made["root"] / "other-bank" / "audit.jsonl").exists()


def test_share_1_blocks_only_blocks_the_documents_trained_alone(made, cli):
    out = owner_block(cli, "topic", "--min-share", "1")
    want = expected(made, "topic")
    assert out["min_share"] == 1.0 and all(
        b["share"] == 1.0 for r in out["levels"].values() for b in r["per_block"]
    )
    assert {lv: blocked_ids(cli.bank).get(lv, set()) for lv in LEVELS} == {
        lv: set(w.index[(w["owner"] > 0) & (w["owner"] == w["tokens"])]) for lv, w in want.items()
    }


def test_a_per_subtree_bank_blocks_only_the_owners_blocks_it_holds(made, tmp_path, capsys):
    """A per-subtree bank (`memstore split`) holds one level-1 subtree's blocks: the documents'
    blocks outside it are not its to block, and those inside are chosen as from the whole bank."""
    frame = made["frame"].loc[made["frame"]["doc_id"].isin(made["owners"]["topic"])]
    subtree = int(frame["c1"].mode()[0])  # a subtree the owner trained
    assert (
        main(
            [
                "memstore",
                "split",
                str(made["root"] / "bank"),
                "--out",
                str(tmp_path / "split"),
                "--subtrees",
                str(subtree),
                "--json",
            ]
        )
        == 0
    )
    bank = tmp_path / "split" / f"subtree-{subtree:03d}"
    capsys.readouterr()
    assert (
        main(
            [
                "memstore",
                "block",
                str(bank),
                "--documents",
                str(made["root"] / "topic.txt"),
                "--run",
                str(made["run"]),
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    inside = {1: {subtree}, 2: set(range(subtree * B, (subtree + 1) * B))}
    want = {lv: set(frame[f"c{lv}"]) & inside[lv] for lv in LEVELS}
    # the owner trained blocks inside and outside this bank
    assert want[2] and set(frame["c2"]) - want[2]
    assert blocked_ids(bank) == {lv: v for lv, v in want.items() if v}
    assert {lv: out["levels"][str(lv)]["blocks"] for lv in LEVELS} == {
        lv: len(v) for lv, v in want.items()
    }
