"""The main job (`memtree demo`, `make demo`): the knowledge experiment, corpus to report, in one
place.

The experiment behind seed 002's central result (Fig. 1, Table 1, Fig. 6b), at micro scale. Read it
from here: `run_main_job` runs each step through the module that does it, and every step resumes
(a written corpus and a finished pipeline stage are reused; a training run only when its config, the
shards and the run before it are unchanged, recorded in its folder's `demo_inputs.json`).

1. corpus (`pipeline.corpus.bios`, written by `pipeline.demo.run_demo`): the entity-centric
   default corpus, documents about fictional entities, a Zipf-like number of documents per
   entity, facts with a known number of stating documents and a closed value set
   (`facts.jsonl`), plus held-out documents about the same entities (`heldout.jsonl`);
2. pipeline (`pipeline.demo.run_demo` → `pipeline.run`, config `pipeline/yamls/demo.yaml`): ingest,
   embed, the 3-level × 4 clustering tree (one leaf per subtopic), assignments and shards;
3. anchor (`training.train.train`, config `training/yamls/demo.yaml`, `mode=baseline`): the
   anchor-only run for `anchor_duration`;
4. co-training (`training.train.train`, same YAML, `mode=cotrain`): anchor + hierarchical FFN
   memories for `cotrain_duration` (`memory_mode="frozen"`: the memories alone on the frozen
   anchor, seed 002's row A3);
5. knowledge and blocking eval (`eval.knowledge`): probes from the facts (`eval.longtail`) scored
   through the trained run (`eval.model.RunModel`) with anchor only / + generic / + fetched memory
   and the RAG rows (`eval.rag`), routing agreement per level (`eval.rag.routing_agreement`), and
   blocking the subtree a target domain's probes route to (adversarial, `memstore.blocking`)
   against a random subtree of the same share (`eval.knowledge.blocking_eval`);
6. answers in words (`eval.answers`): long-tail questions answered by `memtree generate`'s decoding
   (`training.generate.Generator`) with fetched memory, generic memory and the subtree blocked;
7. report (`eval.knowledge.write_report`): `ROOT/report/report.md`, `results.json` and PNGs, with
   the design choices below (`DESIGN`) as its first section.

With `anchor=NAME` (`memtree demo --anchor smollm2-135m`) it is seed 002's Table 2 instead, at the
same micro scale: the anchor is a named pretrained model (`memtree.pretrained`), the pipeline
tokenises with that model's tokenizer (`window.tokenizer=NAME`), step 3 is skipped, and step 4
trains the memories alone on the frozen pretrained model (`mode=frozen`, `model.anchor=NAME`:
post-hoc memories, `training.hf.HFMemoryModel`), sized by `memory.multipliers` in `train_overrides`,
by default `PRETRAINED_MULTIPLIERS` (fetched ≈ 10 % of the anchor). Exposures count the memory
stage's epochs only, and the report names the model, its quantisation and licence.

This module sits at the top of the import graph because it drives every stage.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from memtree.clustering.gate import GateSpec, calibrate
from memtree.config import from_dict
from memtree.eval.answers import answers_in_words
from memtree.eval.forgetting import demo_owners, forgetting_eval, plan_forgetting
from memtree.eval.knowledge import blocking_eval, knowledge_eval, write_report
from memtree.eval.longtail import build_probes, load_facts
from memtree.eval.model import RunModel
from memtree.eval.rag import RagIndex, routing_agreement
from memtree.eval.runinfo import run_pretrained, run_tpp_table
from memtree.geometry import plan
from memtree.io import atomic_write_json, atomic_write_text, iter_jsonl, read_json
from memtree.pipeline.corpus.bios import BiosSpec
from memtree.pipeline.demo import run_demo
from memtree.pretrained import SPECS as PRETRAINED
from memtree.tpp import deliberate
from memtree.training.config import TrainConfig, load_train_config
from memtree.training.train import rerun_plan, train

DEMO_TRAIN_YAML = Path(__file__).resolve().parents[1] / "training" / "yamls" / "demo.yaml"

# Why each choice was made; printed into the report so a reader can judge the experiment.
DESIGN = (
    (
        "corpus",
        (
            "entity-centric documents (one entity each, varied frames and subtopic prose) so a "
            "question naming the entity and its kind routes where the documents about it went"
        ),
    ),
    (
        "values",
        (
            "every attribute takes one of ~12 values, gold uniform and distractors uniform from "
            "the same set; a never-stated fact's distractors are balanced so that its gold is the "
            "most- to least-stated of its choices equally often within each attribute: an anchor "
            "that prefers values the corpus states often is at chance on them on every corpus, not "
            "only on average, so the unseen bucket tests the scorer"
        ),
    ),
    (
        "exposures",
        (
            "documents stating the fact × epochs over them (anchor + co-training), counted from "
            "the corpus plan; every sample is seen once per epoch (drop_last off)"
        ),
    ),
    (
        "tree",
        (
            "3 levels × 4 = fields / domains / subtopics; a domain is one level-2 subtree = 1/16 "
            "of the bank, the paper's blocking share; built bottom-up (leaves first, then merged): "
            "every domain stays whole on every seed (level-2 purity ≥ 0.99 on seeds 0–4, the "
            "paper's top-down 0.91–0.99); 20 k-means restarts per node, the lowest distortion "
            "kept: one k-means++ seed can merge two subtopics, and the questions' leaf routing "
            "follows the objective; MiniLM in float, not int8: int8 numerics follow the "
            "CPU, and on an AMD EPYC they took the fetched-generic gap from 16.0 to 6.8 points "
            "(docs/BENCHMARKS.md)"
        ),
    ),
    (
        "memory",
        (
            "FFN memories at levels 2 and 3 only (level 1 spans four domains, so blocking a domain "
            "removes all of its memory); leaf blocks ≥ level-2 blocks because the tail is most "
            "specific"
        ),
    ),
    (
        "generic",
        (
            "drawn with probability 1/16 as in the paper (seed 002 §4): as many updates as one "
            "level-2 block, the most-updated bank block"
        ),
    ),
    (
        "common knowledge",
        (
            "one famous entity per domain has no documents of its own; its facts close many "
            "documents of its domain, so they sit in the top exposure bucket: the knowledge the "
            'paper leaves to the anchor. Those closing lines open with the fact ("The … is …, as '
            'everyone knows.", BiosSpec.common_initial), the form the probes ask in: with '
            'lead-ins only ("Everyone knows that the …") co-training took the anchor\'s grip '
            "on them, 82.8 % after the anchor stage to 54.7 % (docs/BENCHMARKS.md)"
        ),
    ),
    (
        "windows",
        (
            "256-token sequences, about one document each, so a sequence's cluster path is its "
            "entity's subtopic"
        ),
    ),
    (
        "anchor",
        (
            "4 layers × d 128: it learns the facts it sees dozens of times (the head) but not "
            "those seen a few times, the paper's premise"
        ),
    ),
    (
        "epochs",
        (
            "2 anchor + 5 co-training epochs: the budget of `make demo` on 2 CPU cores; facts "
            "stated in one document are seen 7 times, two documents 14 times"
        ),
    ),
    (
        "memory LR",
        (
            "1.5e-2 for the bank (5x the anchor's 3e-3), cosine to 10 %, no memory dropout: a "
            "block is updated only by its own subtopic's sequences; with the bottom-up tree this "
            "gave fetched - generic +8.3 to +24.0 on facts seen 1-7 times over seeds 0-4, where "
            "3e-2 with one forward in 10 on the anchor alone gave +8.1 on seed 0 (docs/"
            "BENCHMARKS.md); on real text 3e-2 starved the anchor (held-out perplexity 35 % above "
            "the anchor's shape trained alone; `memtree eval realtext`), where 1e-3 generalises "
            "but moves the tail into the anchor"
        ),
    ),
    (
        "retrieval",
        (
            "questions are routed by the same greedy traversal as the training documents, from the "
            "question text only (no oracle path)"
        ),
    ),
)


# Table 2's memories on a pretrained anchor: FFN memories at levels 2 and 3 as the demo's, leaf
# blocks wider, sized to what a 24 GB machine holds rather than Table 2's ≈ 10 %: training keeps ~46
# bytes per bank parameter (fp32 bank, gradients, AdamW moments; measured: SmolLM2 at [0,48,80], a
# 305M-parameter bank, ran at ~14.6 GB resident; at [0,96,160], 610M, it passed 20 GB and was
# stopped). Fetched blocks: SmolLM2 4.9 % of the anchor, Gemma 2.3 % (its 168M-parameter embedding
# counts in the anchor); `memtree memstore plan --anchor NAME --memory …` shows both, and --train
# memory.multipliers=[0,96,160] gives SmolLM2 Table 2's 9.9 % where the memory allows.
PRETRAINED_MULTIPLIERS = {"smollm2-135m": (0, 48, 80), "gemma3-270m": (0, 64, 112)}


def pretrained_design(
    info: dict[str, Any],
    *,
    memory_duration: str,
    fetched_share: float | None,
    multipliers: list[int],
    memory_lr: float,
) -> tuple[tuple[str, str], ...]:
    """`DESIGN` for a pretrained anchor (`info`: the run's record of it,
    `eval.runinfo.run_pretrained`): the rows about the anchor, its epochs, the memory's size and
    rate say what this run did instead."""
    share = (
        f", fetched {fetched_share:.1%} of the anchor's parameters"
        if fetched_share is not None
        else ""
    )
    levels = " and ".join(str(lv) for lv, m in enumerate(multipliers, start=1) if m)
    title = info.get("title") or info.get("name")
    rows = {
        "exposures": (
            "documents stating the fact × the memory stage's epochs over them: the pretrained "
            "anchor never saw the corpus (counted from the corpus plan; drop_last off)"
        ),
        "memory": (
            f"FFN memories at level(s) {levels}, multipliers {list(multipliers)}{share}: seed 002 "
            "Table 2 sizes post-hoc memories against the anchor; a level-1 block spans four "
            "domains, so blocking a domain would remove all of its memory"
        ),
        "common knowledge": (
            "one famous entity per domain has no documents of its own; its facts close many "
            "documents of its domain, so they sit in the top exposure bucket. The paper leaves "
            "such knowledge to the anchor; this frozen anchor never saw it, so here only the "
            "memories can learn it"
        ),
        "anchor": (
            f"{title} ({info.get('name')}), pretrained and frozen: seed 002 Table 2's post-hoc "
            "memories; the corpus is tokenised with its own tokenizer. Its weights ship as "
            f"{info.get('quantisation')} and are dequantised to fp32, so they are pretrained but "
            "not bit for bit the released checkpoint. The corpus's entities are fictional, so the "
            "anchor alone answers their facts only as far as the questions' wording gives them away"
        ),
        "epochs": (
            f"{memory_duration} of the memory stage only, on the frozen anchor (no anchor stage): "
            "facts stated in one document are seen once per epoch"
        ),
        "memory LR": (
            f"{memory_lr:g} for the bank, cosine to 10 %: the anchor is frozen, so only the bank "
            "learns, and a block only from its own subtopic's sequences"
        ),
    }
    return tuple((k, rows.get(k, v)) for k, v in DESIGN)


def _log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _epochs(duration: str, batch_size: int, n_samples: int) -> float:
    """A Composer duration in epochs: exact for "Nep", samples seen / samples per epoch for
    "Nba"."""
    d = duration.strip()
    if d.endswith("ep"):
        return float(d[:-2])
    if d.endswith("ba"):
        return float(d[:-2]) * batch_size / max(n_samples, 1)
    raise ValueError(
        f"demo durations must be in epochs ('2ep') or batches ('150ba'), got {duration!r}"
    )


def train_once(name: str, cfg: TrainConfig, inputs: dict[str, str], log=_log) -> tuple[str, str]:
    """Train `cfg` unless `save_folder` finished a run from the same `inputs` (recorded in its
    `demo_inputs.json`); returns (their key, "reused" | "trained" | "resumed" | "retrained").

    A folder half-trained from the same inputs and config continues from its latest checkpoint
    (`training.train.rerun_plan`: the README's "rerunning a command resumes it"; before, the
    stage started again from batch 0 over its own checkpoints). A folder trained (or half-trained)
    from other inputs, or by a version that did not record them, is removed first: Composer would
    otherwise resume its checkpoints on the new shards."""
    folder = Path(cfg.save_folder)
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    marker = folder / "demo_inputs.json"
    old = read_json(marker) if marker.is_file() else None
    action = "trained"
    if old is not None and old.get("key") == key:
        if (folder / "metrics.json").exists():
            log(f"{name}: already trained from these inputs ({folder}), skipping")
            return key, "reused"
        plan, resumed = rerun_plan(cfg)
        if plan == "resume":
            log(f"{name}: resuming from its latest checkpoint ({folder}/checkpoints)")
            train(resumed)
            return key, "resumed"
    elif folder.exists() and any(folder.iterdir()):
        if old is None:
            log(
                f"{name}: {folder} holds a run with no record of what it was trained from, "
                "retraining"
            )
        else:
            changed = sorted(k for k in inputs if old.get("inputs", {}).get(k) != inputs[k])
            log(
                f"{name}: {folder} was trained from other inputs ({', '.join(changed)} changed), "
                "retraining"
            )
        shutil.rmtree(folder)
        action = "retrained"
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(marker, {"key": key, "inputs": inputs})
    log(f"{name}: training ({cfg.max_duration}, mode {cfg.mode}) → {folder}")
    train(cfg)
    return key, action


def _train_stage(name: str, cfg: TrainConfig, inputs: dict[str, str]) -> str:
    """`train_once` for a demo stage; returns the inputs' key (the next stage's upstream)."""
    return train_once(name, cfg, inputs)[0]


def shards_fingerprint(shards: Path) -> str:
    """What a run trained on the shards depends on: the pipeline's shards-stage fingerprint (it
    folds in the tree and assignments), else the manifest's digest."""
    stage = shards / "_stage.json"
    if stage.is_file():
        return read_json(stage)["fingerprint"]
    return hashlib.sha256((shards / "manifest.json").read_bytes()).hexdigest()[:16]


