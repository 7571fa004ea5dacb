"""Blocking for Mixture of Chapters: the chapters' analogue of blocking a subtree.

A hierarchical memory is blocked by cluster: a subtree's blocks were trained on its documents
only, so blocking the subtree a domain's questions route to removes that domain's knowledge and
leaves the rest alone (`memstore.blocking`, seed 002 Fig. 6b). Chapters have no such alignment:
the router learns which chapters a sequence reads, from the loss alone. The analogue measured
here asks whether they ended up holding domains anyway:

1. route the target domain's probe sequences (question + each choice, as they are scored) and
   count, per MoC layer, how often each routed chapter is picked;
2. forbid the router the most-picked chapters (`MoCLayer.blocked`), as many as `fraction` of the
   routed chapters (the demo blocks 1/16 of its bank), and score every probe again;
3. a random control forbids as many other chapters, drawn with `seed`.

If chapters held domains, the target's accuracy would drop under (2) and not under (3), and the
other domains' would not move; the figures say how far that is from the case.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from memtree.eval.model import RunModel
from memtree.eval.tasks import multiple_choice
from memtree.training.hooks import attached
from memtree.training.layers.moc import MoCLayer


def moc_layers(rm: RunModel) -> list[MoCLayer]:
    """The model's MoC layers in order (ValueError when it has none)."""
    layers = [m for m in rm.model.modules() if isinstance(m, MoCLayer)]
    if not layers:
        raise ValueError("chapter blocking needs a model with Mixture-of-Chapters layers")
    return layers


@contextmanager
def blocked(layers: Sequence[MoCLayer], chapters: Sequence[Sequence[int]]) -> Iterator[None]:
    """Per layer, the global chapter ids its router may not pick, for the block's duration."""
    try:
        for layer, ids in zip(layers, chapters, strict=True):
            layer.blocked = torch.as_tensor(list(ids), dtype=torch.long)
        yield
    finally:
        for layer in layers:
            layer.blocked = None


def routed_counts(
    rm: RunModel, probes: Sequence[dict[str, Any]], layers: Sequence[MoCLayer]
) -> np.ndarray:
    """(layers, n_chapters) how often each chapter was picked by the routed top-k (shared chapters
    excluded) over the probes' scored sequences."""
    n = layers[0].cfg.n_chapters
    counts = np.zeros((len(layers), n), dtype=np.int64)

    def hook(i: int):
        def record(layer: MoCLayer, _inputs, _output) -> None:
            r = layer.last_routing
            routed = (r.routed + layer.cfg.n_shared).reshape(-1).cpu().numpy()
            counts[i] += np.bincount(routed, minlength=n)

        return record

    with attached([(layer, hook(i)) for i, layer in enumerate(layers)]):
        multiple_choice(rm, probes, mode="none")
    return counts


def chapter_blocking_eval(
    rm: RunModel,
    probes: Sequence[dict[str, Any]],
    *,
    target_domains: Sequence[str],
    fraction: float,
    seed: int = 0,
) -> dict[str, Any]:
    """Accuracy of the target domains' probes and of the others before and after blocking the
    chapters the target's sequences pick most (adversarial) and as many random other chapters."""
    layers = moc_layers(rm)
    cfg = layers[0].cfg
    n_block = max(1, round(fraction * cfg.n_routed))
    if n_block > cfg.n_routed - cfg.top_k:
        raise ValueError(
            f"blocking {n_block} of {cfg.n_routed} routed chapters leaves fewer than top_k "
            f"{cfg.top_k} to pick"
        )
    target = np.asarray([p.get("domain") in set(target_domains) for p in probes])
    if not target.any():
        raise ValueError(f"no probe belongs to the target domains {list(target_domains)}")
    gold = np.asarray([p["gold"] for p in probes])

    def score() -> np.ndarray:
        return np.asarray(multiple_choice(rm, probes, mode="none")["predictions"]) == gold

    def acc(mask: np.ndarray, ok: np.ndarray) -> float:
        return float(ok[mask].mean()) if mask.any() else float("nan")

    counts = routed_counts(rm, [p for p, t in zip(probes, target, strict=True) if t], layers)
    routed_ids = np.arange(cfg.n_shared, cfg.n_chapters)
    adversarial = [
        routed_ids[np.argsort(-c[cfg.n_shared :], kind="stable")[:n_block]].tolist() for c in counts
    ]
    rng = np.random.default_rng(seed)
    rand = [
        sorted(rng.choice(np.setdiff1d(routed_ids, adv), n_block, replace=False).tolist())
        for adv in adversarial
    ]
    base = score()
    result: dict[str, Any] = {
        "fraction": n_block / cfg.n_routed,
        "chapters_blocked_per_layer": n_block,
        "n_routed": cfg.n_routed,
        "top_k": cfg.top_k,
        "target_domains": list(target_domains),
        "n_target": int(target.sum()),
        "n_other": int((~target).sum()),
        "settings": {},
    }
    for name, chosen in (("adversarial", adversarial), ("random", rand)):
        total = counts.sum(axis=1)
        share = [
            float(c[ids].sum() / t) if t else 0.0
            for c, ids, t in zip(counts, chosen, total, strict=True)
        ]
        with blocked(layers, chosen):
            ok = score()
        result["settings"][name] = {
            "chapters": chosen,
            # of the target sequences' routed picks, the share that fell on these chapters
            "target_picks_on_blocked": share,
            "accuracy_target": {"before": acc(target, base), "after": acc(target, ok)},
            "accuracy_other": {"before": acc(~target, base), "after": acc(~target, ok)},
            "other_predictions_changed": int((ok != base)[~target].sum()),
        }
    return result
