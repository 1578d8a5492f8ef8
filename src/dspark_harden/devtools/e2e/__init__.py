"""End-to-end benches against real servers: ``dspark-harden bench serve`` (stock vs plugin,
production-shaped replay, correctness gates, ablation) and ``dspark-harden bench soak`` (constant
mixed load on a plugin server, optional adversarial input). See docs/e2e.md.

- :mod:`.trace`: the seeded production-shaped trace generator and the JSONL trace format;
- :mod:`.client`: the asyncio HTTP replay client and output validation;
- :mod:`.procs`: per-process CPU / RSS / fd sampling of a server's process tree, pause / resume;
- :mod:`.serve`, :mod:`.soak`: the two benches; :mod:`.cli`: their argument parsers.

This package is developer tooling (like the rest of :mod:`dspark_harden.devtools`): the plugin
never imports it, and it imports no feature package (it reaches the server through HTTP only).
"""
