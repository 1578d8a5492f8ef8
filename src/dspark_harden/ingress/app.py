"""App module for SGLang's multi-tokenizer HTTP workers.

Stock workers (``--tokenizer-worker-num > 1``) import ``SGLANG_HTTP_SERVER_APP_PATH`` and never
call ``load_plugins()``. The main process sets that variable to ``dspark_harden.ingress.app:app``
(see :mod:`dspark_harden.ingress.feature`); importing this module in a worker runs SGLang's plugin
loader (so every plugin, ours included, binds its main-role patches there, fail-closed) and
re-exports the stock FastAPI ``app`` with ``/health_scheduler`` registered on it.
"""

from __future__ import annotations

from sglang.srt.plugins import load_plugins

from ..core import binder
from ..core.patch import Role
from ..entry import load

load_plugins()
if binder.STATE.report is None:  # SGLANG_PLUGINS excluded us, but this module was asked for by name
    load(Role.MAIN)

from sglang.srt.entrypoints.http_server import app  # noqa: E402

__all__ = ["app"]
