"""The harness's own parts, without starting a server: tiny models, the CPU platform, the server lock.

The platform checks run in fresh interpreters (platform resolution and ``init_backend()`` mutate
SGLang module state for the whole process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import lock as server_lock
from tests.plugin._proc import run_py, run_pys

pytestmark = pytest.mark.timeout(900)


# --- tiny tokenizers and models -------------------------------------------------------------------


def test_tokenizer_2048_contract(tiny_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    assert len(tok) == 2048
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|endoftext|>", "<|im_end|>", "<|pad|>")
    assert [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")] == [
        0,
        1,
        2,
        3,
    ]
    ids = tok.encode("<think>x = 1</think>done", add_special_tokens=False)
    think, end_think = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    assert ids[0] == think and end_think in ids
    # reasoning markers survive skip_special_tokens (they are added tokens, not special ones)
    assert tok.decode(ids, skip_special_tokens=True) == "<think>x = 1</think>done"
    text = tok.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # byte-level: any text round-trips
    sample = "def f(x):\n    return {'é': x ** 2}  # ✓\n"
    assert tok.decode(tok.encode(sample, add_special_tokens=False)) == sample


def test_tokenizer_32000_has_exact_size():
    from transformers import AutoTokenizer

    from dspark_harden.devtools.tiny_models import ensure_tokenizer

    tok = AutoTokenizer.from_pretrained(ensure_tokenizer(32000))
    assert len(tok) == 32000
    assert tok.convert_tokens_to_ids("</think>") == 31999


def test_bad_vocab_size_and_arch_are_rejected():
    from dspark_harden.devtools.tiny_models import ensure_model, ensure_tokenizer

    with pytest.raises(ValueError, match="vocab_size"):
        ensure_tokenizer(100)
    with pytest.raises(ValueError, match="unknown tiny model arch 'gpt2'"):
        ensure_model("gpt2")


def test_models_match_the_documented_shapes(tiny_models):
    import transformers
    from safetensors import safe_open

    ds = json.loads(Path(tiny_models["deepseek_v3"], "config.json").read_text())
    assert ds["architectures"] == ["DeepseekV3ForCausalLM"]
    assert ds["rope_scaling"]["type"] == "yarn" and ds["rope_scaling"]["factor"] == 4.0
    assert ds["rope_scaling"]["original_max_position_embeddings"] == 512
    assert ds["moe_layer_freq"] == 1 and ds["first_k_dense_replace"] == 1
    assert (
        ds["q_lora_rank"],
        ds["kv_lora_rank"],
        ds["qk_rope_head_dim"],
        ds["qk_nope_head_dim"],
        ds["v_head_dim"],
    ) == (64, 32, 16, 32, 32)
    assert (ds["n_routed_experts"], ds["num_experts_per_tok"], ds["n_shared_experts"]) == (4, 2, 1)
    with safe_open(str(Path(tiny_models["deepseek_v3"], "model.safetensors")), "pt") as f:
        keys = set(f.keys())
        dtypes = {f.get_tensor(k).dtype for k in list(keys)[:10]}
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in keys  # layer 1 is MoE
    assert "model.layers.0.mlp.gate_proj.weight" in keys  # layer 0 is dense
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in keys  # MLA
    import torch

    assert dtypes == {torch.bfloat16}
    for arch, heads_kv in (("qwen3", 2), ("llama", 4)):
        cfg = transformers.AutoConfig.from_pretrained(tiny_models[arch])
        assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
            2,
            128,
            4,
            heads_kv,
        )
        assert cfg.vocab_size == 2048 and cfg.eos_token_id == 2


def test_parallel_builds_build_once_and_are_deterministic(tmp_path):
    """Two processes racing on an empty cache: one build, same result; a second cache gets identical files."""
    code = "from dspark_harden.devtools.tiny_models import ensure_tokenizer; print(ensure_tokenizer(512))"

    def launch(cache):
        env = dict(os.environ, DSPARK_HARDEN_MODEL_CACHE=str(cache))
        return subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    a, b = tmp_path / "a", tmp_path / "b"
    procs = [launch(a), launch(a)]
    p = launch(b)  # the second cache is built at the same time (independent: another directory)
    outs = [q.communicate(timeout=600) for q in procs]
    assert all(q.returncode == 0 for q in procs), outs
    paths = {o[0].strip().splitlines()[-1] for o in outs}
    assert len(paths) == 1
    built = Path(paths.pop())
    marker = json.loads((built / ".complete").read_text())
    assert marker["built_by_pid"] in {q.pid for q in procs}
    assert not [d for d in a.iterdir() if d.is_dir() and d.name.startswith(".tokenizer-")]  # no temp dirs left
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    other = Path(out.strip().splitlines()[-1])
    assert (other / "tokenizer.json").read_bytes() == (built / "tokenizer.json").read_bytes()


# --- the CPU platform --------------------------------------------------------------------------------

_PLATFORM_ENV = {"DSPARK_TEST_CPU_PLATFORM": "1", "SGLANG_PLATFORM": "dspark_test_cpu"}


def test_cpu_platform_resolves_and_adjusts_sglang():
    rc, res, out = run_py(
        """
        from sglang.srt.platforms import current_platform as p
        import sglang.srt.model_executor.forward_batch_info as fbi
        import sglang.srt.layers.dp_attention as dpa
        import sglang.srt.distributed.parallel_state as ps
        import sglang.srt.layers.logits_processor as lp
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend as B
        before = [fbi._is_cpu, dpa._is_cpu, ps._is_cpu, lp._is_cpu, dpa.memcpy_func is dpa.memcpy_cpu,
                  "get_cpu_graph_seq_len_fill_value" in B.__dict__]
        p.init_backend()
        after = [fbi._is_cpu, dpa._is_cpu, ps._is_cpu, lp._is_cpu, dpa.memcpy_func is dpa.memcpy_cpu,
                 B.get_cpu_graph_seq_len_fill_value(None), B.get_cuda_graph_seq_len_fill_value(None)]
        emit({"cls": type(p).__name__, "oot": p.is_out_of_tree(), "attn": p.get_default_attention_backend(),
              "key": p.get_dispatch_key_name(), "dist": p.get_torch_distributed_backend_str(),
              "pin": p.is_pin_memory_available(), "device": str(p.get_device(0)),
              "graphs": p.capabilities.graph_capture, "triton": p.capabilities.supports_triton,
              "before": before, "after": after})
        """,
        env=_PLATFORM_ENV,
    )
    assert rc == 0 and res, out[-4000:]
    assert res["cls"] == "DsparkTestCpuPlatform" and res["oot"] is True
    assert (res["attn"], res["key"], res["dist"], res["device"]) == ("torch_native", "native", "gloo", "cpu")
    assert res["pin"] is False and res["graphs"] is False and res["triton"] is False
    assert res["before"] == [False, False, False, False, False, False]  # stock decides from SGLANG_USE_CPU_ENGINE
    assert res["after"] == [True, True, True, True, True, 1, 1]


@pytest.mark.parametrize("value, expect", [("0", "none"), (None, "none"), ("yes", "error")])
def test_cpu_platform_is_strictly_opt_in(value, expect, monkeypatch):
    monkeypatch.delenv("DSPARK_TEST_CPU_PLATFORM", raising=False)  # run_py inherits os.environ
    env = {"DSPARK_TEST_CPU_PLATFORM": value} if value is not None else {}
    rc, res, out = run_py(
        """
        from dspark_testsupport.cpu_platform import activate
        try:
            emit({"result": activate()})
        except ValueError as exc:
            emit({"error": str(exc)})
        """,
        env=env,
    )
    assert rc == 0 and res, out[-3000:]
    if expect == "none":
        assert res == {"result": None}
    else:
        assert "DSPARK_TEST_CPU_PLATFORM must be exactly '0' or '1'" in res["error"]


def test_cpu_platform_surface_check_names_missing_attributes(monkeypatch):
    from dspark_testsupport import cpu_platform

    monkeypatch.setitem(
        cpu_platform.ADJUSTED_MODULE_ATTRS, "sglang.srt.layers.dp_attention", ("_is_cpu", "no_such_attr")
    )
    with pytest.raises(AssertionError, match=r"sglang\.srt\.layers\.dp_attention\.no_such_attr"):
        cpu_platform.check_stock_surfaces()


# --- the server lock -----------------------------------------------------------------------------------


def _flock_free(path: str) -> bool:
    return subprocess.run(["flock", "-n", path, "true"]).returncode == 0


def test_server_lock_excludes_flock_command_and_is_reentrant(tmp_path, monkeypatch):
    path = str(tmp_path / "server.lock")
    monkeypatch.setenv("DSPARK_SERVER_LOCK", path)
    assert not server_lock.held()
    with server_lock.server_lock():
        assert not _flock_free(path)  # `flock /tmp/dspark-server.lock cmd` would wait
        with server_lock.server_lock():  # re-entrant within this process
            assert server_lock.held()
        assert not _flock_free(path)
    assert not server_lock.held()
    assert _flock_free(path)


def test_server_lock_times_out_with_a_clear_error(tmp_path, monkeypatch):
    path = str(tmp_path / "server.lock")
    monkeypatch.setenv("DSPARK_SERVER_LOCK", path)
    monkeypatch.setenv("DSPARK_SERVER_LOCK_TIMEOUT", "1.5")
    holder = subprocess.Popen(["flock", path, "sleep", "30"])
    try:
        import time

        deadline = time.monotonic() + 10
        while _flock_free(path) and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(TimeoutError, match="server lock"):
            server_lock.acquire()
        assert not server_lock.held()
    finally:
        holder.kill()
        holder.wait()


# --- server command line and environment ----------------------------------------------------------


def test_server_command_and_environment(tmp_path, monkeypatch):
    from tests.harness.server import DP2_CONFIG, STOCK_PLUGINS, ServerConfig, SGLangServer

    monkeypatch.setenv("DSPARK_HARDEN_GRAMMAR", "0")  # a developer's export must not leak into servers
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/nonexistent")
    monkeypatch.setenv("DSPARK_HARDEN_ROLE", "main")
    server = SGLangServer(DP2_CONFIG.with_env(DSPARK_TESTFEATURE="1"))
    server.workdir, server.port = tmp_path, 12345
    cmd = server.command()
    joined = " ".join(cmd)
    for flag in (
        "--device cpu",
        "--attention-backend torch_native",
        "--sampling-backend pytorch",
        "--disable-cuda-graph",
        "--max-total-tokens 8192",
        "--grammar-backend xgrammar",
        "--constrained-json-disable-any-whitespace",
        "--enable-metrics",
        "--sleep-on-idle",
        "--tp-size 2",
        "--dp-size 2",
        "--enable-dp-attention",
        "--port 12345",
        "--host 127.0.0.1",
    ):
        assert flag in joined, flag
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    env = server.environment()
    assert env["SGLANG_PLUGINS"] == "dspark_harden"
    assert (env["DSPARK_TEST_CPU_PLATFORM"], env["SGLANG_PLATFORM"]) == ("1", "dspark_test_cpu")
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1"
    assert env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
    assert env["TMPDIR"] == str(tmp_path / "tmp") and (tmp_path / "tmp").is_dir()
    assert env["DSPARK_TESTFEATURE"] == "1"
    for leaked in ("DSPARK_HARDEN_GRAMMAR", "PROMETHEUS_MULTIPROC_DIR", "DSPARK_HARDEN_ROLE"):
        assert leaked not in env
    single = SGLangServer(ServerConfig(arch="qwen3", plugins=None))
    single.workdir, single.port = tmp_path, 1
    env = single.environment()
    assert env["SGLANG_PLUGINS"] == STOCK_PLUGINS and "SGLANG_CPU_OMP_THREADS_BIND" not in env
    assert "--tp-size" not in single.command() and "--enable-dp-attention" not in single.command()


def test_server_launcher_serve_and_unknown_launcher(tmp_path):
    """``launcher="serve"`` runs this environment's real ``sglang serve`` console script with the same
    flags; an unknown launcher is a clear error, not a silent ``launch_server``."""
    import dataclasses

    from tests.harness.server import DP2_CONFIG, ServerError, SGLangServer

    server = SGLangServer(dataclasses.replace(DP2_CONFIG, launcher="serve"))
    server.workdir, server.port = tmp_path, 12345
    cmd = server.command()
    assert cmd[0] == str(Path(sys.executable).with_name("sglang")) and cmd[1] == "serve", cmd
    assert Path(cmd[0]).read_text().count("from sglang.cli.main import main") == 1  # the stock entry point
    assert "--enable-dp-attention" in cmd and "--model-path" in cmd
    bad = SGLangServer(dataclasses.replace(DP2_CONFIG, launcher="sglang-run"))
    with pytest.raises(ServerError, match="unknown launcher 'sglang-run'"):
        bad.command()


def test_stock_server_allow_list_loads_no_plugin():
    """What ServerConfig(plugins=None) sets really keeps dspark_harden out (unset would load it)."""
    from tests.harness.server import STOCK_PLUGINS

    code = """
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from dspark_harden.core import binder
        emit({"loaded": binder.STATE.report is not None})
    """
    stock, plugin = run_pys(
        (code, {"SGLANG_PLUGINS": STOCK_PLUGINS, "DSPARK_HARDEN_ROLE": "main"}),
        (code, {"SGLANG_PLUGINS": "dspark_harden", "DSPARK_HARDEN_ROLE": "main"}),
    )
    rc, res, out = stock
    assert rc == 0 and res == {"loaded": False}, out[-3000:]
    rc, res, out = plugin
    assert rc == 0 and res == {"loaded": True}, out[-3000:]


# --- ports ----------------------------------------------------------------------------------------


def test_free_port_leaves_sglangs_derived_ports_free_by_sglangs_own_test(monkeypatch):
    """A CI run once failed starting a server: SGLang waited 30 s for its metrics port (--port + 233
    + 4) and exited, because a socket of the server stopped just before was still in teardown there
    (psutil reports such a socket with no pid, which SGLang's message shows as the new server
    itself). ``free_port`` now checks SGLang's derived ports with SGLang's own test."""
    import socket

    from sglang.srt.server_args import ZMQ_TCP_PORT_DELTA
    from sglang.srt.utils.network import is_port_available

    from dspark_harden.devtools import server as S

    assert S.SGLANG_PORT_DELTA == ZMQ_TCP_PORT_DELTA
    port = S.free_port()
    for p in [*range(port, port + 16), *range(port + ZMQ_TCP_PORT_DELTA, port + ZMQ_TCP_PORT_DELTA + 10)]:
        assert is_port_available(p), p
    # the same verdict as SGLang's for a held port, and a held derived port is never handed out:
    # hold the metrics port (P + 233 + 4) of a range free_port itself chose
    other = S.free_port()
    hp = port + ZMQ_TCP_PORT_DELTA + 4
    with socket.socket() as held:
        held.bind(("127.0.0.1", hp))
        held.listen()
        assert S.port_bindable(hp) is is_port_available(hp) is False
        S._handed_out.clear()
        monkeypatch.setattr(S, "_candidate_ports", lambda lowest, top: iter([port, other]))
        assert S.free_port() == other  # the first candidate's metrics port is held: skipped
    assert S.port_bindable(hp) is is_port_available(hp) is True


def test_free_port_stays_below_the_ephemeral_range_and_never_repeats_a_range():
    """A CI run once failed when uvicorn could not bind the HTTP port 17 s after ``free_port`` chose
    it from the kernel's ephemeral range: the kernel can hand such a port to any port-0 bind or
    outgoing connection meanwhile. Every port of every range handed out lies below that range, and
    ranges handed out by one process never overlap (two servers launched before either binds)."""
    from dspark_harden.devtools import server as S

    low, high = S.ephemeral_range()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        assert (low, high) == tuple(int(v) for v in f.read().split())
    seen: set[int] = set()
    for _ in range(40):
        port = S.free_port()
        ports = {
            *range(port, port + 16),
            *range(port + S.SGLANG_PORT_DELTA, port + S.SGLANG_PORT_DELTA + S.SGLANG_DERIVED_PORTS),
        }
        assert all(S.LOWEST_PORT <= p < low for p in ports), port
        assert not ports & seen, port
        seen |= ports


_STAND_IN = r"""
import sys, time
import uvicorn
from fastapi import FastAPI

