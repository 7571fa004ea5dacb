"""The on-device fetch-latency simulator and its device calibration (seed 002 §3, Fig. 5).

- `profiles`: hardware profiles (storage tiers; the shipped ones in `memstore/yamls/profiles/`).
- `latency`: the cost model: one path fetch, a session of queries (Zipf, routed texts or a
  trace file) through a cache, sweeps of memory configs.
- `report`: results.json, the Markdown table and the figures.
- `calibrate`: measure this machine's tiers through the real store into a profile;
  `validate`: check the simulator against real fetches; `timing`: what both share (the
  latency / bandwidth fit, the calibration banks, cold reads through the store).
  `calibrate` re-exports the other two's public names.

The command-line flags live in `memstore.cli_sim` (registered by `memstore.cli`) (`memtree memstore
simulate-fetch`, `memtree memstore calibrate`).
"""