# What the TPP table (memtree/tpp.py) says about the demo, and why the demo keeps its settings
# there.
TPP_NOTE = (
    "The demo keeps two settings that the table above flags, on purpose. Its bank learns at 5× "
    "the anchor's rate over 5 epochs: most of its facts are stated in one or two documents, and "
    "the question it answers is whether a fetched block holds such a fact and blocking its subtree "
    "removes it; at a third of the anchor's rate the facts move into the anchor (fetched − generic "
    "on facts seen 4–7 times 6.8 → 3.1 points, blocking a domain's subtree −8.7 → −6.1, measured "
    "against 10×). On real text a bank at 3.3× and at 10× the anchor's rate read held-out pages "
    "worse than the anchor's shape trained alone (+0.19 and +0.30 nats/token on Python "
    "documentation; 10× +0.13 on a second corpus; 5× was not run there), so held-out text is not "
    "the demo's measure. Its leaf blocks see fewer tokens per parameter than "
    "0.139, the fewest measured on real text, where a bank at a third of the anchor's rate still "
    "generalised; nothing between that and 0.0044 was measured, so the table notes it without a "
    "warning and does not say whether the blocks memorise. At or under 0.0044 (a pretrained "
    "anchor's short memory stage gets there) it warns: the one run measured that low read held-out "
    "text worse with fetched than with generic memory. For real text, keep the bank's learning "
    "rate at or below the anchor's and check the sizes with `memtree memstore plan --shards` "
    '(training/yamls/realtext.yaml, `memtree eval realtext`; docs/BENCHMARKS.md, "Memory rows on '
    'real text" and "Tokens per parameter on real text").'
)
# The settings above, as the demo's training console reports them (memtree.tpp.deliberate): one note
# each instead of a warning, since TPP_NOTE explains them in the report (tpp.json keeps the
# warnings).
DELIBERATE = {
    "lr": (
        "the bios demo's, to hold facts stated in one or two documents; its report.md explains it"
    ),
    "tpp": "the bios demo's bank size; its report.md explains it",
}


