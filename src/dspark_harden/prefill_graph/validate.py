"""Eager-reference validation of prefill-graph replays (``DSPARK_HARDEN_PREFILL_GRAPH_VALIDATE=N``).

On a validated replay the step runs twice: the captured graph (stock ``PrefillCudaGraphRunner.execute``)
and stock's eager path (``ModelRunner.eager_runner.execute``) on the same ``ForwardBatch``. Both write
side state: the KV of the step's tokens and per-request state (DSV4 compressor / ring rows, mamba
states). So the rows the step touches are saved first, the graph runs, its outputs and the touched
rows are copied, the saved rows are restored, eager runs, and outputs and touched rows are compared
(:func:`compare`). The step returns the eager result (the reference) and keeps eager's side state.

Touched rows (:class:`TouchedRows`): every tensor held by the KV pool and the request pool (their
attributes, nested lists / tuples / dicts and nested SGLang objects, three levels deep) whose leading dimension
covers the step's indices -- token-indexed rows at ``out_cache_loc``, request-indexed rows at
``req_pool_indices``. State addressed through another index (DSV4's translated SWA / compressed
locations) is not saved: validation therefore runs only on replays without a cached prefix, where
such state is written from this step's inputs alone and an eager re-run rewrites it identically.

Schedule (:class:`Schedule`): per bucket, the first ``K`` eligible replays
(``DSPARK_HARDEN_PREFILL_GRAPH_VALIDATE_FIRST``) and every ``N``-th after. Buckets and verdicts are
shared by the DP group, so every rank validates the same steps (both run graph then eager: the
collectives pair up). A mismatch raises :class:`PrefillGraphValidationError` naming the bucket and
geometry (``..._VALIDATE_ACTION=raise``, default) or is counted and logged (``count``); outcomes are
counted in ``dspark_harden_prefill_graph_validations_total{outcome}``. Cost: a validated step runs
the forward twice; device memory holds two copies of the touched rows while the graph's result is
compared (the saved rows until the restore, the graph's rows until the comparison), read back one
tensor at a time.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Callable, Iterator, Optional

logger = logging.getLogger("dspark_harden.prefill_graph")

OUTCOMES = ("match", "mismatch")
ACTIONS = ("raise", "count")


class PrefillGraphValidationError(RuntimeError):
    """A validated prefill-graph replay differs from stock's eager forward of the same batch."""

    def __init__(self, *, bucket: int, differences: list, geometry: dict, dp_rank: Any = None) -> None:
        self.bucket, self.differences, self.geometry = bucket, differences, geometry
        super().__init__(
            f"dspark-harden prefill-graph validation (dp_rank {dp_rank}): the replay of bucket {bucket} differs "
            f"from stock's eager forward: {'; '.join(differences[:6])}"
            f"{f' (+{len(differences) - 6} more)' if len(differences) > 6 else ''}; geometry {geometry}"
        )


class Schedule:
    """Per-key replay counter: the first ``first`` replays of a key and every ``every``-th after."""

    def __init__(self, every: int, first: int) -> None:
        if every < 1 or first < 0:
            raise ValueError(f"validation schedule needs every >= 1 and first >= 0, got {every}, {first}")
        self.every, self.first = every, first
        self.seen: collections.Counter = collections.Counter()

    def due(self, key: Any) -> bool:
        self.seen[key] += 1
        n = self.seen[key]
        return n <= self.first or (n - self.first) % self.every == 0


def _tensors(obj: Any, name: str, depth: int, seen: set, top: bool = False) -> Iterator[tuple]:
    import torch

    if isinstance(obj, torch.Tensor):
        yield name, obj
        return
    if depth <= 0 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            yield from _tensors(x, f"{name}[{i}]", depth - 1, seen)
    elif isinstance(obj, dict):
        for k, x in obj.items():
            yield from _tensors(x, f"{name}[{k!r}]", depth - 1, seen)
    elif (top or type(obj).__module__.startswith("sglang.")) and hasattr(obj, "__dict__"):
        for k, x in vars(obj).items():
            yield from _tensors(x, f"{name}.{k}", depth - 1, seen)


