"""The pipeline driver: ingest → tokenizer → window → embed → tree → assign → shards → report.

`run_pipeline(cfg)` runs every stage that is not up to date, in order, on a
Dask cluster (a LocalCluster unless `dask.scheduler` names one). Stage
functions here are thin: they plan the Dask tasks (one per input unit,
partition, tree node group or level-1 subtree) and reconcile counts; the work
itself lives in `pipeline.ingest`, `pipeline.window`, `clustering.*` and
`pipeline.shards`. The embed stage, with its encoder export and allocator
tuning, is `pipeline.embed_stage`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from memtree.clustering import gemm
from memtree.clustering.blas import check_host, resolve_gemm
from memtree.clustering.bottomup import build_tree_bottomup
from memtree.clustering.kmeans import single_threaded
from memtree.clustering.route import route
from memtree.clustering.tree import (
    build_tree,
    fit_level,
    level_cell_size,
    level_cell_slack,
    load_tree,
    save_tree,
)
from memtree.config import to_dict
from memtree.io import atomic_path, atomic_save_npy, atomic_write_json
from memtree.pipeline import ingest as ing
from memtree.pipeline.config import PipelineConfig
from memtree.pipeline.dask_utils import dask_client, map_tasks
from memtree.pipeline.embed_stage import embed_fingerprint, embed_stage
from memtree.pipeline.report import write_report
from memtree.pipeline.shards import (
    SHARDS_FORMAT,
    SHARDS_VERSION,
    split_part,
    stream_name,
    write_stream,
)
from memtree.pipeline.stages import Ctx, StageDef, fingerprint, read_marker, run_stage
from memtree.pipeline.window import build_tokenizer, tokenizer_eot_id, window_part
from memtree.pretrained import SPECS as PRETRAINED
from memtree.pretrained import PretrainedError, pretrained_dir

PIPELINE_FORMAT_VERSION = 1


# ----------------------------------------------------------------------------- ingest
def _ingest(ctx: Ctx, work: Path) -> dict:
    cfg = ctx.cfg.ingest
    units = ing.expand_inputs(cfg.inputs)
    raw = work / "raw"
    raw.mkdir(exist_ok=True)
    unit_stats = map_tasks(
        ctx.client,
        ing.ingest_unit,
        [(i, u, cfg, str(raw)) for i, u in enumerate(units)],
        desc="ingest",
        progress=ctx.cfg.progress,
    )
    chunks = [c for s in unit_stats for c in s["chunks"]]
    drops, dup_rejects = ing.dedup_plan(raw, [c["name"] for c in chunks], dedup=cfg.dedup)
    args, parts, offset = [], [], 0
    for c in chunks:
        n_keep = c["n"] - len(drops[c["name"]])
        if n_keep == 0:
            continue
        name = f"docs/part-{len(parts):05d}.parquet"
        args.append((str(raw / c["name"]), str(work / name), offset, drops[c["name"]]))
        parts.append({"file": name, "n": n_keep, "offset": offset})
        offset += n_keep
    (work / "docs").mkdir(exist_ok=True)
    written = map_tasks(
        ctx.client, ing.write_docs_part, args, desc="ingest:write", progress=ctx.cfg.progress
    )
    assert written == [p["n"] for p in parts]
    rejects = [pq.read_table(raw / s["rejects"]) for s in unit_stats]
    rejects.append(pa.Table.from_pylist(dup_rejects, schema=ing.REJECT_SCHEMA))
    rej = pa.concat_tables(rejects)
    with atomic_path(work / "rejects.parquet") as tmp:
        pq.write_table(rej, tmp)
    shutil.rmtree(raw)
    records_in = sum(s["records_in"] for s in unit_stats)
    reasons: dict[str, int] = {}
    for r in rej["reason"].to_pylist():
        reasons[r] = reasons.get(r, 0) + 1
    if records_in != offset + rej.num_rows:
        raise RuntimeError(
            f"ingest count mismatch: {records_in} in != {offset} kept + {rej.num_rows} rejected"
        )
    if records_in == 0:
        raise ValueError(
            f"ingest: the inputs hold no records ({sum(len(u.urls) for u in units)} file(s) read: "
            f"{', '.join(url for u in units[:3] for url in u.urls[:1])}"
            f"{' …' if len(units) > 3 else ''}); "
            "give JSONL / Parquet / .txt / .md files whose records carry a 'text'"
        )
    if offset == 0:  # the stage is not published: its rejects are still in the work directory
        raise ValueError(
            f"ingest: all {records_in} records were rejected ({reasons}); "
            f"see {work}/rejects.parquet"
        )
    return {
        "units": len(units),
        "records_in": records_in,
        "kept": offset,
        "rejected": rej.num_rows,
        "rejects_by_reason": dict(sorted(reasons.items())),
        "parts": parts,
    }


# -------------------------------------------------------------------------- tokenizer
def _tokenizer(ctx: Ctx, work: Path) -> dict:
    parts = [ctx.stage_dir("ingest") / p["file"] for p in ctx.parts("ingest")]
    return build_tokenizer(ctx.cfg.window, parts, work)


# ----------------------------------------------------------------------------- window
def _window(ctx: Ctx, work: Path) -> dict:
    tok_dir = str(ctx.stage_dir("tokenizer"))
    docs = ctx.parts("ingest")
    args = [
        (
            str(ctx.stage_dir("ingest") / p["file"]),
            str(work / f"part-{i:05d}.parquet"),
            tok_dir,
            ctx.cfg.window.window_tokens,
        )
        for i, p in enumerate(docs)
    ]
    res = map_tasks(ctx.client, window_part, args, desc="window", progress=ctx.cfg.progress)
    parts, offset = [], 0
    for i, r in enumerate(res):
        parts.append(
            {
                "file": f"part-{i:05d}.parquet",
                "n": r["n_windows"],
                "offset": offset,
                "n_tokens": r["n_tokens"],
            }
        )
        offset += r["n_windows"]
    return {
        "docs_in": sum(p["n"] for p in docs),
        "n_windows": offset,
        "n_tokens": sum(p["n_tokens"] for p in parts),
        "parts": parts,
    }


# ------------------------------------------------------------------------------- tree
def fit_nodes_task(
    emb_path: str,
    nodes: list[tuple[int, np.ndarray]],
    level: int,
    cell_slack: float,
    params: dict,
    fallbacks: np.ndarray,
    gemm_backend: str = "numpy",
) -> list[tuple[np.ndarray, int, int]]:
    """Dask task: fit a group of sibling-independent nodes of one level, their cells capped at
    cell_slack × the level's mean cell, as `build_tree`'s own fitter caps them, with the GEMMs on
    `gemm_backend` (`clustering.gemm`, the host check's choice)."""
    x = np.load(emb_path, mmap_mode="r")
    with (
        gemm.using(gemm_backend),
        single_threaded(),
    ):  # sorted rows: sequential reads from the memmap
        return fit_level(
            x,
            [(int(p), np.sort(idx)) for p, idx in nodes],
            np.asarray(fallbacks),
            level=level,
            cell_size=level_cell_size(x.shape[0], params["branching"], level),
            cell_slack=cell_slack,
            **params,
        )


def effective_levels(n: int, levels: int, branching: int, auto_reduce: bool) -> int:
    if n >= branching**levels:
        return levels
    if not auto_reduce:
        raise ValueError(
            f"the tree has {branching}^{levels} = {branching**levels} leaves but the corpus has "
            f"only {n} windows; at least {branching**levels} windows are needed. Use fewer levels "
            "(--levels) or a smaller branching (--branching), or set tree.auto_reduce=true to "
            "drop levels"
        )
    lv = levels
    while lv > 1 and branching**lv > n:
        lv -= 1
    if branching**lv > n:
        raise ValueError(f"the corpus has {n} windows, fewer than the {branching} level-1 clusters")
    return lv


def _tree_fingerprint(c) -> dict:
    """The tree config and seed; `restarts` only when it is not 1, so trees built before that
    field existed keep their fingerprint (the same fit). `gemm` is a speed setting (the same
    paths, centroids to float32 rounding): changing it rebuilds nothing."""
    fp = {**to_dict(c.tree), "seed": c.seed}
    if fp.get("restarts") == 1:
        del fp["restarts"]
    if fp.get("method") == "topdown":  # the rule every tree was built with before the field
        del fp["method"]
    fp.pop("gemm", None)
    return fp


def _tree(ctx: Ctx, work: Path) -> dict:
    t = ctx.cfg.tree
    emb_path = ctx.stage_dir("embed") / "embeddings.npy"
    x = np.load(emb_path)
    levels = effective_levels(x.shape[0], t.levels, t.branching, t.auto_reduce)
    if levels != t.levels:
        ctx.log(
            f"[tree] {x.shape[0]} windows: levels reduced {t.levels} -> {levels} (tree.auto_reduce)"
        )
    node_params = {
        "branching": t.branching,
        "min_points_per_child": t.min_points_per_child,
        "batch_size": t.batch_size,
        "steps": t.steps,
        "balance_factor": t.balance_factor,
        "equalize_steps": t.equalize_steps,
        "restarts": t.restarts,
        "converge_tol": t.converge_tol,
        "seed": ctx.cfg.seed,
    }
    n_workers = max(1, len(ctx.client.scheduler_info()["workers"]))
    host = dict(ctx.host or {"action": "off"})
    if t.gemm != "auto":
        gemm_backend = t.gemm
    elif "gemm" in host:  # the check's timed choice
        gemm_backend = host["gemm"]
    else:  # dask.blas: off
        gemm_backend = resolve_gemm("auto", ctx.cfg.dask.threads_per_worker)
    host["gemm_used"] = gemm_backend

    def fit_nodes(level, nodes, parent_c, *, strict):
        # Group nodes into ~4 tasks per worker, balanced by point count.
        groups: list[list[int]] = [[] for _ in range(min(len(nodes), 4 * n_workers))]
        loads = [0] * len(groups)
        for i in sorted(range(len(nodes)), key=lambda i: -len(nodes[i][1])):
            g = loads.index(min(loads))
            groups[g].append(i)
            loads[g] += len(nodes[i][1]) + 1
        args = [
            (
                str(emb_path),
                [nodes[i] for i in g],
                level,
                level_cell_slack(t.balance_factor, level, levels, strict),
                {**node_params, "strict_balance": strict},
                np.stack([parent_c[nodes[i][0]] for i in g]),
                gemm_backend,
            )
            for g in groups
            if g
        ]
        res = map_tasks(
            ctx.client, fit_nodes_task, args, desc=f"tree:l{level}", progress=ctx.cfg.progress
        )
        out: list = [None] * len(nodes)
        for g, r in zip([g for g in groups if g], res):
            for i, fit in zip(g, r):
                out[i] = fit
        return out

    if t.method == "bottomup":  # one node fit and tiny groupings: in this process, no tasks
        tree, _ = build_tree_bottomup(
            x,
            levels=levels,
            gemm_backend=gemm_backend,
            on_level=lambda lv: ctx.log(f"[tree] level {lv} built (bottomup)"),
            **node_params,
        )
    else:
        tree, _ = build_tree(
            x,
            levels=levels,
            fit_nodes=fit_nodes,
            on_level=lambda lv: ctx.log(f"[tree] level {lv} built"),
            strict_balance=t.strict_balance,
            balance_target=t.balance_target,
            **node_params,
        )
    for lv, (refit, kept) in enumerate(tree.meta["balance_repairs"], start=1):
        if refit:
            ctx.log(
                f"[tree] level {lv}: {refit} node(s) over tree.balance_target refitted with "
                f"strict balance, {kept} kept"
            )
    em = ctx.markers["embed"]["stats"]
    meta = save_tree(
        tree,
        work,
        config={**to_dict(t), "levels_requested": t.levels, "levels": levels, "seed": ctx.cfg.seed},
        embedder={
            "model": em["model"],
            "strategy": em["strategy"],
            "max_seq_length": em["max_seq_length"],
            "batch_size": em["batch_size"],
            "dim": em["dim"],
            **_export_ref(ctx, em),
        },
    )
    return {
        "tree_id": meta["tree_id"],
        "levels": levels,
        "branching": t.branching,
        "n_points": int(x.shape[0]),
        "level_stats": meta["level_stats"],
        "host": {k: v for k, v in host.items() if k != "before"}
        | (
            {
                "before": {
                    k: host["before"].get(k)
                    for k in ("faiss_kernel", "faiss_search_gflops", "sgemm_gflops")
                }
            }
            if host.get("before")
            else {}
        ),
    }


def _export_ref(ctx: Ctx, em: dict) -> dict:
    """tree.json's pointer to the embedder export, relative to the tree directory."""
    if not em.get("export"):
        return {"backend": em.get("backend", "torch")}
    rel = os.path.relpath(ctx.stage_dir("embed") / em["export"], ctx.stage_dir("tree"))
    return {"backend": em["backend"], "export": rel}


# ----------------------------------------------------------------------------- assign
def assign_part(
    tree_dir: str, emb_path: str, windows_path: str, out_path: str, offset: int, n: int
) -> list[list[int]]:
    """Dask task: route one partition's windows; returns per-level cluster sizes (sparse)."""
    out = Path(out_path)
    tree = load_tree(tree_dir)
    if not out.exists():
        x = np.load(emb_path, mmap_mode="r")[offset : offset + n]
        paths = route(tree, np.asarray(x))
        doc = pq.read_table(windows_path, columns=["doc_ordinal"])["doc_ordinal"]
        table = pa.table(
            {
                "window_ordinal": pa.array(np.arange(offset, offset + n), pa.int64()),
                "doc_ordinal": doc,
                "path": pa.FixedSizeListArray.from_arrays(pa.array(paths.reshape(-1)), tree.levels),
                "leaf": pa.array(paths[:, -1], pa.int64()),
                "subtree": pa.array(paths[:, 0], pa.int64()),
            }
        )
        with atomic_path(out) as tmp:
            pq.write_table(table, tmp, compression="zstd")
    else:
        paths = np.stack(
            pq.read_table(out, columns=["path"])["path"].to_numpy(zero_copy_only=False)
        )
    return [
        np.bincount(paths[:, lv], minlength=tree.branching ** (lv + 1)).tolist()
        for lv in range(tree.levels)
    ]


def _assign(ctx: Ctx, work: Path) -> dict:
    wparts = ctx.parts("window")
    args = [
        (
            str(ctx.stage_dir("tree")),
            str(ctx.stage_dir("embed") / "embeddings.npy"),
            str(ctx.stage_dir("window") / p["file"]),
            str(work / f"part-{i:05d}.parquet"),
            p["offset"],
            p["n"],
        )
        for i, p in enumerate(wparts)
    ]
    res = map_tasks(ctx.client, assign_part, args, desc="assign", progress=ctx.cfg.progress)
    sizes = [np.sum([np.asarray(r[lv]) for r in res], axis=0) for lv in range(len(res[0]))]
    for lv, s in enumerate(sizes, start=1):
        atomic_save_npy(work / f"sizes-l{lv}.npy", s.astype(np.int64))
    parts = [
        {"file": f"part-{i:05d}.parquet", "n": p["n"], "offset": p["offset"]}
        for i, p in enumerate(wparts)
    ]
    return {"n_windows": int(sizes[0].sum()), "parts": parts}


# ----------------------------------------------------------------------------- shards
def _shards(ctx: Ctx, work: Path) -> dict:
    p = ctx.cfg.pack
    split = work / ".split"
    split.mkdir(exist_ok=True)
    wparts, aparts = ctx.parts("window"), ctx.parts("assign")
    args = [
        (
            str(ctx.stage_dir("window") / w["file"]),
            str(ctx.stage_dir("assign") / a["file"]),
            str(split),
            i,
        )
        for i, (w, a) in enumerate(zip(wparts, aparts))
    ]
    counts = map_tasks(ctx.client, split_part, args, desc="shards:split", progress=ctx.cfg.progress)
    subtrees = sorted({s for c in counts for s in c})
    eot = tokenizer_eot_id(ctx.stage_dir("tokenizer"))
    args = [
        (
            str(split),
            str(work / stream_name(s)),
            s,
            p.seq_len,
            eot,
            p.compression,
            list(p.hashes),
            p.size_limit,
        )
        for s in subtrees
    ]
    streams = map_tasks(
        ctx.client, write_stream, args, desc="shards:write", progress=ctx.cfg.progress
    )
    shutil.rmtree(split)
    for s in subtrees:
        (work / f"{stream_name(s)}.done.json").unlink()
    tree = ctx.markers["tree"]["stats"]
    manifest = {
        "format": SHARDS_FORMAT,
        "version": SHARDS_VERSION,
        "tree_id": tree["tree_id"],
        "levels": tree["levels"],
        "branching": tree["branching"],
        "seq_len": p.seq_len,
        "eot_id": eot,
        "tokenizer": "../tokenizer",
        "mds_columns": {
            "tokens": "ndarray:int32",
            "doc_bounds": "ndarray:int32",
            "path": "ndarray:int64",
            "leaf": "int64",
            "window_ids": "ndarray:int64",
        },
        "streams": streams,
    }
    atomic_write_json(work / "manifest.json", manifest)
    n_windows = sum(s["n_windows"] for s in streams)
    return {
        "n_streams": len(streams),
        "n_samples": sum(s["n_samples"] for s in streams),
        "n_windows": n_windows,
        "n_tokens": sum(s["n_tokens"] for s in streams),
        "tree_id": tree["tree_id"],
    }


# ----------------------------------------------------------------------------- report
def _report(ctx: Ctx, work: Path) -> dict:
    return write_report(ctx.root, ctx.markers, work)


def _ingest_cfg(c: PipelineConfig):
    d = to_dict(c.ingest)
    if any(
        ing.is_glob(i) for i in c.ingest.inputs
    ):  # a file that newly matches a pattern reruns ingest
        d["inputs_resolved"] = ing.resolve_inputs(c.ingest.inputs)
    return d


STAGES: list[StageDef] = [
    StageDef("ingest", 1, (), _ingest_cfg, _ingest),
    StageDef(
        "tokenizer",
        1,
        ("ingest",),
        lambda c: {
            k: to_dict(c.window)[k]
            for k in ("tokenizer", "vocab_size", "train_sample_docs", "eot_token")
        },
        _tokenizer,
    ),
    StageDef("window", 1, ("ingest", "tokenizer"), lambda c: c.window.window_tokens, _window),
    StageDef("embed", 1, ("window",), lambda c: embed_fingerprint(c.embed), embed_stage),
    StageDef("tree", 1, ("embed",), lambda c: _tree_fingerprint(c), _tree),
    StageDef("assign", 1, ("tree", "embed", "window"), lambda c: None, _assign),
    StageDef(
        "shards", 2, ("assign", "window", "tokenizer", "tree"), lambda c: to_dict(c.pack), _shards
    ),
    StageDef(
        "report",
        1,
        ("ingest", "window", "embed", "tree", "assign", "shards"),
        lambda c: None,
        _report,
    ),
]
STAGE_NAMES = [s.name for s in STAGES]


def run_pipeline(
    cfg: PipelineConfig,
    *,
    until: str | None = None,
    client: Any = None,
    log: Callable[[str], None] = print,
) -> dict[str, dict]:
    """Run (or resume) the pipeline up to and including stage `until`; returns the stage markers."""
    if until is not None and until not in STAGE_NAMES:
        raise ValueError(f"unknown stage {until!r} (--until); stages: {STAGE_NAMES}")
    remote = "://" in cfg.out and not cfg.out.startswith("file://")
    if remote:
        # Work happens in a local staging copy (Dask tasks need a shared filesystem and
        # atomic renames); every finished stage is then uploaded through fsspec.
        base = Path(
            os.environ.get("MEMTREE_STAGING", Path.home() / ".cache" / "memtree" / "staging")
        )
        root = base / hashlib.sha256(cfg.out.encode()).hexdigest()[:16]
    else:  # absolute: the Dask workers' working directory may not be this process's (--scheduler)
        root = Path(cfg.out.removeprefix("file://")).absolute()
    wanted = STAGE_NAMES[: STAGE_NAMES.index(until) + 1] if until else STAGE_NAMES
    # Fingerprints and inputs are checked before anything is written into the run directory: a
    # wrong input leaves no config.json or work directory behind.
    fps: dict[str, str] = {}
    for st in STAGES:
        if st.name not in wanted:
            break
        fps[st.name] = fingerprint(st, st.config(cfg), [fps[d] for d in st.deps])
    todo = {n for n, fp in fps.items() if (read_marker(root / n) or {}).get("fingerprint") != fp}
    preflight(cfg, todo)
    # before the LocalCluster starts: a fix of OPENBLAS_CORETYPE reaches only processes started
    # after it
    host = (
        host_check(cfg, can_fix=client is None and not cfg.dask.scheduler, log=log)
        if "tree" in todo
        else None
    )
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        root / "config.json",
        {"format": "memtree-run", "version": PIPELINE_FORMAT_VERSION, "config": to_dict(cfg)},
    )
    if remote:
        _upload(root / "config.json", cfg.out.rstrip("/") + "/config.json")

    def go(c) -> dict[str, dict]:
        ctx = Ctx(cfg=cfg, root=root, client=c, log=log, host=host)
        for st in STAGES:
            if st.name not in wanted:
                break
            ctx.markers[st.name] = run_stage(root, st, fps[st.name], ctx, log=log)
            if remote:
                _sync_stage(root / st.name, cfg.out.rstrip("/") + "/" + st.name, log)
            note = rejects_note(ctx.markers[st.name], cfg.out.rstrip("/") + "/" + st.name)
            if note:
                log(f"[{st.name}] {note}")
        return ctx.markers

    if client is not None:
        return go(client)
    with dask_client(cfg.dask) as c:
        return go(c)


