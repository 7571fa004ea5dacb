"""Rebuild a Hugging Face fast tokenizer from the vocabulary stored in a GGUF file.

A GGUF checkpoint carries its own tokenizer (tokens, scores, merges, token
types, special ids), so it can be used without the original ``tokenizer.json``.
transformers can convert it too, but its conversion of SentencePiece ("llama")
vocabularies without merges splits words wrongly (Gemma 3 reads "cat" as
"▁c" + "at"), which wrecks perplexity. This module rebuilds the tokenizer from
the file's metadata with the semantics of the tokenizer the model was trained
with:

* ``gpt2``: byte-level BPE with the file's merges and the pre-tokenizer named
  by ``tokenizer.ggml.pre`` (only ``smollm`` is known).
* ``llama``: SentencePiece BPE; merges are derived from the piece scores,
  unknown characters fall back to the ``<0xXX>`` byte pieces.

``special_tokens_from_gguf`` gives the special-token strings needed to wrap the
result in ``transformers.PreTrainedTokenizerFast``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

__all__ = ["special_tokens_from_gguf", "tokenizer_from_gguf"]

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_SPIECE_SPACE = "▁"

# llama.cpp pre-tokenizer names for gpt2 vocabularies, as Hugging Face pre-tokenizers.
_GPT2_PRE_TOKENIZERS = {
    "smollm": lambda: [
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ],
}

_SPECIAL_ID_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _read_metadata(path: Path) -> dict[str, Any]:
    # GGUFReader maps the tensors too, but only the tokenizer.* keys are needed.
    reader = GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def _special_tokens(meta: dict[str, Any]) -> dict[str, str | None]:
    tokens = meta["tokenizer.ggml.tokens"]
    out: dict[str, str | None] = {}
    for name, key in _SPECIAL_ID_KEYS.items():
        idx = meta.get(key)
        out[name] = tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None
    return out


def special_tokens_from_gguf(path: str | Path) -> dict[str, str | None]:
    """Return ``bos_token``/``eos_token``/``unk_token``/``pad_token`` strings
    named by the GGUF file's token ids (``None`` where the file has none)."""
    return _special_tokens(_read_metadata(Path(path)))


def _gpt2_model(meta: dict[str, Any], path: Path) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in _GPT2_PRE_TOKENIZERS:
        raise ValueError(f"{path}: unsupported tokenizer.ggml.pre {pre!r} for a gpt2 vocabulary")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise ValueError(f"{path}: gpt2 vocabulary without tokenizer.ggml.merges")
    # Byte-level tokens never contain a literal space, so it separates the pair
    # unambiguously. No unk token: like llama.cpp, bytes missing from the vocab
    # (SmolLM2 lacks 21, e.g. 0xF5-0xFF) are dropped.
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(_GPT2_PRE_TOKENIZERS[pre]())
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_merges(
    tokens: list[str], scores: list[float], mergeable: set[int]
) -> list[tuple[str, str]]:
    # SentencePiece BPE repeatedly merges the adjacent pair whose concatenation is
    # the highest-scoring piece; ranking every (a, b) with a+b, a, b in the vocab by
    # the score of a+b reproduces that in HF's rank-ordered BPE. Control, byte and
    # user-defined pieces never take part: SentencePiece freezes or reserves them.
    # Equal scores only arise for different splits of one piece; they are ordered
    # by the left part's id, where SentencePiece would take the leftmost pair.
    ids = {tokens[i]: i for i in mergeable}
    ranked = []
    for i in mergeable:
        piece = tokens[i]
        for cut in range(1, len(piece)):
            left, right = ids.get(piece[:cut]), ids.get(piece[cut:])
            if left is not None and right is not None:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    return [(tokens[a], tokens[b]) for _, _, a, b in ranked]


def _space_split(tokens: list[str], mergeable: set[int]) -> pre_tokenizers.PreTokenizer:
    # SentencePiece runs BPE over the whole text; HF's BPE on one huge "word" is
    # about half as fast on long single-spaced prose as on cached per-word pieces.
    # Cutting just before a "▁" that follows character c is exact as long as no
    # mergeable piece contains c + "▁": no merge can then cross the cut. Gemma 3
    # has one such piece (">▁</"), hence the computed exclusion set rather than
    # Metaspace's split before every "▁".
    glued = {
        piece[k - 1]
        for i in mergeable
        if _SPIECE_SPACE in (piece := tokens[i])
        for k in range(1, len(piece))
        if piece[k] == _SPIECE_SPACE
    }
    glued.add(_SPIECE_SPACE)
    charset = "".join(f"\\x{{{ord(c):x}}}" for c in sorted(glued))
    pattern = Regex(f"(?<![{charset}]){_SPIECE_SPACE}")
    return pre_tokenizers.Split(pattern, behavior="merged_with_next")


