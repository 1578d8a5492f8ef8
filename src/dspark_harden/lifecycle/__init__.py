"""Lifecycle with explicit ownership (issue 14): draining ordered shutdown, surfaced child death
with complete cleanup, GC freeze after warm-up, the one-shot HiCache eviction gate, isolated
host-pool teardown and strict VMM. See docs/lifecycle.md."""
