"""kernels stage (see docs/ARCHITECTURE.md)."""
