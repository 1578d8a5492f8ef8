"""Declared patches: one object per hook point into stock SGLang.

A :class:`Patch` names its dotted target (``"package.module:Qualified.name"``), the process
roles it applies in, its kind, the fingerprint of the stock source it was written against, the
SGLang versions it supports, why it exists and which upstream change would retire it.
``apply()`` / ``revert()`` are idempotent and revert restores the stock object exactly (the very
object, including ``staticmethod`` / ``classmethod`` wrappers and stale ``from x import f``
bindings that were re-pointed).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib
import inspect
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

SUPPORTED_SGLANG = ">=0.5.23,<0.5.24"


class Role(str, enum.Enum):
    """SGLang process roles that call ``load_plugins()``."""

    MAIN = "main"  # launch_server / Engine: tokenizer manager + HTTP app
    CONTROLLER = "controller"  # run_data_parallel_controller_process
    SCHEDULER = "scheduler"  # run_scheduler_process
    DETOKENIZER = "detokenizer"  # run_detokenizer_process

    def __str__(self) -> str:  # pragma: no cover - cosmetic
        return self.value


ALL_ROLES = frozenset(Role)


class Kind(str, enum.Enum):
    WRAP = "wrap"  # new callable that calls the stock one (``__wrapped__`` points at it)
    REPLACE = "replace"  # new callable that does not call the stock one
    ROUTE = "route"  # new HTTP route on a FastAPI app
    ATTRIBUTE = "attribute"  # attribute that does not exist in stock


class PatchError(Exception):
    """A patch could not be applied; the message names the target."""


def fingerprint_source(obj: Any) -> str:
    """sha256 (first 16 hex) of the dedented source of ``obj`` (functions, methods, classes)."""
    obj = unwrap_descriptor(obj)
    try:
        src = inspect.getsource(obj)
    except (OSError, TypeError) as exc:
        raise PatchError(f"cannot read source of {obj!r}: {exc}") from None
    return hashlib.sha256(textwrap.dedent(src).encode()).hexdigest()[:16]


def _module_path(module: str) -> str:
    import importlib.util
    import os

    spec = importlib.util.find_spec(module.split(".")[0])
    if spec is None or spec.origin is None:
        raise PatchError(f"package {module.split('.')[0]!r} is not installed")
    return os.path.join(os.path.dirname(spec.origin), *module.split(".")[1:]) + ".py"


def source_text_fingerprint(target: str) -> str:
    """The same digest as :func:`fingerprint_source`, read from the installed source *text* of a
    module-level function or ``Class.method`` target, without importing its module (for targets whose
    module loads a CUDA extension at import: ``Patch.requires_cuda``)."""
    import ast

    module, _, qual = target.partition(":")
    path = _module_path(module)
    with open(path, encoding="utf-8") as fh:
        src = fh.read()
    lines = src.splitlines(keepends=True)
    body = ast.parse(src).body
    node = None
    for part in qual.split("."):
        node = next(
            (
                n
                for n in body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part
            ),
            None,
        )
        if node is None:
            raise PatchError(f"{target}: {part!r} not found in {path}")
        body = node.body
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    return hashlib.sha256(textwrap.dedent("".join(lines[start : node.end_lineno])).encode()).hexdigest()[:16]


def unwrap_descriptor(obj: Any) -> Any:
    if isinstance(obj, (staticmethod, classmethod)):
        return obj.__func__
    return obj


def split_target(target: str) -> tuple[str, list[str]]:
    if ":" not in target:
        raise PatchError(f"target {target!r} must look like 'package.module:Attr.path'")
    module, _, qual = target.partition(":")
    return module, qual.split(".")


def resolve_owner(target: str) -> tuple[Any, str]:
    """Import the module and walk to the object that owns the last attribute."""
    module_name, parts = split_target(target)
    try:
        owner: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - report any import failure as unresolvable
        raise PatchError(f"{target}: cannot import {module_name}: {type(exc).__name__}: {exc}") from None
    for part in parts[:-1]:
        try:
            owner = getattr(owner, part)
        except AttributeError:
            raise PatchError(f"{target}: {part!r} not found") from None
    return owner, parts[-1]


_MISSING = object()


def source_drift(mirrored: dict, *, text: Optional[dict] = None, allow: Iterable[str] = ()) -> list[str]:
    """``"target (expected X, found Y)"`` for every read-only stock source a feature reproduces whose
    fingerprint changed: ``mirrored`` targets are fingerprinted from the live attribute, ``text``
    targets from their source text (no import). Targets named in ``allow`` (or ``"all"``) are skipped."""
    allow = set(allow)
    text = text or {}
    drifted = []
    for target, expected in list(mirrored.items()) + list(text.items()):
        if "all" in allow or target in allow:
            continue
        try:
            if target in text:
                found = source_text_fingerprint(target)
            else:
                owner, attr = resolve_owner(target)
                found = fingerprint_source(raw_attr(owner, attr))
        except PatchError as exc:
            found = f"unreadable: {exc}"
        if found != expected:
            drifted.append(f"{target} (expected {expected}, found {found})")
    return drifted


def raw_attr(owner: Any, name: str) -> Any:
    """The attribute as stored (keeps staticmethod/classmethod), or _MISSING."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in klass.__dict__:
                return klass.__dict__[name] if klass is owner else _Inherited(klass.__dict__[name])
        return _MISSING
    return getattr(owner, name, _MISSING)