def demo_forgetting(
    rm: RunModel,
    root: Path,
    probes: list[dict[str, Any]],
    knowledge: dict[str, Any],
    held_out: list[dict[str, Any]],
    domain: str,
    seed: int,
) -> list[dict[str, Any]]:
    """Forget one long-tail entity's documents, then one subtopic's (`eval.forgetting.demo_owners`):
    every block they trained blocked, read as the generic memory. Each owner's id list is written to
    ROOT/report/forget-<key>.txt, so `memtree eval knowledge --block-documents` can repeat it."""
    corpus = [rec for _, rec in iter_jsonl(root / "corpus.jsonl")]
    facts = load_facts(root / "facts.jsonl")
    given = {m: knowledge["modes"][m]["predictions"] for m in ("fetched", "generic")}
    unblocked: dict = {}  # the held-out pages' unblocked scores, the same for every owner
    out = []
    for owner in demo_owners(corpus, domain):
        ids_file = root / "report" / f"forget-{owner['key']}.txt"
        atomic_write_text(ids_file, "".join(f"{i}\n" for i in owner["ids"]))
        _log(f"forgetting {owner['name']}: blocking every block its documents trained")
        plan = plan_forgetting(
            rm,
            run=root / "pipeline",
            ids=owner["ids"],
            documents=ids_file,
            name=owner["name"],
            seed=seed,
            owner_field=owner["owner_field"],
            log=_log,
        )
        out.append(
            forgetting_eval(
                rm,
                plan,
                probes=probes,
                facts=facts,
                held_out=held_out,
                fallback="generic",
                predictions=given,
                paths=knowledge["paths"],
                unblocked=unblocked,
                log=_log,
            )
        )
    return out