app = FastAPI()
app.get("/model_info")(lambda: {"model_path": "stand-in"})
app.get("/health_generate")(lambda: {})
port = int(sys.argv[1])
uvicorn.run(app, host="127.0.0.1", port=port, log_level="info")
print("uvicorn returned: hanging like SGLang's main process does", flush=True)
time.sleep(3600)
"""


class _NoServerLock:
    """The stand-ins below are no SGLang server: they take no machine-wide server lock (a CI run's stand-in
    waited 450 s for the other worker's real servers, then failed a timed assertion, since removed)."""

    def acquire(self) -> None:
        pass

    def release(self) -> None:
        pass

    def __getattr__(self, name):  # everything else (the ready timeout's setting) from the real module
        from dspark_harden.devtools import lock

        return getattr(lock, name)


def test_a_start_that_lost_its_http_port_is_retried_on_a_new_port(tmp_path, monkeypatch):
    """The harness side of that CI failure: SGLang's main process does not exit when uvicorn cannot
    bind (the run waited 600 s), so ``start`` must recognise the lost race from the log, stop the
    server and start again on a new port. Stand-in for SGLang (a real start costs about a minute an
    attempt): a real uvicorn app on the harness's port that, like SGLang's main process, hangs after
    uvicorn gives up; the port is really held by this test on the first attempt, so the error line
    is real uvicorn's (the CI log: ``[Errno 98] error while attempting to bind on address
    ('127.0.0.1', 34125): address already in use``)."""
    import socket

    from dspark_harden.devtools import server as S

    script = tmp_path / "stand_in.py"
    script.write_text(_STAND_IN)
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    ports = iter([held.getsockname()[1]])
    real_free_port = S.free_port
    monkeypatch.setattr(S, "free_port", lambda: next(ports, None) or real_free_port())
    monkeypatch.setattr(S.SGLangServer, "command", lambda self: [sys.executable, str(script), str(self.port)])
    monkeypatch.setattr(S, "_lock", _NoServerLock())
    server = S.SGLangServer(S.ServerConfig(name="port-race"))
    try:
        # recognised from the log: a missed race would end the first attempt at the ready deadline with a
        # ServerError, which ``start`` does not retry (only a PortRaceError is)
        server.start(timeout=120)
        assert server.port != held.getsockname()[1]
        assert server.get("/model_info").json() == {"model_path": "stand-in"}
        races = list(server.workdir.glob("port-race-*.log"))
        assert len(races) == 1 and "error while attempting to bind on address" in races[0].read_text()
    finally:
        server.stop()
        server.remove_workdir()
        held.close()


def test_a_port_race_on_every_attempt_fails_with_the_log(tmp_path, monkeypatch):
    """When every attempt loses its port, ``start`` raises :class:`PortRaceError` naming the line."""
    import socket

    from dspark_harden.devtools import server as S

    script = tmp_path / "stand_in.py"
    script.write_text(_STAND_IN)
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    monkeypatch.setattr(S, "free_port", lambda: held.getsockname()[1])
    monkeypatch.setattr(S.SGLangServer, "command", lambda self: [sys.executable, str(script), str(self.port)])
    monkeypatch.setattr(S, "_lock", _NoServerLock())
    server = S.SGLangServer(S.ServerConfig(name="port-race-always"))
    try:
        with pytest.raises(S.PortRaceError, match=r"lost a port race \(.*error while attempting to bind"):
            server.start(timeout=120, attempts=2)
        assert server.proc.poll() is not None and not server._locked
    finally:
        server.stop()
        server.remove_workdir()
        held.close()


def test_sglang_patch_left_in_the_pytest_process_fails_and_is_restored():
    """The conftest guard against SGLang patches leaking between test modules (real SGLang classes,
    the suite's own conftest, a pytest of its own over two probe modules): a method replaced, added
    or deleted and left so fails the module's last test at teardown naming each attribute, is
    restored, and the next module sees stock code; a monkeypatch undone at teardown is no leak.
    Fails if the guard misses a kind of patch or does not restore it (the second module then fails)."""
    root = Path(__file__).resolve().parents[2]
    probes = ["tests/integration/_patch_leak_probe.py", "tests/integration/_patch_leak_probe_after.py"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rE", *probes],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout
    summary = out.strip().splitlines()[-1]  # the guard fails the leaking module's last teardown
    assert "5 passed" in summary and "1 error" in summary and "failed" not in summary, out[-4000:]
    line = next(ln for ln in out.splitlines() if "left 3 SGLang patch(es) in the pytest process" in ln)
    for attr in ("normalize", "planted_by_a_test", "verify"):
        assert f"sglang.srt.sampling.sampling_params.SamplingParams.{attr}" in line, line
    assert "integration._patch_leak_probe left" in line and "test_leaves_a_method_deleted" in line, line


def test_host_exclusive_test_runs_alone_between_two_xdist_workers(tmp_path):
    """The conftest's readers-writer lock between pytest-xdist workers (the suite's own conftest and
    Makefile arguments, a pytest of its own over three probe modules that sleep and record when they ran):
    no other test runs while a ``host_exclusive`` one does, while plain tests of the two workers do run at
    the same time (the control: the workers are concurrent, so the gap around the exclusive test is the
    lock's doing). Fails if the lock is not taken, taken shared, or released early."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "windows.jsonl"
    tmpdir = tmp_path / "tmp"  # the run's lock directory is made here and removed at its end
    tmpdir.mkdir()
    probes = [f"tests/integration/_host_lock_probe_{x}.py" for x in "abc"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "--no-loadscope-reorder",
            *probes,
        ],
        cwd=root,
        env={**os.environ, "DSPARK_HOST_LOCK_PROBE_OUT": str(out), "TMPDIR": str(tmpdir)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "9 passed" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(runs) == 9 and len({r["worker"] for r in runs}) == 2, runs
    (ex,) = [r for r in runs if r["name"] == "exclusive"]

    def overlap(a, b):
        return a["start"] < b["end"] and b["start"] < a["end"]

    assert not [r["name"] for r in runs if r is not ex and overlap(r, ex)], runs
    assert not [p.name for p in tmpdir.iterdir() if p.name.startswith("dspark-harden-pytest-")]
    plain = [r for r in runs if r is not ex]
    assert any(overlap(a, b) for a in plain for b in plain if a["worker"] != b["worker"]), runs


def test_warm_commands_run_as_a_fresh_interpreter_and_differing_imports_run_fresh(monkeypatch):
    """tests/harness/warm.py: a command forked from the warm interpreter sees its own argv, environment,
    exit code, stderr and a main-process identity, as a fresh one; an environment that differs in a
    variable read at import (not the plugin's own) sends it fresh; ``fresh=True`` always does. Mutations:
    ``_differs`` returning [] (every environment warm) -> the fresh count stays and this fails; the child
    not taking the job's environment -> the DSPARK_HARDEN_ value is missing."""
    from tests.harness import warm

    code = (
        "import os, sys, multiprocessing as mp\n"
        "print(sys.argv[1:], os.environ.get('DSPARK_HARDEN_PROBE'), mp.current_process().name, mp.parent_process())\n"
        "sys.stderr.write('to stderr\\n'); sys.exit(7)"
    )
    env = {**os.environ, "DSPARK_HARDEN_PROBE": "x1"}
    before = dict(warm.STATS, why_fresh=dict(warm.STATS["why_fresh"]))
    r = warm.run([sys.executable, "-c", code, "a", "b"], env=env, timeout=600)
    assert (r.returncode, r.stdout.strip(), r.stderr) == (7, "['a', 'b'] x1 MainProcess None", "to stderr\n")
    if "disabled" in warm._STATE or warm._STATE.get("pid") != os.getpid():
        pytest.skip(f"no warm interpreter in this process: {warm._STATE.get('disabled')}")
    assert warm.STATS["warm"] == before["warm"] + 1, warm.STATS
    r = warm.run([sys.executable, "-c", code, "c"], env={**env, "SGLANG_SOME_IMPORT_SETTING": "1"}, timeout=600)
    assert (r.returncode, r.stdout.strip()) == (7, "['c'] x1 MainProcess None")
    assert warm.STATS["fresh"] == before["fresh"] + 1, warm.STATS
    assert warm.STATS["why_fresh"]["environment differs in SGLANG_SOME_IMPORT_SETTING"] >= 1
    r = warm.run([sys.executable, "-c", "raise ValueError('boom')"], env=env, timeout=600)
    assert r.returncode == 1 and r.stderr.splitlines()[-1] == "ValueError: boom", r.stderr
    assert 'File "<string>", line 1, in <module>' in r.stderr and "_warm_child" not in r.stderr, r.stderr
    r = warm.run([sys.executable, "-c", code], env=env, timeout=600, fresh=True)
    assert r.returncode == 7 and warm.STATS["fresh"] == before["fresh"] + 2


# --- which /dev/shm entries a process tree left (dspark_harden.devtools.shmwatch) ---------------------

_SHM_CHILD = r"""
import mmap, os, sys, time, _multiprocessing
tag = sys.argv[1]

def mapped(name, size=4096):
    fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    return mmap.mmap(fd, size)

parent = os.getpid()
if os.fork() == 0:  # a grandchild of the same group maps its own entry; exits after its parent, removing nothing
    m = mapped(f"dsh-watch-{tag}-grandchild")
    os.write(1, b"grandchild\n")  # one write each: the two lines never interleave
    while os.getppid() == parent:
        time.sleep(0.01)
    os._exit(0)
keep = [
    mapped(f"dsh-watch-{tag}-own"),                          # left: mapped by the tree only
    mapped(f"dsh-watch-{tag}-shared"),                       # mapped by another process too: in use
    mapped(f"dsh-watch-{tag}-removed"),                      # removed before the exit
    # a POSIX semaphore: sem_open() maps a temporary name, then links it as sem.<name>; not unlinked
    _multiprocessing.SemLock(1, 1, 1, f"/dsh-watch-{tag}-sem", False),
]
os.unlink(f"/dev/shm/dsh-watch-{tag}-removed")
os.write(1, b"ready\n")
sys.stdin.readline()
os._exit(0)  # nothing else removed
"""


def test_shm_watch_names_only_what_its_tree_mapped_and_left(tmp_path):
    """A process tree (a child and its grandchild) maps five /dev/shm entries of its own and exits; meanwhile
    this process creates one it does not map and keeps one of the child's mapped (a watch sees what is mapped
    at its scans: here the grandchild lives until its parent exits). The watch names exactly the
    child's and grandchild's unremoved, unused entries, the semaphore included (mapped under another name),
    and not the other process's (a host-wide before/after diff names it too)."""
    import mmap
    import time
    import uuid

    from dspark_harden.core import procfs
    from dspark_harden.devtools import shmwatch

    tag = uuid.uuid4().hex[:8]
    before = shmwatch.entries()
    child = subprocess.Popen(
        [sys.executable, "-c", _SHM_CHILD, tag],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    watch = shmwatch.watch(child.pid, every_s=0.05)
    held = None
    try:
        assert sorted(child.stdout.readline() for _ in range(2)) == ["grandchild\n", "ready\n"]
        watch.scan()
        foreign = f"/dev/shm/dsh-watch-{tag}-foreign"
        with open(foreign, "wb") as f:
            f.write(b"x")
        fd = os.open(f"/dev/shm/dsh-watch-{tag}-shared", os.O_RDWR)
        held = mmap.mmap(fd, 4096)
        os.close(fd)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(30) == 0
        deadline = time.monotonic() + 30
        while procfs.group_pids(child.pid):  # the grandchild follows its parent
            assert time.monotonic() < deadline
            time.sleep(0.05)
        watch.stop()
        mine = {n for n in shmwatch.entries() - before if tag in n}
        assert mine == {f"dsh-watch-{tag}-{k}" for k in ("grandchild", "own", "shared", "foreign")} | {
            f"sem.dsh-watch-{tag}-sem"
        }, mine
        assert shmwatch.leftovers(watch, before) == sorted(
            [f"dsh-watch-{tag}-grandchild", f"dsh-watch-{tag}-own", f"sem.dsh-watch-{tag}-sem"]
        )
    finally:
        if child.poll() is None:
            child.kill()
        if held is not None:
            held.close()
        for n in shmwatch.entries():
            if tag in n:
                os.unlink(f"/dev/shm/{n}")