@dataclass(frozen=True)
class _Inherited:
    value: Any


def wrapped_chain(obj: Any, limit: int = 64) -> Iterable[Any]:
    """obj, obj.__wrapped__, ... (through staticmethod/classmethod/functools.partial)."""
    seen = 0
    while obj is not None and seen < limit:
        yield obj
        obj = unwrap_descriptor(obj)
        yield obj
        nxt = getattr(obj, "__wrapped__", None)
        if nxt is None and isinstance(obj, functools.partial):
            nxt = obj.func
        obj = nxt
        seen += 1


@dataclass(eq=False)
class Patch:
    """One declared hook into stock SGLang.

    ``build`` receives the stock object (``None`` for ROUTE/ATTRIBUTE kinds) and returns the
    replacement. For WRAP the replacement must call the stock object; ``apply`` sets
    ``__wrapped__`` on it so the verifier can find our wrapper under others.
    """

    feature: str
    target: str
    kind: Kind
    roles: frozenset
    build: Callable[[Any], Any]
    fingerprint: Optional[str]
    why: str
    retire_when: str
    versions: str = SUPPORTED_SGLANG
    # module-level functions imported elsewhere with ``from m import f``: re-point those too
    propagate: bool = True
    # the target's module loads a CUDA extension when imported: on a host without CUDA the patch
    # cannot be applied (its feature is unavailable there) and is verified from its source text
    requires_cuda: bool = False

    # runtime state
    applied: bool = field(default=False, init=False)
    replacement: Any = field(default=None, init=False)
    found_fingerprint: Optional[str] = field(default=None, init=False)
    drift_allowed: bool = field(default=False, init=False)
    _original: Any = field(default=_MISSING, init=False)
    _owner: Any = field(default=None, init=False)
    _attr: str = field(default="", init=False)
    _rebound: list = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.roles = frozenset(Role(r) for r in self.roles)
        if self.kind in (Kind.WRAP, Kind.REPLACE) and not self.fingerprint:
            raise PatchError(f"{self.target}: wrap/replace patches must declare a fingerprint")

    # -- inspection -------------------------------------------------------------------------
    @property
    def key(self) -> str:
        return self.target

    def stock_object(self) -> Any:
        owner, attr = resolve_owner(self.target)
        raw = raw_attr(owner, attr)
        if isinstance(raw, _Inherited):
            raw = raw.value
        if raw is _MISSING:
            raise PatchError(f"{self.target}: attribute {attr!r} does not exist")
        # if already patched by us, report the stock object underneath
        if self.applied and self._original is not _MISSING:
            return self._original
        return raw

    def _live_fingerprint(self, raw: Any) -> str:
        """Fingerprint of the live object; a live object without readable source is not stock
        SGLang's (stock functions are plain Python with source): say so, and what to do."""
        try:
            return fingerprint_source(raw)
        except PatchError as exc:
            func = unwrap_descriptor(raw)
            module = getattr(func, "__module__", None) or "?"
            name = getattr(func, "__qualname__", None) or type(func).__name__
            expected_module = self.target.partition(":")[0]
            origin = (
                f"defined in {module!r}, not in {expected_module!r}"
                if module != expected_module
                else f"its source cannot be read ({str(exc).rsplit(': ', 1)[-1]})"
            )
            raise PatchError(
                f"{self.target}: the live object is not the stock SGLang one: it is {name} ({type(func).__name__}, "
                f"{origin}), so its source cannot be fingerprinted. dspark-harden expected the stock source with "
                f"fingerprint {self.fingerprint} (sglang {self.versions}). Something replaced this attribute before "
                f"dspark-harden bound (another SGLANG_PLUGINS plugin or HookRegistry hook, or a monkeypatch in the "
                f"launching code). Remove that replacement, or disable feature {self.feature!r}; "
                f"DSPARK_HARDEN_ALLOW_DRIFT does not apply to an object without source."
            ) from None

    # -- apply / revert ---------------------------------------------------------------------
    def apply(self, allow_drift: bool = False) -> None:
        if self.applied:
            return
        owner, attr = resolve_owner(self.target)
        raw = raw_attr(owner, attr)
        inherited = isinstance(raw, _Inherited)
        if inherited:
            raw = raw.value
        if self.kind in (Kind.WRAP, Kind.REPLACE):
            if raw is _MISSING:
                raise PatchError(f"{self.target}: attribute {attr!r} does not exist in this SGLang")
            self.found_fingerprint = self._live_fingerprint(raw)
            if self.found_fingerprint != self.fingerprint:
                if not allow_drift:
                    raise PatchError(
                        f"{self.target}: stock source drifted: expected fingerprint {self.fingerprint}, "
                        f"found {self.found_fingerprint}"
                    )
                self.drift_allowed = True
            replacement = self.build(raw)
            self._stamp(replacement, raw)
        elif self.kind is Kind.ATTRIBUTE:
            if raw is not _MISSING:
                raise PatchError(f"{self.target}: attribute {attr!r} already exists (stock or another plugin)")
            replacement = self.build(None)
            self._stamp(replacement, None)
        else:  # ROUTE handled by RoutePatch
            raise PatchError(f"{self.target}: kind {self.kind} needs RoutePatch")
        self._owner, self._attr = owner, attr
        self._original = _MISSING if (raw is _MISSING or inherited) else raw
        self.replacement = replacement
        setattr(owner, attr, replacement)
        if self.propagate and not isinstance(owner, type) and raw is not _MISSING:
            self._rebind_imports(raw, replacement)
        self.applied = True

    def revert(self) -> None:
        if not self.applied:
            return
        for module, name, old in reversed(self._rebound):
            setattr(module, name, old)
        self._rebound.clear()
        if self._original is _MISSING:
            try:
                delattr(self._owner, self._attr)
            except AttributeError:
                pass
        else:
            setattr(self._owner, self._attr, self._original)
        self.applied = False
        self.replacement = None

    def _stamp(self, replacement: Any, original: Any) -> None:
        func = unwrap_descriptor(replacement)
        try:
            if original is not None and self.kind is Kind.WRAP:
                func.__wrapped__ = unwrap_descriptor(original)
            func.__dspark_patch__ = self.target
        except (AttributeError, TypeError):
            pass  # e.g. builtins; verification then relies on identity only

    def _rebind_imports(self, old: Any, new: Any) -> None:
        for module in list(sys.modules.values()):
            mdict = getattr(module, "__dict__", None)
            if not mdict or module is self._owner:
                continue
            for name, value in list(mdict.items()):
                if value is old:
                    setattr(module, name, new)
                    self._rebound.append((module, name, old))

    # -- verification -----------------------------------------------------------------------
    def _resolve_for_check(self) -> tuple:
        if not self.applied:
            return None, "", "not applied"
        try:
            owner, attr = resolve_owner(self.target)
        except PatchError as exc:
            return None, "", str(exc)
        return owner, attr, None

    def live_check(self) -> Optional[str]:
        """None when our replacement is live at the target (possibly under other wrappers)."""
        owner, attr, problem = self._resolve_for_check()
        if problem:
            return problem
        raw = raw_attr(owner, attr)
        if isinstance(raw, _Inherited):
            raw = raw.value
        if raw is _MISSING:
            return "attribute disappeared"
        ours = unwrap_descriptor(self.replacement)
        for obj in wrapped_chain(raw):
            if obj is self.replacement or obj is ours:
                return None
            if _bypasses_wrapped(obj):
                # SGLang's HookRegistry REPLACE wrapper sets __wrapped__ but never calls it
                return (
                    f"live object is {_describe(raw)}: a HookRegistry REPLACE hook of another plugin "
                    f"bypasses our {self.kind.value} (replaced by another plugin)"
                )
        return f"live object is {_describe(raw)}, not our {self.kind.value} (replaced by another plugin?)"


