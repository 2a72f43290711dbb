"""Datasets and retrieval/answer metrics."""
