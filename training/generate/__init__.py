"""Run what you trained: generation with fetched memories, and export."""
