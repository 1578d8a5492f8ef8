"""Patch objects against real SGLang 0.5.23 targets: apply/revert round trips, drift, missing and
replaced targets. Every test that binds runs in a forked child so no patch leaks."""

from __future__ import annotations

import logging

import pytest

# import the SGLang modules once in the parent: forked tests then start warm
import sglang.srt.managers.data_parallel_controller  # noqa: F401,E402
import sglang.srt.plugins.hook_registry  # noqa: F401,E402

from dspark_harden.cli.ledger import patch_rows
from dspark_harden.core import binder
from dspark_harden.core.feature import Feature
from dspark_harden.core.hookspecs import hookimpl
from dspark_harden.core.manager import make_manager
from dspark_harden.core.patch import Kind, Patch, PatchError, Role, fingerprint_source, raw_attr

TARGET = "sglang.srt.managers.data_parallel_controller:DataParallelController.refresh_load_budget"
FUNC_TARGET = "sglang.srt.utils.common:get_bool_env_var"


def _stock(target):
    from dspark_harden.core.patch import resolve_owner

    owner, attr = resolve_owner(target)
    return owner, attr, raw_attr(owner, attr)


def _wrap_patch(target=TARGET, fingerprint=None, feature="t"):
    owner, attr, stock = _stock(target)

    def build(original):
        def wrapper(*a, **kw):
            return original(*a, **kw)

        return wrapper

    return Patch(
        feature=feature,
        target=target,
        kind=Kind.WRAP,
        roles={Role.CONTROLLER, Role.MAIN},
        build=build,
        fingerprint=fingerprint or fingerprint_source(stock),
        why="test",
        retire_when="never",
    )


@pytest.mark.forked
def test_round_trip_restores_exact_stock_object():
    owner, attr, stock = _stock(TARGET)
    patch = _wrap_patch()
    for _ in range(2):
        patch.apply()
        patch.apply()  # idempotent
        assert raw_attr(owner, attr) is patch.replacement
        assert patch.live_check() is None
        assert patch.replacement.__wrapped__ is stock
        patch.revert()
        patch.revert()  # idempotent
        assert raw_attr(owner, attr) is stock


@pytest.mark.forked
def test_module_function_rebinding_is_reverted():
    import sglang.srt.utils.common as common

    stock = common.get_bool_env_var
    importers = [
        m for m in __import__("sys").modules.values() if getattr(m, "__dict__", {}).get("get_bool_env_var") is stock
    ]
    assert len(importers) >= 2, "expected a `from ... import get_bool_env_var` somewhere"
    patch = _wrap_patch(FUNC_TARGET)
    patch.apply()
    assert all(m.__dict__["get_bool_env_var"] is patch.replacement for m in importers)
    patch.revert()
    assert all(m.__dict__["get_bool_env_var"] is stock for m in importers)


@pytest.mark.forked
def test_every_declared_patch_round_trips():
    """apply -> revert -> apply for every patch any feature declares (all roles)."""
    import torch

    from dspark_harden.cli.ledger import declared_patches
    from dspark_harden.core.patch import source_text_fingerprint as source_fingerprint

    patches = declared_patches(make_manager())
    for patch in patches:
        if patch.requires_cuda and not torch.cuda.is_available():
            # its module loads a CUDA extension at import: verified from the installed source text
            assert source_fingerprint(patch.target) == patch.fingerprint, patch.key
            continue
        stock = None if patch.kind in (Kind.ROUTE, Kind.ATTRIBUTE) else patch.stock_object()
        patch.apply()
        assert patch.live_check() is None, patch.key
        patch.revert()
        if stock is not None:
            assert patch.stock_object() is stock, patch.key
        patch.apply()
        assert patch.live_check() is None, patch.key
        patch.revert()
    assert len(patches) == len(patch_rows()) > 0


def test_drift_refuses_naming_target_and_fingerprints():
    patch = _wrap_patch(fingerprint="0" * 16)
    with pytest.raises(PatchError) as info:
        patch.apply()
    msg = str(info.value)
    assert TARGET in msg and "0" * 16 in msg and fingerprint_source(_stock(TARGET)[2]) in msg
    assert not patch.applied


@pytest.mark.forked
def test_replaced_target_without_source_is_explained():
    """Another party replaced the target with a function whose source cannot be read (here: built
    by eval, as from a REPL or exec'd code): the refusal says the live object is not stock, which
    fingerprint was expected and what to do, instead of a bare 'cannot read source'."""
    from sglang.srt.managers.data_parallel_controller import DataParallelController

    expected = fingerprint_source(_stock(TARGET)[2])
    DataParallelController.refresh_load_budget = eval("lambda self: None")  # noqa: S307
    patch = _wrap_patch(fingerprint=expected, feature="my-feature")
    with pytest.raises(PatchError) as info:
        patch.apply()
    msg = str(info.value)
    assert msg.startswith(TARGET + ": the live object is not the stock SGLang one")
    assert (
        "<lambda>" in msg and f"defined in {__name__!r}, not in 'sglang.srt.managers.data_parallel_controller'" in msg
    )
    assert f"fingerprint {expected}" in msg
    assert "Remove that replacement, or disable feature 'my-feature'" in msg
    assert not patch.applied
    # one that claims the stock module: the unreadable source is what gives it away
    fn = eval("lambda self: None")  # noqa: S307
    fn.__module__ = "sglang.srt.managers.data_parallel_controller"
    DataParallelController.refresh_load_budget = fn
    with pytest.raises(PatchError, match="its source cannot be read"):
        patch.apply()


