"""`memtree train context-vae`: train the context bank's compressor and reader on a frozen anchor
(Composer).

Input: a finished anchor run (`anchor`: its save_folder) and recall pairs (`data.pairs`, JSONL, one
record per (document, fact it states): {"doc", "prompt", "question", "answer", …}; eval's
`memtree eval context-bank` writes them from a bios corpus with
`pipeline.corpus.bios.recall_pairs`). Each example is the chunk of the prompt that holds the answer
(what one bank entry would hold), the question with its answer (the recall loss is on the answer's
tokens) and the question alone (the retrieval query). Losses: training/context/vae.py.

The anchor's weights are frozen and never written. What the run leaves in `save_folder`:
  context_vae.safetensors / context_vae.json   the compressor + reader
                                               (format memtree-context-vae v1)
  checkpoints/                                 Composer checkpoints (resume with autoresume: true)
  config.yaml                                  the resolved config
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from composer.models import ComposerModel
from torch import Tensor
from torch.utils.data import DataLoader

from memtree.config import (
    ConfigError,
    TimeString,
    check_time_string,
    dump_yaml,
    is_int,
    load_config,
)
from memtree.io import atomic_write_text, iter_jsonl
from memtree.training.context.vae import (
    ContextVAE,
    ContextVAEConfig,
    anchor_dims,
    anchor_fingerprint,
    hidden_pair,
    pad,
    reading,
    save_vae,
    segments,
)
from memtree.training.train import load_run


@dataclass(frozen=True, kw_only=True)
class ContextDataSection:
    """pairs: recall pairs JSONL; max_pairs: use at most this many (0: all); batch_size: pairs
    per step (every question reads every chunk of its batch); shuffle_seed: order of the pairs."""

    pairs: str
    batch_size: int = 32
    max_pairs: int = 0
    shuffle_seed: int = 0

    def __post_init__(self) -> None:
        if not is_int(self.batch_size) or self.batch_size < 2:
            raise ValueError(
                f"batch_size must be an integer >= 2 (the retrieval loss needs negatives), "
                f"got {self.batch_size!r}"
            )
        if not is_int(self.max_pairs) or self.max_pairs < 0:
            raise ValueError(f"max_pairs must be an integer >= 0, got {self.max_pairs!r}")


@dataclass(frozen=True, kw_only=True)
class ContextTrainConfig:
    anchor: str  # the anchor run's save_folder (memtree_config.json, anchor.safetensors)
    data: ContextDataSection
    save_folder: str
    vae: ContextVAEConfig = field(default_factory=ContextVAEConfig)
    max_duration: TimeString = "2ep"
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup: TimeString = "20ba"
    alpha_f: float = 0.1
    seed: int = 0
    save_interval: TimeString = "1ep"
    autoresume: bool = False
    progress_bar: bool = False
    log_interval: TimeString = "50ba"

    def __post_init__(self) -> None:
        for key in (
            "max_duration",
            "warmup",
            "save_interval",
            "log_interval",
        ):  # also when built in Python
            check_time_string(getattr(self, key), key)
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")


def load_context_config(
    path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()
) -> ContextTrainConfig:
    return load_config(ContextTrainConfig, str(path) if path else None, list(overrides))


def answer_chunk(
    tokenizer: Any, prompt: str, answer: str, chunk_tokens: int
) -> tuple[list[int], int]:
    """The prompt's chunk (≤ chunk_tokens ids) that holds the answer's first statement, so the
    entry a question is trained against states its fact, and the position of the answer's first
    token in it (-1, and the first chunk, when the prompt does not contain the answer)."""
    enc = tokenizer.encode(prompt)
    ids, offsets = enc.ids, enc.offsets
    at = prompt.lower().find(answer.lower())
    tok = next((i for i, (_, end) in enumerate(offsets) if end > at), -1) if at >= 0 else -1
    start = (max(tok, 0) // chunk_tokens) * chunk_tokens
    return ids[start : start + chunk_tokens], (tok - start if tok >= 0 else -1)


def build_examples(
    pairs: list[dict[str, Any]], tokenizer: Any, chunk_tokens: int
) -> list[dict[str, Any]]:
    """Recall pairs → token-level examples {prompt, answer_pos, query, target, n_answer, doc}."""
    out = []
    for n, p in enumerate(pairs):
        for key in ("prompt", "question", "answer"):
            if not isinstance(p.get(key), str) or not p[key].strip():
                raise ValueError(
                    f"recall pair {n}: {key!r} must be a non-empty string, got {p.get(key)!r}"
                )
        query = tokenizer.encode(p["question"]).ids
        answer = tokenizer.encode(" " + p["answer"].strip()).ids
        chunk, pos = answer_chunk(tokenizer, p["prompt"], p["answer"], chunk_tokens)
        out.append(
            {
                "prompt": chunk,
                "answer_pos": pos,
                "query": query[:chunk_tokens],
                "target": query + answer,
                "n_answer": len(answer),
                "doc": str(p.get("doc", n)),
            }
        )
    return out


def collate(examples: list[dict[str, Any]], *, pad_id: int) -> dict[str, Tensor]:
    prompt, prompt_len = pad([e["prompt"] for e in examples], pad_id)
    query, query_len = pad([e["query"] for e in examples], pad_id)
    target, target_len = pad([e["target"] for e in examples], pad_id)
    answer_mask = torch.zeros_like(target, dtype=torch.bool)  # (B, S_t): the answer's tokens
    for i, e in enumerate(examples):
        answer_mask[i, int(target_len[i]) - e["n_answer"] : int(target_len[i])] = True
    docs = {d: k for k, d in enumerate(dict.fromkeys(e["doc"] for e in examples))}
    return {
        "prompt": prompt,
        "prompt_len": prompt_len,
        "query": query,
        "query_len": query_len,
        "target": target,
        "answer_mask": answer_mask,
        "answer_pos": torch.as_tensor(
            [e.get("answer_pos", -1) for e in examples], dtype=torch.long
        ),
        "doc": torch.as_tensor([docs[e["doc"]] for e in examples], dtype=torch.long),
    }


class ContextVAEModel(ComposerModel):
    """Frozen anchor + trainable compressor and reader; `loss` returns the weighted losses."""

    def __init__(self, anchor: torch.nn.Module, vae: ContextVAE) -> None:
        super().__init__()
        self.anchor = anchor
        self.vae = vae
        for p in self.anchor.parameters():
            p.requires_grad_(False)
        self.anchor.eval()

    def train(self, mode: bool = True) -> ContextVAEModel:
        super().train(mode)
        self.anchor.eval()  # frozen: never in training mode
        return self

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        cfg = self.vae.cfg
        h = hidden_pair(self.anchor, batch["prompt"], cfg.first)  # (B, S_p, 2d)
        parts = self.vae.compressor.losses(h, batch["prompt_len"], sample=self.training)
        z = parts["z"]  # (B, n, e)
        B, n, e = z.shape
        k = B - 1 if cfg.distractors < 0 else min(cfg.distractors, B - 1)
        # question b reads its own chunk and the next k of the batch (a shuffled batch: random
        # others)
        rows = (
            torch.arange(B, device=z.device)[:, None] + torch.arange(k + 1, device=z.device)
        ) % B  # (B, 1+k)
        mem = z[rows].reshape(B, (k + 1) * n, e)
        mask = torch.ones(B, (k + 1) * n, dtype=torch.bool, device=z.device)
        layers = list(self.vae.reader.layers.values())
        for layer in layers:
            layer.keep_attention = cfg.align_weight > 0
        try:
            with reading(self.anchor, self.vae, mem, mask):
                logits = self.anchor(batch["target"])  # (B, S_t, V)
        finally:
            for layer in layers:
                layer.keep_attention = False
        out = {"recon": parts["recon"], "kl": parts["kl"], "logits": logits}
        if cfg.align_weight > 0:
            # the own chunk's latents come first in each row's memory: the answer's segment indexes
            # them
            seg, _, _ = segments(batch["prompt_len"], batch["prompt"].shape[1], n)
            pos = batch["answer_pos"]
            target = seg.gather(1, pos.clamp(min=0)[:, None])[:, 0]  # (B,)
            at = batch["query_len"] - 1  # the question's last token predicts the answer
            rows_b = torch.arange(B, device=z.device)
            probs = torch.stack(
                [layer.attention.mean(1)[rows_b, at, target] for layer in layers]
            )  # (R, B)
            ok = pos >= 0
            out["align"] = -(torch.log(probs.clamp(min=1e-9)) * ok).sum() / (
                ok.sum() * len(layers)
            ).clamp(min=1)
            for layer in layers:
                layer.attention = None
        if cfg.retrieval_weight > 0:
            q_mu, _ = self.vae.compressor.encode(
                hidden_pair(self.anchor, batch["query"], cfg.first), batch["query_len"]
            )
            out["retrieval_logits"] = (
                q_mu.mean(1) @ parts["mu"].mean(1).T
            )  # (B, B): query · entry key
        return out

    def loss(self, outputs: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, Tensor]:
        cfg = self.vae.cfg
        logits, target, mask = outputs["logits"], batch["target"], batch["answer_mask"]
        lp = F.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, target[:, 1:, None])[
            ..., 0
        ]  # (B, S-1)
        m = mask[:, 1:]
        recall = -(lp * m).sum() / m.sum().clamp(min=1)
        losses = {"recon": outputs["recon"], "kl": outputs["kl"], "recall": recall}
        total = (
            cfg.recon_weight * outputs["recon"]
            + cfg.kl_weight * outputs["kl"]
            + cfg.recall_weight * recall
        )
        if "align" in outputs:
            losses["align"] = outputs["align"]
            total = total + cfg.align_weight * outputs["align"]
        if "retrieval_logits" in outputs:
            r = outputs["retrieval_logits"]
            same = (
                batch["doc"][:, None] == batch["doc"][None, :]
            )  # (B, B): chunks of the question's doc
            # several questions of one document share its chunk: every copy is a positive
            retrieval = (
                torch.logsumexp(r, 1) - torch.logsumexp(r.masked_fill(~same, float("-inf")), 1)
            ).mean()
            losses["retrieval"] = retrieval
            total = total + cfg.retrieval_weight * retrieval
        losses["total"] = total
        return losses

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        return {}


def _check_save_folder(cfg: ContextTrainConfig) -> None:
    folder = Path(cfg.save_folder)
    ckpts = folder / "checkpoints"
    if ckpts.exists() and any(ckpts.iterdir()) and not cfg.autoresume:
        raise ConfigError(
            f"save_folder {folder} holds checkpoints of an earlier run; set autoresume: true "
            "to continue it, or choose another save_folder"
        )


def train_context_vae(cfg: ContextTrainConfig) -> dict[str, Any]:
    """Train (or resume) the compressor + reader; writes the artefact; returns its metrics."""
    from composer import Trainer
    from composer.optim import CosineAnnealingWithWarmupScheduler
    from composer.utils import reproducibility

    _check_save_folder(cfg)
    reproducibility.seed_all(cfg.seed)
    composer_model, _, manifest, tokenizer = load_run(cfg.anchor)
    anchor = composer_model.model
    d, n_layers, max_len = anchor_dims(anchor)
    try:
        vae = ContextVAE(cfg.vae, d_model=d, n_layers=n_layers, max_seq_len=max_len)
    except ConfigError as e:
        raise ConfigError(f"vae.{e}") from None
    pairs_path = Path(cfg.data.pairs)
    if not pairs_path.is_file():
        raise ConfigError(
            f"data.pairs: {pairs_path} not found (memtree eval context-bank writes recall pairs)"
        )
    pairs = [rec for _, rec in iter_jsonl(pairs_path)]
    if cfg.data.max_pairs:
        pairs = pairs[: cfg.data.max_pairs]
    if len(pairs) < cfg.data.batch_size:
        raise ConfigError(
            f"data.pairs: {pairs_path} has {len(pairs)} pairs, fewer than one batch "
            f"(batch_size={cfg.data.batch_size})"
        )
    examples = build_examples(pairs, tokenizer, cfg.vae.chunk_tokens)
    random.Random(cfg.data.shuffle_seed).shuffle(
        examples
    )  # mixes documents so a batch holds distractors
    pad_id = int(manifest["eot_id"])
    loader = DataLoader(
        examples,
        batch_size=cfg.data.batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(cfg.data.shuffle_seed),
        collate_fn=lambda b: collate(b, pad_id=pad_id),
    )
    model = ContextVAEModel(anchor, vae)
    folder = Path(cfg.save_folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / "config.yaml", dump_yaml(cfg))
    trainer = Trainer(
        model=model,
        train_dataloader=loader,
        max_duration=cfg.max_duration,
        optimizers=torch.optim.AdamW(
            [p for p in vae.parameters()], lr=cfg.lr, weight_decay=cfg.weight_decay
        ),
        schedulers=CosineAnnealingWithWarmupScheduler(t_warmup=cfg.warmup, alpha_f=cfg.alpha_f),
        save_folder=str(folder / "checkpoints"),
        save_interval=cfg.save_interval,
        save_num_checkpoints_to_keep=1,
        save_overwrite=not cfg.autoresume,
        autoresume=cfg.autoresume,
        run_name="context-vae",
        device="cpu",
        precision="fp32",
        seed=cfg.seed,
        progress_bar=cfg.progress_bar,
        log_to_console=not cfg.progress_bar,
        console_log_interval=cfg.log_interval,
        step_schedulers_every_batch=True,
    )
    try:
        trainer.fit()
        last = trainer.state.loss  # the last batch's losses (a dict, as `loss` returns them)
        values = {k: round(float(v), 5) for k, v in last.items()} if isinstance(last, dict) else {}
        metrics = {
            "last_losses": values,
            "examples": len(examples),
            "steps": int(trainer.state.timestamp.batch),
        }
        vae.eval()
        save_vae(folder, vae, anchor=anchor_fingerprint(anchor, cfg.anchor), metrics=metrics)
        return {"folder": str(folder), **metrics}
    finally:
        trainer.close()
