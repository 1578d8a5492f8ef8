"""pytest harness for dspark-harden (see docs/testing.md).

- markers ``server`` (starts a real SGLang server on CPU: slow) and ``gpu`` (needs CUDA; skipped
  when torch sees no GPU);
- session fixtures building the tiny local models once (``tiny_models``, ``tiny_tokenizer``);
- ``sglang_server``: function-scoped factory ``sglang_server(ServerConfig) -> SGLangServer``
  (stopped at teardown); ``module_sglang_server``: the same, stopped at the end of the module;
- shared servers (``dp2_server``: DeepseekV3 tiny, DP2 attention over TP2, plugin active), see
  tests/harness/shared.py.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import sys
import threading
import time

import pytest

from tests.harness import shared, warm
from tests.harness.server import ServerConfig, SGLangServer


def pytest_configure(config):
    config.addinivalue_line("markers", "server: starts a real SGLang server on CPU (slow)")
    config.addinivalue_line("markers", "gpu: needs CUDA (run on the device machine)")
    config.addinivalue_line("markers", "shared_order(n): position inside a shared server's group (default 0)")
    config.addinivalue_line(
        "markers",
        "host_exclusive: compares host-wide state (all of /dev/shm) before and after; no test of another "
        "pytest-xdist worker runs meanwhile",
    )
    config.pluginmanager.register(_SGLangPatchGuard(), "dspark-sglang-patch-guard")
    # The pytest process forks (pytest-forked) after earlier tests ran torch ops in it. Once a
    # multi-threaded op has started torch's OpenMP pool in this process, a forked child deadlocks in
    # its first parallel op (libgomp is not fork-safe): seen twice in one suite run, in
    # test_integration's logits.clone() and in a forked prefill-graph test's ReqToTokenPool
    # (torch.zeros). One intra-op thread in this process means the pool is never started here.
    # Servers and helper processes are spawned fresh and keep torch's default.
    import torch

    torch.set_num_threads(1)
    # a pytest-xdist worker runs execnet's I/O thread(s) from before the first test: the harness's own,
    # never a test's (the fork guard below leaves them out; a forked child never uses the channel)
    _HARNESS_THREADS.update(_other_threads())
    worker_input = getattr(config, "workerinput", None)
    if worker_input is not None:
        if _HostLock.KEY in worker_input:
            _HOST_LOCK.append(_HostLock(worker_input[_HostLock.KEY]))
    elif getattr(config.option, "numprocesses", None):  # a pytest-xdist controller
        import tempfile

        _HOST_LOCK_DIR.append(tempfile.mkdtemp(prefix="dspark-harden-pytest-"))


_PYTEST_PID = os.getpid()


def _process_state():
    """What a bind changes in a process: the installed metric registry and the binder's state."""
    from dspark_harden.core import binder, metrics

    st = binder.STATE
    return metrics.FAMILIES._reg, st.pm, st.report, st.settings, len(st.patches)


@pytest.fixture(autouse=True)
def _no_bind_leaks_into_the_pytest_process(request):
    """A test that binds (installs a registry of its own plugin manager, applies patches) in the
    pytest process itself changes every later test of the run: one did, with a manager of a single
    module, and 25 tests of later modules failed on missing metric families in a full suite run while
    passing alone. Such a test must run forked (docs/testing.md); this fails it at teardown, naming
    it, and restores the state so the rest of the run is not affected. Forked children are exempt."""
    if os.getpid() != _PYTEST_PID:
        yield
        return
    from dspark_harden.core import binder, metrics

    before = _process_state()
    yield
    after = _process_state()
    if after[0] is not before[0] and before[0] is None:
        full = set(metrics.registry())  # built lazily by first use: fine if it is the default one
        if set(after[0]) == full and after[1:] == before[1:]:
            return
    if after != before:
        reg, pm, report, settings, n = before
        metrics.FAMILIES.use(reg)
        st = binder.STATE
        with st.lock:
            del st.patches[n:]
            st.pm, st.report, st.settings = pm, report, settings
        pytest.fail(
            f"{request.node.nodeid} bound in the pytest process (metric registry or binder state "
            "changed): mark it @pytest.mark.forked",
            pytrace=False,
        )


def _is_code(value) -> bool:
    return callable(value) or isinstance(value, (property, staticmethod, classmethod))


