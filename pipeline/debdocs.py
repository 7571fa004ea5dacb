"""Real long text that installs offline: the documentation a Debian package ships.

memtree's long-context evaluation (CAMELoT, seed 001; `memtree eval-longctx`) needs documents
written by people and much longer than a 128-token window, on a machine that reaches only PyPI
and the Debian archive and may download no dataset at run time. The Python documentation is
such a corpus: `python3.11-doc` ships the reStructuredText sources of every page
(`usr/share/doc/python3.11/html/_sources/**/*.rst.txt`, 497 pages, ~12 MB), from the tutorial to
the library reference — prose, examples and tables, median page ~3,000 words.

`write_docs_corpus(OUT, deb=…)` reads the `.deb` (an `ar` archive holding `data.tar.*`; parsed
here, so neither dpkg nor root is needed), keeps each matching file as one document, splits
the documents into train and test by a hash of their path (stable across runs and machines, so
a page never moves between splits), and writes, atomically:

| file | content |
|---|---|
| `train.jsonl`, `test.jsonl` | `{"id": path in the package, "text", "section": first directory, "source": package}` |
| `rejects.jsonl` | `{"id", "reason", "detail"}`: `too_short` (< `min_chars`), `invalid_utf8`, `empty` |
| `corpus.json` | `format` "memtree-debdocs", `version` 1, `package`, `deb` (file name), `deb_sha256`, `prefix`, `suffix`, `test_fraction`, `min_chars`, `max_chars` (null: whole pages), counts: `files` = `train` + `test` + `rejected` |

`fetch_deb(package, cache_dir)` runs `apt-get download` (no root) when no `.deb` of the package
is in `cache_dir` yet; `memtree docs-corpus OUT` does both.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import unicodedata
from collections.abc import Iterator
from pathlib import Path

from memtree.io import atomic_write_json, atomic_write_text, sha256_file

FORMAT = "memtree-debdocs"
VERSION = 1
PYTHON_DOC = {"package": "python3.11-doc", "prefix": "usr/share/doc/python3.11/html/_sources/",
              "suffix": ".rst.txt"}


def fetch_deb(package: str, cache_dir: str | Path) -> Path:
    """The newest `.deb` of `package` in `cache_dir`, downloaded with `apt-get download` if absent."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    have = sorted(cache.glob(f"{package}_*.deb"))
    if have:
        return have[-1]
    if shutil.which("apt-get") is None:
        raise RuntimeError(f"no {package}_*.deb in {cache} and no apt-get to download it: "
                           f"fetch the package elsewhere and pass it with --deb")
    proc = subprocess.run(["apt-get", "download", package], cwd=cache, capture_output=True, text=True,
                          check=False)  # its stderr goes into our error
    have = sorted(cache.glob(f"{package}_*.deb"))
    if proc.returncode != 0 or not have:
        raise RuntimeError(f"apt-get download {package} failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()[-500:]}")
    return have[-1]


def iter_deb_files(deb: str | Path, *, prefix: str = "", suffix: str = "") -> Iterator[tuple[str, bytes]]:
    """(path, bytes) of every regular file in the package's data archive whose path (without a
    leading "./") starts with `prefix` and ends with `suffix`, in archive order."""
    deb = Path(deb)
    with open(deb, "rb") as f:
        if f.read(8) != b"!<arch>\n":
            raise ValueError(f"{deb}: not a Debian package (no ar archive header)")
        while True:
            head = f.read(60)
            if len(head) < 60:
                break
            name = head[:16].decode("ascii", "replace").strip().rstrip("/")
            size = int(head[48:58].decode("ascii").strip())
            body = f.read(size)
            f.read(size % 2)  # ar members are 2-byte aligned
            if not name.startswith("data.tar"):
                continue
            if name.endswith(".zst"):
                raise ValueError(f"{deb}: {name} is zstd-compressed, which Python's tarfile cannot read")
            with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as tar:
                for m in tar:
                    path = m.name.removeprefix("./")
                    if m.isfile() and path.startswith(prefix) and path.endswith(suffix):
                        yield path, tar.extractfile(m).read()
            return
    raise ValueError(f"{deb}: no data.tar.* member")


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


def write_docs_corpus(out_dir: str | Path, *, deb: str | Path, package: str = PYTHON_DOC["package"],
                      prefix: str = PYTHON_DOC["prefix"], suffix: str = PYTHON_DOC["suffix"],
                      test_fraction: float = 0.1, min_chars: int = 2000, max_chars: int | None = None) -> dict:
    """Write train/test/rejects JSONL and corpus.json (module docstring) from a `.deb`; returns corpus.json.

    max_chars: keep each page's opening only, cut at its last paragraph break (else line break) at or
    before max_chars: a corpus of short documents (issue #38's real-text runs), where a page's
    introduction names its topic. None keeps whole pages."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if min_chars < 0:
        raise ValueError(f"min_chars must be ≥ 0, got {min_chars}")
    if max_chars is not None and max_chars < max(min_chars, 1):
        raise ValueError(f"max_chars must be ≥ min_chars ({min_chars}) and ≥ 1, got {max_chars}")
    out = Path(out_dir)
    rows: dict[str, list[str]] = {"train": [], "test": [], "rejects": []}
    n_files = 0
    for path, data in iter_deb_files(deb, prefix=prefix, suffix=suffix):
        n_files += 1
        doc_id = path[len(prefix):]
        try:
            text = unicodedata.normalize("NFC", data.decode("utf-8")).replace("\r\n", "\n").strip()
        except UnicodeDecodeError as e:
            rows["rejects"].append(json.dumps({"id": doc_id, "reason": "invalid_utf8", "detail": str(e)}))
            continue
        if not text:
            rows["rejects"].append(json.dumps({"id": doc_id, "reason": "empty", "detail": ""}))
            continue
        if len(text) < min_chars:
            rows["rejects"].append(json.dumps({"id": doc_id, "reason": "too_short",
                                               "detail": f"{len(text)} < {min_chars} characters"}))
            continue
        if max_chars is not None:
            text = opening(text, max_chars)
        rec = {"id": doc_id, "text": text, "section": doc_id.split("/")[0] if "/" in doc_id else "",
               "source": package}
        rows["test" if in_test_split(doc_id, test_fraction) else "train"].append(
            json.dumps(rec, ensure_ascii=False))
    if n_files == 0:
        raise ValueError(f"{deb}: no file under {prefix!r} ending in {suffix!r}")
    out.mkdir(parents=True, exist_ok=True)  # only once the package is read: a bad one leaves no folder
    for name, lines in rows.items():
        atomic_write_text(out / f"{name}.jsonl", "".join(line + "\n" for line in lines))
    meta = {"format": FORMAT, "version": VERSION, "package": package, "deb": Path(deb).name,
            "deb_sha256": sha256_file(deb), "prefix": prefix, "suffix": suffix, "test_fraction": test_fraction,
            "min_chars": min_chars, "max_chars": max_chars, "files": n_files, "train": len(rows["train"]),
            "test": len(rows["test"]),
            "rejected": len(rows["rejects"])}
    assert meta["files"] == meta["train"] + meta["test"] + meta["rejected"]
    atomic_write_json(out / "corpus.json", meta)
    return meta
