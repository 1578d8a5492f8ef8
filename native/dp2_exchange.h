/* dspark-harden native DP2 exchange: public C API.
 *
 * This header is both #included by dp2_exchange.c and cdef'd by cffi (native/build_dp2.py strips
 * the preprocessor lines, so every constant the Python side needs is an enum, not a macro).
 *
 * Every function returns 0 (DSPARK_DP2_OK) or one of the error codes below and writes a
 * NUL-terminated message into the caller's buffer (at least DSPARK_DP2_ERRBUF_MIN bytes).
 */
#ifndef DSPARK_DP2_EXCHANGE_H
#define DSPARK_DP2_EXCHANGE_H

#include <stddef.h>
#include <stdint.h>

enum {
    DSPARK_DP2_ABI_VERSION = 5,
    DSPARK_DP2_LAYOUT_VERSION = 3,
    DSPARK_DP2_WORLD_SIZE = 2,
    DSPARK_DP2_MAX_WIDTH = 32,
    DSPARK_DP2_ERRBUF_MIN = 128,
    DSPARK_DP2_HIST_BUCKETS = 12, /* 11 edges (1 us .. 1 s) + above */
    DSPARK_DP2_WAIT_SLICE_MS = 20
};

/* Error codes. Codes >= DSPARK_DP2_E_OWNERSHIP are published to shared state (the first one
 * wins) so both ranks stop; the channel is poisoned for good after any of them. */
enum {
    DSPARK_DP2_OK = 0,
    DSPARK_DP2_E_ARG = 1,          /* bad argument (local, nothing published) */
    DSPARK_DP2_E_SHM = 2,          /* shm_open/ftruncate/mmap/mlock/flock failed at open */
    DSPARK_DP2_E_MISMATCH = 3,     /* ABI / layout / world size / width / config mismatch at open */
    DSPARK_DP2_E_OWNED = 4,        /* this rank's slot is owned by another (live or stale) process, or the
                                      segment is not this server's (owner uid / mode 0600) */
    DSPARK_DP2_E_FORK = 5,         /* handle used in a process other than the one that opened it */
    DSPARK_DP2_E_CLOSED = 6,       /* handle already closed */
    DSPARK_DP2_E_POISONED = 7,     /* an error was published earlier (by either rank) */
    DSPARK_DP2_E_OWNERSHIP = 8,    /* own slot no longer holds our pid */
    DSPARK_DP2_E_CLOCK = 9,        /* clock_gettime failed */
    DSPARK_DP2_E_SEQUENCE = 10,    /* own published sequence diverged from the local count */
    DSPARK_DP2_E_PEER_DIED = 11,   /* peer process gone (ESRCH, zombie, or pid reused) */
    DSPARK_DP2_E_PEER_CLOSED = 12, /* peer closed its end while we waited for it */
    DSPARK_DP2_E_TIMEOUT = 13,     /* peer did not arrive within the timeout */
    DSPARK_DP2_E_FUTEX = 14,       /* futex wait failed with an unexpected errno */
    DSPARK_DP2_E_LAPPED = 15,      /* peer sequence is more than one ahead (or behind) */
    DSPARK_DP2_E_ARRIVAL = 16,     /* peer arrival timestamp missing for the slot */
    DSPARK_DP2_E_UNLINK = 17,      /* shm_unlink failed when both ranks were attached */
    DSPARK_DP2_E_CALLER = 18,      /* the caller found a problem and poisoned the channel */
    DSPARK_DP2_STALLED = 19        /* not an error, nothing published: one timeout period passed while the
                                      peer is attached and provably alive; dspark_dp2_wait continues */
};

typedef struct dspark_dp2_channel dspark_dp2_channel;

typedef struct {
    uint64_t sequence;               /* sequence number of the completed exchange (1, 2, ...) */
    uint64_t total_ns;               /* whole call */
    uint64_t peer_wait_ns;           /* after publishing, waiting for the peer */
    uint64_t arrival_skew_ns;        /* |own arrival - peer arrival| */
    uint64_t post_latest_arrival_ns; /* finish - max(own arrival, peer arrival) */
    uint32_t futex_waits;            /* futex waits this call (0 when the spin sufficed) */
    uint32_t reserved;
    /* Accumulated by every successful call until the caller resets them (metrics flush), so the
     * hot path needs no per-call work in Python. Index: 0 total, 1 peer_wait, 2 arrival_skew,
     * 3 post_latest_arrival. */
    uint64_t acc_calls;
    uint64_t acc_futex_waits;
    uint64_t acc_sum_ns[4];
    uint64_t acc_max_ns[4];
    /* Low-resolution histogram per phase (same index), accumulated like the sums: acc_hist[i][b] counts
     * the calls whose value is <= dspark_dp2_hist_edge_ns(b) and > the edge before (b = HIST_BUCKETS - 1:
     * above the last edge). */
    uint64_t acc_hist[4][DSPARK_DP2_HIST_BUCKETS];
} dspark_dp2_stats;

/* Upper edge of histogram bucket b in ns (0 <= b < DSPARK_DP2_HIST_BUCKETS - 1); 0 for any other b. */
uint64_t dspark_dp2_hist_edge_ns(int b);

int dspark_dp2_abi_version(void);

