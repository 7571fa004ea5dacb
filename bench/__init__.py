"""The benchmarks, one folder per topic (bench/README.md is the index); run each as
`python -m bench.<topic>.<script>` from the repository's root."""