class TouchedRows:
    """Rows of side-state tensors a step may write: ``(label, tensor, index)`` entries; ``save`` /
    ``restore`` / ``read`` copy exactly those rows."""

    def __init__(self, entries: list) -> None:
        self.entries = entries
        self.saved: Optional[list] = None

    @classmethod
    def discover(cls, owners: dict, *, depth: int = 3) -> "TouchedRows":
        """``owners``: ``{label: (object, index tensor)}``; every tensor reachable from the object whose
        leading dimension exceeds the largest index is saved at those rows (each tensor once)."""
        entries, seen_ptrs = [], set()
        for label, (obj, index) in owners.items():
            if obj is None or index is None or index.numel() == 0:
                continue
            idx = index.long()
            top = int(idx.max())
            if int(idx.min()) < 0:
                raise ValueError(f"{label}: negative index in the step's rows")
            for name, t in _tensors(obj, label, depth, set(), top=True):
                if t.dim() == 0 or t.shape[0] <= top or t.data_ptr() in seen_ptrs:
                    continue
                seen_ptrs.add(t.data_ptr())
                entries.append((name, t, idx.to(t.device)))
        return cls(entries)

    def read(self) -> list:
        return [t.index_select(0, idx) for _, t, idx in self.entries]

    def save(self) -> None:
        self.saved = self.read()

    def restore(self) -> None:
        """Write the saved rows back and drop the copy (one copy less held while eager runs)."""
        if self.saved is None:
            raise RuntimeError("TouchedRows.restore before save")
        for (_, t, idx), rows in zip(self.entries, self.saved, strict=True):
            t.index_copy_(0, idx, rows)
        self.saved = None

    def compare_to(self, rows: list, tolerance: float) -> list:
        """Differences between ``rows`` (an earlier :meth:`read`) and the current rows, read one tensor
        at a time (no second full copy)."""
        out = []
        for (name, t, idx), before in zip(self.entries, rows, strict=True):
            out += compare([(name, before)], [(name, t.index_select(0, idx))], tolerance)
        return out

    @property
    def labels(self) -> list:
        return [name for name, _, _ in self.entries]


def output_tensors(out: Any, name: str = "output") -> Iterator[tuple]:
    """``(path, tensor)`` of every tensor in a runner output (dataclasses, PPProxyTensors, nesting)."""
    import torch

    if out is None:
        return
    if isinstance(out, torch.Tensor):
        yield name, out
    elif isinstance(out, (list, tuple)):
        for i, x in enumerate(out):
            yield from output_tensors(x, f"{name}[{i}]")
    elif isinstance(out, dict):
        for k, x in out.items():
            yield from output_tensors(x, f"{name}[{k!r}]")
    elif dataclasses.is_dataclass(out):
        for f in dataclasses.fields(out):
            yield from output_tensors(getattr(out, f.name), f"{name}.{f.name}")
    elif hasattr(out, "tensors") and isinstance(out.tensors, dict):
        yield from output_tensors(out.tensors, f"{name}.tensors")