def test_missing_target_refuses():
    patch = _wrap_patch()
    patch.target = TARGET + "_does_not_exist"
    with pytest.raises(PatchError, match="does not exist"):
        patch.apply()
    patch.target = "sglang.srt.no_such_module:X.y"
    with pytest.raises(PatchError, match="cannot import"):
        patch.apply()


def test_attribute_patch_refuses_existing_attribute():
    patch = Patch(
        feature="t",
        target=TARGET,
        kind=Kind.ATTRIBUTE,
        roles={Role.MAIN},
        build=lambda _: 1,
        fingerprint=None,
        why="t",
        retire_when="t",
    )
    with pytest.raises(PatchError, match="already exists"):
        patch.apply()


def test_wrap_without_fingerprint_is_rejected_at_declaration():
    with pytest.raises(PatchError, match="fingerprint"):
        Patch(
            feature="t",
            target=TARGET,
            kind=Kind.WRAP,
            roles={Role.MAIN},
            build=lambda o: o,
            fingerprint=None,
            why="t",
            retire_when="t",
        )


class _Plugin:
    """A feature contributed directly to the plugin manager (tests only)."""

    def __init__(self, patches, name="testing-feature", switch=None):
        self.patches, self.name, self.switch = patches, name, switch

    @hookimpl
    def dspark_features(self):
        return [Feature(name=self.name, area="test", description="test", switch=self.switch)]

    @hookimpl
    def dspark_patches(self, role, settings):
        return self.patches


@pytest.mark.forked
def test_bind_reports_drift_and_raise_aborts_with_systemexit():
    patch = _wrap_patch(fingerprint="f" * 16, feature="testing-feature")
    report = binder.bind(Role.CONTROLLER, pm=make_manager(extra=(_Plugin([patch]),)), environ={})
    assert not report.ok
    with pytest.raises(binder.BindError) as info:
        binder.raise_if_failed(report)
    assert isinstance(info.value, SystemExit) and not isinstance(info.value, Exception)
    assert TARGET in str(info.value) and "f" * 16 in str(info.value)


@pytest.mark.forked
def test_operator_override_binds_with_warning(caplog):
    patch = _wrap_patch(fingerprint="f" * 16, feature="testing-feature")
    with caplog.at_level(logging.WARNING, logger="dspark_harden"):
        report = binder.bind(
            Role.CONTROLLER,
            pm=make_manager(extra=(_Plugin([patch]),)),
            environ={"DSPARK_HARDEN_ALLOW_DRIFT": TARGET},
        )
    assert report.ok, report.failures()
    assert patch.applied and patch.drift_allowed
    assert any("DESPITE source drift" in r.getMessage() and TARGET in r.getMessage() for r in caplog.records)


@pytest.mark.forked
def test_replaced_by_another_plugin_after_us_aborts():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from dspark_harden import entry

    patch = _wrap_patch(feature="testing-feature")
    report = binder.bind(Role.CONTROLLER, pm=make_manager(extra=(_Plugin([patch]),)), environ={})
    assert report.ok
    entry._install_post_apply_verifier()
    dotted = TARGET.replace(":", ".")

    def other(*a, **kw):
        return None

    HookRegistry.register(dotted, other, HookType.REPLACE)
    with pytest.raises(binder.BindError) as info:
        HookRegistry.apply_hooks()
    assert TARGET in str(info.value) and "replaced by another plugin" in str(info.value)


@pytest.mark.forked
def test_version_range_mismatch_refuses():
    patch = _wrap_patch(feature="testing-feature")
    patch.versions = ">=9.0"
    report = binder.bind(Role.CONTROLLER, pm=make_manager(extra=(_Plugin([patch]),)), environ={})
    assert not report.ok
    assert any(">=9.0" in f and "0.5.23" in f for f in report.failures())
    assert not patch.applied


@pytest.mark.forked
def test_disabled_feature_binds_nothing():
    from dspark_harden.core.settings import Setting, flag01

    patch = _wrap_patch(feature="testing-feature")
    plugin = _Plugin([patch], switch="TESTING_FEATURE_SWITCH")
    plugin.dspark_settings = hookimpl(lambda: [Setting("TESTING_FEATURE_SWITCH", flag01, False, "t")])
    report = binder.bind(Role.CONTROLLER, pm=make_manager(extra=(plugin,)), environ={})
    assert report.ok and not patch.applied
    status = {f.name: f.status for f in report.features}
    assert status["testing-feature"] == "disabled"
