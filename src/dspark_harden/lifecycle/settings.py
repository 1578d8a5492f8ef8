"""Features and environment variables of the lifecycle package (parsed strictly by the core)."""

from __future__ import annotations

from ..core.settings import Setting, flag01, nonneg_float, nonneg_int, positive_float

SHUTDOWN = "lifecycle-shutdown"
GC_FREEZE = "gc-freeze"
HICACHE_GATE = "hicache-gate"
HOSTPOOL = "hostpool-teardown"
STRICT_VMM = "strict-vmm"

SHUTDOWN_SWITCH = "DSPARK_HARDEN_LIFECYCLE"
DRAIN_S = "DSPARK_HARDEN_SHUTDOWN_DRAIN_S"
BARRIER_TIMEOUT_S = "DSPARK_HARDEN_SHUTDOWN_BARRIER_TIMEOUT_S"
DEATH_GRACE_S = "DSPARK_HARDEN_DEATH_GRACE_S"
GC_SWITCH = "DSPARK_HARDEN_GC_FREEZE"
GC_AFTER_BATCHES = "DSPARK_HARDEN_GC_FREEZE_AFTER_BATCHES"
GATE_CONTROL = "SGLANG_HICACHE_GATE_CONTROL"
HOSTPOOL_SWITCH = "DSPARK_HARDEN_HOSTPOOL_TEARDOWN"
STRICT_VMM_SWITCH = "DSPARK_HARDEN_STRICT_VMM"

#: vLLM's --shutdown-timeout is the anchor (it defaults to 0 = abort); serving stacks behind a
#: load balancer (Kubernetes: terminationGracePeriodSeconds 30 s) want in-flight requests to
#: finish. 30 s lets a long generation of a few thousand tokens finish on a GPU and stays inside
#: Kubernetes' default grace period together with the ~5 s teardown.
DEFAULT_DRAIN_S = 30.0
DEFAULT_BARRIER_TIMEOUT_S = 10.0
DEFAULT_DEATH_GRACE_S = 2.0
DEFAULT_GC_AFTER_BATCHES = 8


class GateMode(str):
    """``disabled`` / ``armed``; truthy only when armed (it is also the feature's switch)."""

    def __bool__(self) -> bool:
        return self == "armed"


def gate_control(raw: str) -> GateMode:
    """one of: disabled, armed"""
    if raw in ("armed", "disabled"):
        return GateMode(raw)
    raise ValueError(f"must be one of disabled, armed; got {raw!r}")


gate_control.bad_examples = ("", "1", "ARMED", "on", "armed ")

SETTINGS = [
    Setting(
        SHUTDOWN_SWITCH,
        flag01,
        True,
        "1: draining, ordered SIGTERM shutdown and loud, complete handling of a child process death "
        "(every in-flight request answered, leftovers removed, non-zero exit naming the rank). 0: stock.",
        feature=SHUTDOWN,
    ),
    Setting(
        DRAIN_S,
        nonneg_float,
        DEFAULT_DRAIN_S,
        "Seconds in-flight requests may take to finish after SIGTERM (new requests get 503 at once). "
        "Requests still running at the deadline are aborted with HTTP 503 naming the drain window. "
        "0: abort in-flight requests at once (vLLM's --shutdown-timeout 0).",
        feature=SHUTDOWN,
        accepts="seconds >= 0",
    ),
    Setting(
        BARRIER_TIMEOUT_S,
        positive_float,
        DEFAULT_BARRIER_TIMEOUT_S,
        "Seconds a scheduler waits at the shutdown barrier (its CPU process group, after releasing host "
        "resources, before the groups are torn down) for its peers; a dead peer costs at most this.",
        feature=SHUTDOWN,
        accepts="positive seconds",
    ),
    Setting(
        DEATH_GRACE_S,
        positive_float,
        DEFAULT_DEATH_GRACE_S,
        "After a child process died: seconds the main process gives the error responses of in-flight "
        "requests to reach their clients before it tears the server down.",
        feature=SHUTDOWN,
        accepts="positive seconds",
    ),
    Setting(
        GC_SWITCH,
        flag01,
        True,
        "1: gc.freeze() once after warm-up in every scheduler, the detokenizer and the main process "
        "(tokenizer) after a gc.collect(), re-freeze after a later graph capture unfroze the heap, pace gen-2 "
        "collections after the freeze, and export gen-2 collection pauses per dp_rank. 0: stock (the HTTP server "
        "freezes once after its warm-up request, without a collection first; the offline Engine only on Engine.freeze_gc()).",
        feature=GC_FREEZE,
    ),
    Setting(
        GC_AFTER_BATCHES,
        nonneg_int,
        DEFAULT_GC_AFTER_BATCHES,
        "Warm-up is over after this many batches processed by the process (scheduler: forward batches; "
        "detokenizer: output batches; main: responses), counted after startup (graph capture and "
        "SGLang's own warm-up request are part of startup).",
        feature=GC_FREEZE,
        accepts="integer >= 0",
    ),
    Setting(
        GATE_CONTROL,
        gate_control,
        GateMode("disabled"),
        "The one-shot HiCache eviction gate (POST /set_internal_state with "
        '{"server_args": {"hicache_gate_evict_device_tokens": N}}). armed: accepted once per scheduler '
        "(then disarmed), only while HiCache is on and the scheduler idle; needs one scheduler per DP group "
        "(attention-TP 1, attention-CP 1, PP 1), startup stops otherwise. disabled: the key is refused.",
        feature=HICACHE_GATE,
        accepts="disabled (default) or armed",
    ),
    Setting(
        HOSTPOOL_SWITCH,
        flag01,
        True,
        "1: HostPoolGroup.destroy runs every pool's destroy() even when one raises, then reports every "
        "failure naming its pool. 0: stock (the first failure skips the remaining pools).",
        feature=HOSTPOOL,
    ),
    Setting(
        STRICT_VMM_SWITCH,
        flag01,
        False,
        "1: the CUDA VMM multimodal feature transport must get the handle type it asked for; SGLang's "
        "silent FABRIC -> POSIX fallback on one node stops startup instead. 0: stock.",
        feature=STRICT_VMM,
    ),
]