/* Open (create or attach) the channel "/dspark_dp2_<fnv1a64(session_id + ':' + channel)>".
 * width: number of int64 values each rank contributes (1..DSPARK_DP2_MAX_WIDTH).
 * config_digest: any 64-bit value both ranks must agree on (else DSPARK_DP2_E_MISMATCH).
 * timeout_ms > 0; spin_ns: busy-poll budget before the first futex wait (0 = futex only). */
int dspark_dp2_open(const char *session_id, const char *channel, int rank, int world_size, int width,
                    int64_t timeout_ms, int64_t spin_ns, uint64_t config_digest, dspark_dp2_channel **out, char *err,
                    size_t errlen);

/* One exchange: publish `local` (width values), wait for the peer, write world_size*width values
 * in rank order into `out`. `stats` may be NULL. */
int dspark_dp2_exchange(dspark_dp2_channel *ch, const int64_t *local, int64_t *out, dspark_dp2_stats *stats, char *err,
                        size_t errlen);

/* The hot path with one argument (a cffi call with one pointer argument costs a fraction of one with six):
 * register the buffers once, then each dspark_dp2_exchange_bound(ch) is dspark_dp2_exchange(ch, req + 1,
 * out_base + req[0] * 2 * width, stats, err, errlen). req: 1 + width int64 values the caller fills before each
 * call, req[0] the output row (0 <= row < out_rows; outside: DSPARK_DP2_E_ARG, nothing published),
 * req[1..width] the local values. stats may be NULL. Every buffer must stay valid until the next bind or close;
 * rebinding while an exchange is pending is refused. Messages go to the bound err buffer. */
int dspark_dp2_bind(dspark_dp2_channel *ch, const int64_t *req, int64_t *out_base, int64_t out_rows,
                    dspark_dp2_stats *stats, char *err, size_t errlen);
int dspark_dp2_exchange_bound(dspark_dp2_channel *ch);
/* dspark_dp2_wait for a bound exchange that returned DSPARK_DP2_STALLED (into the row that exchange named). */
int dspark_dp2_wait_bound(dspark_dp2_channel *ch);

/* Treat a peer whose process has been stopped or traced (state T / t) or in uninterruptible sleep
 * (state D) for longer than limit_ms, continuously, as dead (DSPARK_DP2_E_PEER_DIED, published): a
 * peer that is alive but can never arrive must not hold this rank until the hard timeout. 0 disables
 * the check (a stopped peer is then a stall like any other). Default after open: 0. */
int dspark_dp2_set_peer_stop_limit(dspark_dp2_channel *ch, int64_t limit_ms, char *err, size_t errlen);

/* For a watcher thread of the process that owns the handle (the handle must stay open meanwhile; only shared
 * state and /proc are read): the peer's pid (0 when it is not attached or has closed) and process state
 * letter ('?' unknown). Returns 1 when the peer is dead (why says how), else 0. */
int dspark_dp2_peer_state(dspark_dp2_channel *ch, int32_t *pid, char *state, char *why, size_t whylen);

/* Publish DSPARK_DP2_E_PEER_DIED with msg: a watcher judged the peer dead (e.g. stopped for longer than the
 * limit while this rank was blocked outside the exchange). Thread-safe like dspark_dp2_poison. */
int dspark_dp2_declare_peer_dead(dspark_dp2_channel *ch, const char *msg, char *err, size_t errlen);

/* Continue the exchange whose wait returned DSPARK_DP2_STALLED, for one more timeout period (same
 * outcomes as dspark_dp2_exchange; `out` receives the rows on success). */
int dspark_dp2_wait(dspark_dp2_channel *ch, int64_t *out, dspark_dp2_stats *stats, char *err, size_t errlen);

/* Release this rank's slot, wake the peer, unlink the name if the peer is not attached, unmap,
 * free. In a forked child it only frees the child's copy (never touches shared state). */
int dspark_dp2_close(dspark_dp2_channel *ch, char *err, size_t errlen);

/* Publish a caller-detected error (code DSPARK_DP2_E_CALLER, message msg) so the peer stops too. */
int dspark_dp2_poison(dspark_dp2_channel *ch, const char *msg, char *err, size_t errlen);

/* Shared error code (0 = healthy) and the shm object name (for tests / diagnostics). */
int dspark_dp2_shared_error(dspark_dp2_channel *ch);
int dspark_dp2_shm_name(dspark_dp2_channel *ch, char *buf, size_t buflen);
int dspark_dp2_name_for(const char *session_id, const char *channel, char *buf, size_t buflen);

/* Fault-injection hooks used by the test-suite only (documented as such in docs/dp2.md). */
int dspark_dp2_debug_set_start_time(dspark_dp2_channel *ch, int rank, uint64_t start_time);
int dspark_dp2_debug_skip_sequence(dspark_dp2_channel *ch, uint64_t delta, int publish);
int dspark_dp2_debug_set_pid(dspark_dp2_channel *ch, int rank, int32_t pid);
/* The next exchange treats its first read of the peer's sequence as stale and waits (up to the timeout)
 * until the peer has closed, died or published an error before its state checks: the publish-then-close race, made deterministic. */
int dspark_dp2_debug_hold_until_peer_closed(dspark_dp2_channel *ch);

#endif
