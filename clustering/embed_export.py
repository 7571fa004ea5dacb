"""Int8 OpenVINO export of the sentence embedder, made locally from the shipped weights.

sentence-transformers runs a model through OpenVINO (`backend="openvino"`, via optimum-intel)
and quantises it statically to int8 with NNCF, which needs calibration inputs. Its own helper
fetches a Hugging Face dataset for them; here the calibration texts come from the caller (the
pipeline passes the first windows of the corpus being embedded), so nothing is downloaded and the
int8 scales fit the text the model will see.

On disk (format `memtree-embedder-export`, version 1; a directory, written atomically):
  export.json     format, version, backend, source model dir + sha256 of its weights, NNCF settings,
                  calibration (n texts, sha256 of the texts, max_seq_length), package versions,
                  sha256 of every file below
  <the sentence-transformers files>   tokenizer, configs, pooling/normalize modules
  openvino/openvino_model_qint8_quantized.{xml,bin}   the int8 network

The export is keyed by (source weights, calibration texts, max_seq_length): calling
`export_openvino_int8` again with the same key reuses the directory (a resumed pipeline does not
re-quantise); any difference rebuilds it. With `cache_dir` (the pipeline passes
`$MEMTREE_CACHE_DIR/embedder`) a finished export is also kept there under its key's hash, so that
another run over the same corpus sample (a rerun after the embed stage's settings changed, a second
output folder) copies it instead of calibrating again: calibration is the int8 path's fixed cost
(minutes on 2 cores), which on a small corpus can exceed the embedding itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import io
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

from memtree.io import atomic_dir, atomic_write_json, check_format, read_json, sha256_file

EXPORT_FORMAT = "memtree-embedder-export"
EXPORT_VERSION = 1
OPENVINO_INT8 = "openvino-int8"
OV_INT8_FILE = "openvino/openvino_model_qint8_quantized.xml"
_PACKAGES = ("openvino", "nncf", "optimum-intel", "sentence-transformers")
# Measured on 3,000 corpus documents against torch (docs/BENCHMARKS.md): the default
# NNCF settings leave 0.2 % of embeddings below cosine 0.99 (min 0.9875); smooth-quant alpha 0.8
# and layer 0's FFN down-projection kept in float (BERT's first FFN output carries the largest
# activation outliers) give min 0.9962 at 94 % of the all-int8 speed. The pattern matches
# BERT-style module names and nothing elsewhere (then everything is quantised).
QUANTIZATION = {
    "smooth_quant_alpha": 0.8,
    "ignored_scope": {"patterns": [r".*layer\.0\.output\.dense.*"], "validate": False},
}


def _texts_sha(texts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _weights_sha(source: Path) -> str:
    files = sorted(source.glob("*.safetensors")) or sorted(source.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"{source}: no model weights (*.safetensors or pytorch_model*.bin)")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for p in _PACKAGES:
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            out[p] = None
    return out


def _require_openvino() -> None:
    missing = [p for p, v in _versions().items() if v is None and p != "sentence-transformers"]
    if missing:
        raise ImportError(
            f"embed.backend={OPENVINO_INT8!r} needs {', '.join(missing)}: "
            "pip install 'optimum-intel[openvino]' (a memtree dependency)"
        )


def quiet_loaders() -> None:
    """Silence two warnings that fire on every local load and mean nothing here: optimum-intel
    "could not infer whether the model was already converted" (it probes a Hub cache layout;
    `file_name` says which network to load) and sentence-transformers' advice to save a converted
    network (the export does)."""
    logging.getLogger("optimum.intel.openvino.modeling_base").setLevel(logging.ERROR)
    logging.getLogger("sentence_transformers.backend.utils").setLevel(logging.ERROR)


@contextlib.contextmanager
def _quiet_nncf(quiet: bool):
    """NNCF's INFO lines go to its own stdout handler and its rich progress bars to the console
    (sys.stdout at the time they draw): raise its level and send the bars nowhere."""
    if not quiet:
        yield
        return
    import nncf

    nncf_log = logging.getLogger("nncf")
    level = nncf_log.level
    nncf.set_log_level(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        nncf_log.setLevel(level)


def read_export(path: str | os.PathLike, *, verify: bool = True) -> dict:
    """export.json of an export directory, after checking format, version and file checksums."""
    d = Path(path)
    if not (
        d / "export.json"
    ).is_file():  # e.g. a tree copied without the pipeline's embed/embedder
        raise FileNotFoundError(
            f"{d}: no embedder export here (export.json missing); the tree's queries are "
            "embedded with the export its pipeline wrote (RUN/embed/embedder): copy it "
            "along with the tree"
        )
    meta = read_json(d / "export.json")
    check_format(
        meta, EXPORT_FORMAT, EXPORT_VERSION, f"{d}/export.json", what="memtree embedder export"
    )
    if verify:
        for name, sha in meta["files"].items():
            f = d / name
            if not f.is_file():
                raise FileNotFoundError(f"{f}: missing file of the embedder export")
            if sha256_file(f) != sha:
                raise ValueError(
                    f"{f}: checksum mismatch (file changed since the export was written)"
                )
    return meta


def export_key_hash(key: dict) -> str:
    """The name of an export's entry in the cross-run cache: a hash of its key."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _matches(out: Path, key: dict) -> dict | None:
    """out's export.json when out holds an intact export of `key`, else None."""
    if not (out / "export.json").is_file():
        return None
    try:
        old = read_export(out)
    except (ValueError, FileNotFoundError, KeyError):
        return None  # a stale or damaged export is rebuilt
    return old if all(old.get(k) == v for k, v in key.items()) else None


