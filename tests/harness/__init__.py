"""Importable helpers for the CPU integration harness (see docs/testing.md).

The launcher and the lock live in the package (:mod:`dspark_harden.devtools.server`,
:mod:`dspark_harden.devtools.lock`), shared with ``make demo``; ``tests.harness.server`` and
``tests.harness.lock`` are those same modules.

- :mod:`tests.harness.server`: :class:`SGLangServer`, :class:`ServerConfig`, :data:`DP2_CONFIG`,
  :func:`start_server`, :func:`start_expect_failure`, :class:`ServerError`;
- :mod:`tests.harness.lock`: the machine-wide one-server-at-a-time lock;
- :mod:`tests.harness.shared`: servers shared by many tests (started once, stopped as soon as the
  last test that needs them has run).
"""

from .server import (  # noqa: F401
    DP2_CONFIG,
    PLUGIN_ACTIVE_RE,
    ServerConfig,
    ServerError,
    SGLangServer,
    start_expect_failure,
    start_server,
)