class _SGLangCode:
    """The functions, classes and descriptors of every loaded ``sglang`` module and of the classes
    those modules define, held by reference (an id taken while its object is alive cannot be reused,
    so comparing ids is exact). State that is not code (a group a test initialised, a registry) is
    not compared: a patch replaces code. Cheap when nothing changed: each module's and class's
    namespace is first compared as a tuple of value ids (C speed); only one that differs is diffed."""

    def __init__(self):
        self.owners: dict = {}  # (module, class name or "") -> [owner, ids of its namespace, {attr: code}]
        self.classes: dict = {}  # module name -> [(class name, class)] defined there

    @staticmethod
    def _code_of(d) -> dict:
        return {k: v for k, v in list(d.items()) if _is_code(v)}

    def _classes(self, modname: str, d) -> list:
        return [(n, v) for n, v in list(d.items()) if isinstance(v, type) and v.__module__ == modname]

    def changes(self, accept: bool = False) -> list:
        """[(key, owner, attribute, old value or None)] changed since the state last taken; new
        modules and classes (imported since) are taken, not reported. ``accept``: take the changed
        owners' current state as the new reference (what a module-scoped fixture set up is not this
        test's doing)."""
        out: list = []
        for modname, module in list(sys.modules.items()):
            if module is None or not (modname == "sglang" or modname.startswith("sglang.")):
                continue
            d = getattr(module, "__dict__", None)
            if d is None:
                continue
            if self._check((modname, ""), module, d, out, accept) or modname not in self.classes:
                self.classes[modname] = self._classes(modname, d)
            for name, cls in self.classes[modname]:
                self._check((modname, name), cls, cls.__dict__, out, accept)
        return out

    def _check(self, key, owner, d, out: list, accept: bool) -> bool:
        """Compare one namespace; True when it differs from (or is new to) the reference."""
        ids = tuple(map(id, d.values()))
        known = self.owners.get(key)
        if known is not None and known[0] is owner and known[1] == ids:
            return False
        if known is None or known[0] is not owner:
            self.owners[key] = [owner, ids, self._code_of(d)]
            return True
        old, n = known[2], len(out)
        for name, value in old.items():
            if d.get(name, _MISSING) is not value:
                out.append((key, owner, name, value))
        if key[1]:  # a class: code added to it is a patch too (a module gains submodules by import)
            out.extend((key, owner, name, None) for name, v in list(d.items()) if name not in old and _is_code(v))
        if len(out) == n or accept:  # only state changed, or accepted: the new reference
            self.owners[key] = [owner, ids, self._code_of(d)]
        return True


_MISSING = object()
_SGLANG_CODE = _SGLangCode()


class _SGLangPatchGuard:
    """Registered as a plugin (tests/conftest.py's own ``pytest_runtest_teardown`` stops shared servers)."""

    def pytest_collection_finish(self, session):
        # the reference: SGLang as the test modules' imports left it (a module first imported inside a
        # test is taken when the guard first sees it, patched or not)
        _SGLANG_CODE.changes(accept=True)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        yield from _sglang_patch_guard(item, nextitem)


def _sglang_patch_guard(item, nextitem):
    """A module that patches an SGLang function or class in the pytest process and leaves the patch
    in place changes every later module of the run (the binder's state is guarded per test above;
    this covers any patch: ``setattr`` on a class, a module function replaced, a method added or
    deleted). After the last test of each module is torn down (its module-scoped fixtures too), every
    SGLang module and class is compared with the state after the previous module; a difference is
    restored and fails that test's teardown, naming the module and each attribute. Per module, not
    per test: the comparison costs tens of ms, ~10 s over a run at this granularity. Forked tests
    run in a child and cannot leak."""
    yield
    if os.getpid() != _PYTEST_PID or (nextitem is not None and nextitem.module is item.module):
        return
    changed = _SGLANG_CODE.changes()
    if not changed:
        return
    names = []
    for (modname, cls), owner, attr, old in changed:
        names.append(f"{modname}.{cls + '.' if cls else ''}{attr}")
        if old is None:
            with contextlib.suppress(AttributeError, TypeError):
                delattr(owner, attr)
        else:
            setattr(owner, attr, old)
    _SGLANG_CODE.changes(accept=True)
    pytest.fail(
        f"{item.module.__name__} left {len(names)} SGLang patch(es) in the pytest process after its tests "
        f"(found after {item.name}; restored now): {', '.join(sorted(names))}; undo them in the test that "
        "made them (monkeypatch) or mark it @pytest.mark.forked",
        pytrace=False,
    )


_HARNESS_THREADS: set = set()  # idents of the threads alive at pytest_configure (pytest-xdist's execnet I/O)


def _other_threads() -> dict:
    main = threading.main_thread()
    return {
        t.ident: t for t in threading.enumerate() if t is not main and t.is_alive() and t.ident not in _HARNESS_THREADS
    }


