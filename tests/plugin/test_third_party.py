"""A third-party feature registered through our entry-point group (``dspark_harden.features``, the
test-only distribution in tests/support) is bound and verified like a built-in one, and each way of
breaking it makes SGLang's real ``load_plugins()`` abort the process naming the target."""

from __future__ import annotations

import pytest

from ._proc import run_py

TARGET = "sglang.srt.sampling.sampling_params:SamplingParams.verify"

LOAD = """
from sglang.srt.plugins import load_plugins
try:
    load_plugins()
except SystemExit as exc:
    emit({"aborted": True, "message": str(exc), "is_exception": isinstance(exc, Exception)})
    raise
from dspark_harden.core import binder
from sglang.srt.sampling.sampling_params import SamplingParams
rep = binder.STATE.report
status = {f.name: f.status for f in rep.features}
live = SamplingParams.__dict__["verify"]
emit({"aborted": False, "status": status, "ours": getattr(live, "__dspark_patch__", None),
      "problems": [p.live_check() for p in binder.STATE.patches]})
"""


def _load(role: str, **env):
    return run_py(LOAD, env={"SGLANG_PLUGINS": "dspark_harden", "DSPARK_HARDEN_ROLE": role, **env})


def test_third_party_feature_is_bound_and_verified():
    rc, result, out = _load("scheduler", DSPARK_TESTFEATURE="1")
    assert rc == 0 and result and not result["aborted"], out[-3000:]
    assert result["status"]["testfeature"] == "bound"
    assert result["ours"] == TARGET
    assert all(p is None for p in result["problems"])


def test_third_party_feature_off_by_default():
    rc, result, out = _load("main")
    assert rc == 0 and result["status"]["testfeature"] == "disabled", out[-3000:]
    assert result["ours"] is None


@pytest.mark.parametrize(
    "mode,needle",
    [
        ("drift", "expected fingerprint 0000000000000000"),
        ("missing", "dspark_testfeature_no_such_method"),
        ("replaced", "replaced by another plugin"),
    ],
)
def test_broken_third_party_patch_aborts_startup(mode, needle):
    rc, result, out = _load("main", DSPARK_TESTFEATURE="1", DSPARK_TESTFEATURE_BREAK=mode)
    assert rc != 0, out[-3000:]
    assert result and result["aborted"] and not result["is_exception"], out[-3000:]
    assert needle in result["message"]
    assert "SamplingParams" in result["message"]
    assert "refuses to start" in out
