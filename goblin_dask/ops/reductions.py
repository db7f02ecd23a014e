"""Chunk reductions (partials and combines) for goblin_dask.array."""
