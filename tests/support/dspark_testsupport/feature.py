"""A test-only dspark-harden feature, registered through the third-party entry-point group
``dspark_harden.features`` (exactly how an external package would extend dspark-harden).

Inert unless ``DSPARK_TESTFEATURE=1``. When on, it binds one harmless WRAP patch in the main and
scheduler processes: ``SamplingParams.verify`` (the tokenizer manager calls it for every request;
in the scheduler the module is loaded and the patch is bound and verified, but not called). The
wrapper counts calls (:data:`CALLS` and its own metric family ``dspark_harden_testfeature_verify_calls_total``,
declared through the ``dspark_metrics`` hook like a built-in feature's) and otherwise returns exactly what
the stock method returns or raises.

``DSPARK_TESTFEATURE_BREAK`` breaks it on purpose, to prove that startup fails closed:

- ``drift``: the patch declares a wrong fingerprint (the stock source "drifted");
- ``missing``: the patch targets an attribute that does not exist in SGLang;
- ``replaced``: this module also registers, through SGLang's own ``HookRegistry``, a REPLACE hook
  on the same target under another plugin name; SGLang's ``apply_hooks()`` installs it after
  dspark-harden bound, so our wrapper is no longer called (the post-apply verifier must notice).

``DSPARK_TEST_CPU_PLATFORM`` (read by :mod:`dspark_testsupport.cpu_platform`, not by this feature)
is declared here too so ``dspark-harden env`` lists it.
"""

from __future__ import annotations

import threading

from dspark_harden.core import metrics
from dspark_harden.core.feature import Feature
from dspark_harden.core.hookspecs import hookimpl
from dspark_harden.core.patch import Kind, Patch, Role
from dspark_harden.core.settings import Setting, flag01

from . import PLATFORM_ENV

FEATURE = "testfeature"
SWITCH = "DSPARK_TESTFEATURE"
BREAK = "DSPARK_TESTFEATURE_BREAK"
BREAK_MODES = ("", "drift", "missing", "replaced")

TARGET = "sglang.srt.sampling.sampling_params:SamplingParams.verify"
#: fingerprint_source(SamplingParams.verify) in sglang 0.5.23
FINGERPRINT = "269829a259903b0a"
WRONG_FINGERPRINT = "0000000000000000"
MISSING_TARGET = "sglang.srt.sampling.sampling_params:SamplingParams.dspark_testfeature_no_such_method"
ROGUE_PLUGIN = "dspark_testfeature_rogue"

ROLES = frozenset({Role.MAIN, Role.SCHEDULER})

#: the test feature's own metric family, declared through the dspark_metrics hook like a built-in's
CALLS_METRIC = "dspark_harden_testfeature_verify_calls_total"
METRICS = (
    metrics.Family(
        CALLS_METRIC,
        "counter",
        "TEST ONLY: SamplingParams.verify calls through the test feature's wrapper, by process role.",
        labels=("role",),
        feature=FEATURE,
        roles=("main", "scheduler"),
        precreate=(("main",), ("scheduler",)),
        aggregation="sum by (role) (increase(...)); test support only",
    ),
)

#: calls through our wrapper in this process
CALLS = 0
_calls_lock = threading.Lock()
_rogue_registered = False


def parse_break(raw: str) -> str:
    """one of: '' (not broken), drift, missing, replaced"""
    if raw not in BREAK_MODES:
        raise ValueError(f"must be one of '', drift, missing, replaced; got {raw!r}")
    return raw


parse_break.bad_examples = ("bogus", "DRIFT", " drift", "drift ", "none")


@hookimpl
def dspark_features():
    return [
        Feature(
            name=FEATURE,
            area="test",
            description="TEST ONLY: harmless wrap of SamplingParams.verify (breakable via DSPARK_TESTFEATURE_BREAK)",
            switch=SWITCH,
            default_on=False,
            roles=ROLES,
            test_only=True,
        )
    ] + _fault_features()


@hookimpl
def dspark_settings():
    return _fault_settings() + [
        Setting(
            SWITCH,
            flag01,
            False,
            "TEST ONLY (dspark-testsupport): 1 binds the test feature's harmless wrap of "
            "SamplingParams.verify in the main and scheduler processes.",
            feature=FEATURE,
        ),
        Setting(
            BREAK,
            parse_break,
            "",
            "TEST ONLY: break the test feature on purpose so startup must fail closed: 'drift' (wrong "
            "fingerprint), 'missing' (target does not exist), 'replaced' (another plugin REPLACEs the target "
            "through SGLang's HookRegistry after we bound). Empty: not broken.",
            feature=FEATURE,
            accepts="'', drift, missing, replaced",
        ),
        Setting(
            PLATFORM_ENV,
            flag01,
            False,
            "TEST ONLY (dspark-testsupport): 1 activates the out-of-tree CPU platform 'dspark_test_cpu' for "
            "SGLang (also set SGLANG_PLATFORM=dspark_test_cpu). Read by the platform, not by the plugin.",
            feature=None,
        ),
    ]


@hookimpl
def dspark_metrics():
    return list(METRICS)


def _count_call() -> None:
    try:
        from dspark_harden.core import roles

        role = roles.CONTEXT.role.value if roles.CONTEXT is not None else "main"
        metrics.get(CALLS_METRIC).labels(role).inc()
    except Exception:  # noqa: BLE001 - a metric must never fail the wrapped call
        pass