def compare(graph: list, eager: list, tolerance: float) -> list:
    """Differences between two ``[(path, tensor)]`` lists: a missing / extra tensor, a shape or dtype
    change, or ``max|graph - eager| > tolerance * max(1, max|eager|)`` (0: bit-identical)."""
    out = []
    g, e = dict(graph), dict(eager)
    for path in sorted(set(g) ^ set(e)):
        out.append(f"{path}: only in the {'graph' if path in g else 'eager'} output")
    for path in [p for p, _ in eager if p in g]:
        a, b = g[path], e[path]
        if a.shape != b.shape or a.dtype != b.dtype:
            out.append(f"{path}: graph {tuple(a.shape)} {a.dtype} vs eager {tuple(b.shape)} {b.dtype}")
            continue
        if a.numel() == 0:
            continue
        if not (a.is_floating_point() or a.is_complex()):
            bad = int((a != b).sum())
            if bad:
                out.append(f"{path}: {bad} of {a.numel()} elements differ")
            continue
        af, bf = a.double(), b.double()
        nan_mismatch = int((af.isnan() != bf.isnan()).sum())
        diff = (af - bf).abs().nan_to_num(0.0)
        worst = float(diff.max())
        scale = max(1.0, float(bf.abs().nan_to_num(0.0).max()))
        if nan_mismatch or worst > tolerance * scale:
            out.append(
                f"{path}: max |graph - eager| {worst:.3g} > {tolerance:g} x {scale:.3g}"
                + (f", {nan_mismatch} NaN positions differ" if nan_mismatch else "")
            )
    return out


def clone_outputs(out: Any) -> list:
    return [(p, t.detach().clone()) for p, t in output_tensors(out)]


@dataclasses.dataclass
class Validator:
    schedule: Schedule
    tolerance: float
    action: str = "raise"
    dp_rank: Any = None
    #: ``on_outcome(outcome)`` per validated replay (metrics)
    on_outcome: Optional[Callable[[str], None]] = None
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def eligible(self, forward_batch: Any) -> bool:
        return not any(int(p) for p in (getattr(forward_batch, "extend_prefix_lens_cpu", None) or []))

    def record(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self.on_outcome is not None:
            self.on_outcome(outcome)

    def run(
        self,
        *,
        bucket: int,
        graph: Callable[[], Any],
        eager: Callable[[], Any],
        touched: TouchedRows,
        geometry: Callable[[], dict],
    ) -> Any:
        """One validated step: returns the eager output (or raises on a mismatch with ``raise``)."""
        touched.save()
        graph_out = clone_outputs(graph())
        graph_rows = touched.read()
        touched.restore()
        eager_result = eager()
        diffs = compare(graph_out, clone_outputs(eager_result), self.tolerance)
        diffs += touched.compare_to(graph_rows, self.tolerance)
        outcome = "mismatch" if diffs else "match"
        self.record(outcome)
        if diffs:
            err = PrefillGraphValidationError(
                bucket=bucket, differences=diffs, geometry=geometry(), dp_rank=self.dp_rank
            )
            if self.action == "raise":
                logger.critical("%s", err)
                raise err
            logger.error("%s (counted: DSPARK_HARDEN_PREFILL_GRAPH_VALIDATE_ACTION=count)", err)
        return eager_result


VALIDATOR: Optional[Validator] = None


def touched_rows(model_runner: Any, forward_batch: Any) -> TouchedRows:
    return TouchedRows.discover(
        {
            "token_to_kv_pool": (getattr(model_runner, "token_to_kv_pool", None), forward_batch.out_cache_loc),
            "req_to_token_pool": (getattr(model_runner, "req_to_token_pool", None), forward_batch.req_pool_indices),
        }
    )


def build_execute(stock: Callable, validator: Optional[Validator] = None) -> Callable:
    """``PrefillCudaGraphRunner.execute`` with the validation schedule in front of it."""

    def execute(self, forward_batch, **kwargs):
        v = validator or VALIDATOR
        if v is None or not v.eligible(forward_batch):
            return stock(self, forward_batch, **kwargs)
        bucket = self._pad_to_bucket(len(forward_batch.input_ids), self.capture_num_tokens)
        if not v.schedule.due(bucket):
            return stock(self, forward_batch, **kwargs)
        from .decision import geometry

        mr = self.model_runner
        return v.run(
            bucket=bucket,
            graph=lambda: stock(self, forward_batch, **kwargs),
            eager=lambda: mr.eager_runner.execute(forward_batch, pp_proxy_tensors=kwargs.get("pp_proxy_tensors")),
            touched=touched_rows(mr, forward_batch),
            geometry=lambda: geometry(forward_batch),
        )

    execute.__doc__ = stock.__doc__
    return execute
