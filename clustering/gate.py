"""The domain gate: fetch memories only for queries that lie where the tree's training windows lie.

A tree built on one corpus routes *every* query to some leaf, however far it is from anything the
bank was trained on. A bank trained post hoc on a narrow corpus then adds that corpus's register to
text it never saw: measured on frozen SmolLM2-135M with a bank trained on the bios world, plain
English paragraphs read at perplexity 20.5 alone and 60.9 with fetched memory
(docs/benchmarks/2026-12-05-pretrained-anchors-intel-xeon.md). The gate says which queries
belong to the tree: a query is admitted when its cosine similarity to the centroid it was routed
to at `level` is at least `threshold`; an admitted query reads its fetched blocks, any other reads
the model alone, exactly as without a bank.

The threshold is calibrated on the data the tree was built from, never on the queries scored: the
`quantile` of the training windows' similarity to their own cluster at that level (0.01: 99 % of
training windows would be admitted). `calibrate` reads the windows' embeddings (the pipeline's
`embed/embeddings.npy`, beside the run's `tree/`), routes them as training routed them, and takes
the quantile; `GateSpec` ("leaf:0.01" or "2:0.01" on a command line, or an explicit threshold
"leaf:=0.42") says which. Centroids are not unit vectors (equalisation rescales their norms,
`clustering.kmeans`), so the similarity is x·c / |c| for the L2-normalised embeddings x.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from memtree.clustering.route import route
from memtree.clustering.tree import Tree

# windows read for the calibration: routing 100k embeddings takes ~1 s; more moves a 1 %
# quantile by less than its sampling error at this size (±0.1 % of the windows)
CALIBRATION_SAMPLE = 100_000


@dataclass(frozen=True, kw_only=True)
class GateSpec:
    """Which similarity admits a query: at `level` (1 … tree levels; -1: the leaves, "leaf" in
    text), either the `quantile` of the training windows' own similarities or an explicit
    `threshold`."""

    level: int = -1
    quantile: float | None = 0.01
    threshold: float | None = None

    def __post_init__(self) -> None:
        if self.level == 0 or self.level < -1:
            raise ValueError(f"gate level: 1 or more (or 'leaf'), got {self.level}")
        if (self.quantile is None) == (self.threshold is None):
            raise ValueError("gate: give a quantile of the training windows or a threshold, one")
        if self.quantile is not None and not 0.0 <= self.quantile < 1.0:
            raise ValueError(f"gate quantile: in [0, 1), got {self.quantile}")
        if self.threshold is not None and not -1.0 <= self.threshold <= 1.0:
            raise ValueError(
                f"gate threshold: a cosine similarity in [-1, 1], got {self.threshold}"
            )

    @classmethod
    def parse(cls, text: str) -> GateSpec:
        """'LEVEL:QUANTILE' (e.g. 'leaf:0.01', '2:0.02') or 'LEVEL:=THRESHOLD' (e.g.
        'leaf:=0.4'); LEVEL is a tree level (1 = below the root) or 'leaf'."""
        level, sep, rest = text.partition(":")
        level = "-1" if level == "leaf" else level
        try:
            if not sep or level.startswith("-") and level != "-1":
                raise ValueError
            if rest.startswith("="):
                return cls(level=int(level), quantile=None, threshold=float(rest[1:]))
            return cls(level=int(level), quantile=float(rest))
        except ValueError as e:
            detail = f": {e}" if str(e) else ""
            raise ValueError(
                f"gate {text!r}: LEVEL:QUANTILE (e.g. leaf:0.01, 2:0.01) or LEVEL:=THRESHOLD "
                f"(e.g. leaf:=0.4){detail}"
            ) from None


@dataclass(frozen=True)
class Gate:
    level: int  # 1 … tree levels
    threshold: float
    quantile: float | None  # the training windows' quantile it came from (None: given)
    calibration: str | None  # the embeddings file it was calibrated on
    windows: int  # training windows read for the calibration (0: given)

    def admit(self, similarity: np.ndarray) -> np.ndarray:
        """(n, levels) similarities (`similarities`) → (n,) bool: which queries read memory."""
        return np.asarray(similarity)[:, self.level - 1] >= self.threshold

    def describe(self) -> dict:
        return asdict(self)


def similarities(tree: Tree, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Route the rows of x (n, dim) and score them: paths (n, levels) int64 as `route` gives them,
    and (n, levels) float32, each row's cosine similarity to the centroid it was routed to at
    each level (rows are L2-normalised embeddings)."""
    x = np.asarray(x, dtype=np.float32)
    paths = route(tree, x)
    sims = np.empty(paths.shape, dtype=np.float32)
    for lvl in range(1, tree.levels + 1):
        ids = paths[:, lvl - 1]
        c = tree.centroids[lvl - 1][ids]  # (n, dim)
        norm = np.sqrt(tree.sq_norms(lvl)[ids])  # the tree keeps ||c||² for routing
        sims[:, lvl - 1] = np.einsum("nd,nd->n", x, c) / np.maximum(norm, 1e-12)
    return paths, sims


def default_embeddings(tree: Tree) -> Path:
    """Where a pipeline run keeps the windows a tree was built from: `embed/embeddings.npy`
    beside its `tree/` folder."""
    if tree.path is None:
        raise ValueError("the gate's calibration needs the tree's folder (a tree loaded from disk)")
    return Path(tree.path).parent / "embed" / "embeddings.npy"


def calibrate(
    tree: Tree,
    spec: GateSpec,
    *,
    embeddings: str | Path | None = None,
    sample: int = CALIBRATION_SAMPLE,
    seed: int = 0,
) -> Gate:
    """The gate `spec` describes on `tree`: an explicit threshold as given, or the quantile of
    the training windows' similarity (read from `embeddings`, default `default_embeddings`; at
    most `sample` windows, drawn with `seed`)."""
    level = tree.levels if spec.level == -1 else spec.level
    if level > tree.levels:
        raise ValueError(f"gate level {spec.level}: the tree has {tree.levels} levels")
    if spec.threshold is not None:
        return Gate(level, float(spec.threshold), None, None, 0)
    path = Path(embeddings) if embeddings is not None else default_embeddings(tree)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: the gate is calibrated on the windows the tree was built from (the "
            "pipeline's embed/embeddings.npy); give their file, or an explicit threshold "
            "(LEVEL:=THRESHOLD)"
        )
    x = np.load(path, mmap_mode="r")
    if x.ndim != 2 or x.shape[1] != tree.dim:
        raise ValueError(f"{path}: expected embeddings of shape (n, {tree.dim}), got {x.shape}")
    if x.shape[0] == 0:
        raise ValueError(f"{path}: no windows to calibrate the gate on")
    rows = np.arange(x.shape[0])
    if len(rows) > sample:
        rows = np.sort(np.random.default_rng(seed).choice(len(rows), sample, replace=False))
    _, sims = similarities(tree, np.asarray(x[rows], dtype=np.float32))
    threshold = float(np.quantile(sims[:, level - 1].astype(np.float64), spec.quantile))
    return Gate(level, threshold, spec.quantile, str(path), len(rows))
