"""The real-text corpus from a Debian documentation package (pipeline/debdocs.py): the .deb is
read without dpkg, every file is kept or rejected with a reason, and the split is stable."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from memtree.pipeline.debdocs import (
    DocSource,
    deb_control,
    in_test_split,
    iter_deb_files,
    opening,
    write_docs_corpus,
)

PREFIX = "usr/share/doc/pkg/_sources/"


def _ar_member(name: str, data: bytes) -> bytes:
    head = f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode("ascii")
    assert len(head) == 60
    return head + data + (b"\n" if len(data) % 2 else b"")


def make_deb(
    path: Path,
    files: dict[str, bytes],
    compression: str = "xz",
    package: str = "pkg",
    version: str = "1.0",
) -> Path:
    """A Debian package as dpkg writes one: an ar archive of debian-binary, control and data
    tarballs."""

    def tarball(members: dict[str, bytes]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode=f"w:{compression}") as tar:
            for name, data in members.items():
                info = tarfile.TarInfo("./" + name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            d = tarfile.TarInfo("./usr/share/doc/pkg/")
            d.type = tarfile.DIRTYPE
            tar.addfile(d)
        return buf.getvalue()

    body = (
        b"!<arch>\n"
        + _ar_member("debian-binary", b"2.0\n")
        + _ar_member(
            f"control.tar.{compression}",
            tarball(
                {
                    "control": f"Package: {package}\nVersion: {version}\n"
                    "Description: docs\n more text\n".encode()
                }
            ),
        )
        + _ar_member(f"data.tar.{compression}", tarball(files))
    )
    path.write_bytes(body)
    return path


def _page(i: int, n: int = 3000) -> bytes:
    return (
        f"Page {i}\n=======\n\n" + "Some documentation prose written by people. " * (n // 45)
    ).encode()


def test_deb_members_are_read_without_dpkg(tmp_path):
    files = {
        PREFIX + "library/os.rst.txt": _page(1),
        PREFIX + "tutorial/intro.rst.txt": _page(2),
        "usr/share/doc/pkg/copyright": b"(c)",
        PREFIX + "library/os.html": b"<html>",
    }
    deb = make_deb(tmp_path / "pkg_1.0_all.deb", files, compression="gz")
    got = dict(iter_deb_files(deb, prefix=PREFIX, suffix=".rst.txt"))
    assert got == {k: v for k, v in files.items() if k.endswith(".rst.txt")}


def test_every_file_is_kept_or_rejected_and_the_split_is_stable(tmp_path):
    files = {PREFIX + f"library/m{i:03d}.rst.txt": _page(i) for i in range(60)}
    files[PREFIX + "short.rst.txt"] = b"too short"
    files[PREFIX + "bad.rst.txt"] = b"\xff\xfe not utf-8" * 300
    files[PREFIX + "blank.rst.txt"] = b"  \n\n "
    deb = make_deb(tmp_path / "pkg_1.0_all.deb", files)
    meta = write_docs_corpus(
        tmp_path / "out",
        deb=deb,
        package="pkg",
        prefix=PREFIX,
        suffix=".rst.txt",
        test_fraction=0.25,
        min_chars=1000,
    )
    assert meta["files"] == 63 == meta["train"] + meta["test"] + meta["rejected"]
    rejects = {
        r["id"]: r["reason"]
        for r in map(json.loads, (tmp_path / "out/rejects.jsonl").read_text().splitlines())
    }
    assert rejects == {
        "short.rst.txt": "too_short",
        "bad.rst.txt": "invalid_utf8",
        "blank.rst.txt": "empty",
    }
    train = [json.loads(x) for x in (tmp_path / "out/train.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (tmp_path / "out/test.jsonl").read_text().splitlines()]
    assert {r["id"] for r in test} == {
        f"library/m{i:03d}.rst.txt"
        for i in range(60)
        if in_test_split(f"library/m{i:03d}.rst.txt", 0.25)
    }
    assert 5 <= len(test) <= 25 and len(train) + len(test) == 60  # ~15 expected
    assert all(
        r["section"] == "library" and r["source"] == "pkg" and r["text"].startswith("Page")
        for r in train
    )
    assert json.loads((tmp_path / "out/corpus.json").read_text())["format"] == "memtree-debdocs"
    # the split depends on the page alone: a package with fewer pages splits the rest the same way
    deb2 = make_deb(tmp_path / "pkg_2.0_all.deb", {k: v for k, v in list(files.items())[:30]})
    write_docs_corpus(
        tmp_path / "out2",
        deb=deb2,
        package="pkg",
        prefix=PREFIX,
        suffix=".rst.txt",
        test_fraction=0.25,
        min_chars=1000,
    )
    test2 = {json.loads(x)["id"] for x in (tmp_path / "out2/test.jsonl").read_text().splitlines()}
    assert test2 == {r["id"] for r in test if int(r["id"][9:12]) < 30}


def test_bad_packages_are_named(tmp_path):
    (tmp_path / "x.deb").write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(ValueError, match="x.deb: not a Debian package"):
        list(iter_deb_files(tmp_path / "x.deb"))
    deb = make_deb(tmp_path / "pkg_1.0_all.deb", {"usr/share/doc/other/a.txt": b"text"})
    with pytest.raises(ValueError, match="no file under"):
        write_docs_corpus(
            tmp_path / "out", deb=deb, package="pkg", prefix=PREFIX, suffix=".rst.txt"
        )
    with pytest.raises(ValueError, match="pkg_1.0_all.deb: is package 'pkg', not 'python3.11-doc'"):
        write_docs_corpus(tmp_path / "out", deb=deb, prefix=PREFIX, suffix=".rst.txt")
    assert not (tmp_path / "out").exists()


def test_max_chars_keeps_each_pages_opening_on_a_paragraph_break(tmp_path):
    paras = [f"Paragraph {i}: " + "words " * 60 for i in range(20)]  # ~375 characters each
    text = "\n\n".join(paras)
    cut = opening(text, 1000)
    assert len(cut) <= 1000 and text.startswith(cut) and cut.endswith(paras[1].rstrip())
    assert opening("short", 1000) == "short"
    assert opening("x" * 3000, 1000) == "x" * 1000  # no break at all: a hard cut
    files = {PREFIX + f"library/m{i:03d}.rst.txt": text.encode() for i in range(8)}
    deb = make_deb(tmp_path / "pkg_1.0_all.deb", files)
    meta = write_docs_corpus(
        tmp_path / "out",
        deb=deb,
        package="pkg",
        prefix=PREFIX,
        suffix=".rst.txt",
        test_fraction=0.25,
        min_chars=1000,
        max_chars=1000,
    )
    assert meta["max_chars"] == 1000 and meta["train"] + meta["test"] == 8
    docs = [
        json.loads(x)
        for s in ("train", "test")
        for x in (tmp_path / f"out/{s}.jsonl").read_text().splitlines()
    ]
    assert all(d["text"] == cut for d in docs)
    with pytest.raises(ValueError, match="max_chars must be"):
        write_docs_corpus(
            tmp_path / "o2",
            deb=deb,
            package="pkg",
            prefix=PREFIX,
            suffix=".rst.txt",
            min_chars=1000,
            max_chars=500,
        )


def test_several_packages_one_corpus_stable_split_and_named_rejects(tmp_path):
    pa, pb = "usr/share/doc/a/_sources/", "usr/share/doc/b/html/"
    deb_a = make_deb(
        tmp_path / "a-doc_2.1_all.deb",
        {
            **{pa + f"guide/p{i:02d}.rst.txt": _page(i) for i in range(40)},
            **{pa + f"translations/it/p{i:02d}.rst.txt": _page(i) for i in range(5)},
            pa + "index.rst.txt": b"tiny",
        },
        package="a-doc",
        version="2.1-3",
    )
    deb_b = make_deb(
        tmp_path / "b-doc_7_all.deb",
        {pb + f"api/q{i:02d}.rst.txt": _page(100 + i) for i in range(30)},
        package="b-doc",
        version="7",
    )
    assert deb_control(deb_a)["Version"] == "2.1-3" and deb_control(deb_b)["Package"] == "b-doc"
    sources = [
        (
            DocSource(package="a-doc", prefix=pa, suffix=".rst.txt", exclude=("translations/",)),
            deb_a,
        ),
        (DocSource(package="b-doc", prefix=pb, suffix=".rst.txt"), deb_b),
    ]
    meta = write_docs_corpus(
        tmp_path / "c1", sources=sources, test_fraction=0.3, min_chars=1000, command="make it"
    )
    assert (
        meta["version"] == 2
        and meta["files"] == 76 == meta["train"] + meta["test"] + meta["rejected"]
    )
    a, b = meta["packages"]
    assert (a["package"], a["version"], a["files"], a["rejected"], b["version"], b["rejected"]) == (
        "a-doc",
        "2.1-3",
        46,
        6,
        "7",
        0,
    )
    assert a["deb_sha256"] == hashlib.sha256(deb_a.read_bytes()).hexdigest()
    rejects = {
        r["id"]: (r["reason"], r["detail"])
        for r in map(json.loads, (tmp_path / "c1/rejects.jsonl").read_text().splitlines())
    }
    assert rejects["a-doc/index.rst.txt"][0] == "too_short"
    assert {k for k, v in rejects.items() if v[0] == "excluded"} == {
        f"a-doc/translations/it/p{i:02d}.rst.txt" for i in range(5)
    }
    docs = {
        s: [json.loads(x) for x in (tmp_path / f"c1/{s}.jsonl").read_text().splitlines()]
        for s in ("train", "test")
    }
    ids = [d["id"] for s in docs.values() for d in s]
    assert len(ids) == len(set(ids)) == 70 and all(
        i.split("/")[0] in ("a-doc", "b-doc") for i in ids
    )
    assert {d["id"] for d in docs["test"]} == {i for i in ids if in_test_split(i, 0.3)}
    assert {d["source"] for d in docs["train"]} == {"a-doc", "b-doc"} and docs["train"][0][
        "section"
    ] == "guide"
    assert meta["train_chars"] == sum(len(d["text"]) for d in docs["train"])
    readme = (tmp_path / "c1/README.md").read_text()
    assert "make it" in readme and a["deb_sha256"] in readme and "| a-doc | 2.1-3 |" in readme
    assert "excluded 5, too_short 1" in readme
    # the same packages again: byte-identical files; the package order does not move a page
    write_docs_corpus(
        tmp_path / "c2", sources=sources[::-1], test_fraction=0.3, min_chars=1000, command="make it"
    )
    for f in ("train", "test", "rejects"):
        assert sorted((tmp_path / "c1" / f"{f}.jsonl").read_text().splitlines()) == sorted(
            (tmp_path / "c2" / f"{f}.jsonl").read_text().splitlines()
        )
    write_docs_corpus(
        tmp_path / "c3", sources=sources, test_fraction=0.3, min_chars=1000, command="make it"
    )
    for f in ("train.jsonl", "test.jsonl", "rejects.jsonl", "corpus.json", "README.md"):
        assert (tmp_path / "c1" / f).read_bytes() == (tmp_path / "c3" / f).read_bytes()
    # a .deb that holds another package than its source says is named
    with pytest.raises(ValueError, match="b-doc_7_all.deb: is package 'b-doc', not 'a-doc'"):
        write_docs_corpus(tmp_path / "c4", sources=[(sources[0][0], deb_b)])
    assert not (tmp_path / "c4").exists()
