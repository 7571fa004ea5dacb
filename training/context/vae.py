"""The context bank's compressor and reader (seed 004 §9.2–§9.3): the model side of the runtime
memory.

The store itself is `memstore.context.bank` (capacity, merging, clustering, persistence). This
module turns a prompt into entries for it, and lets a frozen anchor read what it retrieves.

Compressor (§9.2, a VAE). A prompt is cut into chunks of at most `chunk_tokens` tokens; one chunk
is one bank entry. The frozen anchor runs over the chunk and the compressor sees, per token, the
concatenation of its first-layer state (default the embedding layer's output, "the raw semantic
content of the original tokens"; or block 0's output) and the final-norm output,
h_t = [LN(h¹_t); LN(h^L_t)] (2d; each half normalised without gain so neither dominates the
reconstruction by scale). The
chunk's L tokens are split into n_latent = chunk_tokens / ratio contiguous segments (token t of a
chunk of length L is in segment ⌊t·n/L⌋, so a short chunk gets shorter segments and an entry is
always (n_latent, latent_dim)). Each segment is pooled by attention with a learned query into one
vector, and a residual MLP gives μ, log σ² of its latent token: a time-series VAE, one latent per
stretch of the sequence, in order. The decoder rebuilds every token's h_t from its segment's
latent plus a learned offset-in-segment embedding. Loss: mean squared reconstruction error +
kl_weight · KL(q(z|h) ‖ N(0, I)).

Why not reconstruction alone: a latent the anchor cannot read is no use to it. Three more losses
train what the bank needs (and are reported separately):
- recall: the anchor reads the batch's latent tokens through the reader (below) while it scores a
  question about a fact its own chunk stated, "The {label} of {reference} is {value}"; cross-entropy
  on the value's tokens. Every question reads every chunk of the batch, so the reader learns to
  pick the right entry among distractors, as it must among the entries a retrieval returns.
- retrieval (InfoNCE): the query vector of a text is the mean of its latents' μ (`query_vector`),
  the bank clusters entries by the mean of their tokens and scores clusters by centroid · query
  (§9.3); the loss makes a question's query score its own chunk's key highest among the batch's.
  No router is trained for inference: retrieval stays the seed's dot product with centroids.

- align (`align_weight`): cross-entropy of the reader's attention, at the question's last token
  (where the answer is predicted), on the latent token whose segment holds the answer's first
  token in the question's own chunk. Measured on the demo anchor: without it the reader settles on
  the attribute's value prior and never learns to select (its attention stays diffuse); the pair
  tells where the answer is, so the selection is supervised in training and left to the learned
  attention at inference.

Reader (§2.2, §9.3): where chosen (`reader_layers`: after a block, or after the final norm), a
cross-attention from the hidden states (RMSNorm, W_Q) to the retrieved latent tokens (RMSNorm,
W_K, W_V), one softmax over all retrieved tokens, output W_O added to the stream. The default reads
after the final norm, just before the frozen output head: measured on the demo anchor, a read
added to the last block's residual is squashed by the final norm and learns the answer far more
slowly. W_O starts at zero, so an untrained reader (or an empty
retrieval) leaves the anchor's logits exactly unchanged. The reader keeps the softmax weights
each latent token received (mean over heads and query positions): the importance signal of §9.5.

The anchor is never modified: its weights are frozen and the reader is attached with forward
hooks for the duration of a `reading` block.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from memtree.config import ConfigError, from_dict, is_int, is_number, to_dict
from memtree.io import atomic_path, atomic_write_json, check_format, read_json, sha256_file
from memtree.training.hooks import attached
from memtree.training.model import AnchorLM

FORMAT = "memtree-context-vae"
VERSION = 1
WEIGHTS_FILE = "context_vae.safetensors"
MANIFEST_FILE = "context_vae.json"


@dataclass(frozen=True, kw_only=True)
class ContextVAEConfig:
    """chunk_tokens: most tokens per entry; ratio: tokens per latent token (n_latent =
    ceil(chunk_tokens / ratio)); first: the first-layer states, "embedding" (the embedding
    layer's output) or "block" (block 0's output); latent_dim: d of a latent token (0: 2·d_model,
    the width of what it compresses); hidden: encoder / decoder width (0: 2·d_model); reader_layers:
    where the reader reads: i in 0..n_layers-1 after block i, n_layers after the final norm (just
    before the output head); negative indices count back from n_layers (-1: the head; default);
    reader_heads: its heads; distractors: other chunks of the batch each training question reads
    beside its own (-1: all of them); *_weight: the loss weights (module docstring)."""

    chunk_tokens: int = 128
    ratio: int = 8
    first: str = "embedding"
    latent_dim: int = 0
    hidden: int = 0
    reader_layers: tuple[int, ...] = (-1,)
    reader_heads: int = 4
    distractors: int = -1
    recon_weight: float = 1.0
    kl_weight: float = 1e-3
    recall_weight: float = 1.0
    retrieval_weight: float = 0.1
    align_weight: float = 1.0

    def __post_init__(self) -> None:
        for name in ("chunk_tokens", "ratio", "reader_heads"):
            v = getattr(self, name)
            if not is_int(v) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.ratio > self.chunk_tokens:
            raise ValueError(
                f"ratio={self.ratio} exceeds chunk_tokens={self.chunk_tokens} "
                "(an entry needs at least one latent token)"
            )
        for name in ("latent_dim", "hidden"):
            v = getattr(self, name)
            if not is_int(v) or v < 0:
                raise ValueError(
                    f"{name} must be an integer >= 0 (0: twice the anchor's d_model), got {v!r}"
                )
        if self.first not in ("embedding", "block"):
            raise ValueError(f"first must be 'embedding' or 'block', got {self.first!r}")
        if not is_int(self.distractors) or self.distractors < -1:
            raise ValueError(
                "distractors must be an integer >= -1 (-1: the whole batch), got "
                f"{self.distractors!r}"
            )
        for name in (
            "recon_weight",
            "kl_weight",
            "recall_weight",
            "retrieval_weight",
            "align_weight",
        ):
            v = getattr(self, name)
            if not is_number(v) or not 0 <= v < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")

    @property
    def n_latent(self) -> int:
        return -(-self.chunk_tokens // self.ratio)

    @property
    def max_offset(self) -> int:
        """Longest segment of a full chunk: offsets run 0..max_offset-1."""
        return -(-self.chunk_tokens // self.n_latent)


def _check_against(cfg: ContextVAEConfig, d_model: int, n_layers: int, max_seq_len: int) -> None:
    """A config that does not fit the anchor: a ConfigError naming the field and the model's
    value."""
    bad = [i for i in cfg.reader_layers if not -n_layers - 1 <= i <= n_layers]
    if bad:
        raise ConfigError(
            f"reader_layers {list(bad)} out of range: the anchor has n_layers={n_layers} "
            f"(0..{n_layers - 1}: after a block, {n_layers} or -1: after the final norm)"
        )
    if not cfg.reader_layers:
        raise ConfigError("reader_layers is empty: the reader must read somewhere")
    latent = cfg.latent_dim or 2 * d_model
    if d_model % cfg.reader_heads:
        raise ConfigError(
            f"reader_heads={cfg.reader_heads} does not divide the anchor's d_model={d_model}"
        )
    if latent <= 0:
        raise ConfigError(f"latent_dim={latent} must be positive")
    if cfg.chunk_tokens > max_seq_len:
        raise ConfigError(
            f"chunk_tokens={cfg.chunk_tokens} exceeds the anchor's max_seq_len={max_seq_len}"
        )


def segments(lengths: Tensor, seq_len: int, n_latent: int) -> tuple[Tensor, Tensor, Tensor]:
    """lengths (B,) int64 → seg (B, S) segment of each token, off (B, S) its offset in the
    segment, mask (B, S) bool real token (S = seq_len). Token t < L is in segment ⌊t·n/L⌋;
    padding positions get segment 0 / offset 0 and mask False."""
    t = torch.arange(seq_len, device=lengths.device)[None, :]  # (1, S)
    L = lengths.clamp(min=1)[:, None]  # (B, 1)
    mask = t < lengths[:, None]
    seg = torch.where(mask, (t * n_latent) // L, torch.zeros_like(t))
    start = (seg * L + n_latent - 1) // n_latent  # first token of each token's segment
    off = torch.where(mask, t - start, torch.zeros_like(t))
    return seg, off, mask


class _ResMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        nn.init.zeros_(self.down.weight)  # starts as the identity; learns a correction
        nn.init.zeros_(self.down.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ContextCompressor(nn.Module):
    """The segment VAE (module docstring): h (B, S, 2d) → latents (B, n_latent, latent_dim)."""

    def __init__(self, cfg: ContextVAEConfig, d_model: int) -> None:
        super().__init__()
        self.cfg, self.d_model = cfg, d_model
        self.latent_dim = cfg.latent_dim or 2 * d_model
        self.hidden = h = cfg.hidden or 2 * d_model
        self.inp = nn.Linear(2 * d_model, h)
        self.pool_q = nn.Parameter(torch.zeros(h))  # zero: a segment starts as its tokens' mean
        self.seg_emb = nn.Embedding(cfg.n_latent, h)
        self.enc = _ResMLP(h)
        self.mu = nn.Linear(h, self.latent_dim)
        self.logvar = nn.Linear(h, self.latent_dim)
        nn.init.zeros_(self.logvar.weight)
        nn.init.constant_(
            self.logvar.bias, -4.0
        )  # start near-deterministic; KL widens it as it can
        self.dec_z = nn.Linear(self.latent_dim, h)
        self.dec_off = nn.Embedding(cfg.max_offset, h)
        self.dec = nn.Sequential(_ResMLP(h), nn.LayerNorm(h), nn.Linear(h, 2 * d_model))
        # position embeddings start small: at N(0, 1) they would outweigh a segment's content
        # (its pooled norm is ~sqrt(H) smaller) and the latents would start as mostly position
        nn.init.normal_(self.seg_emb.weight, std=0.02)
        nn.init.normal_(self.dec_off.weight, std=0.02)
        # Identity starts where the widths allow: μ then begins as the segment's mean of the
        # normalised [first; last] states, each coordinate meaning what it meant in the anchor.
        # Measured on the demo anchor: from random projections the reader learned to read a value
        # out of a latent ~2x slower than out of the raw states, and never within one epoch.
        with torch.no_grad():
            if h == 2 * d_model:
                self.inp.weight.copy_(torch.eye(h))
                self.inp.bias.zero_()
            if self.latent_dim == h:
                self.mu.weight.copy_(torch.eye(h))
                self.mu.bias.zero_()

    def encode(self, h: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """h (B, S, 2d), lengths (B,) → μ, log σ² (B, n_latent, latent_dim)."""
        n = self.cfg.n_latent
        seg, _, mask = segments(lengths, h.shape[1], n)
        x = self.inp(h)  # (B, S, H), linear: a token's identity reaches μ by a linear path
        a = (x @ self.pool_q) / math.sqrt(x.shape[-1])  # (B, S) attention-pooling logits
        a = a.masked_fill(~mask, float("-inf"))
        a = a - a.amax(dim=1, keepdim=True).clamp(min=-1e30)  # row max over real tokens
        e = torch.exp(a) * mask  # (B, S)
        onehot = F.one_hot(seg, n).to(x.dtype) * mask[..., None]  # (B, S, n)
        denom = torch.einsum("bsn,bs->bn", onehot, e)  # (B, n)
        pooled = (
            torch.einsum("bsn,bs,bsh->bnh", onehot, e, x) / denom.clamp(min=1e-20)[..., None]
        )  # (B, n, H)
        pooled = self.enc(pooled + self.seg_emb.weight[None])  # empty segments: embedding only
        return self.mu(pooled), self.logvar(pooled).clamp(-12.0, 6.0)

    def decode(self, z: Tensor, lengths: Tensor, seq_len: int) -> Tensor:
        """z (B, n_latent, latent_dim) → reconstruction (B, S, 2d) of every token's h."""
        seg, off, _ = segments(lengths, seq_len, self.cfg.n_latent)
        zt = torch.gather(self.dec_z(z), 1, seg[..., None].expand(-1, -1, self.hidden))  # (B, S, H)
        return self.dec(zt + self.dec_off(off.clamp(max=self.cfg.max_offset - 1)))

    def losses(self, h: Tensor, lengths: Tensor, *, sample: bool = True) -> dict[str, Tensor]:
        """{"recon", "kl", "z" (B, n, e) the latents used, "mu"}: recon = MSE over real tokens and
        features, kl = mean over latent coordinates of KL(N(μ, σ²) ‖ N(0, 1))."""
        mu, logvar = self.encode(h, lengths)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar) if sample else mu
        rec = self.decode(z, lengths, h.shape[1])
        _, _, mask = segments(lengths, h.shape[1], self.cfg.n_latent)
        err = ((rec - h) ** 2).mean(-1)  # (B, S)
        recon = (err * mask).sum() / mask.sum().clamp(min=1)
        kl = 0.5 * (mu.pow(2) + logvar.exp() - 1.0 - logvar).mean()
        return {"recon": recon, "kl": kl, "z": z, "mu": mu}


