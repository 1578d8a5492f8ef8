"""Hook specifications: how features (built-in and third-party) plug into dspark-harden.

Every hook is named ``dspark_*`` and called with keyword arguments only. Built-in features are
registered by :mod:`dspark_harden.core.manager`; third-party packages register a module or object
in the entry-point group ``dspark_harden.features``. Each hook is documented in docs/hooks.md
with its exact signature (a test keeps the two in sync).
"""

from __future__ import annotations

import pluggy

PROJECT = "dspark_harden"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def dspark_features():
    """Return a list of :class:`~dspark_harden.core.feature.Feature` this plugin contributes.

    Feature names are unique across all plugins; a duplicate stops startup.
    """


@hookspec
def dspark_settings():
    """Return a list of :class:`~dspark_harden.core.settings.Setting` (environment variables)
    this plugin reads. Every variable a feature reads must be declared here so that it is parsed
    strictly at startup and listed by ``dspark-harden env``."""


@hookspec
def dspark_metrics():
    """Return the Prometheus metric families this plugin exports: a list of
    :class:`~dspark_harden.core.metrics.Family` and/or
    :class:`~dspark_harden.core.metrics.MetricGroup` (a titled group for the generated reference).

    Declare them in the feature's own package. Each family names its ``feature`` (one this or
    another plugin contributes, or ``"core"``); names are unique across all plugins (a duplicate
    stops startup). Called once per process when the registry is built; must not create metrics."""


@hookspec
def dspark_patches(role, settings):
    """Return the :class:`~dspark_harden.core.patch.Patch` objects to bind in process ``role``
    (a :class:`~dspark_harden.core.patch.Role`) given the parsed ``settings``.

    Return patches only for enabled features; the binder still checks each patch's ``roles``.
    Must not import heavy SGLang modules that ``role`` does not need (patch targets resolve
    lazily)."""


@hookspec
def dspark_stock_sources():
    """Return a list of :class:`~dspark_harden.core.porting.StockSource`: stock SGLang sources a feature
    reproduces or relies on *without* patching them (read-only mirrors), each with the fingerprint of its
    source in the supported release. ``dspark-harden port-report`` and the out-of-range verdict compare
    them with an SGLang tree like the patch targets. Must not import SGLang."""


@hookspec
def dspark_process_bound(role, settings, report):
    """Called once in every process after all patches of ``role`` are bound and verified.

    ``report`` is the :class:`~dspark_harden.core.binder.BindReport`. Use it to start per-process
    machinery (metrics, background threads). Raising here stops startup."""


@hookspec
def dspark_health_stalls():
    """Return a list of stall records (dicts: ``rank`` waiting, ``peer_rank`` not arriving,
    ``waited_s``, ``channel``, ``message``; the DP2 stall board's format) of the inter-rank exchanges
    this plugin runs: what ``/health_scheduler`` reports as ``dp2_stalled``.
    Called in the HTTP server process on every probe; must be cheap and must not block.
    Return ``[]`` (or ``None``) when nothing is stalled or the exchange is not running."""


@hookspec(firstresult=True)
def dspark_pair_exchange(channel, width, fields):
    """Return a callable ``exchange(row) -> [row_of_dp_rank_0, row_of_dp_rank_1]`` that exchanges
    a row of ``width`` int64 values (named ``fields``, part of what both ranks must agree on) between
    the two DP ranks of this scheduler over a dedicated channel named ``channel``, or ``None`` when this plugin runs no such exchange in this process
    (the caller then uses the TP CPU group). The first non-``None`` answer is used."""


@hookspec
def dspark_cli(subparsers, bench_subparsers):
    """Add ``dspark-harden`` sub-commands (``subparsers``) or ``dspark-harden bench`` targets
    (``bench_subparsers``). Each parser must ``set_defaults(func=callable(args) -> int)``."""
