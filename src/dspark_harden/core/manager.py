"""The pluggy plugin manager: built-in features plus third-party ones from our entry-point group."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from typing import Optional

import pluggy

from . import hookspecs
from .feature import Feature
from .settings import CORE_SETTINGS, Setting, Settings, SettingsError, load_settings

logger = logging.getLogger("dspark_harden")

EXTENSION_GROUP = "dspark_harden.features"

# One module per hardened area; each owns its patches, settings and CLI additions.
BUILTIN_FEATURE_MODULES: list[str] = [
    "dspark_harden.upstream",
    "dspark_harden.observability.feature",
    "dspark_harden.ingress.feature",
    "dspark_harden.health.feature",
    "dspark_harden.grammar.feature",
    "dspark_harden.dp2.feature",
    "dspark_harden.dspark_masks.feature",
    "dspark_harden.dspark_results.feature",
    "dspark_harden.prefill_graph.feature",
    "dspark_harden.prefill_graph.draft_graph",
    "dspark_harden.dsv4_memory.feature",
    "dspark_harden.lifecycle.feature",
]


class ExtensionError(Exception):
    """A third-party feature failed to load."""


def make_manager(
    *, load_extensions: bool = True, strict_extensions: Optional[bool] = None, extra: tuple = ()
) -> pluggy.PluginManager:
    """Built-in features, then third-party ones (entry-point group ``dspark_harden.features``),
    then ``extra`` plugin objects (tests); ``check_pending()`` rejects misspelled hook names.
    ``strict_extensions`` ``None``: DSPARK_HARDEN_STRICT_EXTENSIONS from the environment (strict when unset
    or invalid: binding reports an invalid value itself, naming it)."""
    if strict_extensions is None:
        try:
            strict_extensions = strict_extensions_from_env() if load_extensions else True
        except SettingsError:
            strict_extensions = True
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in BUILTIN_FEATURE_MODULES:
        pm.register(importlib.import_module(name), name=name)
    for plugin in extra:
        pm.register(plugin)
    if load_extensions:
        _load_extensions(pm, strict=strict_extensions)
    pm.check_pending()
    return pm


def _load_extensions(pm: pluggy.PluginManager, *, strict: bool) -> None:
    for ep in importlib.metadata.entry_points(group=EXTENSION_GROUP):
        if pm.get_plugin(ep.name) is not None:
            continue
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
        except Exception as exc:  # noqa: BLE001
            msg = f"third-party dspark-harden feature {ep.name!r} ({ep.value}) failed to load: {type(exc).__name__}: {exc}"
            if strict:
                raise ExtensionError(msg) from exc
            logger.error("%s (skipped: DSPARK_HARDEN_STRICT_EXTENSIONS=0)", msg)


def all_setting_specs(pm: pluggy.PluginManager) -> list[Setting]:
    specs: list[Setting] = list(CORE_SETTINGS)
    for group in pm.hook.dspark_settings():
        specs.extend(group or [])
    return specs


def all_features(pm: pluggy.PluginManager) -> list[Feature]:
    features: list[Feature] = []
    seen: dict[str, Feature] = {}
    for group in pm.hook.dspark_features():
        for feat in group or []:
            if feat.name in seen:
                raise ExtensionError(f"feature name {feat.name!r} is contributed twice")
            seen[feat.name] = feat
            features.append(feat)
    return features


def strict_extensions_from_env(environ: Optional[dict] = None) -> bool:
    """Parse DSPARK_HARDEN_STRICT_EXTENSIONS before the full settings exist (extensions may add settings)."""
    only = [s for s in CORE_SETTINGS if s.name == "DSPARK_HARDEN_STRICT_EXTENSIONS"]
    return bool(load_settings(only, environ)["DSPARK_HARDEN_STRICT_EXTENSIONS"])


def settings_for(pm: pluggy.PluginManager, environ: Optional[dict] = None) -> Settings:
    return load_settings(all_setting_specs(pm), environ)


def feature_settings(pm: pluggy.PluginManager, feature: str, environ: Optional[dict] = None) -> Settings:
    """The core settings plus those of one feature, parsed strictly. For a feature's own CLI and
    bench modules, which reach their feature through the hooks instead of importing its module."""
    specs = [s for s in all_setting_specs(pm) if s.feature in (None, feature)]
    return load_settings(specs, environ)


def feature_patches(pm: pluggy.PluginManager, feature: str, role, settings: Settings) -> list:
    """The patches of one feature for ``role``, from the ``dspark_patches`` hook of the plugin(s)
    that contribute it (other plugins are not asked: ``settings`` may hold only this feature's)."""
    owners = {
        impl.plugin_name
        for impl in pm.hook.dspark_features.get_hookimpls()
        if any(f.name == feature for f in impl.function() or [])
    }
    if not owners:
        raise ExtensionError(f"no plugin contributes feature {feature!r}")
    out = []
    for impl in pm.hook.dspark_patches.get_hookimpls():
        if impl.plugin_name in owners:
            out += [
                p for p in impl.function(role=role, settings=settings) or [] if p.feature == feature and role in p.roles
            ]
    return out
