"""The metrics module: conventions enforced at declaration, pre-creation, and SGLang's Prometheus
multiprocess mode (real prometheus_client mmap files read by a real MultiProcessCollector, each
writer a separate process, as in a server)."""

from __future__ import annotations

import os

import pytest

from dspark_harden import metrics
from dspark_harden.core.manager import all_features, make_manager

from ..plugin._proc import run_py


@pytest.mark.parametrize("name,kind,labels,needle", [
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
])
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
    with pytest.raises(ValueError, match="declared twice"):
        metrics.declare(metrics.FAMILIES["dspark_harden_build_info"])


def test_every_declared_family_is_clean_and_names_a_real_feature():
    features = {f.name for f in all_features(make_manager(load_extensions=False))}
    for fam in metrics.FAMILIES.values():
        assert metrics.convention_problems(fam.name, fam.kind, fam.labels) == []
        assert fam.feature == "core" or fam.feature in features, (
            f"{fam.name}: feature {fam.feature!r} is not a registered Feature name ({sorted(features)})")
        if fam.kind == "gauge":
            assert fam.multiprocess_mode in metrics.GAUGE_MODES


def test_get_unknown_family_raises():
    with pytest.raises(KeyError, match="not declared"):
        metrics.get("dspark_harden_nope_total")


_MP_WRITER = """
import os
from dspark_harden import metrics
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
        for phase in metrics.SCHEDULER_PHASES:
            if phase in ("run_batch", "idle"):
                continue
            assert _sample(text, "dspark_harden_scheduler_phase_calls_total", dp_rank=dp, phase=phase) == 0
            assert _sample(text, "dspark_harden_scheduler_phase_max_seconds", dp_rank=dp, phase=phase) == 0
    assert "pid=" not in text.replace("pid=\"", "pid=") or 'pid="' not in text, "no gauge may add a pid label"


def test_precreation_only_for_active_features_and_own_roles(tmp_path):
    rc, res, out = run_py("""
        from dspark_harden import metrics
        done_sched_off = metrics.precreate_process("scheduler", [], "0")
        done_main = metrics.precreate_process("main", ["scheduler-phase-metrics"], "none")
        done_sched_on = metrics.precreate_process("scheduler", ["scheduler-phase-metrics"], "1")
        emit({"off": done_sched_off, "main": done_main, "on": done_sched_on})
    """, env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert rc == 0, out
    assert "dspark_harden_scheduler_phase_calls_total" not in res["off"]  # feature inactive
    assert "dspark_harden_scheduler_phase_calls_total" not in res["main"]  # not a main-process family
    assert {"dspark_harden_scheduler_phase_calls_total", "dspark_harden_scheduler_phase_seconds_total",
            "dspark_harden_scheduler_phase_max_seconds"} <= set(res["on"])


def test_main_process_readiness_defers_publishing_and_repairs_an_early_import(tmp_path):
    """SGLang's main process loads plugins before PROMETHEUS_MULTIPROC_DIR exists. Publishing waits
    for configured(); a metric created too early (prometheus_client imported in-process mode) is
    re-created in multiprocess mode and reaches the files the main process serves."""
    rc, res, out = run_py(f"""
        import os, sys
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        from dspark_harden import metrics
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
    rc, res, out = run_py("""
        from dspark_harden import metrics
        metrics.defer_until_configured()
        ran = []
        metrics.when_ready(lambda: ran.append(1))
        emit({"ready": metrics.ready(), "ran": ran})
    """, env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert rc == 0, out
    assert res == {"ready": True, "ran": [1]}
