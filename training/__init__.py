"""training stage (see docs/ARCHITECTURE.md)."""
