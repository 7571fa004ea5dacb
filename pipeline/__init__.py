"""pipeline stage (see docs/ARCHITECTURE.md)."""
