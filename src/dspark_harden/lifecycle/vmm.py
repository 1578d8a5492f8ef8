"""Strict VMM: refuse SGLang's silent FABRIC -> POSIX handle fallback.

``CudaVmmFeatureTransport.__init__`` (multimodal ``--mm-feature-transport cuda_vmm``) builds its
``CudaVmmMemoryPool`` with ``allow_posix_fallback=nnodes == 1``: on one node, when the device
reports POSIX file-descriptor handles or the FABRIC allocation fails, the pool silently switches
to a POSIX FD shared over a unix socket (a WARNING at most). With ``DSPARK_HARDEN_STRICT_VMM=1``
the wrapped ``CudaVmmMemoryPool.__init__`` always passes ``allow_posix_fallback=False`` and turns
the resulting failure into :class:`StrictVmmError` naming what happened and what to do; startup
stops (the tokenizer manager is built during launch).

Only reachable with CUDA (the pool calls the CUDA driver first thing); on a CPU machine the patch
is bound and verified, and its decision logic is tested with a stand-in for the CUDA pool.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("dspark_harden.lifecycle")

MESSAGE = (
    "DSPARK_HARDEN_STRICT_VMM=1: the CUDA VMM multimodal feature transport could not use a FABRIC "
    "handle ({cause}); SGLang would fall back to a POSIX file-descriptor handle on this node, which "
    "strict VMM refuses. Use a driver/device with FABRIC handles (IMEX channel), another "
    "--mm-feature-transport, or DSPARK_HARDEN_STRICT_VMM=0 to accept the POSIX fallback."
)


class StrictVmmError(RuntimeError):
    """The FABRIC -> POSIX fallback was needed and refused."""


def build_pool_init(stock):
    @functools.wraps(stock)
    def __init__(self, *args, **kwargs):
        names = ("memory_size", "recycle_interval", "base_gpu_id", "consumer_count", "allow_posix_fallback")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        wanted = bool(bound.get("allow_posix_fallback", False))
        bound["allow_posix_fallback"] = False
        try:
            stock(self, **bound)
        except RuntimeError as exc:
            if not wanted:
                raise
            msg = MESSAGE.format(cause=f"{type(exc).__name__}: {exc}")
            logger.critical(msg)
            raise StrictVmmError(msg) from exc

    return __init__
