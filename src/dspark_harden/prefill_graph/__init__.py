"""Prefill CUDA graphs as one DP decision (issue 13): see docs/prefill_graph.md."""