def run_main_job(
    root: str | Path = "runs/demo",
    *,
    corpus: dict[str, Any] | None = None,
    pipeline_overrides: list[str] = (),
    train_overrides: list[str] = (),
    anchor_duration: str = "2ep",
    cotrain_duration: str = "5ep",
    max_probes: int = 0,
    target_domain: str | None = None,
    rag: bool = True,
    seed: int = 0,
    memory_mode: str | None = None,
    anchor: str | None = None,
    gate: str | GateSpec | None = None,
) -> Path:
    """Run (or resume) the whole demo under `root`; returns the evaluation report path.

    corpus: `pipeline.corpus.bios.BiosSpec` fields (e.g. {"entities_per_subtopic": 4}); `max_probes`
    keeps that many probes, evenly spread (0 = all); `target_domain`: the blocking target
    (default: the first domain in sorted order); `memory_mode`: the memory stage's training mode,
    "cotrain" (anchor and memories; the default) or "frozen" (memories alone on the anchor stage's
    weights); `anchor`: a named pretrained model (`memtree.pretrained`) as the frozen anchor, seed
    002's Table 2 (no anchor stage, `anchor_duration` unused; `memory_mode` frozen); `gate`: a
    domain gate ("leaf:0.01", `memtree.clustering.gate.GateSpec`) calibrated on the pipeline's
    windows, which adds the probes' gated row to the report."""
    if memory_mode not in (None, "cotrain", "frozen"):
        raise ValueError(f"memory_mode: 'cotrain' or 'frozen', got {memory_mode!r}")
    # a bad gate's error before any work
    gate_spec = GateSpec.parse(gate) if isinstance(gate, str) else gate
    pipeline_overrides, train_overrides = list(pipeline_overrides), list(train_overrides)
    defaults: list[str] = []
    if anchor is not None:
        pipeline_overrides, defaults = pretrained_overrides(
            anchor, memory_mode, pipeline_overrides, train_overrides
        )
        memory_mode = "frozen"
    memory_mode = memory_mode or "cotrain"
    root = Path(root)
    t0 = time.time()
    timings: dict[str, float] = {}
    spec = from_dict(BiosSpec, {**(corpus or {}), "seed": seed}, where="corpus")
    run_demo(root, spec=spec, overrides=list(pipeline_overrides))
    timings["pipeline_s"] = time.time() - t0
    shards = root / "pipeline" / "shards"
    manifest = read_json(shards / "manifest.json")
    n_samples = sum(s["n_samples"] for s in manifest["streams"])

    common = [
        f"data.shards={shards}",
        f"seed={seed}",
        f"data.shuffle_seed={seed}",
        *defaults,
        *train_overrides,
    ]
    if anchor is None:
        stages = (
            (
                "anchor",
                [
                    "mode=baseline",
                    f"save_folder={root / 'train' / 'anchor'}",
                    "run_name=demo-anchor",
                    "memory.multipliers=[]",
                    f"max_duration={anchor_duration}",
                ],
            ),
            (
                "cotrain",
                [
                    f"mode={memory_mode}",
                    f"save_folder={root / 'train' / 'cotrain'}",
                    "run_name=demo-cotrain",
                    f"anchor_checkpoint={root / 'train' / 'anchor'}",
                    f"max_duration={cotrain_duration}",
                ],
            ),
        )
    else:  # the pretrained model is the anchor: one memory stage on it, in the folder eval reads
        stages = (
            (
                "cotrain",
                [
                    "mode=frozen",
                    f"model.anchor={anchor}",
                    f"save_folder={root / 'train' / 'cotrain'}",
                    f"run_name=demo-{anchor}",
                    f"max_duration={cotrain_duration}",
                ],
            ),
        )
    epochs = 0.0
    # What a stage was trained from: its config, the shards' contents (the pipeline's shards-stage
    # fingerprint, which folds in the tree and assignments) and the stage before it. The config
    # alone names the shards by path, so a rebuilt tree under the same root would otherwise be
    # reused.
    upstream = read_json(shards / "_stage.json")["fingerprint"]
    for name, extra in stages:
        t = time.time()
        cfg = load_train_config(DEMO_TRAIN_YAML, common + extra)
        epochs += _epochs(cfg.max_duration, cfg.data.batch_size, n_samples)
        inputs = {"config": cfg.fingerprint(), "duration": cfg.max_duration, "upstream": upstream}
        with deliberate(**DELIBERATE):
            upstream = _train_stage(name, cfg, inputs)
        timings[f"{name}_s"] = time.time() - t

    t = time.time()
    rm = RunModel.load(root / "train" / "cotrain", tree_dir=root / "pipeline" / "tree")
    if gate_spec is not None:
        rm.gate = calibrate(rm.tree, gate_spec)
    probes = build_probes(
        load_facts(root / "facts.jsonl"), seed=seed, epochs=epochs, balance_unseen=True
    )
    if max_probes:
        probes = probes[:: max(1, len(probes) // max_probes)][:max_probes]
    held_out = [rec for _, rec in iter_jsonl(root / "heldout.jsonl")]
    _log(
        f"evaluating {len(probes)} probes and {len(held_out)} held-out documents × memory settings"
    )
    index = RagIndex.open(root / "pipeline") if rag else None
    knowledge = knowledge_eval(rm, probes, held_out, rag=index)
    index = index or RagIndex.open(root / "pipeline")
    paths = np.asarray(knowledge["paths"])  # each question's traversal, as fetched memory used it
    knowledge["routing"] = routing_agreement(
        index.texts(range(len(index.paths))), index.paths, probes, paths
    )
    domains = sorted({p["domain"] for p in probes})
    target = target_domain or domains[0]
    if target not in domains:
        raise ValueError(f"target_domain {target!r} is not one of the probes' domains {domains}")
    _log(
        f"blocking the level-2 subtree the {target} probes route to (1/16 of the bank), and a "
        "random one"
    )
    blocking = blocking_eval(
        rm,
        probes,
        target_domains=[target],
        level=2,
        fraction=1 / 16,
        seed=seed,
        fallback="generic",
        paths=paths,
    )
    timings["eval_s"] = time.time() - t
    t = time.time()
    forgetting = demo_forgetting(rm, root, probes, knowledge, held_out, target, seed)
    timings["forgetting_s"] = time.time() - t
    t = time.time()
    _log(
        "answering long-tail questions in words: fetched, generic, subtree blocked (memtree "
        "generate)"
    )
    answers = answers_in_words(
        root / "train" / "cotrain", probes, tree_dir=root / "pipeline" / "tree"
    )
    timings["answers_s"] = time.time() - t
    timings["total_s"] = time.time() - t0
    metrics = {
        name: read_json(root / "train" / name / "metrics.json")["train"] for name, _ in stages
    }
    design, pretrained = DESIGN, None
    if anchor is not None:
        pretrained = run_pretrained(root / "train" / "cotrain")
        sizes = plan(
            rm.anchor_shape, rm.store.info.memory
        )  # as `memtree memstore plan --anchor` counts
        design = pretrained_design(
            pretrained,
            memory_duration=cotrain_duration,
            multipliers=list(sizes.memory.multipliers),
            memory_lr=rm.config.memory.lr,
            fetched_share=sizes.fetch_params / sizes.anchor_params,
        )
    files = write_report(
        root / "report",
        knowledge=knowledge,
        blocking=blocking,
        design=design,
        tpp=run_tpp_table(root / "train" / "cotrain"),
        tpp_note=TPP_NOTE,
        forgetting=forgetting,
        answers=answers,
        pretrained=pretrained,
        meta={
            "corpus": read_json(root / "corpus.json"),
            "epochs": epochs,
            "probes": len(probes),
            "held_out_documents": len(held_out),
            "train_metrics": metrics,
            **{k: round(v, 1) for k, v in timings.items()},
        },
    )
    return Path(files["markdown"])


def pretrained_overrides(
    anchor: str, memory_mode: str | None, pipeline_overrides: list[str], train_overrides: list[str]
) -> tuple[list[str], list[str]]:
    """The pipeline's overrides with the model's own tokenizer, and the memory stage's defaults
    (`PRETRAINED_MULTIPLIERS` unless the caller sized the memory), for `anchor`; the refusals
    first."""
    if anchor not in PRETRAINED:
        raise ValueError(
            f"anchor: {anchor!r} is not a pretrained model ({', '.join(sorted(PRETRAINED))})"
        )
    if memory_mode == "cotrain":
        raise ValueError(
            "memory_mode: a pretrained anchor is trained frozen (seed 002 Table 2's post-hoc "
            "memories); leave memory_mode unset or 'frozen'"
        )
    keys = lambda overrides: {
        o.split("=", 1)[0].strip(): o.split("=", 1)[1].strip() for o in overrides if "=" in o
    }
    tok = keys(pipeline_overrides).get("window.tokenizer")
    if tok not in (None, anchor):
        raise ValueError(
            f"window.tokenizer={tok}: the shards feed {anchor}, which reads its own tokenizer"
        )
    given = keys(train_overrides)
    for key in ("mode", "model.anchor", "model.hf_dir", "anchor_checkpoint"):
        if key in given:
            raise ValueError(
                f"{key}: set by the demo for a pretrained anchor (frozen {anchor}); drop the "
                "override"
            )
    defaults = []
    if "memory.multipliers" not in given:
        if anchor not in PRETRAINED_MULTIPLIERS:
            raise ValueError(
                f"memory.multipliers: no default for {anchor}; give one (≈ 10 % of the anchor: "
                f"`memtree memstore plan --anchor {anchor} --memory 0,M2,M3 --branching 4`)"
            )
        defaults.append(
            f"memory.multipliers=[{','.join(map(str, PRETRAINED_MULTIPLIERS[anchor]))}]"
        )
    return [*pipeline_overrides, f"window.tokenizer={anchor}"], defaults