class ReaderLayer(nn.Module):
    """Cross-attention from hidden states (B, S, d) to retrieved latent tokens (B, M, e)."""

    def __init__(self, d_model: int, latent_dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d_model // heads
        self.norm_x = nn.RMSNorm(d_model)
        self.norm_m = nn.RMSNorm(latent_dim)
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(latent_dim, d_model, bias=False)
        self.v = nn.Linear(latent_dim, d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        nn.init.zeros_(self.o.weight)  # a new reader is an exact no-op
        self.keep_attention = False
        self.attention: Tensor | None = None

    def forward(self, x: Tensor, mem: Tensor, mem_mask: Tensor) -> tuple[Tensor, Tensor]:
        """x (B, S, d), mem (B, M, e), mem_mask (B, M) bool → (out (B, S, d), weights (B, M):
        the softmax weight each latent token got, mean over heads and queries)."""
        B, S, _ = x.shape
        q = (
            self.q(self.norm_x(x)).view(B, S, self.heads, self.head_dim).transpose(1, 2)
        )  # (B, H, S, D)
        m = self.norm_m(mem.to(x.dtype))
        k = self.k(m).view(B, -1, self.heads, self.head_dim).transpose(1, 2)  # (B, H, M, D)
        v = self.v(m).view(B, -1, self.heads, self.head_dim).transpose(1, 2)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)  # (B, H, S, M)
        s = s.masked_fill(~mem_mask[:, None, None, :], -1e9)
        p = torch.softmax(s.float(), dim=-1).to(x.dtype) * mem_mask.any(-1)[:, None, None, None]
        if self.keep_attention:  # the alignment loss reads it (training only)
            self.attention = p  # (B, H, S, M)
        out = (p @ v).transpose(1, 2).reshape(B, S, -1)  # (B, S, d)
        return self.o(out), p.detach().float().mean(dim=(1, 2))


class ContextReader(nn.Module):
    """One `ReaderLayer` per chosen block (`layers`: resolved, non-negative block indices)."""

    def __init__(self, cfg: ContextVAEConfig, *, d_model: int, n_layers: int) -> None:
        super().__init__()
        self.layer_ids = tuple(sorted({i % (n_layers + 1) for i in cfg.reader_layers}))
        latent = cfg.latent_dim or 2 * d_model
        self.layers = nn.ModuleDict(
            {str(i): ReaderLayer(d_model, latent, cfg.reader_heads) for i in self.layer_ids}
        )


class ContextVAE(nn.Module):
    """Compressor + reader, built for one anchor shape."""

    def __init__(
        self, cfg: ContextVAEConfig, *, d_model: int, n_layers: int, max_seq_len: int
    ) -> None:
        super().__init__()
        _check_against(cfg, d_model, n_layers, max_seq_len)
        self.cfg = cfg
        self.compressor = ContextCompressor(cfg, d_model)
        self.reader = ContextReader(cfg, d_model=d_model, n_layers=n_layers)

    @property
    def latent_dim(self) -> int:
        return self.compressor.latent_dim


# -- the frozen anchor ---------------------------------------------------------------------------


def anchor_dims(model: nn.Module) -> tuple[int, int, int]:
    """(d_model, n_layers, max_seq_len) of a memtree AnchorLM."""
    if not isinstance(model, AnchorLM):
        raise TypeError(
            f"the context bank reads through memtree's AnchorLM, got {type(model).__name__}"
        )
    return model.config.anchor.d_model, model.config.anchor.n_layers, model.config.max_seq_len


def hidden_pair(model: nn.Module, ids: Tensor, first: str = "embedding") -> Tensor:
    """ids (B, S) → (B, S, 2d): [LN(first-layer states); LN(final norm's output)], no grad.
    first: "embedding" (the embedding layer's output, the tokens' raw content) or "block" (the
    first transformer block's output). Padding sits at the end, and attention is causal, so real
    tokens never see it."""
    if first not in ("embedding", "block"):
        raise ValueError(f"first must be 'embedding' or 'block', got {first!r}")
    got: dict[str, Tensor] = {}
    src = model.embed if first == "embedding" else model.blocks[0]
    with (
        attached(
            [
                (src, lambda m, a, o: got.__setitem__("first", o)),
                (model.norm, lambda m, a, o: got.__setitem__("last", o)),
            ]
        ),
        torch.no_grad(),
    ):
        model(ids)
    d = got["first"].shape[-1]
    return torch.cat(
        [F.layer_norm(got["first"].float(), (d,)), F.layer_norm(got["last"].float(), (d,))], -1
    )


@dataclass
class ReadState:
    """What the reader hooks read during a `reading` block: mem (B, M, e), mask (B, M) bool;
    after the forward, weights (B, M): summed over reader layers (importance, §9.5)."""

    mem: Tensor
    mask: Tensor
    weights: Tensor | None = None


@contextmanager
def reading(model: nn.Module, vae: ContextVAE, mem: Tensor, mask: Tensor) -> Iterator[ReadState]:
    """Attach the reader to `model`'s blocks for the duration: each chosen block's output gets
    the reader's read of mem (B, M, e) (mask (B, M) True = a real token) added."""
    state = ReadState(mem=mem, mask=mask)

    def hook(layer: ReaderLayer):
        def fn(module: nn.Module, args: Any, out: Tensor) -> Tensor:
            y, w = layer(out, state.mem, state.mask)
            state.weights = w if state.weights is None else state.weights + w
            return out + y

        return fn

    n = len(model.blocks)
    with attached(
        [
            (model.norm if i == n else model.blocks[i], hook(vae.reader.layers[str(i)]))
            for i in vae.reader.layer_ids
        ]
    ):
        yield state


def chunk_ids(ids: Sequence[int], chunk_tokens: int) -> list[list[int]]:
    """A prompt's token ids cut into consecutive chunks of at most chunk_tokens (one bank entry
    each)."""
    ids = list(ids)
    return [ids[i : i + chunk_tokens] for i in range(0, len(ids), chunk_tokens)] or [[]]


def pad(seqs: Sequence[Sequence[int]], value: int) -> tuple[Tensor, Tensor]:
    """Right-padded (B, S) int64 ids and (B,) lengths."""
    S = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), S), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    return ids, torch.as_tensor([len(s) for s in seqs], dtype=torch.long)


