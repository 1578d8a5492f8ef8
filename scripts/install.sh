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
# hypothesis < 6.170.10: hypothesis-jsonschema 0.23.1 (the latest) uses conjecture's many.more(), removed in 6.170.10
# grafana-foundation-sdk (Grafana's dashboards-as-code SDK, pinned: the shipped dashboard JSON is its output)
# ruff, clang-format: the linters (pinned: tests/packaging/test_lint.py runs them in make test)
# build: `python -m build` (the sdist + abi3 wheel; tests/packaging builds and installs it, docs/install.md)
EXTRA_REQS=("ruff==0.17.6" "clang-format==23.1.5" cffi pyzmq prometheus-client filelock "pluggy>=1.5" packaging "pytest>=8,<9" "pytest-forked>=1.6" pytest-timeout "pytest-xdist>=3.6,<4" jsonschema numpy "setuptools>=77" wheel "build>=1.2" "hypothesis>=6.100,<6.170.10" "hypothesis-jsonschema==0.23.1" "grafana-foundation-sdk==1769699998!10.1.0")
# the grammar tests' real-world schema corpus: the JSON Schema Test Suite from the npm registry
NPM_PREFIX="${DSPARK_HARDEN_NPM_PREFIX:-$HOME/.cache/dspark-harden/npm}"
NPM_CORPUS="json-schema-test-suite@0.0.10"
STAMP="$VENV/.dspark-harden-venv"
WANT="$(printf '%s\n' "$SGLANG_REQ" "${EXTRA_REQS[@]}" | sha256sum | cut -c1-16)"

log() { printf '[install] %s\n' "$*"; }

venv_complete() {
  [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] || return 1
  "$VENV/bin/python" - <<'PY' >/dev/null 2>&1 || return 1
import importlib.metadata as md
assert md.version("sglang") == "0.5.23"
import sglang, torch, xgrammar, zmq, cffi, pluggy, filelock, prometheus_client, pytest, pytest_forked, xdist  # noqa
import hypothesis, hypothesis_jsonschema  # noqa
import grafana_foundation_sdk  # noqa
import build  # noqa
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

corpus_complete() {
  [[ -f "$NPM_PREFIX/node_modules/json-schema-test-suite/package.json" ]] || return 1
  grep -q '"version": "0.0.10"' "$NPM_PREFIX/node_modules/json-schema-test-suite/package.json"
}
if corpus_complete; then
  log "reusing the JSON Schema Test Suite corpus in $NPM_PREFIX"
else
  if ! command -v npm >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]]; then
    log "installing Debian packages nodejs + npm (for the grammar tests' schema corpus)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null) \
      || log "WARNING: could not install npm; the grammar corpus tests will fail"
  fi
  log "installing npm $NPM_CORPUS (the JSON Schema Test Suite) into $NPM_PREFIX"
  mkdir -p "$NPM_PREFIX"
  npm install --prefix "$NPM_PREFIX" --no-audit --no-fund --no-save --loglevel=error "$NPM_CORPUS" >/dev/null \
    || log "WARNING: npm install $NPM_CORPUS failed; the grammar corpus tests will fail"
fi

log "building tiny local models and tokenizers (cached)"
"$VENV/bin/python" -m dspark_harden.devtools.tiny_models --all >/dev/null
log "done: $VENV"
