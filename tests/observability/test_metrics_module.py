"""The metrics module: conventions enforced at declaration, pre-creation, and SGLang's Prometheus
multiprocess mode (real prometheus_client mmap files read by a real MultiProcessCollector, each
writer a separate process, as in a server)."""

from __future__ import annotations

import pytest

from dspark_harden.core import hookspecs, metrics
from dspark_harden.core.manager import BUILTIN_FEATURE_MODULES, all_features, make_manager
from dspark_harden.observability.metrics import SCHEDULER_PHASES

from ..plugin._proc import run_py


@pytest.mark.parametrize(
    "name,kind,labels,needle",
    [
        ("sglang_x_total", "counter", (), "must start with"),
        ("dspark_harden:x_total", "counter", (), "':'"),
        ("dspark_harden_x", "counter", (), "must end with _total"),
        ("dspark_harden_x_total", "gauge", (), "only counters"),
        ("dspark_harden_latency_ms", "histogram", (), "'ms' is not a base unit"),
        ("dspark_harden_size_mb", "gauge", (), "'mb' is not a base unit"),
        ("dspark_harden_x_count", "gauge", (), "reserved"),
        ("dspark_harden_x", "gauge", ("le", "le"), "duplicate label"),
        ("dspark_harden_x", "histogram", ("le",), "reserved"),
        ("dspark_harden_x", "gauge", ("pid",), "pid"),
        ("dspark_harden_X", "gauge", (), "snake_case"),
        ("dspark_harden_x", "summary", (), "unknown type"),
    ],
)
def test_convention_problems_are_found(name, kind, labels, needle):
    problems = metrics.convention_problems(name, kind, labels)
    assert any(needle in p for p in problems), problems
    with pytest.raises(ValueError, match="dspark_harden|must"):
        metrics.Family(name, kind, "doc", labels=labels)


def test_family_rejects_bad_specs():
    with pytest.raises(ValueError, match="multiprocess_mode"):
        metrics.Family("dspark_harden_g", "gauge", "doc", multiprocess_mode="latest")
    with pytest.raises(ValueError, match="pid label"):
        metrics.Family("dspark_harden_g", "gauge", "doc", multiprocess_mode="all")
    with pytest.raises(ValueError, match="does not match labels"):
        metrics.Family("dspark_harden_c_total", "counter", "doc", labels=("a", "b"), precreate=(("x",),))
    with pytest.raises(ValueError, match="needs roles"):
        metrics.Family("dspark_harden_c_total", "counter", "doc", labels=("dp_rank",), precreate=((metrics.DP_RANK,),))
    with pytest.raises(ValueError, match="unknown role"):
        metrics.Family("dspark_harden_c_total", "counter", "doc", roles=("sched",))
    with pytest.raises(ValueError, match="empty documentation"):
        metrics.Family("dspark_harden_c_total", "counter", " ")


def test_every_declared_family_is_clean_and_names_a_real_feature():
    features = {f.name for f in all_features(make_manager())}
    for fam in metrics.FAMILIES.values():
        assert metrics.convention_problems(fam.name, fam.kind, fam.labels) == []
        assert fam.feature == "core" or fam.feature in features, (
            f"{fam.name}: feature {fam.feature!r} is not a registered Feature name ({sorted(features)})"
        )
        if fam.kind == "gauge":
            assert fam.multiprocess_mode in metrics.GAUGE_MODES


class _Plugin:
    """A stand-in third-party plugin object (registered through make_manager's extra=)."""

    def __init__(self, *answers):
        self.answers = answers

    @hookspecs.hookimpl
    def dspark_metrics(self):
        return list(self.answers)


def _fam(name="dspark_harden_extra_things_total", feature="core"):
    return metrics.Family(name, "counter", "things", feature=feature)


def test_registry_collects_every_plugin_in_registration_order_with_its_owner():
    pm = make_manager(load_extensions=False, extra=(_Plugin(_fam()),))
    reg = metrics.collect(pm)
    names = list(reg)
    assert names[:2] == ["dspark_harden_build_info", "dspark_harden_feature_bound"]  # built-ins first
    assert names[-1] == "dspark_harden_extra_things_total"
    assert reg.owner("dspark_harden_grammar_lookups_total") == "dspark_harden.grammar.feature"
    assert reg.owner("dspark_harden_extra_things_total") != reg.owner("dspark_harden_build_info")
    # a loose list of families becomes one group titled after its plugin
    assert [f.name for f in reg.groups[-1].group.families] == ["dspark_harden_extra_things_total"]
    # no central declarations: every built-in family comes from a feature package's own hook
    assert {reg.owner(n) for n in reg if n != "dspark_harden_extra_things_total"} <= set(BUILTIN_FEATURE_MODULES)


