"""Runnable examples for mgpu_updater (importable from the repository root)."""
