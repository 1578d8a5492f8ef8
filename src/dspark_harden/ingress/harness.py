"""A real ``DataParallelController`` wired to real ZMQ sockets, without launching schedulers.

Used by ``dspark-harden bench controller`` and the controller tests. Stock ``__init__`` launches
scheduler processes (model load) and reads SGLang's process-wide runtime context, so instead the
object is made with ``DataParallelController.__new__`` and given exactly the attributes that the
dispatch path and ``event_loop`` read, wired the way stock wires them:

* ``recv_from_tokenizer``: PULL socket that *connects* to the tokenizer's endpoint (the tokenizer
  side binds, as ``TokenizerManager`` does for ``scheduler_input_ipc_name``);
* ``workers[i]``: PUSH sockets that *bind* (as ``get_zmq_socket_on_host`` does in
  ``launch_dp_attention_schedulers``); each stand-in scheduler connects a PULL socket;
* ``port_args.tokenizer_ipc_name``: the endpoint the tokenizer's result PULL socket binds (the
  detokenizer pushes there; so does our route rejection);
* the dispatcher comes from the real ``init_dispatcher()`` and the watchdog from the real
  ``Watchdog.create`` (soft), so every method called is the stock (or patched) class method.

Stand-ins (stated here because they replace what cannot run in a unit test): the scheduler
processes are PULL sockets in the test/bench process; the load-balance method is round robin
unless a test selects another.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

import zmq


@dataclass
class Endpoints:
    tokenizer_to_controller: str
    controller_to_workers: list
    controller_to_tokenizer: str

    @classmethod
    def new(cls, dp_size: int, directory: Optional[str] = None) -> "Endpoints":
        directory = directory or tempfile.mkdtemp(prefix="dspark-dpc-")
        os.makedirs(directory, exist_ok=True)
        if len(directory) > 60:
            raise ValueError(f"IPC directory {directory!r} is too long for AF_UNIX socket paths")
        tag = uuid.uuid4().hex[:8]
        ipc = lambda name: f"ipc://{os.path.join(directory, f'{tag}-{name}')}"  # noqa: E731
        return cls(
            tokenizer_to_controller=ipc("scheduler_input"),
            controller_to_workers=[ipc(f"worker{i}") for i in range(dp_size)],
            controller_to_tokenizer=ipc("tokenizer"),
        )


def build_controller(
    endpoints: Endpoints,
    *,
    dp_size: int,
    load_balance: str = "round_robin",
    watchdog_timeout: Optional[float] = None,
    active: Optional[list] = None,
) -> Any:
    """A ``DataParallelController`` bound to ``endpoints`` (see the module docstring)."""
    from sglang.srt.managers import data_parallel_controller as dpc
    from sglang.srt.utils.network import get_zmq_socket
    from sglang.srt.utils.watchdog import Watchdog

    ctrl = dpc.DataParallelController.__new__(dpc.DataParallelController)
    ctrl.context = zmq.Context(1 + dp_size)
    ctrl.recv_from_tokenizer = get_zmq_socket(ctrl.context, zmq.PULL, endpoints.tokenizer_to_controller, False)
    ctrl.workers = [get_zmq_socket(ctrl.context, zmq.PUSH, ep, True) for ep in endpoints.controller_to_workers]
    ctrl.port_args = SimpleNamespace(tokenizer_ipc_name=endpoints.controller_to_tokenizer)
    ctrl.load_balance_method = dpc.LoadBalanceMethod.from_str(load_balance)
    ctrl.round_robin_counter = 0
    ctrl.health_round_robin_counter = 0
    lookup = {
        dpc.LoadBalanceMethod.ROUND_ROBIN: ctrl.round_robin_scheduler,
        dpc.LoadBalanceMethod.TOTAL_REQUESTS: ctrl.total_requests_scheduler,
        dpc.LoadBalanceMethod.TOTAL_TOKENS: ctrl.total_tokens_scheduler,
    }
    ctrl.dispatching = lookup[ctrl.load_balance_method]
    ctrl.refresh_load_budget_on_dispatch = ctrl.load_balance_method in (
        dpc.LoadBalanceMethod.TOTAL_REQUESTS,
        dpc.LoadBalanceMethod.TOTAL_TOKENS,
    )
    ctrl.launch_dp_size = ctrl.max_dp_size = dp_size
    ctrl.dp_active = [True] * dp_size
    ctrl.status = list(active) if active is not None else [True] * dp_size
    ctrl._active_workers = [i for i in range(dp_size) if ctrl.dp_active[i] and ctrl.status[i]]
    ctrl._active_count_cache = len(ctrl._active_workers)
    ctrl.control_message_step = 1
    ctrl.dp_budget = dpc.DPBudget(dp_size)
    ctrl._last_refresh_time = 0.0
    ctrl.load_snapshot_reader = SimpleNamespace(read_all=lambda: [])  # no schedulers publish here
    ctrl.soft_watchdog = Watchdog.create(
        debug_name="DataParallelController",
        watchdog_timeout=watchdog_timeout,
        soft=True,
    )
    ctrl.init_dispatcher()
    return ctrl


def close_controller(ctrl: Any) -> None:
    """Close a harness controller's sockets with linger 0 and terminate its context (a context
    left to the garbage collector may block in ``term()`` on unsent messages)."""
    socks = [ctrl.recv_from_tokenizer, *ctrl.workers, getattr(ctrl, "_dspark_reject_sock", None)]
    for sock in socks:
        if sock is not None:
            sock.close(linger=0)
    ctrl.context.term()


@dataclass
class Peer:
    """The tokenizer and scheduler ends of a harness controller, in this process."""

    endpoints: Endpoints
    context: Any = None
    to_controller: Any = None
    from_controller: Any = None  # tokenizer result socket (rejections arrive here)
    workers: list = field(default_factory=list)

    def open(self) -> "Peer":
        from sglang.srt.utils.network import get_zmq_socket

        self.context = zmq.Context(2)
        self.to_controller = get_zmq_socket(self.context, zmq.PUSH, self.endpoints.tokenizer_to_controller, True)
        self.from_controller = get_zmq_socket(self.context, zmq.PULL, self.endpoints.controller_to_tokenizer, True)
        self.workers = [
            get_zmq_socket(self.context, zmq.PULL, ep, False) for ep in self.endpoints.controller_to_workers
        ]
        return self

    def send(self, obj: Any) -> None:
        from sglang.srt.managers.io_struct import sock_send

        sock_send(self.to_controller, obj)

    def recv_any(self, timeout_ms: int) -> Optional[tuple]:
        """``(worker_index or 'tokenizer', message)`` for the first message, or None on timeout."""
        from sglang.srt.managers.io_struct import sock_recv

        poller = zmq.Poller()
        socks = {s: i for i, s in enumerate(self.workers)}
        socks[self.from_controller] = "tokenizer"
        for s in socks:
            poller.register(s, zmq.POLLIN)
        ready = dict(poller.poll(timeout_ms))
        for s, who in socks.items():
            if s in ready:
                return who, sock_recv(s, flags=zmq.NOBLOCK)
        return None

    def close(self) -> None:
        for s in [self.to_controller, self.from_controller, *self.workers]:
            if s is not None:
                s.close(linger=0)
        if self.context is not None:
            self.context.term()


def make_request(rid: str, *, routed_dp_rank: Optional[int] = None, n_tokens: int = 4) -> Any:
    """A real ``TokenizedGenerateReqInput`` with wrapped API-server time stats, as the
    tokenizer sends it."""
    from array import array

    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput, wrap_as_pickle
    from sglang.srt.observability.req_time_stats import APIServerReqTimeStats
    from sglang.srt.sampling.sampling_params import SamplingParams

    ts = APIServerReqTimeStats()
    ts.set_created_time()
    ts.set_api_server_dispatch_time()
    return TokenizedGenerateReqInput(
        rid=rid,
        input_text="x",
        input_ids=array("i", range(1, n_tokens + 1)),
        input_embeds=None,
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=SamplingParams(max_new_tokens=1),
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        stream=False,
        routed_dp_rank=routed_dp_rank,
        time_stats=wrap_as_pickle(ts),
    )


def make_batch(rids: list, ranks: list) -> Any:
    from sglang.srt.managers.io_struct import BatchTokenizedGenerateReqInput

    return BatchTokenizedGenerateReqInput(batch=[make_request(r, routed_dp_rank=k) for r, k in zip(rids, ranks)])
