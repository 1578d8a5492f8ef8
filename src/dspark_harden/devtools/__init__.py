"""Developer / test tooling that ships with the package but is never imported by the plugin itself.

- :mod:`dspark_harden.devtools.tiny_models`: tiny local tokenizers and random-weight models
  (nothing from a hub) for the CPU integration harness, the demo and benches;
- :mod:`dspark_harden.devtools.server`: start, probe and stop a real ``sglang.launch_server`` on a
  CPU machine (used by ``make demo`` and by the tests, through ``tests.harness``);
- :mod:`dspark_harden.devtools.lock`: the machine-wide one-server-at-a-time lock.
"""
