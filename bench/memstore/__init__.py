"""Benchmarks of the memory store: fetches, calibration and cache against raw reads and the
simulator."""
