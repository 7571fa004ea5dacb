"""Benchmarks of the demo's knowledge experiment and of multiple-choice scoring."""