# how long the threads alive in the pytest process get to end before a fork is reported as taken with them
THREAD_GRACE_S = 5.0
_THREAD_ORIGIN: dict = {}  # thread ident -> the test during which it was first seen alive
_FORKED_WITH: list = []  # the threads the parent still ran when it forked this test (read in the child)


@pytest.fixture(autouse=True)
def _no_fork_with_threads(request):
    """The pytest process forks for every ``@pytest.mark.forked`` test. A fork taken while another
    thread of this process runs (a grammar worker inside xgrammar's compiler, a persister thread, a
    pipe reader) copies the locks that thread holds into the child, held forever: a CI run hung 30
    minutes in test_set_cache's forked child after earlier grammar tests left 11 threads behind. The
    parent records which test started each thread (below) and, before a fork, gives live threads
    ``THREAD_GRACE_S`` to end (``pytest_runtest_protocol``). A fork taken with threads still running is
    reported at the end of the run (``pytest_terminal_summary``: each forked test, each thread and the
    test that left it), and such a forked test fails before its body runs (``DSPARK_TEST_STRICT_FORK=0``:
    report only).
    The child's watchdog (``pytest_runtest_setup``) bounds a hang either way."""
    if os.getpid() != _PYTEST_PID:
        if _FORKED_WITH and os.environ.get("DSPARK_TEST_STRICT_FORK", "1") != "0":
            pytest.fail(
                f"forked while {len(_FORKED_WITH)} other thread(s) ran in the pytest process: "
                f"{'; '.join(_FORKED_WITH)} (the fork copies their held locks; the tests named "
                "must close what they started)",
                pytrace=False,
            )
        yield
        return
    yield
    for ident in _other_threads():
        _THREAD_ORIGIN.setdefault(ident, request.node.nodeid)


_FORKS_WITH_THREADS: list = []  # (forked test, [thread descriptions]) for the terminal summary


_MODULE_SECONDS: dict = {}  # test module -> [setup+call+teardown seconds, tests]


_FORK_HAZARD = "dspark_forked_with_threads"

_WARM_STATS: list = []  # warm.stats_json() of this process, or of every pytest-xdist worker


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    stats = getattr(node, "workeroutput", {}).get("dspark_warm")
    if stats:
        _WARM_STATS.append(stats)


def _module(nodeid: str) -> str:
    """The test module's path of a node id (the per-module table's and the xdist groups' key)."""
    return nodeid.split("::", 1)[0]


def pytest_runtest_logreport(report):
    if report.when == "setup":
        _FORKS_WITH_THREADS.extend((report.nodeid, v) for k, v in report.user_properties if k == _FORK_HAZARD)
    entry = _MODULE_SECONDS.setdefault(_module(report.nodeid), [0.0, 0])
    entry[0] += report.duration
    if report.when == "call" or (report.when == "setup" and report.skipped):
        entry[1] += 1


def pytest_terminal_summary(terminalreporter):
    if _MODULE_SECONDS:  # the per-module budget of docs/testing.md is checked against this table
        total = sum(s for s, _ in _MODULE_SECONDS.values())
        terminalreporter.section(f"seconds per module (setup + call + teardown; {total:.0f} s in all)")
        for module, (seconds, n) in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1][0]):
            terminalreporter.line(f"{seconds:8.1f} s {n:4d} tests  {module}")
    if _WARM_STATS:  # tests/harness/warm.py: subprocesses forked from the warm interpreter, and why not
        terminalreporter.section("warm subprocesses")
        for line in warm.summary_lines(_WARM_STATS):
            terminalreporter.line(line)
    if _FORKS_WITH_THREADS:
        terminalreporter.section("forked tests forked while other threads ran (fork hazard)")
        for nodeid, threads in _FORKS_WITH_THREADS:
            terminalreporter.line(f"{nodeid}: {'; '.join(threads)}")


