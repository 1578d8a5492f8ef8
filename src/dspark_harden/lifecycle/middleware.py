"""A declared patch that adds an ASGI middleware to a FastAPI/Starlette app (``target`` = ``module:app``).

Like :class:`~dspark_harden.core.patch.RoutePatch` it adds something stock does not have, so it has
no fingerprint; ``build`` returns the middleware class. ``apply`` refuses once the app has built its
middleware stack (Starlette cannot add middleware to a started app); ``revert`` removes exactly
ours; ``live_check`` requires exactly one instance of ours in ``app.user_middleware``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..core.patch import Kind, Patch, PatchError, resolve_app


@dataclass(eq=False)
class MiddlewarePatch(Patch):
    def __post_init__(self) -> None:
        super().__post_init__()
        self.kind = Kind.ROUTE

    @property
    def key(self) -> str:
        return f"{self.target}[middleware]"

    def _ours(self, app: Any) -> list:
        return [m for m in getattr(app, "user_middleware", []) if getattr(m, "cls", None) is self.replacement]

    def apply(self, allow_drift: bool = False) -> None:
        if self.applied:
            return
        app = resolve_app(self.target, "add_middleware", "an ASGI app with add_middleware")
        if getattr(app, "middleware_stack", None) is not None:
            raise PatchError(f"{self.target}: the app already started; middleware cannot be added")
        cls = self.build(None)
        try:
            cls.__dspark_patch__ = self.key
        except (AttributeError, TypeError):
            pass
        app.add_middleware(cls)
        self._owner, self._attr = app, "user_middleware"
        self.replacement = cls
        self.applied = True

    def revert(self) -> None:
        if not self.applied:
            return
        app = self._owner
        app.user_middleware[:] = [m for m in app.user_middleware if getattr(m, "cls", None) is not self.replacement]
        if getattr(app, "middleware_stack", None) is not None:
            app.middleware_stack = None
        self.applied = False
        self.replacement = None

    def live_check(self) -> Optional[str]:
        owner, attr, problem = self._resolve_for_check()
        if problem:
            return problem
        app = getattr(owner, attr, None)
        n = len(self._ours(app)) if app is not None else 0
        if n != 1:
            return f"expected our one middleware on {self.target}, found {n}"
        return None
