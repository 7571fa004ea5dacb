"""Real text that installs offline: the documentation Debian packages ship.

memtree's real-text experiments need documents written by people, on a machine that reaches only
PyPI and the Debian archive and may download no dataset at run time. Debian's documentation
packages are such corpora: `python3.11-doc` ships the reStructuredText sources of every page of the
Python documentation (`usr/share/doc/python3.11/html/_sources/**/*.rst.txt`, 497 pages, ~11 MB),
`linux-doc-6.1` those of the kernel's documentation (3,184 pages, ~24 MB, 342 of them translations).
`KNOWN_SOURCES` says where each package keeps them.

`write_docs_corpus(OUT, sources=[(DocSource, deb), …])` reads each `.deb` (an `ar` archive holding
`control.tar.*` and `data.tar.*`; parsed here, so neither dpkg nor root is needed), keeps each
matching file as one document, splits the documents into train and test by a hash of their id
(stable across runs and machines, so a page never moves between splits), and writes, atomically:

* `train.jsonl`, `test.jsonl`: `{"id", "text", "section": first directory, "source":
  package}`; `id` is the path under the package's prefix, led by "<package>/" when the corpus
  has several packages.
* `rejects.jsonl`: `{"id", "reason", "detail"}`: `excluded` (under one of the source's
  `exclude` prefixes, e.g. translations), `too_short` (< `min_chars`), `invalid_utf8`, `empty`.
* `corpus.json`: `format` "memtree-debdocs", `version` 2, `packages`: per package its name,
  Debian version, `.deb` file name and sha256, prefix, suffix, exclude, and its counts;
  `test_fraction`, `min_chars`, `max_chars` (null: whole pages), totals: `files` = `train` +
  `test` + `rejected`, and the characters of each split.
* `README.md`: the same, for people: the packages, versions, hashes and counts, and the
  command that rebuilt it.

Version 1 (written before several packages) had one package's fields at the top level.
`fetch_deb(package, cache_dir)` runs `apt-get download` (no root) when no `.deb` of the package
is in `cache_dir` yet; `memtree pipeline docs-corpus OUT [--package P …]` does both.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from memtree.io import atomic_write_json, atomic_write_text, sha256_file

FORMAT = "memtree-debdocs"
VERSION = 2


@dataclass(frozen=True, kw_only=True)
class DocSource:
    """Where a documentation package keeps its pages: files under `prefix` ending in `suffix`,
    except those under one of the `exclude` prefixes (relative to `prefix`)."""

    package: str
    prefix: str
    suffix: str
    exclude: tuple[str, ...] = field(default=())


# The kernel's translations are the same pages again in other languages: excluded, so that an
# English page's translation never sits on the other side of the split.
KNOWN_SOURCES = {
    "python3.11-doc": DocSource(
        package="python3.11-doc",
        prefix="usr/share/doc/python3.11/html/_sources/",
        suffix=".rst.txt",
    ),
    "linux-doc-6.1": DocSource(
        package="linux-doc-6.1",
        prefix="usr/share/doc/linux-doc-6.1/html/_sources/",
        suffix=".rst.txt",
        exclude=("translations/",),
    ),
}
PYTHON_DOC = {
    "package": "python3.11-doc",
    "prefix": KNOWN_SOURCES["python3.11-doc"].prefix,
    "suffix": ".rst.txt",
}


def known_source(
    package: str, *, prefix: str | None = None, suffix: str | None = None
) -> DocSource:
    """The source of a package in KNOWN_SOURCES, with `prefix` / `suffix` overriding its own; an
    unknown package needs both."""
    base = KNOWN_SOURCES.get(package)
    if base is None and (prefix is None or suffix is None):
        raise ValueError(
            f"package {package!r}: give its prefix and suffix (known packages: "
            f"{', '.join(sorted(KNOWN_SOURCES))})"
        )
    return DocSource(
        package=package,
        prefix=base.prefix if prefix is None else prefix,
        suffix=base.suffix if suffix is None else suffix,
        exclude=base.exclude if base else (),
    )


def fetch_deb(package: str, cache_dir: str | Path) -> Path:
    """The newest `.deb` of `package` in `cache_dir`, downloaded with `apt-get download` if
    absent."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    have = sorted(cache.glob(f"{package}_*.deb"))
    if have:
        return have[-1]
    if shutil.which("apt-get") is None:
        raise RuntimeError(
            f"no {package}_*.deb in {cache} and no apt-get to download it: "
            f"fetch the package elsewhere and pass it with --deb"
        )
    proc = subprocess.run(
        ["apt-get", "download", package], cwd=cache, capture_output=True, text=True, check=False
    )  # its stderr goes into our error
    have = sorted(cache.glob(f"{package}_*.deb"))
    if proc.returncode != 0 or not have:
        raise RuntimeError(
            f"apt-get download {package} failed (exit {proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip()[-500:]}"
        )
    return have[-1]


