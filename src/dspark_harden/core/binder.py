"""Bind every enabled patch for this process role, then verify it fail-closed.

SGLang's loader swallows every ``Exception`` raised by a plugin or a hook. We therefore verify the
live attributes ourselves — once right after binding and again after SGLang's own
``HookRegistry.apply_hooks()`` (so another plugin replacing one of our targets is caught) — and
abort with :class:`BindError`, a ``SystemExit`` subclass that ``except Exception`` cannot swallow.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn, Optional

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from . import feature as F
from . import metrics
from .manager import ExtensionError, all_features, make_manager, settings_for, strict_extensions_from_env
from .patch import Patch, PatchError, Role
from .settings import Settings, SettingsError

logger = logging.getLogger("dspark_harden")


class BindError(SystemExit):
    """Startup refused: an enabled hardening could not be bound or verified.

    Derives from ``SystemExit`` (a ``BaseException``) so SGLang's ``except Exception`` around
    plugin loading cannot swallow it; the process exits non-zero with this message.
    """

    def __init__(self, message: str, report: Optional["BindReport"] = None):
        super().__init__(message)
        self.message = message
        self.report = report

    def __str__(self) -> str:
        return self.message


def refuse(report: Any, role: Any, feature: str, problem: str, status: Any = None) -> NoReturn:
    """Stop this process's start-up in a ``dspark_process_bound`` hook: ``[feature] problem``, the feature's
    status (when given) marked failed with ``problem`` so ``check`` and the report say why."""
    if status is not None:
        status.status, status.detail = "failed", problem
    raise BindError(f"dspark-harden refuses to start ({role.value}): [{feature}] {problem}", report)


@dataclass
class TargetStatus:
    target: str
    role: str
    bound: bool
    detail: str


@dataclass
class FeatureStatus:
    name: str
    area: str
    status: str
    detail: str = ""
    switch: Optional[str] = None
    default_on: bool = True
    targets: list = field(default_factory=list)
    test_only: bool = False


@dataclass
class BindReport:
    role: str
    sglang_version: str
    features: list = field(default_factory=list)
    errors: list = field(default_factory=list)  # problems not tied to one feature (settings, extensions)
    # SGLang outside the supported range: the one line (version, range, how many targets changed) that
    # opens the refusal and `check`, before the per-target detail (core.porting.version_verdict)
    verdict: Optional[str] = None

    @property
    def ok(self) -> bool:
        return not self.errors and all(f.status != F.FAILED for f in self.features)

    def failures(self) -> list[str]:
        out = list(self.errors)
        for feat in self.features:
            if feat.status != F.FAILED:
                continue
            bad = [t for t in feat.targets if not t.bound]
            if bad:
                out.extend(f"[{feat.name}] {t.target} ({t.role}): {t.detail}" for t in bad)
            else:
                out.append(f"[{feat.name}] {feat.detail}")
        return out

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "role": self.role,
            "sglang_version": self.sglang_version,
            "verdict": self.verdict,
            "errors": list(self.errors),
            "features": [asdict(f) for f in self.features],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _version_problem(patch: Patch, installed: str, changed: Optional[set] = None) -> Optional[str]:
    try:
        spec = SpecifierSet(patch.versions)
    except InvalidSpecifier:
        return f"invalid version range {patch.versions!r}"
    try:
        if Version(installed) in spec:
            return None
    except Exception:  # noqa: BLE001 - "not installed" and similar
        pass
    source = ""
    if changed is not None and patch.fingerprint:
        source = "; its stock source changed" if patch.target in changed else "; its stock source is unchanged"
    return f"sglang {installed} is outside the range this patch was written for ({patch.versions}){source}"


class _ProcessState:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.report: Optional[BindReport] = None
        self.patches: list[Patch] = []
        self.settings: Optional[Settings] = None
        self.pm: Any = None
        self.default_pm: Any = None  # hooks() outside a bound process


STATE = _ProcessState()


def hooks() -> Any:
    """The hook relay of the plugin manager this process bound with (``pm.hook``), else of a
    default manager built for the call (a process that never bound: a tool, a test worker). How a
    feature asks another feature for something without importing it."""
    pm = STATE.pm
    if pm is None:
        with STATE.lock:
            if STATE.default_pm is None:
                STATE.default_pm = make_manager(strict_extensions=strict_extensions_from_env())
            pm = STATE.default_pm
    return pm.hook


def bind(role: Role, *, environ: Optional[dict] = None, pm: Any = None) -> BindReport:
    """Bind and verify for ``role``. Never raises for binding problems: they land in the report."""
    report = BindReport(role=role.value, sglang_version=sglang_version())
    try:
        if pm is None:
            pm = make_manager(strict_extensions=strict_extensions_from_env(environ))
        settings = settings_for(pm, environ)
        features = all_features(pm)
        metrics.use(metrics.collect(pm, [f.name for f in features]))
    except (SettingsError, ExtensionError, metrics.MetricsError) as exc:
        report.errors.append(str(exc))
        return report
    except Exception as exc:  # noqa: BLE001 - e.g. pluggy's check_pending
        report.errors.append(f"plugin manager: {type(exc).__name__}: {exc}")
        return report

    by_name: dict[str, FeatureStatus] = {}
    active: set[str] = set()
    for feat in features:
        if feat.roles is not None and role not in feat.roles:
            continue
        st = FeatureStatus(
            name=feat.name,
            area=feat.area,
            status=F.BOUND,
            switch=feat.switch,
            default_on=feat.default_on,
            test_only=feat.test_only,
        )
        by_name[feat.name] = st
        report.features.append(st)
        if feat.upstream_probe is not None:
            try:
                present, detail = feat.upstream_probe()
            except Exception as exc:  # noqa: BLE001
                present, detail = False, f"probe raised {type(exc).__name__}: {exc}"
            st.status = F.UPSTREAM if present else F.FAILED
            st.detail = detail if present else f"expected upstream behaviour missing: {detail}"
            continue
        if not feat.enabled(settings):
            st.status, st.detail = F.DISABLED, f"{feat.switch}=0" if feat.switch else "disabled"
            continue
        reason = feat.unavailable_reason(settings)
        if reason:
            if feat.explicitly_enabled(settings):
                st.status, st.detail = F.FAILED, f"enabled by {feat.switch}=1 but unavailable: {reason}"
            else:
                st.status, st.detail = F.UNAVAILABLE, reason
            continue
        active.add(feat.name)

    try:
        groups = pm.hook.dspark_patches(role=role, settings=settings)
    except Exception as exc:  # noqa: BLE001
        report.errors.append(f"collecting patches failed: {type(exc).__name__}: {exc}")
        return report
    patches = [p for group in groups for p in (group or []) if role in p.roles]

    allow = settings["DSPARK_HARDEN_ALLOW_DRIFT"]
    installed = report.sglang_version
    changed = _out_of_range_verdict(report, pm)
    bound: list[Patch] = []
    for patch in patches:
        st = by_name.get(patch.feature)
        if st is None:
            report.errors.append(f"patch {patch.key} names unknown feature {patch.feature!r}")
            continue
        if patch.feature not in active:
            continue  # a plugin returned a patch for a disabled feature: never bind it
        problem = _version_problem(patch, installed, changed)
        if problem is None:
            try:
                patch.apply(allow_drift=("all" in allow or patch.target in allow))
                if patch.drift_allowed:
                    logger.warning(
                        "dspark-harden: %s bound DESPITE source drift (expected %s, found %s) because "
                        "DSPARK_HARDEN_ALLOW_DRIFT allows it",
                        patch.target,
                        patch.fingerprint,
                        patch.found_fingerprint,
                    )
                bound.append(patch)
            except PatchError as exc:
                problem = str(exc)
            except Exception as exc:  # noqa: BLE001
                problem = f"{patch.key}: {type(exc).__name__}: {exc}"
        st.targets.append(TargetStatus(patch.key, role.value, problem is None, problem or _bound_detail(patch)))

    with STATE.lock:
        STATE.patches.extend(bound)
        STATE.settings, STATE.pm, STATE.report = settings, pm, report
    verify(report)
    return report


def _out_of_range_verdict(report: BindReport, pm: Any) -> Optional[set]:
    """For an SGLang outside the supported range: set ``report.verdict`` (logged now, and the first line
    of the refusal) and return the targets whose stock source changed; ``None`` when in range."""
    from . import porting

    if porting.in_supported_range(report.sglang_version):
        return None
    try:
        verdict = porting.version_verdict(pm)
    except Exception as exc:  # noqa: BLE001 - the verdict is a summary: never hide the per-target detail
        verdict = {
            "line": f"sglang {report.sglang_version} is outside the supported range "
            f"{porting.SUPPORTED_SGLANG} (counting changed targets failed: {type(exc).__name__}: {exc})",
            "changed_targets": None,
        }
    if verdict is None:
        return None
    report.verdict = verdict["line"]
    logger.warning("dspark-harden: %s", report.verdict)
    return set(verdict["changed_targets"]) if verdict["changed_targets"] is not None else None


def _bound_detail(patch: Patch) -> str:
    if patch.fingerprint:
        suffix = " (drift allowed by operator)" if patch.drift_allowed else ""
        return f"{patch.kind.value}, fingerprint {patch.found_fingerprint or patch.fingerprint}{suffix}"
    return patch.kind.value


def verify(report: Optional[BindReport] = None) -> BindReport:
    """Re-check every bound patch's live attribute; mark features failed where it is not ours."""
    report = report or STATE.report
    if report is None:
        raise RuntimeError("dspark-harden: verify() before bind()")
    by_key = {p.key: p for p in STATE.patches}
    for feat in report.features:
        if feat.status not in (F.BOUND, F.FAILED) or not feat.targets:
            continue
        for t in feat.targets:
            patch = by_key.get(t.target)
            if patch is None:
                continue
            problem = patch.live_check()
            if problem:
                t.bound, t.detail = False, problem
        if any(not t.bound for t in feat.targets):
            feat.status = F.FAILED
            feat.detail = "one or more targets did not bind"
    return report


def raise_if_failed(report: BindReport) -> None:
    if report.ok:
        return
    lines = report.failures()
    message = (
        (f"{report.verdict}\n" if report.verdict else "")
        + f"dspark-harden refuses to start ({report.role} process, sglang {report.sglang_version}): "
        f"{len(lines)} problem(s):\n  - " + "\n  - ".join(lines)
    )
    logger.critical(message)
    raise BindError(message, report)


def revert_all() -> None:
    """Revert every bound patch of this process in reverse order (tests, `check`)."""
    with STATE.lock:
        for patch in reversed(STATE.patches):
            patch.revert()
        STATE.patches.clear()
        STATE.report = None
