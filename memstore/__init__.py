"""memstore stage (see docs/ARCHITECTURE.md)."""
