"""The embedded corpora: synthetic English text with a known topic tree and known facts.

Neither is a pipeline stage: they are inputs that need no network, for the demo, the knowledge
benchmark, the tests and the benchmarks.

* `bios` — the entity-centric corpus of the knowledge benchmark and the default corpus of
  `memtree demo`, `memtree pipeline demo` and `memtree pipeline demo-corpus`: documents about
  fictional entities with controlled exposure per fact (vocabulary: `data/bios_vocab.json`).
* `topical` — topical prose on 16 domains × 4 subtopics with Zipf-distributed facts
  (`memtree pipeline demo-corpus --topical`): the pipeline, eval and reliability tests and the
  pipeline benchmarks (vocabulary: `data/topical_vocab.json`, read by `topical_vocab`; verb
  forms and articles: `grammar`).

Import from the modules (`pipeline.corpus.bios`, `pipeline.corpus.topical`); this package
re-exports nothing, so loading one corpus does not load the other.
"""
