"""Issue 36, the memstore items: each README / --help command run as a new user would, through the
CLI, on a real tree (3 levels × branching 4, as `make demo`'s) and a real bank holding memory at
levels 2 and 3 only (as the demo's), both written with the project's own APIs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from memtree.cli import main
from memtree.memstore.journal import audit_log
from memtree.memstore.store import MemoryStore, read_policy
from tests.conftest import cli_on_bank_copy

PROBES = [
    "What is the atomic number of gold?",
    "A recipe for sourdough bread",
    "The history of the Roman empire",
]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from memtree.clustering.tree import build_tree, save_tree

    root = tmp_path_factory.mktemp("usability")
    x = np.random.default_rng(0).normal(size=(400, 384)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    tree, _ = build_tree(x, levels=3, branching=4, batch_size=256, steps=5, seed=0, n_jobs=1)
    save_tree(tree, root / "tree", config={"levels": 3}, embedder={"model": None})
    assert (
        main(
            [
                "memstore",
                "init",
                str(root / "bank"),
                "--anchor",
                "tiny",
                "--memory",
                "0,16,4",
                "--tree",
                str(root / "tree"),
                "--dtype",
                "int8",
                "--json",
            ]
        )
        == 0
    )
    (root / "probes.txt").write_text("\n".join(PROBES) + "\n")
    (root / "empty.txt").write_text("\n\n")
    return root


@pytest.fixture
def run(made, tmp_path, capsys):
    """A fresh copy of the bank in tmp_path; run(*argv) → (rc, stdout, stderr) with {bank}, {tree},
    {probes} and {tmp} filled in."""
    return cli_on_bank_copy(
        made / "bank",
        tmp_path,
        capsys,
        {
            "tree": str(made / "tree"),
            "probes": str(made / "probes.txt"),
            "empty": str(made / "empty.txt"),
            "tmp": str(tmp_path),
        },
    )


def blocked(bank: Path) -> dict:
    return read_policy(bank)["blocked"]


# --- item 1: no level is assumed ------------------------------------------------------------------


def test_block_queries_as_in_the_readme_derives_the_level(run):
    rc, out, err = run(
        "memstore",
        "block",
        "{bank}",
        "--queries",
        "{probes}",
        "--tree",
        "{tree}",
        "--fraction",
        "0.0625",
        "--json",
    )
    assert rc == 0, err
    report = json.loads(out)
    assert (
        report["level"] == 2
        and len(report["clusters"]) == 1
        and report["blocks"] == {"2": 1, "3": 4}
    )
    assert report["bank_fraction_refused"] == pytest.approx(1 / 16)
    assert report["queries"] == 3


def test_random_clusters_unblock_delete_without_level_use_a_level_that_holds_memory(run):
    rc, out, err = run("memstore", "block", "{bank}", "--random", "--json")
    assert rc == 0, err
    assert json.loads(out)["level"] == 2 and json.loads(out)[
        "bank_fraction_refused"
    ] == pytest.approx(1 / 16)
    rc, out, err = run("memstore", "block", "{bank}", "--clusters", "3")
    assert rc == 0, err
    assert "level 2: 1" in out
    assert run("memstore", "unblock", "{bank}", "--clusters", "3")[0] == 0
    assert run("memstore", "delete", "{bank}", "--clusters", "5")[0] == 0
    with MemoryStore(run.bank) as st:
        assert st.is_refused(2, 5) and not st.is_refused(2, 3)


@pytest.mark.parametrize(
    "argv",
    [
        ("block", "--level", "1", "--clusters", "0"),
        ("block", "--level", "1", "--random"),
        ("unblock", "--level", "1", "--clusters", "0"),
        ("delete", "--level", "1", "--clusters", "0"),
        ("relocate", "--level", "1", "--to", "{tmp}/ext"),
    ],
)
def test_a_level_without_memory_is_an_error_naming_the_flag(run, argv):
    rc, _, err = run("memstore", argv[0], "{bank}", *argv[1:])
    assert rc == 1
    assert "--level 1" in err and "--level 2 or --level 3" in err
    assert blocked(run.bank) == {} and not (run.bank / "audit.jsonl").exists()


def test_level_help_says_how_it_is_derived(capsys):
    with pytest.raises(SystemExit):
        main(["memstore", "block", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "--level LEVEL" in text
        and "shallowest level holding memory" in text
        and "--fraction" in text
    )


# --- item 3: simulate-fetch takes what the tree implies -------------------------------------------


def test_simulate_fetch_with_a_tree_needs_no_branching_or_memory(run):
    rc, out, err = run(
        "memstore",
        "simulate-fetch",
        "--queries",
        "{probes}",
        "--tree",
        "{tree}",
        "--profile",
        "phone",
        "--out",
        "{tmp}/sim",
        "--json",
    )
    assert rc == 0, err
    meta = json.loads(out)["meta"]
    assert meta["branching"] == 4 and meta["memory"] == [256, 64, 16] and meta["n_queries"] == 3
    rc, _, err = run(
        "memstore",
        "simulate-fetch",
        "--queries",
        "{probes}",
        "--tree",
        "{tree}",
        "--profile",
        "phone",
        "--memory",
        "0,16",
        "--out",
        "{tmp}/sim2",
    )
    assert rc == 0 and err == ""
    assert json.loads((Path(run.names["tmp"]) / "sim2" / "results.json").read_text())["meta"][
        "memory"
    ] == [0, 16]
    # one spelling per thing: the old --queries-file is refused, naming itself
    with pytest.raises(SystemExit) as e:
        run(
            "memstore",
            "simulate-fetch",
            "--queries-file",
            "{probes}",
            "--tree",
            "{tree}",
            "--out",
            "{tmp}/sim4",
        )
    assert e.value.code == 2 and "unrecognized arguments: --queries-file" in run.err()
    rc, _, err = run(
        "memstore", "simulate-fetch", "--tree", "{tree}", "--branching", "16", "--out", "{tmp}/sim3"
    )
    assert rc == 1 and "--branching 16" in err and "branching 4" in err


# --- item 4: undo mirrors do ----------------------------------------------------------------------


def test_unblock_lifts_what_block_queries_blocked(run):
    rc, out, _ = run(
        "memstore", "block", "{bank}", "--queries", "{probes}", "--tree", "{tree}", "--json"
    )
    c = json.loads(out)["clusters"][0]
    entry = audit_log(run.bank)[-1]
    assert (entry["level"], entry["clusters"], entry["subtree"]) == (2, [c], True)
    rc, out, err = run("memstore", "unblock", "{bank}", "--level", "2", "--clusters", str(c))
    assert rc == 0, err
    assert blocked(run.bank) == {"2": [], "3": []} and "level 3: 4" in out
    # a plain block is lifted alone, and --no-subtree lifts only the named block of a subtree block
    run("memstore", "block", "{bank}", "--level", "2", "--clusters", "7", "--subtree")
    run("memstore", "block", "{bank}", "--level", "3", "--clusters", "29")
    assert (
        run("memstore", "unblock", "{bank}", "--level", "2", "--clusters", "7", "--no-subtree")[0]
        == 0
    )
    assert blocked(run.bank) == {"2": [], "3": [[28, 32]]}
    assert run("memstore", "unblock", "{bank}", "--level", "3", "--clusters", "29")[0] == 0
    assert blocked(run.bank)["3"] == [[28, 29], [30, 32]]


def test_unblock_of_what_is_not_blocked_says_so(run):
    rc, out, _ = run("memstore", "unblock", "{bank}", "--level", "2", "--clusters", "13")
    assert rc == 0 and "nothing changed" in out and "13" in out


# --- items 5 and 13: queries files ----------------------------------------------------------------


def test_block_with_an_empty_queries_file_is_refused(run):
    rc, _, err = run("memstore", "block", "{bank}", "--queries", "{empty}", "--tree", "{tree}")
    assert rc == 1 and run.names["empty"] in err and "no queries" in err
    assert blocked(run.bank) == {} and not (run.bank / "audit.jsonl").exists()


@pytest.mark.parametrize(
    "argv, flag",
    [
        (
            ("memstore", "block", "{bank}", "--queries", "{tmp}/nope.txt", "--tree", "{tree}"),
            "--queries",
        ),
        (
            ("memstore", "block", "{bank}", "--queries", "{probes}", "--tree", "{tmp}/nope"),
            "--tree",
        ),
        (
            ("memstore", "fetch", "{bank}", "--queries", "{tmp}/nope.txt", "--tree", "{tree}"),
            "--queries",
        ),
        (
            (
                "memstore",
                "simulate-fetch",
                "--queries",
                "{tmp}/nope.txt",
                "--tree",
                "{tree}",
                "--out",
                "{tmp}/s",
            ),
            "--queries",
        ),
        (("memstore", "info", "{tmp}/nope"), "bank"),
    ],
)
def test_a_missing_file_names_the_flag(run, argv, flag):
    rc, _, err = run(*argv)
    assert (
        rc == 1
        and f"{flag} " in err
        and "nope" in err
        and "not found" in err
        and "Errno" not in err
    )


# --- item 6: fetch paths must exist in a tree of the bank's branching -----------------------------


def test_fetch_rejects_a_path_that_cannot_exist(run):
    rc, _, err = run("memstore", "fetch", "{bank}", "--path", "0,1,40")
    assert rc == 1 and "level-3 id 40" in err and "level-2 id 1" in err and "4…7" in err
    assert run("memstore", "fetch", "{bank}", "--path", "0,1,5")[0] == 0
    rc, _, err = run("memstore", "fetch", "{bank}", "--path", "0,1,64")
    assert rc == 1 and "level-3 id 64 is out of range [0, 64)" in err


# --- item 14: one way to say one thing ------------------------------------------------------------


def test_fetch_query_text_alias_and_queries_file(run):
    rc, out, err = run(
        "memstore", "fetch", "{bank}", "--query", PROBES[0], "--tree", "{tree}", "--json"
    )
    assert rc == 0 and err == ""
    path = json.loads(out)["fetches"][0]["path"]
    # one spelling per thing: the old --text is refused, naming itself
    with pytest.raises(SystemExit) as e:
        run("memstore", "fetch", "{bank}", "--text", PROBES[0], "--tree", "{tree}", "--json")
    assert e.value.code == 2 and "unrecognized arguments: --text" in run.err()
    rc, out, err = run(
        "memstore", "fetch", "{bank}", "--query", PROBES[0], "--tree", "{tree}", "--json"
    )
    assert json.loads(out)["fetches"][0]["path"] == path
    rc, out, _ = run("memstore", "fetch", "{bank}", "--queries", "{probes}", "--tree", "{tree}")
    assert rc == 0 and out.count("path [") == 3 and "tier " in out and "{" not in out


def test_block_prints_text_by_default_and_json_with_json(run):
    for how in (
        ("--queries", "{probes}", "--tree", "{tree}"),
        ("--clusters", "2"),
        ("--random", "--seed", "4"),
    ):
        rc, out, _ = run("memstore", "block", "{bank}", *how)
        assert rc == 0 and out.startswith("block: ") and "of the bank refused" in out
        run("memstore", "unblock", "{bank}", "--clusters", "2")
    rc, out, _ = run("memstore", "unblock", "{bank}", "--clusters", "2", "--json")
    assert json.loads(out)["action"] == "unblock"


def test_split_and_merge_take_out_and_keep_the_old_forms(run):
    rc, out, err = run("memstore", "split", "{bank}", "--out", "{tmp}/parts")
    assert rc == 0 and err == "" and out.count("subtree-") == 4
    parts = [f"{{tmp}}/parts/subtree-{s:03d}" for s in range(4)]
    rc, out, err = run("memstore", "merge", *parts, "--out", "{tmp}/merged", "--json")
    assert rc == 0 and err == "" and json.loads(out)["manifest"]["subtree"] is None
    # the old positional forms are gone: split's second positional is refused, merge needs --out
    with pytest.raises(SystemExit) as e:
        run("memstore", "split", "{bank}", "{tmp}/old-parts")
    assert e.value.code == 2 and "unrecognized arguments" in run.err()
    assert not (Path(run.names["tmp"]) / "old-parts").exists()
    rc, _, err = run("memstore", "merge", "{tmp}/old-merged", *parts)
    assert (
        rc == 1 and "give --out OUT" in err and not (Path(run.names["tmp"]) / "old-merged").exists()
    )
    # without --out, a per-subtree bank first is a part, never the output to overwrite
    rc, _, err = run("memstore", "merge", *parts)
    assert rc == 1 and "--out" in err
    assert (Path(run.names["tmp"]) / "parts" / "subtree-000" / "manifest.json").exists()


# --- item 15: init does not replace what it should not; writers say what they did -----------------


def test_init_needs_force_to_replace_a_used_bank(run):
    init = (
        "memstore",
        "init",
        "{bank}",
        "--anchor",
        "tiny",
        "--memory",
        "0,16,4",
        "--tree",
        "{tree}",
        "--json",
    )
    assert run(*init)[0] == 0  # a fresh, untouched init bank is replaced freely
    run("memstore", "block", "{bank}", "--clusters", "1")
    rc, _, err = run(*init)
    assert rc == 1 and "--force" in err and "audit log" in err
    assert blocked(run.bank) == {"2": [[1, 2]]}
    rc, out, _ = run(*init, "--force")
    assert rc == 0 and json.loads(out)["replaced"] and blocked(run.bank) == {}
    Path(run.names["tmp"], "notabank").mkdir()
    Path(run.names["tmp"], "notabank", "keep.txt").write_text("x")
    rc, _, err = run(
        "memstore", "init", "{tmp}/notabank", "--anchor", "tiny", "--memory", "0,16,4", "--force"
    )
    assert rc == 1 and "not a memory bank" in err


def test_relocate_says_what_it_did(run):
    rc, out, _ = run("memstore", "relocate", "{bank}", "--level", "3", "--to", "{tmp}/ext")
    assert rc == 0 and out.startswith("relocated level 3") and "ext/level-3.bin" in out
    rc, out, _ = run("memstore", "relocate", "{bank}", "--level", "3", "--to", "{tmp}/ext")
    assert rc == 0 and "nothing moved" in out


# --- the same kinds of cuts in the other subcommands ----------------------------------------------


@pytest.mark.parametrize(
    "argv, says",
    [
        (
            ("memstore", "block", "{bank}", "--clusters", "1", "--fraction", "0.1"),
            "--fraction is used with --queries",
        ),
        (
            ("memstore", "block", "{bank}", "--clusters", "1", "--tree", "{tree}"),
            "--tree is only used with --queries",
        ),
        (("memstore", "block", "{bank}"), "give --clusters IDS, --queries FILE"),
        (("memstore", "unblock", "{bank}"), "give --clusters IDS"),
        (("memstore", "block", "{bank}", "--clusters", "1,x"), "--clusters '1,x'"),
        (("memstore", "split", "{bank}", "--out", "{tmp}/p", "--subtrees", "9"), "--subtrees 9"),
        (("memstore", "split", "{bank}"), "give --out DIR"),
        (("memstore", "verify", "{bank}", "--tree", "{tmp}/nope"), "--tree "),
        (
            (
                "memstore",
                "init",
                "{tmp}/b2",
                "--anchor",
                "tiny",
                "--memory",
                "0,16,4",
                "--tree",
                "{tree}",
                "--branching",
                "16",
            ),
            "--branching 16",
        ),
        (
            ("memstore", "fetch", "{bank}", "--path", "0,1,5", "--query", "x"),
            "give one of --path IDS",
        ),
    ],
)
def test_flags_that_would_be_ignored_or_are_wrong_are_errors_naming_them(run, argv, says):
    rc, out, err = run(*argv)
    assert rc == 1 and says in err and out == ""
    assert blocked(run.bank) == {}