def host_check(cfg: PipelineConfig, *, can_fix: bool, log: Callable[[str], None]) -> dict | None:
    """The BLAS check of `dask.blas` (`clustering.blas.check_host`), logged; None when off."""
    if cfg.dask.blas == "off":
        return None
    res = check_host(mode=cfg.dask.blas, can_fix=can_fix, threads=cfg.dask.threads_per_worker)
    log(f"[tree] {res['message']}")
    if cfg.tree.gemm not in ("auto", res["gemm"]):
        log(
            f"[tree] the node fits run on {cfg.tree.gemm}'s GEMM (tree.gemm); the fastest here was "
            f"{res['gemm']}'s: tree.gemm=auto would use it"
        )
    return res


def preflight(cfg: PipelineConfig, stages: set[str]) -> None:
    """Check the inputs of the stages that will run (`stages`: those not up to date), before the
    run directory is touched: the ingest inputs (globs expanded), a local tokenizer, a local
    embedding model. Errors name the key and the path."""
    if "ingest" in stages:
        ing.expand_inputs(
            cfg.ingest.inputs
        )  # missing inputs, patterns matching nothing, empty directories
    tok = cfg.window.tokenizer
    if "tokenizer" in stages and tok in PRETRAINED:
        try:  # converted here, once, before the run directory is touched
            pretrained_dir(tok)
        except PretrainedError as e:
            raise FileNotFoundError(f"window.tokenizer={tok}: {e}") from None
    elif "tokenizer" in stages and tok and not (Path(tok) / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"window.tokenizer={tok}: no tokenizer.json there (a fast Hugging Face tokenizer "
            "directory is required; save one with tokenizer.save_pretrained(dir), or leave "
            "window.tokenizer unset to train a byte-level BPE on the corpus)"
        )
    model = cfg.embed.model
    if "embed" in stages and model and "://" not in model and not Path(model).is_dir():
        raise FileNotFoundError(
            f"embed.model={model}: no such directory (a local sentence-transformers "
            "model directory; leave embed.model unset for the packaged all-MiniLM-L6-v2)"
        )