class _HostLock:
    """Readers-writer lock between the pytest-xdist workers of one run (``flock(2)`` on two files of a
    private directory the controller creates and removes, handed to its workers in ``workerinput``):
    every test holds it shared for its whole protocol (setup, which runs module fixtures, call,
    teardown); a ``host_exclusive`` test holds it exclusively. Such a test compares all of /dev/shm (or
    all of a prefix) before and after a server or engine lives: in the first two-worker CI run a
    multiprocessing semaphore and an SGLang message queue that tests of the other worker were using
    meanwhile read as the server's leftovers. Writer preference through a turnstile: a waiting exclusive
    test holds ``turnstile``, so the other worker's next test waits instead of starving it. Only real
    workers take it (``workerinput``, which a pytest started inside a test does not inherit, unlike the
    environment: a serial pytest inside a worker's test taking the turnstile behind a waiting exclusive
    test would deadlock the run). A serial run takes no lock; a dead worker's locks go with it."""

    KEY = "dspark_host_lock_dir"

    def __init__(self, d: str):
        self.turnstile = os.open(os.path.join(d, "turnstile"), os.O_RDWR | os.O_CREAT, 0o600)
        self.main = os.open(os.path.join(d, "host"), os.O_RDWR | os.O_CREAT, 0o600)

    @contextlib.contextmanager
    def held(self, exclusive: bool):
        import fcntl

        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.main, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self.main, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(self.turnstile, fcntl.LOCK_UN)


_HOST_LOCK: list = []  # [this worker's _HostLock] in a pytest-xdist worker (pytest_configure)
_HOST_LOCK_DIR: list = []  # [the directory] in a pytest-xdist controller


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist controller, per worker: hand it the run's lock directory."""
    node.workerinput[_HostLock.KEY] = _HOST_LOCK_DIR[0]


def pytest_unconfigure(config):
    for d in _HOST_LOCK_DIR:
        shutil.rmtree(d, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    exclusive = item.get_closest_marker("host_exclusive") is not None
    with _HOST_LOCK[0].held(exclusive) if _HOST_LOCK else contextlib.nullcontext():
        _before_fork(item)
        start = time.time()
        yield
    timeline = os.environ.get("DSPARK_TEST_TIMELINE")
    if timeline and os.getpid() == _PYTEST_PID:  # scripts/cpu_ledger.py maps process accounting onto tests
        with open(timeline, "a") as f:
            f.write(f"{os.getpid()}\t{start:.3f}\t{time.time():.3f}\t{item.nodeid}\n")


def _before_fork(item) -> None:
    _FORKED_WITH.clear()
    if os.getpid() != _PYTEST_PID or item.get_closest_marker("forked") is None:
        return None
    live = list(_other_threads().values())
    end = time.monotonic() + THREAD_GRACE_S
    for t in live:
        t.join(max(0.0, end - time.monotonic()))
    _FORKED_WITH.extend(
        f"{t.name}{' (daemon)' if t.daemon else ''} left by {_THREAD_ORIGIN.get(t.ident, 'a fixture or plugin')}"
        for t in live
        if t.is_alive()
    )
    if _FORKED_WITH:  # to the terminal summary through the report (pytest-xdist: from the worker)
        item.user_properties.append((_FORK_HAZARD, list(_FORKED_WITH)))
    return None


def _child_watchdog_s(item) -> float:
    """A forked child's own deadline, before pytest-timeout's (the test's ``timeout`` mark, else
    ``--timeout``). That alarm only raises in the parent, which then leaves the hung child behind and
    hangs at exit joining it (the CI run that timed out): the child has to end itself."""
    mark = item.get_closest_marker("timeout")
    if mark is not None and mark.args:
        timeout = float(mark.args[0])
    else:
        timeout = float(item.config.getoption("timeout", default=0) or 0)
    return max(30.0, timeout - 60.0) if timeout > 0 else 0.0


def pytest_runtest_setup(item):
    if os.getpid() != _PYTEST_PID:  # a forked child: dump every thread's stack and exit when hung
        limit = _child_watchdog_s(item)
        if limit:
            faulthandler.dump_traceback_later(limit, exit=True, file=sys.__stderr__)


def _shared_names(item) -> list[str]:
    names = getattr(item, "fixturenames", ())
    return [n for n in shared.SHARED_CONFIGS if n in names]


#: the pytest-xdist group of every module with a ``server`` or ``host_exclusive`` item (docs/testing.md): one
#: worker runs them all, one after another in the serial order below (the machine-wide server lock would make
#: a second worker wait on it anyway; shared servers keep their order and are started once), while the other
#: worker takes the remaining modules, one module per unit (module-scoped fixtures run once)
SERVER_GROUP = "sglang-servers"


def _uses_server(item) -> bool:
    return bool(_shared_names(item)) or bool(
        {"sglang_server", "module_sglang_server"} & set(getattr(item, "fixturenames", ()))
    )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(session, config, items):
    order = list(shared.SHARED_CONFIGS)

    def key(pair):
        idx, item = pair
        used = _shared_names(item)
        group = 1 + min(order.index(n) for n in used) if used else 0
        # inside a shared server's group: ``shared_order(n)`` marks (default 0), e.g. a module that needs
        # the fresh server first, a test that shuts it down last (tests/harness/shared.py)
        mark = item.get_closest_marker("shared_order")
        return (group, mark.args[0] if (used and mark) else 0, idx)

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]
    gpu_items = []
    server_modules = set()
    for item in items:
        if _uses_server(item):
            item.add_marker(pytest.mark.server)
        if item.get_closest_marker("server") or item.get_closest_marker("host_exclusive"):
            server_modules.add(_module(item.nodeid))
        if item.get_closest_marker("gpu"):
            gpu_items.append(item)
    # the controller has --dist loadgroup; a worker has dist "no" and xdist's own ``loadgroup`` flag (the
    # workers' collection is what the scheduler groups: without the marks there, every module was its own
    # unit, the two workers each started the shared servers and waited on each other's server lock)
    if config.pluginmanager.hasplugin("xdist") and (
        config.getoption("dist", "no") == "loadgroup" or getattr(config.option, "loadgroup", False)
    ):
        # the server group first (the longest unit: the other worker takes the other modules beside it),
        # then every other module as its own unit in collection order
        for item in items:
            module = _module(item.nodeid)
            item.add_marker(pytest.mark.xdist_group(SERVER_GROUP if module in server_modules else module))
        items.sort(key=lambda item: _module(item.nodeid) not in server_modules)  # stable
    if gpu_items:
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs CUDA (gpu marker); run on the device machine")
            for item in gpu_items:
                item.add_marker(skip)


