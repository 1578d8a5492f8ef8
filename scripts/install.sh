#!/usr/bin/env bash
# Reproducible set-up from the repository alone: a virtualenv with sglang==0.5.23 (reused when complete),
# this package (editable, from THIS checkout), the test-support distribution, Prometheus (Debian package)
# and the tiny local models. Idempotent.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${DSPARK_VENV:-$HOME/.cache/dspark-harden/venv}"
PY="${PYTHON:-python3}"
SGLANG_REQ="sglang==0.5.23"
# runtime + test requirements that are not pulled by sglang itself
EXTRA_REQS=(cffi pyzmq prometheus-client filelock "pluggy>=1.5" packaging "pytest>=8,<9" "pytest-forked>=1.6" pytest-timeout jsonschema numpy "setuptools>=77" wheel)
STAMP="$VENV/.dspark-harden-venv"
WANT="$(printf '%s\n' "$SGLANG_REQ" "${EXTRA_REQS[@]}" | sha256sum | cut -c1-16)"

log() { printf '[install] %s\n' "$*"; }

venv_complete() {
  [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] || return 1
  "$VENV/bin/python" - <<'PY' >/dev/null 2>&1 || return 1
import importlib.metadata as md
assert md.version("sglang") == "0.5.23"
import sglang, torch, xgrammar, zmq, cffi, pluggy, filelock, prometheus_client, pytest, pytest_forked  # noqa
PY
}

if venv_complete; then
  log "reusing complete virtualenv $VENV"
else
  log "creating virtualenv $VENV with $SGLANG_REQ (about 11 GB, ~7 minutes on a fresh machine)"
  mkdir -p "$(dirname "$VENV")"
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "$SGLANG_REQ" "${EXTRA_REQS[@]}"
  echo "$WANT" > "$STAMP"
fi

log "installing dspark-harden (editable, builds the native cffi module) from $ROOT"
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT"
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT/tests/support"

if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  if [[ "$(id -u)" == 0 ]]; then
    log "installing Debian package prometheus (real Prometheus + promtool for the metrics tests)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
      || log "WARNING: could not install prometheus; the Prometheus tests will fail"
    # the Debian package starts a system service on :9090; the tests start their own on a free port
    (systemctl stop prometheus 2>/dev/null || service prometheus stop 2>/dev/null || pkill -x prometheus || true) >/dev/null 2>&1
  else
    log "WARNING: prometheus/promtool missing and not root: install the Debian package 'prometheus'"
  fi
fi

log "building tiny local models and tokenizers (cached)"
"$VENV/bin/python" -m dspark_harden.devtools.tiny_models --all >/dev/null
log "done: $VENV"