def export_openvino_int8(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    calibration_texts: Sequence[str],
    *,
    max_seq_length: int,
    batch_size: int = 16,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> dict:
    """Export `source` (a local sentence-transformers dir) to int8 OpenVINO in out_dir →
    export.json.

    The int8 scales are calibrated on `calibration_texts`, tokenised exactly as encode will
    (truncated at `max_seq_length` word pieces). Reuses out_dir when its key matches, else copies
    the export `cache_dir` keeps for the key, else calibrates (and leaves a copy in `cache_dir`).
    `progress=False` silences NNCF's progress bars and INFO lines (its warnings stay). The result
    says how it came: `obtained` is "reused", "cache" or "calibrated" (not written to disk).
    """
    _require_openvino()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    src, out = Path(source), Path(out_dir)
    if not calibration_texts:
        raise ValueError("export_openvino_int8: no calibration texts")
    key = {
        "backend": OPENVINO_INT8,
        "source_weights_sha256": _weights_sha(src),
        "quantization": QUANTIZATION,
        "calibration": {
            "n": len(calibration_texts),
            "texts_sha256": _texts_sha(calibration_texts),
            "max_seq_length": max_seq_length,
        },
    }
    old = _matches(out, key)
    if old is not None:
        return {**old, "obtained": "reused"}
    cached = Path(cache_dir) / export_key_hash(key) if cache_dir else None
    hit = (
        _matches(cached, key) if cached is not None else None
    )  # verified there: the copy is byte for byte
    if hit is not None:
        with atomic_dir(out) as tmp:
            shutil.copytree(cached, tmp, dirs_exist_ok=True)
        return {**hit, "obtained": "cache"}
    meta = _calibrate(
        src,
        out,
        calibration_texts,
        key,
        max_seq_length=max_seq_length,
        batch_size=batch_size,
        progress=progress,
    )
    if cached is not None:
        try:
            with atomic_dir(cached) as tmp:
                shutil.copytree(out, tmp, dirs_exist_ok=True)
        except (
            OSError
        ) as e:  # a read-only or full cache costs the next run a calibration, nothing more
            logging.getLogger(__name__).warning("embedder export not cached in %s: %s", cached, e)
    return {**meta, "obtained": "calibrated"}


def _calibrate(
    src: Path,
    out: Path,
    calibration_texts: Sequence[str],
    key: dict,
    *,
    max_seq_length: int,
    batch_size: int,
    progress: bool,
) -> dict:
    import nncf
    from optimum.intel.openvino import OVConfig, OVQuantizationConfig, OVQuantizer
    from sentence_transformers import SentenceTransformer

    quiet_loaders()
    # optimum-intel converts the local torch weights to an fp32 OpenVINO network in memory, by
    # tracing; transformers' attention-mask helper warns that a constant enters the trace (the
    # constant 1.0, which is right for every input).
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.tensor results are registered as constants"
        )
        model = SentenceTransformer(
            str(src), backend="openvino", device="cpu", local_files_only=True
        )
    model.max_seq_length = max_seq_length
    texts = list(calibration_texts)
    feats = [
        dict(
            model.tokenizer(
                texts[i : i + batch_size],
                padding=True,
                truncation=True,
                max_length=max_seq_length,
                return_tensors="np",
            )
        )
        for i in range(0, len(texts), batch_size)
    ]
    with atomic_dir(out) as tmp, tempfile.TemporaryDirectory(dir=tmp.parent) as qdir:
        model.save_pretrained(str(tmp))
        fp32 = tmp / "openvino"
        with _quiet_nncf(not progress):
            OVQuantizer.from_pretrained(model.transformers_model).quantize(
                calibration_dataset=nncf.Dataset(feats),
                save_directory=qdir,
                # NNCF counts dataset items, here batches: all of them.
                ov_config=OVConfig(
                    quantization_config=OVQuantizationConfig(num_samples=len(feats), **QUANTIZATION)
                ),
            )
        shutil.rmtree(fp32)  # only the int8 network is loaded
        fp32.mkdir()
        stem = Path(OV_INT8_FILE).stem
        for suffix in (".xml", ".bin"):
            shutil.move(
                Path(qdir) / "openvino" / f"openvino_model{suffix}", fp32 / f"{stem}{suffix}"
            )
        files = {
            str(f.relative_to(tmp)): sha256_file(f) for f in sorted(tmp.rglob("*")) if f.is_file()
        }
        meta = {
            "format": EXPORT_FORMAT,
            "version": EXPORT_VERSION,
            **key,
            "source": str(src),
            "file": OV_INT8_FILE,
            "versions": _versions(),
            "files": files,
        }
        atomic_write_json(tmp / "export.json", meta)
    return meta