#: id(item) -> the shared servers some later test of the run needs (filled on first teardown)
_NEEDED_LATER: dict = {}


def _needed_later(item) -> set:
    """The shared servers a test after ``item`` needs. The server group runs on one worker in collection
    order (pytest-xdist sends a group's items as one unit), and no test outside it uses a shared server,
    so the tests after ``item`` in this process's collection are the ones that can still need them."""
    if not _NEEDED_LATER:
        later: set = set()
        for it in reversed(item.session.items):
            _NEEDED_LATER[id(it)] = set(later)
            later |= set(_shared_names(it))
    return _NEEDED_LATER.get(id(item), set())


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    # stopped right after the last test that needs it (not after the last *adjacent* one: a test that uses
    # two shared servers sits at the end of one's group and starts the other, tests/harness/shared.py)
    needed = _needed_later(item) if nextitem is not None else set()
    for name in list(shared.SHARED_CONFIGS):
        if shared.running(name) is not None and name not in needed:
            shared.stop(name)


def pytest_sessionfinish(session, exitstatus):
    out = getattr(session.config, "workeroutput", None)
    if out is not None:  # a pytest-xdist worker: its warm-subprocess counts go to the controller
        out["dspark_warm"] = warm.stats_json()
    else:
        _WARM_STATS.append(warm.stats_json())
    shared.stop_all()
    # a forked child still running here (pytest-timeout failed its test from the parent) would make
    # this process hang at exit in multiprocessing's join of its children
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()


def _shared_fixture(name):
    @pytest.fixture(name=name)
    def fixture():
        return shared.get(name)

    fixture.__doc__ = f"Shared server {name!r}: {shared.SHARED_CONFIGS[name]}"
    return fixture


for _name in shared.SHARED_CONFIGS:
    globals()[f"_fixture_{_name}"] = _shared_fixture(_name)


@pytest.fixture(scope="session")
def tiny_models() -> dict:
    """{arch: model dir} for every tiny model (built once, cached across runs)."""
    from dspark_harden.devtools.tiny_models import ARCHS, ensure_model

    return {arch: ensure_model(arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_tokenizer() -> str:
    """Directory of the 2048-token tokenizer every tiny model uses."""
    from dspark_harden.devtools.tiny_models import ensure_tokenizer

    return ensure_tokenizer(2048)


class _Factory:
    def __init__(self):
        self.servers: list[SGLangServer] = []

    def __call__(self, config: ServerConfig, timeout=None) -> SGLangServer:
        server = SGLangServer(config)
        self.servers.append(server)
        return server.start(timeout)

    def stop_all(self):
        for server in reversed(self.servers):
            server.stop()
            server.remove_workdir()
        self.servers.clear()


@pytest.fixture
def sglang_server():
    """Factory: ``sglang_server(ServerConfig(...))`` starts a server, stopped at test teardown."""
    factory = _Factory()
    yield factory
    factory.stop_all()


@pytest.fixture(scope="module")
def module_sglang_server():
    """Factory like ``sglang_server`` whose servers live until the end of the test module."""
    factory = _Factory()
    yield factory
    factory.stop_all()
