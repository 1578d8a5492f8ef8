"""Developer / test tooling that ships with the package but is never imported by the plugin itself.

- :mod:`dspark_harden.devtools.tiny_models`: tiny local tokenizers and random-weight models
  (nothing from a hub) for the CPU integration harness, the demo and benches.
"""
