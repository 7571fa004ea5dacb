"""Stage 2–3, tokenizer + window: documents → non-overlapping token windows.

The tokenizer is either a local Hugging Face tokenizer directory (the paper
uses GPT-NeoX's) copied into the run, or, by default, a byte-level BPE trained
with `tokenizers` on the first `train_sample_docs` documents. Either way the
run's `tokenizer/` directory is a standard HF tokenizer directory that
`AutoTokenizer.from_pretrained` and `tokenizers.Tokenizer.from_file` load.

Each document is cut into windows of `window_tokens` tokens (the last one
shorter); a window keeps its token ids and the exact character span of the
document it covers, which is what gets embedded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from memtree.io import atomic_path, atomic_write_json
from memtree.pipeline.config import WindowConfig
from memtree.pretrained import SPECS as PRETRAINED
from memtree.pretrained import pretrained_dir, read_manifest

# a pretrained folder's tokenizer, without its model's config.json or manifest
PRETRAINED_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

WINDOW_SCHEMA = pa.schema(
    [
        ("doc_ordinal", pa.int64()),
        ("doc_id", pa.string()),
        ("window_index", pa.int32()),
        ("n_tokens", pa.int32()),
        ("tokens", pa.list_(pa.int32())),
        ("text", pa.string()),
    ]
)


def iter_doc_texts(doc_parts: list[Path], limit: int):
    n = 0
    for p in doc_parts:
        for text in pq.read_table(p, columns=["text"])["text"].to_pylist():
            if n >= limit:
                return
            yield text
            n += 1


def build_tokenizer(cfg: WindowConfig, doc_parts: list[Path], out_dir: Path) -> dict:
    """Write an HF tokenizer directory into out_dir; returns its description."""
    from transformers import PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.tokenizer in PRETRAINED:
        # the model's own tokenizer, so that the shards feed that model
        src = pretrained_dir(cfg.tokenizer)
        for name in PRETRAINED_TOKENIZER_FILES:
            shutil.copy2(src / name, out_dir / name)
        tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
        kind = f"pretrained:{cfg.tokenizer}:{read_manifest(src)['hash'][:16]}"
    elif cfg.tokenizer:
        src = Path(cfg.tokenizer)
        if not (src / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"window.tokenizer={src}: no tokenizer.json there (a fast Hugging Face tokenizer "
                "directory is required; save one with tokenizer.save_pretrained(dir))"
            )
        for f in sorted(src.iterdir()):
            if f.is_file() and f.suffix in (".json", ".txt", ".model"):
                shutil.copy2(f, out_dir / f.name)
        tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
        kind = f"local:{src}"
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=cfg.vocab_size,
            special_tokens=[cfg.eot_token],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(iter_doc_texts(doc_parts, cfg.train_sample_docs), trainer=trainer)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            eos_token=cfg.eot_token,
            bos_token=cfg.eot_token,
            unk_token=cfg.eot_token,
            model_max_length=1 << 30,
        )
        fast.save_pretrained(str(out_dir))
        kind = "byte-level-bpe"
    eot = tok.token_to_id(cfg.eot_token)
    if eot is None:
        raise ValueError(
            f"tokenizer {cfg.tokenizer}: has no token {cfg.eot_token!r}; "
            "set window.eot_token to its end-of-text token"
        )
    info = {
        "kind": kind,
        "vocab_size": tok.get_vocab_size(),
        "eot_token": cfg.eot_token,
        "eot_id": eot,
    }
    atomic_write_json(out_dir / "memtree_tokenizer.json", info)
    return info


_TOKENIZERS: dict[str, object] = {}


def load_tokenizer(tok_dir: str):
    """The run's tokenizer, loaded once per worker process."""
    if tok_dir not in _TOKENIZERS:
        _TOKENIZERS[tok_dir] = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
    return _TOKENIZERS[tok_dir]


def window_offsets(n_tokens: int, window: int) -> list[tuple[int, int]]:
    return [(s, min(s + window, n_tokens)) for s in range(0, n_tokens, window)]


def window_part(docs_path: str, out_path: str, tok_dir: str, window_tokens: int) -> dict:
    """Dask task: one docs partition → its windows partition (skipped if already written)."""
    out = Path(out_path)
    if out.exists():
        n = pq.read_metadata(out).num_rows
        tokens = pq.read_table(out, columns=["n_tokens"])["n_tokens"].to_numpy().sum()
        return {"n_windows": n, "n_tokens": int(tokens)}
    tok = load_tokenizer(tok_dir)
    t = pq.read_table(docs_path, columns=["doc_ordinal", "doc_id", "text"])
    texts = t["text"].to_pylist()
    ords = t["doc_ordinal"].to_pylist()
    ids = t["doc_id"].to_pylist()
    encs = tok.encode_batch(texts, add_special_tokens=False)
    cols: dict[str, list] = {
        k: [] for k in ("doc_ordinal", "doc_id", "window_index", "n_tokens", "text")
    }
    flat: list[np.ndarray] = []
    for text, o, did, enc in zip(texts, ords, ids, encs):
        tids = np.asarray(enc.ids, dtype=np.int32)
        offs = enc.offsets
        for k, (s, e) in enumerate(window_offsets(len(tids), window_tokens)):
            cols["doc_ordinal"].append(o)
            cols["doc_id"].append(did)
            cols["window_index"].append(k)
            cols["n_tokens"].append(e - s)
            # Character span of the window: byte-level BPE offsets index the source text.
            cols["text"].append(text[offs[s][0] : offs[e - 1][1]])
            flat.append(tids[s:e])
    lengths = np.asarray(cols["n_tokens"], dtype=np.int32)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(flat) if flat else np.zeros(0, dtype=np.int32)
    table = pa.table(
        {
            "doc_ordinal": pa.array(cols["doc_ordinal"], pa.int64()),
            "doc_id": pa.array(cols["doc_id"], pa.string()),
            "window_index": pa.array(cols["window_index"], pa.int32()),
            "n_tokens": pa.array(lengths, pa.int32()),
            "tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
            "text": pa.array(cols["text"], pa.string()),
        },
        schema=WINDOW_SCHEMA,
    )
    with atomic_path(out) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return {"n_windows": table.num_rows, "n_tokens": int(lengths.sum())}


def tokenizer_eot_id(tok_dir: Path) -> int:
    return int(json.loads((tok_dir / "memtree_tokenizer.json").read_text())["eot_id"])