def _ar_members(deb: Path) -> Iterator[tuple[str, bytes]]:
    with open(deb, "rb") as f:
        if f.read(8) != b"!<arch>\n":
            raise ValueError(f"{deb}: not a Debian package (no ar archive header)")
        while True:
            head = f.read(60)
            if len(head) < 60:
                return
            name = head[:16].decode("ascii", "replace").strip().rstrip("/")
            size = int(head[48:58].decode("ascii").strip())
            body = f.read(size)
            f.read(size % 2)  # ar members are 2-byte aligned
            yield name, body


def _tar(deb: Path, name: str, body: bytes) -> tarfile.TarFile:
    if name.endswith(".zst"):
        raise ValueError(f"{deb}: {name} is zstd-compressed, which Python's tarfile cannot read")
    return tarfile.open(fileobj=io.BytesIO(body), mode="r:*")


def _archive_files(
    deb: Path, member: str
) -> Iterator[tuple[str, tarfile.TarFile, tarfile.TarInfo]]:
    """(path without "./", archive, entry) of every regular file in the package's first `member`*
    tarball ("data.tar", "control.tar"); a package without one is an error naming it."""
    for name, body in _ar_members(deb):
        if name.startswith(member):
            with _tar(deb, name, body) as tar:
                for m in tar:
                    if m.isfile():
                        yield m.name.removeprefix("./"), tar, m
            return
    raise ValueError(f"{deb}: no {member}.* member")


def iter_deb_files(
    deb: str | Path, *, prefix: str = "", suffix: str = ""
) -> Iterator[tuple[str, bytes]]:
    """(path, bytes) of every regular file in the package's data archive whose path (without a
    leading "./") starts with `prefix` and ends with `suffix`, in archive order."""
    for path, tar, m in _archive_files(Path(deb), "data.tar"):
        if path.startswith(prefix) and path.endswith(suffix):
            yield path, tar.extractfile(m).read()


def deb_control(deb: str | Path) -> dict[str, str]:
    """The package's control fields ({"Package": …, "Version": …}; continuation lines dropped)."""
    for path, tar, m in _archive_files(Path(deb), "control.tar"):
        if path == "control":
            fields = {}
            for line in tar.extractfile(m).read().decode("utf-8", "replace").splitlines():
                key, sep, value = line.partition(":")
                if sep and not line[:1].isspace():
                    fields[key.strip()] = value.strip()
            return fields
    raise ValueError(f"{deb}: no control file in its control.tar.* member")