@pytest.mark.parametrize(
    "answer,needle",
    [
        (
            metrics.Family("dspark_harden_build_info", "gauge", "dup", multiprocess_mode="max"),
            "declared twice (by dspark_harden.observability.feature and",
        ),
        (_fam(feature="no-such-feature"), "names unknown feature 'no-such-feature'"),
        ("dspark_harden_x_total", "not a Family or MetricGroup"),
    ],
)
def test_registry_refuses_inconsistent_declarations(answer, needle):
    pm = make_manager(load_extensions=False, extra=(_Plugin(answer),))
    with pytest.raises(metrics.MetricsError) as exc:
        metrics.collect(pm)
    assert needle in str(exc.value)


def test_metric_group_rejects_non_families_and_empty_titles():
    with pytest.raises(ValueError, match="not a Family"):
        metrics.MetricGroup("t", ("x",))
    with pytest.raises(ValueError, match="title"):
        metrics.MetricGroup(" ", ())


def test_bad_declaration_fails_startup_closed():
    """The binder builds the registry from its plugin manager: a bad declaration is a bind error."""
    rc, res, out = run_py("""
        from dspark_harden.core import binder, hookspecs, metrics
        from dspark_harden.core.manager import make_manager
        from dspark_harden.core.patch import Role

        class Dup:
            @hookspecs.hookimpl
            def dspark_metrics(self):
                return [metrics.Family("dspark_harden_build_info", "gauge", "dup", multiprocess_mode="max")]

        report = binder.bind(Role.DETOKENIZER, pm=make_manager(load_extensions=False, extra=(Dup(),)))
        emit({"errors": report.errors, "ok": report.ok})
    """)
    assert rc == 0, out
    assert res["ok"] is False and any("declared twice" in e for e in res["errors"]), res


def test_third_party_family_is_registered_documented_and_precreated(tmp_path):
    """The test feature (tests/support, entry-point group dspark_harden.features) declares its own
    family through the hook: it is in the process registry, attributed to the extension, listed by
    ``dspark-harden metrics`` and rendered by the reference generator like a built-in, and
    pre-created in its roles when the feature is active. (Exported in a real scrape: the
    observability e2e server runs with it on.)"""
    from dspark_harden.cli import metrics_ref

    name = "dspark_harden_testfeature_verify_calls_total"
    assert metrics.FAMILIES[name].feature == "testfeature"
    assert metrics.current().owner(name) == "dspark_testfeature"
    assert name not in metrics.registry(load_extensions=False)  # the shipped reference stays built-in only
    text = metrics_ref.markdown(metrics.registry())
    assert f"| `{name}` | counter | `role` |" in text
    assert [r for r in metrics_ref.rows(metrics.registry()) if r["name"] == name][0][
        "declared_by"
    ] == "dspark_testfeature"
    import contextlib
    import io

    from dspark_harden.cli import main as cli_main

    for argv, present in (
        (["metrics", "--markdown", "--extensions"], True),
        (["metrics", "--markdown"], False),
        (["metrics"], True),
    ):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert cli_main(argv) == 0
        assert (name in buf.getvalue()) is present, argv
    rc, res, out = run_py(
        """
        from dspark_harden.core import metrics
        off = metrics.precreate_process("scheduler", [], "0")
        on = metrics.precreate_process("scheduler", ["testfeature"], "0")
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess
        reg = CollectorRegistry(); multiprocess.MultiProcessCollector(reg)
        emit({"off": off, "on": on, "text": generate_latest(reg).decode()})
    """,
        env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
    )
    assert rc == 0, out
    assert name not in res["off"] and name in res["on"]
    assert _sample(res["text"], name, role="scheduler") == 0


def test_get_unknown_family_raises():
    with pytest.raises(KeyError, match="not declared"):
        metrics.get("dspark_harden_nope_total")


_MP_WRITER = """
import os
from dspark_harden.core import metrics
from dspark_harden.core import roles
from dspark_harden.observability import phases
dp = os.environ["DP"]
metrics.precreate_process("scheduler", ["scheduler-phase-metrics"], dp)
rec = phases.PhaseRecorder(dp_label=dp, interval_s=3600)
phases.RECORDER = rec
idx = rec.index("run_batch")
for dt in (0.25, 0.5, 0.125):
    rec.observe(idx, dt, 0.0)
rec.observe(rec.index("idle"), 1.0, 0.0)
rec.flush()
emit({"pid": os.getpid()})
"""

