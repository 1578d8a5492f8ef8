"""Ingress hardening: atomic routed batches (tokenizer -> DP controller -> scheduler) and a DP
controller event loop that blocks on its socket instead of spinning a core."""
