"""Feature descriptors: one per hardened area (MISSION.md), each with an explicit switch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .settings import Settings

# status values reported by `dspark-harden check`
BOUND = "bound"
UPSTREAM = "upstream"
DISABLED = "disabled"
UNAVAILABLE = "unavailable"
FAILED = "failed"


def bound_status(report, name: str):
    """The status of feature ``name`` in a bind report when it bound, else None (a report without
    features, the feature absent, or not bound): what a ``dspark_process_bound`` hook checks first."""
    st = next((f for f in getattr(report, "features", []) if f.name == name), None)
    return st if st is not None and st.status == BOUND else None


@dataclass(frozen=True)
class Feature:
    """A switchable hardening.

    * ``switch``: the environment variable (declared as a Setting by the same plugin) that enables
      it; ``None`` for features that are always on (e.g. upstream probes).
    * ``default_on``: whether it is on when the switch is unset. Features safe on any deployment
      are on by default; geometry-specific ones are opt-in.
    * ``available(settings)``: returns ``None`` when the feature can run here, else the reason.
      An explicitly enabled feature that is unavailable FAILS (fail closed); one that is merely on
      by default reports ``unavailable`` and binds nothing.
    * ``test_only``: test support (e.g. dspark-testsupport's feature), left out of an operator's
      view (``dspark-harden check``) unless asked for or failed.
    * ``upstream_probe()``: for behaviour stock SGLang already has; returns ``(present, detail)``.
      A feature with a probe binds no patches: it is ``upstream`` when the probe finds the
      behaviour, ``failed`` when it does not.
    """

    name: str
    area: str
    description: str
    switch: Optional[str] = None
    default_on: bool = True
    available: Optional[Callable[[Settings], Optional[str]]] = None
    upstream_probe: Optional[Callable[[], tuple]] = None
    # roles in which this feature is evaluated (None: all). Keeps e.g. scheduler-only probes from
    # importing scheduler modules into the detokenizer.
    roles: Optional[frozenset] = None
    test_only: bool = False

    def enabled(self, settings: Settings) -> bool:
        if self.switch is None:
            return True
        return bool(settings[self.switch])

    def explicitly_enabled(self, settings: Settings) -> bool:
        return self.switch is not None and settings.is_explicit(self.switch) and bool(settings[self.switch])

    def unavailable_reason(self, settings: Settings) -> Optional[str]:
        return self.available(settings) if self.available else None