def rejects_note(marker: dict, stage_url: str) -> str:
    """One line for a stage that rejected records: how many, why, and the file that lists them."""
    stats = marker.get("stats") or {}
    n = stats.get("rejected") or 0
    if not n:
        return ""
    why = ", ".join(f"{k} {v}" for k, v in (stats.get("rejects_by_reason") or {}).items())
    of = f" of {stats['records_in']:,}" if "records_in" in stats else ""
    return (
        f"{n:,}{of} records rejected"
        + (f" ({why})" if why else "")
        + f"; each is listed with its source, record and reason in {stage_url}/rejects.parquet"
    )


def _upload(local: Path, url: str) -> None:
    fs, path = fsspec.core.url_to_fs(url)
    if local.is_dir():
        fs.put(str(local), path, recursive=True)
    else:
        fs.put_file(str(local), path)


def _sync_stage(local: Path, url: str, log: Callable[[str], None]) -> None:
    """Upload a finished stage unless the remote copy has the same fingerprint; marker last."""
    fs, path = fsspec.core.url_to_fs(url)
    marker = f"{path}/_stage.json"
    local_marker = json.loads((local / "_stage.json").read_text())
    if fs.exists(marker):
        with fs.open(marker, "r") as f:
            if json.load(f).get("fingerprint") == local_marker["fingerprint"]:
                return
        fs.rm(path, recursive=True)
    for p in sorted(local.rglob("*")):
        if p.is_file() and p.name != "_stage.json":
            fs.makedirs(f"{path}/{p.parent.relative_to(local)}".rstrip("/."), exist_ok=True)
            fs.put_file(str(p), f"{path}/{p.relative_to(local)}")
    # The marker goes last: a remote stage with a marker is complete.
    fs.put_file(str(local / "_stage.json"), marker)
    log(f"[{local.name}] uploaded to {url}")