def in_test_split(doc_id: str, test_fraction: float) -> bool:
    """Stable split by a hash of the id: the same page is in the same split on every machine."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big")
    return h / 2**64 < test_fraction


def opening(text: str, max_chars: int) -> str:
    """text's first max_chars characters at most, cut at a paragraph break (else a line break, else
    hard) so that a document ends on a whole paragraph."""
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    for sep in ("\n\n", "\n"):
        cut = head.rfind(sep)
        if cut >= max_chars // 2:
            return head[:cut].rstrip()
    return head.rstrip()


def _read_source(
    src: DocSource,
    deb: Path,
    *,
    many: bool,
    min_chars: int,
    max_chars: int | None,
    test_fraction: float,
    rows: dict[str, list[str]],
) -> dict:
    """Append one package's pages to `rows` (train / test / rejects JSON lines); returns its
    counts."""
    control = deb_control(deb)
    if control.get("Package") != src.package:
        raise ValueError(f"{deb}: is package {control.get('Package')!r}, not {src.package!r}")
    counts = {"files": 0, "train": 0, "test": 0, "rejected": 0, "train_chars": 0, "test_chars": 0}
    for path, data in iter_deb_files(deb, prefix=src.prefix, suffix=src.suffix):
        counts["files"] += 1
        rel = path[len(src.prefix) :]
        doc_id = f"{src.package}/{rel}" if many else rel

        def reject(reason: str, detail: str, doc_id: str = doc_id) -> None:
            rows["rejects"].append(json.dumps({"id": doc_id, "reason": reason, "detail": detail}))
            counts["rejected"] += 1

        hit = next((e for e in src.exclude if rel.startswith(e)), None)
        if hit is not None:
            reject("excluded", f"under {hit!r}")
            continue
        try:
            text = unicodedata.normalize("NFC", data.decode("utf-8")).replace("\r\n", "\n").strip()
        except UnicodeDecodeError as e:
            reject("invalid_utf8", str(e))
            continue
        if not text:
            reject("empty", "")
            continue
        if len(text) < min_chars:
            reject("too_short", f"{len(text)} < {min_chars} characters")
            continue
        if max_chars is not None:
            text = opening(text, max_chars)
        rec = {
            "id": doc_id,
            "text": text,
            "section": rel.split("/")[0] if "/" in rel else "",
            "source": src.package,
        }
        split = "test" if in_test_split(doc_id, test_fraction) else "train"
        rows[split].append(json.dumps(rec, ensure_ascii=False))
        counts[split] += 1
        counts[f"{split}_chars"] += len(text)
    if counts["files"] == 0:
        raise ValueError(f"{deb}: no file under {src.prefix!r} ending in {src.suffix!r}")
    assert counts["files"] == counts["train"] + counts["test"] + counts["rejected"]
    return {
        "package": src.package,
        "version": control.get("Version", ""),
        "deb": deb.name,
        "deb_sha256": sha256_file(deb),
        "prefix": src.prefix,
        "suffix": src.suffix,
        "exclude": list(src.exclude),
        **counts,
    }


def write_docs_corpus(
    out_dir: str | Path,
    *,
    sources: Sequence[tuple[DocSource, str | Path]] | None = None,
    deb: str | Path | None = None,
    package: str = PYTHON_DOC["package"],
    prefix: str = PYTHON_DOC["prefix"],
    suffix: str = PYTHON_DOC["suffix"],
    test_fraction: float = 0.1,
    min_chars: int = 2000,
    max_chars: int | None = None,
    command: str = "",
) -> dict:
    """Write train/test/rejects JSONL, corpus.json and README.md (module docstring); returns
    corpus.json.

    sources: (DocSource, .deb path) per package; or one package by `deb`, `package`, `prefix` and
    `suffix`. With several packages each id is led by its package's name, so ids never collide.
    max_chars: keep each page's opening only, cut at its last paragraph break (else line break)
    at or before max_chars: a corpus of short documents, where a page's introduction names its
    topic. None keeps whole pages. command: how the corpus was built, for its README."""
    if sources is None:
        if deb is None:
            raise ValueError("write_docs_corpus: give sources=[(DocSource, deb), …] or deb=")
        sources = [(DocSource(package=package, prefix=prefix, suffix=suffix), deb)]
    if not sources:
        raise ValueError("write_docs_corpus: no package to read")
    names = [s.package for s, _ in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"write_docs_corpus: a package is given twice: {names}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if min_chars < 0:
        raise ValueError(f"min_chars must be ≥ 0, got {min_chars}")
    if max_chars is not None and max_chars < max(min_chars, 1):
        raise ValueError(f"max_chars must be ≥ min_chars ({min_chars}) and ≥ 1, got {max_chars}")
    out = Path(out_dir)
    rows: dict[str, list[str]] = {"train": [], "test": [], "rejects": []}
    packages = [
        _read_source(
            src,
            Path(d),
            many=len(sources) > 1,
            min_chars=min_chars,
            max_chars=max_chars,
            test_fraction=test_fraction,
            rows=rows,
        )
        for src, d in sources
    ]
    out.mkdir(
        parents=True, exist_ok=True
    )  # only once every package is read: a bad one leaves no folder
    for name, lines in rows.items():
        atomic_write_text(out / f"{name}.jsonl", "".join(line + "\n" for line in lines))
    totals = {
        k: sum(p[k] for p in packages)
        for k in ("files", "train", "test", "rejected", "train_chars", "test_chars")
    }
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "packages": packages,
        "test_fraction": test_fraction,
        "min_chars": min_chars,
        "max_chars": max_chars,
        **totals,
    }
    assert meta["files"] == meta["train"] + meta["test"] + meta["rejected"]
    atomic_write_json(out / "corpus.json", meta)
    atomic_write_text(out / "README.md", corpus_readme(meta, rows["rejects"], command))
    return meta


def corpus_readme(meta: dict, rejects: Sequence[str], command: str = "") -> str:
    """The corpus's README: what it holds and how it was made, from corpus.json and the rejects."""
    reasons: dict[str, int] = {}
    for line in rejects:
        r = json.loads(line)["reason"]
        reasons[r] = reasons.get(r, 0) + 1
    cap = (
        f"each page's opening, ≤ {meta['max_chars']:,} characters"
        if meta["max_chars"]
        else "whole pages"
    )
    lines = [
        "# Real-text corpus from Debian documentation packages (`memtree-debdocs` v2)",
        "",
        f"Built by `{command}`." if command else "Built by `pipeline.debdocs.write_docs_corpus`.",
        "",
        (
            f"One document per page ({cap}; pages under {meta['min_chars']:,} characters "
            "rejected). The split is fixed by a hash of each page's id: "
            f"{meta['test_fraction']:.0%} of the pages are held out (test.jsonl) and training "
            "never sees them."
        ),
        "",
        (
            "| package | version | .deb sha256 | files | train | test | rejected "
            "| train chars | test chars |"
        ),
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in meta["packages"]:
        lines.append(
            f"| {p['package']} | {p['version']} | `{p['deb_sha256']}` | {p['files']:,} "
            f"| {p['train']:,} | {p['test']:,} | {p['rejected']:,} | {p['train_chars']:,} "
            f"| {p['test_chars']:,} |"
        )
    lines.append(
        f"| **all** | | | {meta['files']:,} | {meta['train']:,} | {meta['test']:,} "
        f"| {meta['rejected']:,} | {meta['train_chars']:,} | {meta['test_chars']:,} |"
    )
    lines += [
        "",
        "Rejected, by reason (each page with its reason in rejects.jsonl): "
        + (", ".join(f"{k} {v:,}" for k, v in sorted(reasons.items())) or "none")
        + ".",
        "",
        "Pages taken: "
        + "; ".join(
            f"{p['package']}: `{p['prefix']}**/*{p['suffix']}`"
            + (f", except under {', '.join(p['exclude'])}" if p["exclude"] else "")
            for p in meta["packages"]
        )
        + ".",
    ]
    return "\n".join(lines) + "\n"