_MP_READER = """
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
reg = CollectorRegistry()
multiprocess.MultiProcessCollector(reg)
emit({"text": generate_latest(reg).decode()})
"""


def _sample(text: str, name: str, **labels) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def test_multiprocess_mode_two_scheduler_processes_and_a_reader(tmp_path):
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for dp in ("0", "1"):
        rc, res, out = run_py(_MP_WRITER, env={**env, "DP": dp})
        assert rc == 0 and res, out
    rc, res, out = run_py(_MP_READER, env=env)
    assert rc == 0, out
    text = res["text"]
    for dp in ("0", "1"):
        assert _sample(text, "dspark_harden_scheduler_phase_seconds_total", dp_rank=dp, phase="run_batch") == 0.875
        assert _sample(text, "dspark_harden_scheduler_phase_calls_total", dp_rank=dp, phase="run_batch") == 3
        assert _sample(text, "dspark_harden_scheduler_phase_max_seconds", dp_rank=dp, phase="run_batch") == 0.5
        assert _sample(text, "dspark_harden_scheduler_phase_calls_total", dp_rank=dp, phase="idle") == 1
        # pre-created, never called: present with 0 (a mostrecent gauge needs an explicit set)
        for phase in SCHEDULER_PHASES:
            if phase in ("run_batch", "idle"):
                continue
            assert _sample(text, "dspark_harden_scheduler_phase_calls_total", dp_rank=dp, phase=phase) == 0
            assert _sample(text, "dspark_harden_scheduler_phase_max_seconds", dp_rank=dp, phase=phase) == 0
    assert "pid=" not in text.replace('pid="', "pid=") or 'pid="' not in text, "no gauge may add a pid label"


def test_precreation_only_for_active_features_and_own_roles(tmp_path):
    rc, res, out = run_py(
        """
        from dspark_harden.core import metrics
        done_sched_off = metrics.precreate_process("scheduler", [], "0")
        done_main = metrics.precreate_process("main", ["scheduler-phase-metrics"], "none")
        done_sched_on = metrics.precreate_process("scheduler", ["scheduler-phase-metrics"], "1")
        emit({"off": done_sched_off, "main": done_main, "on": done_sched_on})
    """,
        env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
    )
    assert rc == 0, out
    assert "dspark_harden_scheduler_phase_calls_total" not in res["off"]  # feature inactive
    assert "dspark_harden_scheduler_phase_calls_total" not in res["main"]  # not a main-process family
    assert {
        "dspark_harden_scheduler_phase_calls_total",
        "dspark_harden_scheduler_phase_seconds_total",
        "dspark_harden_scheduler_phase_max_seconds",
    } <= set(res["on"])


def test_main_process_readiness_defers_publishing_and_repairs_an_early_import(tmp_path):
    """SGLang's main process loads plugins before PROMETHEUS_MULTIPROC_DIR exists. Publishing waits
    for configured(); a metric created too early (prometheus_client imported in-process mode) is
    re-created in multiprocess mode and reaches the files the main process serves."""
    rc, res, out = run_py(f"""
        import os, sys
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        from dspark_harden.core import metrics
        metrics.defer_until_configured()
        ran = []
        metrics.when_ready(lambda: ran.append("published"))
        before = list(ran)
        early = metrics.get("dspark_harden_build_info")          # too early: imports prometheus_client now
        early.labels("v", "s").set(7)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = {str(tmp_path)!r}  # what SGLang's _set_envs_and_config does
        metrics.configured()
        late = metrics.get("dspark_harden_build_info")
        late.labels("v", "s").set(1)
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess
        reg = CollectorRegistry(); multiprocess.MultiProcessCollector(reg)
        emit({{"before": before, "after": ran, "same": early is late, "text": generate_latest(reg).decode()}})
    """)
    assert rc == 0, out
    assert res["before"] == [] and res["after"] == ["published"]
    assert res["same"] is False
    assert _sample(res["text"], "dspark_harden_build_info", version="v", sglang_version="s") == 1
    assert "re-created now" in out


def test_defer_is_a_no_op_when_prometheus_is_already_configured(tmp_path):
    rc, res, out = run_py(
        """
        from dspark_harden.core import metrics
        metrics.defer_until_configured()
        ran = []
        metrics.when_ready(lambda: ran.append(1))
        emit({"ready": metrics.ready(), "ran": ran})
    """,
        env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
    )
    assert rc == 0, out
    assert res == {"ready": True, "ran": [1]}
