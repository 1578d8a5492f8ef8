"""DSpark grammar masks: batched native draft-chain traversal and a double-buffered mask pipeline.

Modules: :mod:`.traversal` (engines, pure torch + xgrammar), :mod:`.pipeline` (GPU slots, copy
stream, events; pure torch), :mod:`.resolve` (SGLang grammar objects -> jobs), :mod:`.integration`
(the DSpark-only patches), :mod:`.feature` (settings, patches, CLI), :mod:`.bench`,
:mod:`.workload` (real-grammar workloads for bench and tests). See docs/dspark_masks.md.
"""