@torch.no_grad()
def compress(
    model: nn.Module,
    vae: ContextVAE,
    seqs: Sequence[Sequence[int]],
    *,
    pad_id: int,
    batch_size: int = 64,
) -> Tensor:
    """Chunks (each ≤ chunk_tokens ids, ≥ 1) → their latents μ (N, n_latent, latent_dim)."""
    out = []
    for s in range(0, len(seqs), batch_size):
        chunk = seqs[s : s + batch_size]
        if any(len(c) == 0 or len(c) > vae.cfg.chunk_tokens for c in chunk):
            raise ValueError(f"chunks must hold 1..{vae.cfg.chunk_tokens} tokens")
        ids, lengths = pad(chunk, pad_id)
        mu, _ = vae.compressor.encode(hidden_pair(model, ids, vae.cfg.first), lengths)
        out.append(mu)
    return torch.cat(out) if out else torch.zeros(0, vae.cfg.n_latent, vae.latent_dim)


def query_vector(
    model: nn.Module, vae: ContextVAE, seqs: Sequence[Sequence[int]], *, pad_id: int
) -> Tensor:
    """Texts (token ids) → their query vectors (N, latent_dim): the mean of their latents' μ,
    the same space the bank's centroids live in (the mean latent of each entry)."""
    return compress(model, vae, [s[: vae.cfg.chunk_tokens] for s in seqs], pad_id=pad_id).mean(1)


