"""eval stage (see docs/ARCHITECTURE.md)."""
