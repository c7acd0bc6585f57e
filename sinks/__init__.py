"""Spark sink jobs that keep derived stores in sync from the topics (docs/design.md)."""
