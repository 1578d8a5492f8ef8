"""dspark-harden test support (a separate, test-only distribution: ``pip install -e tests/support``).

- :mod:`dspark_testsupport.cpu_platform`: an out-of-tree SGLang hardware platform (entry-point group
  ``sglang.srt.platforms``, name ``dspark_test_cpu``) that lets the *unmodified*
  ``python -m sglang.launch_server`` serve a tiny model on a CPU-only machine, including
  ``--enable-dp-attention``. Opt-in: ``DSPARK_TEST_CPU_PLATFORM=1`` (and
  ``SGLANG_PLATFORM=dspark_test_cpu`` so SGLang's ``SGLANG_PLUGINS`` allow-list does not hide it).
- :mod:`dspark_testsupport.feature`: a test-only dspark-harden feature (entry-point group
  ``dspark_harden.features``), inert unless ``DSPARK_TESTFEATURE=1``; it can be broken on purpose
  with ``DSPARK_TESTFEATURE_BREAK`` to exercise the fail-closed verifier in a real server.

Never install this distribution on a production host.
"""

PLATFORM_NAME = "dspark_test_cpu"
PLATFORM_ENV = "DSPARK_TEST_CPU_PLATFORM"