def _wrap_verify(stock):
    def verify(self, *args, **kwargs):
        global CALLS
        with _calls_lock:
            CALLS += 1
        _count_call()
        return stock(self, *args, **kwargs)

    verify.__name__ = stock.__name__
    verify.__qualname__ = stock.__qualname__
    verify.__doc__ = stock.__doc__
    return verify


def _register_rogue_replace() -> None:
    """Another "plugin" REPLACEs our target through SGLang's HookRegistry (applied after we bind)."""
    global _rogue_registered
    if _rogue_registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType
    from sglang.srt.sampling.sampling_params import SamplingParams

    stock = SamplingParams.__dict__["verify"]

    def rogue_verify(self, *args, **kwargs):
        return stock(self, *args, **kwargs)  # bypasses dspark-harden's wrapper

    module, _, qual = TARGET.partition(":")
    HookRegistry.register(
        f"{module}.{qual}",
        rogue_verify,
        HookType.REPLACE,
        source=HookSource(plugin_name=ROGUE_PLUGIN, dist_name="dspark-testsupport"),
    )
    _rogue_registered = True


@hookimpl
def dspark_patches(role, settings):
    faults = _fault_patches(role, settings)
    if not settings[SWITCH] or role not in ROLES:
        return faults
    mode = settings[BREAK]
    target, fingerprint = TARGET, FINGERPRINT
    if mode == "drift":
        fingerprint = WRONG_FINGERPRINT
    elif mode == "missing":
        target = MISSING_TARGET
    elif mode == "replaced":
        _register_rogue_replace()
    return [
        Patch(
            feature=FEATURE,
            target=target,
            kind=Kind.WRAP,
            roles=ROLES,
            build=_wrap_verify,
            fingerprint=fingerprint,
            why="TEST ONLY: exercises binding, verification and fail-closed startup in a real server",
            retire_when="never (test support)",
        )
    ] + faults


# -- fault injection (lifecycle drills, issue 14) ------------------------------------------------
# DSPARK_TESTFAULT_SCHEDULER_DP_RANK=N binds, in schedulers only, a wrap of
# Scheduler.handle_generate_request that raises a RuntimeError inside DP rank N's event loop when a
# request's rid starts with FAULT_RID_PREFIX: a real Python exception on the real scheduler thread,
# to drill how the server surfaces a scheduler failure. Other ranks and other rids are untouched.

FAULT_FEATURE = "testfault"
FAULT_SWITCH = "DSPARK_TESTFAULT_SCHEDULER_DP_RANK"
FAULT_RID_PREFIX = "dspark-testfault-"
FAULT_TARGET = "sglang.srt.managers.scheduler:Scheduler.handle_generate_request"
#: fingerprint_source(Scheduler.handle_generate_request) in sglang 0.5.23
FAULT_FINGERPRINT = "d247ea868856f196"


def parse_fault_rank(raw: str):
    """a DP rank >= 1 (the value is also the feature's switch, so rank 0 cannot be chosen)"""
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise ValueError(f"must be a DP rank >= 1, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"must be a DP rank >= 1, got {raw!r}")
    return value


parse_fault_rank.bad_examples = ("", "0", "-1", "x", "1.5")


def _wrap_generate(dp_rank: int):
    def builder(stock):
        def handle_generate_request(self, recv_req, *args, **kwargs):
            from dspark_harden.core import roles

            ctx = roles.CONTEXT
            rid = str(getattr(recv_req, "rid", "") or "")
            if rid.startswith(FAULT_RID_PREFIX) and ctx is not None and ctx.dp_rank == dp_rank:
                raise RuntimeError(f"dspark-testsupport injected fault in DP rank {dp_rank} (request {rid})")
            return stock(self, recv_req, *args, **kwargs)

        return handle_generate_request

    return builder


def _fault_features():
    return [
        Feature(
            name=FAULT_FEATURE,
            area="test",
            description="TEST ONLY: raise in one DP rank's scheduler loop for requests with a marked rid",
            switch=FAULT_SWITCH,
            default_on=False,
            roles=frozenset({Role.SCHEDULER}),
            test_only=True,
        )
    ]


def _fault_settings():
    return [
        Setting(
            FAULT_SWITCH,
            parse_fault_rank,
            None,
            f"TEST ONLY (dspark-testsupport): the DP rank whose scheduler raises RuntimeError for a request "
            f"whose rid starts with {FAULT_RID_PREFIX!r} (a real exception in its event loop). Unset: off.",
            feature=FAULT_FEATURE,
            accepts="DP rank >= 1",
        )
    ]


def _fault_patches(role, settings):
    rank = settings[FAULT_SWITCH]
    if rank is None or role is not Role.SCHEDULER:
        return []
    return [
        Patch(
            feature=FAULT_FEATURE,
            target=FAULT_TARGET,
            kind=Kind.WRAP,
            roles={Role.SCHEDULER},
            build=_wrap_generate(rank),
            fingerprint=FAULT_FINGERPRINT,
            why="TEST ONLY: a real exception in a scheduler's event loop for the lifecycle drills",
            retire_when="never (test support)",
        )
    ]