def resolve_app(target: str, needs: str, what: str) -> Any:
    """The app object a route/middleware patch adds to (``target`` = ``module:app``): it must have
    ``needs``; a middleware cannot be added once the app built its middleware stack."""
    owner, attr = resolve_owner(target)
    app = getattr(owner, attr, None)
    if app is None or not hasattr(app, needs):
        raise PatchError(f"{target}: not {what}")
    return app


@dataclass(eq=False)
class RoutePatch(Patch):
    """A new HTTP route on a FastAPI app object (``target`` = ``module:app``)."""

    path: str = ""
    methods: tuple = ("GET",)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.kind = Kind.ROUTE

    @property
    def key(self) -> str:
        return f"{self.target}{self.path}"

    def _routes(self, app: Any) -> list:
        return [r for r in app.router.routes if getattr(r, "path", None) == self.path]

    def apply(self, allow_drift: bool = False) -> None:
        if self.applied:
            return
        app = resolve_app(self.target, "router", "a FastAPI app")
        if self._routes(app):
            raise PatchError(f"{self.target}: route {self.path} already exists")
        endpoint = self.build(None)
        endpoint.__dspark_patch__ = self.key
        app.add_api_route(self.path, endpoint, methods=list(self.methods))
        self._owner, self._attr = app, self.path
        self.replacement = endpoint
        self.applied = True

    def revert(self) -> None:
        if not self.applied:
            return
        app = self._owner
        app.router.routes[:] = [r for r in app.router.routes if getattr(r, "endpoint", None) is not self.replacement]
        self.applied = False
        self.replacement = None

    def live_check(self) -> Optional[str]:
        owner, attr, problem = self._resolve_for_check()
        if problem:
            return problem
        app = getattr(owner, attr, None)
        routes = self._routes(app) if app is not None else []
        ours = [r for r in routes if getattr(r, "endpoint", None) is self.replacement]
        if len(routes) != 1 or len(ours) != 1:
            return f"expected exactly our one route at {self.path}, found {len(routes)} route(s), {len(ours)} ours"
        return None


_REPLACE_CODE: Any = None


def _bypasses_wrapped(obj: Any) -> bool:
    """True for SGLang HookRegistry REPLACE wrappers: they carry ``__wrapped__`` without calling it."""
    global _REPLACE_CODE
    if _REPLACE_CODE is None:
        try:
            from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

            _REPLACE_CODE = _wrap_fn(lambda: None, lambda: None, HookType.REPLACE).__code__
        except Exception:  # noqa: BLE001 - no SGLang hook registry: nothing to detect
            _REPLACE_CODE = False
    return bool(_REPLACE_CODE) and getattr(obj, "__code__", None) is _REPLACE_CODE


def _describe(obj: Any) -> str:
    obj = unwrap_descriptor(obj)
    mod = getattr(obj, "__module__", "?")
    name = getattr(obj, "__qualname__", type(obj).__name__)
    return f"{mod}.{name}"