# -- the artefact on disk ------------------------------------------------------------------------


def anchor_fingerprint(model: nn.Module, anchor_folder: str | Path) -> dict[str, Any]:
    """What a compressor was trained against: the anchor run, its weights' sha256 and shape."""
    d, n_layers, _ = anchor_dims(model)
    return {
        "folder": str(anchor_folder),
        "sha256": sha256_file(Path(anchor_folder) / "anchor.safetensors"),
        "shape": {"d_model": d, "n_layers": n_layers, "vocab_size": model.config.anchor.vocab_size},
    }


def save_vae(
    folder: str | Path, vae: ContextVAE, *, anchor: dict[str, Any], metrics: dict[str, Any]
) -> Path:
    """Write weights + manifest (format memtree-context-vae v1) atomically; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / WEIGHTS_FILE) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in vae.state_dict().items()}, str(tmp))
    atomic_write_json(
        folder / MANIFEST_FILE,
        {
            "format": FORMAT,
            "version": VERSION,
            "config": to_dict(vae.cfg),
            "latent_dim": vae.latent_dim,
            "n_latent": vae.cfg.n_latent,
            "reader_layers": list(vae.reader.layer_ids),
            "anchor": anchor,
            "weights": {"file": WEIGHTS_FILE, "sha256": sha256_file(folder / WEIGHTS_FILE)},
            "metrics": metrics,
        },
    )
    return folder


def writer_id(folder: str | Path) -> str:
    """The id a context bank records for entries written by this compressor."""
    man = read_json(Path(folder) / MANIFEST_FILE)
    return f"{FORMAT}:{man['weights']['sha256'][:16]}"


def load_vae(
    folder: str | Path, model: nn.Module, *, anchor_folder: str | Path | None = None
) -> ContextVAE:
    """Load a trained compressor + reader for `model`. A manifest of another format / version, or a
    compressor trained for another anchor (shape, or weights when `anchor_folder` is given): a
    ValueError naming the field."""
    folder = Path(folder)
    man = read_json(folder / MANIFEST_FILE)
    check_format(man, FORMAT, VERSION, folder)
    d, n_layers, max_len = anchor_dims(model)
    shape = man["anchor"].get("shape") or {}
    for name, have in (
        ("d_model", d),
        ("n_layers", n_layers),
        ("vocab_size", model.config.anchor.vocab_size),
    ):
        if name in shape and shape[name] != have:
            raise ValueError(
                f"{folder}: compressor was trained for an anchor with {name}={shape[name]}, "
                f"this anchor has {name}={have}"
            )
    if anchor_folder is not None:
        want = man["anchor"].get("sha256")
        have_sha = sha256_file(Path(anchor_folder) / "anchor.safetensors")
        if want and want != have_sha:
            raise ValueError(
                f"{folder}: compressor was trained against anchor weights sha256={want[:16]}…, "
                f"{anchor_folder} has sha256={have_sha[:16]}…"
            )
    if sha256_file(folder / man["weights"]["file"]) != man["weights"]["sha256"]:
        raise ValueError(
            f"{folder}: {man['weights']['file']} does not match its sha256 (corrupt or truncated)"
        )
    cfg = from_dict(ContextVAEConfig, man["config"], where="config")
    vae = ContextVAE(cfg, d_model=d, n_layers=n_layers, max_seq_len=max_len)
    vae.load_state_dict(load_file(str(folder / man["weights"]["file"])))
    return vae.eval()
