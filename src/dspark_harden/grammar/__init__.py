"""Grammar service: canonical keys, bounded LRU with in-flight join, persistent XGrammar cache.

See docs/grammar.md. Modules:

* :mod:`.canonical` — cache keys that are equal exactly when xgrammar derives the same grammar;
* :mod:`.service` — the per-backend in-memory service (bounded LRU, one compile per key, matcher
  copies, bounded compile pool, compile timeout that does not poison the cache);
* :mod:`.disk` — the persistent on-disk cache (scoped namespace, per-entry file lock, atomic
  publish, checksummed entries, byte ledger + pruning, adaptive compile-locally markers);
* :mod:`.xgr` — the bridge into xgrammar: a caching ``GrammarCompiler`` stand-in and scope digests;
* :mod:`.feature` — settings, declared patches and CLI registration.
"""