def _llama_model(meta: dict[str, Any], path: Path) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre != "default":
        raise ValueError(f"{path}: unsupported tokenizer.ggml.pre {pre!r} for a llama vocabulary")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = meta["tokenizer.ggml.token_type"]
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise ValueError(f"{path}: llama vocabulary without tokenizer.ggml.scores")
    # llama.cpp's converter writes user-defined pieces with "▁" turned into spaces;
    # restore the SentencePiece spelling so they match the normalized text.
    for i, t in enumerate(types):
        if t == _USER_DEFINED:
            tokens[i] = tokens[i].replace(" ", _SPIECE_SPACE)
    mergeable = {i for i, t in enumerate(types) if t in (_NORMAL, _UNUSED)}
    unk = _special_tokens(meta)["unk_token"]
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=_spm_merges(tokens, scores, mergeable),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=_BYTE in types,
        )
    )
    steps = [normalizers.Replace(" ", _SPIECE_SPACE)]
    decode = [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        # SentencePiece's dummy prefix: one "▁" before the text, stripped on decode.
        steps.insert(0, normalizers.Prepend(_SPIECE_SPACE))
        decode.append(decoders.Strip(" ", 1, 0))
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = _space_split(tokens, mergeable)
    tok.decoder = decoders.Sequence(decode)
    return tok


def _add_vocab_tokens(tok: Tokenizer, meta: dict[str, Any], vocab: list[str]) -> None:
    types = meta["tokenizer.ggml.token_type"]
    # Control/unknown tokens are matched on the raw text and dropped by
    # skip_special_tokens; user-defined ones are always extracted (as SentencePiece
    # does) but are ordinary text, and are matched after normalization.
    special = [
        AddedToken(vocab[i], special=True, normalized=False)
        for i, t in enumerate(types)
        if t in (_CONTROL, _UNKNOWN)
    ]
    user = [
        AddedToken(vocab[i], special=False, normalized=tok.normalizer is not None)
        for i, t in enumerate(types)
        if t == _USER_DEFINED
    ]
    tok.add_special_tokens(special)
    tok.add_tokens(user)


def _post_processor(meta: dict[str, Any], path: Path) -> processors.PostProcessor | None:
    tokens = meta["tokenizer.ggml.tokens"]
    ends = []
    for flag, key in (("add_bos_token", "bos_token_id"), ("add_eos_token", "eos_token_id")):
        if not meta.get(f"tokenizer.ggml.{flag}", False):
            ends.append(None)
            continue
        idx = meta.get(f"tokenizer.ggml.{key}")
        if not isinstance(idx, int) or not 0 <= idx < len(tokens):
            raise ValueError(f"{path}: {flag} is set but {key} is missing or out of range")
        ends.append((tokens[idx], idx))
    bos, eos = ends
    if bos is None and eos is None:
        return None
    head = [bos[0]] if bos else []
    tail = [eos[0]] if eos else []
    return processors.TemplateProcessing(
        single=[*head, "$A", *tail],
        pair=[*head, "$A", *tail, *(f"{t}:1" for t in head), "$B:1", *(f"{t}:1" for t in tail)],
        special_tokens=list(dict.fromkeys(e for e in ends if e is not None)),
    )


def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    """Build a ``tokenizers.Tokenizer`` equivalent to the one stored in a GGUF file.

    Encoding with ``add_special_tokens=True`` adds BOS/EOS as the file's
    ``add_bos_token``/``add_eos_token`` say. Raises ``ValueError`` for tokenizer
    models or pre-tokenizers this module does not know.
    """
    path = Path(path)
    meta = _read_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok = _gpt2_model(meta, path)
    elif kind == "llama":
        tok = _llama_model(meta, path)
    else:
        raise ValueError(f"{path}: unsupported tokenizer.ggml.model {kind!r}")
    vocab = [tok.id_to_token(i) for i in range(len(meta["tokenizer.ggml.tokens"]))]
    _add_vocab_tokens(tok, meta, vocab)
    post = _post_processor(meta, path)
    if post is not None:
        tok.post_processor = post
    return tok
