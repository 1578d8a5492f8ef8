/* dspark-harden native DP2 exchange: two co-located processes swap one small int64 row per call
 * through POSIX shared memory, with futex waits in bounded slices.
 *
 * Protocol (per call, rank r, peer p = 1 - r):
 *   seq = ++local_seq; slot = seq & 1
 *   write payload[slot], arrival_ns[slot]; store published_seq = seq (seq_cst);
 *   bump own epoch and FUTEX_WAKE only if the peer registered as a waiter
 *   wait until peer.published_seq >= seq: spin (spin_ns), then futex-wait on peer.epoch in slices
 *   of at most DSPARK_DP2_WAIT_SLICE_MS, checking the shared error, peer liveness (pid + process
 *   start time, so a reused pid is detected) and the timeout between slices.
 * Two slots suffice: the peer can be at most one sequence ahead (it then writes the other slot);
 * anything further is lapping and an error. Every failure after open is published to the shared
 * header (first error wins, with its message) and wakes both ranks, so neither continues alone.
 */
#define _GNU_SOURCE
#include "dp2_exchange.h"
#include "native_common.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdalign.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define DP2_MAGIC UINT64_C(0x5044324b52415053) /* "SPARK2DP" little-endian bytes */
#define DP2_CACHELINE 64
#define DP2_MSG_LEN 256

/* histogram edges of dspark_dp2_stats.acc_hist (ns): low resolution, finer where the exchange lives */
static const uint64_t HIST_EDGES_NS[DSPARK_DP2_HIST_BUCKETS - 1] = {
    1000, 2000, 5000, 10000, 20000, 50000, 100000, 1000000, 10000000, 100000000, 1000000000};

_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "32-bit atomics must be lock-free");
_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2, "64-bit atomics must be lock-free");

typedef struct {
    alignas(DP2_CACHELINE) uint64_t magic; /* written last at init, validated first */
    uint32_t abi_version;
    uint32_t layout_version;
    uint32_t world_size;
    uint32_t width;
    uint32_t state_size;
    uint32_t reserved0;
    uint64_t config_digest;
    int64_t timeout_ms;
    _Atomic uint32_t error_code; /* 0 = healthy; stored last, after error_rank and error_msg */
    _Atomic int32_t error_rank;
    _Atomic uint32_t error_claim; /* first publisher wins this, then writes rank + message + code */
    _Atomic uint32_t unlinked;    /* one-shot */
    char error_msg[DP2_MSG_LEN];
} dp2_header;

typedef struct {
    alignas(DP2_CACHELINE) _Atomic uint64_t published_seq;
    _Atomic uint32_t epoch;      /* futex word: bumped after each publish and on errors */
    _Atomic uint32_t waiters;    /* peers currently futex-waiting on this block's epoch */
    _Atomic int32_t pid;         /* 0 = unowned */
    _Atomic uint32_t state;      /* 0 never attached, 1 attached, 2 closed */
    _Atomic uint64_t start_time; /* /proc/<pid>/stat field 22 of the owner */
    _Atomic int32_t cpu;         /* CPU the owner last published from (spin policy hint) */
    uint64_t arrival_ns[2];
    int64_t payload[2][DSPARK_DP2_MAX_WIDTH];
} dp2_rank_block;

typedef struct {
    dp2_header header;
    dp2_rank_block ranks[DSPARK_DP2_WORLD_SIZE];
} dp2_shared;

_Static_assert(sizeof(dp2_header) % DP2_CACHELINE == 0, "header spans whole cache lines");
_Static_assert(sizeof(dp2_rank_block) % DP2_CACHELINE == 0, "rank block spans whole cache lines");
_Static_assert(offsetof(dp2_shared, ranks) % DP2_CACHELINE == 0, "rank blocks start on a cache line");

enum { ST_NEVER = 0, ST_ATTACHED = 1, ST_CLOSED = 2 };

struct dspark_dp2_channel {
    dp2_shared *shm;
    int rank;
    int width;
    pid_t owner_pid;
    int closed;
    uint64_t local_seq;
    uint64_t timeout_ns;
    uint64_t spin_ns;
    int debug_hold_until_peer_closed; /* fault-injection hook, see dspark_dp2_debug_hold_until_peer_closed */
    int pending;                      /* local_seq is published and still waits for the peer */
    int pending_cpu;
    uint32_t pending_futex_waits;
    uint64_t pending_start; /* when the pending exchange began (stats span every wait period) */
    uint64_t pending_published_at;
    uint64_t peer_stop_ns;     /* > 0: a peer stopped / in D state this long is dead (0: off) */
    uint64_t peer_stuck_since; /* when the peer was first seen in state T/t/D (0: not stuck) */
    char peer_stuck_state;
    /* buffers registered by dspark_dp2_bind for the one-argument hot path (dspark_dp2_exchange_bound) */
    const int64_t *bound_req; /* [0] output row, [1..width] the local values */
    int64_t *bound_out;       /* bound_rows rows of 2*width values */
    int64_t bound_rows;       /* 0: nothing bound */
    dspark_dp2_stats *bound_stats;
    char *bound_err;
    size_t bound_errlen;
    int64_t *bound_pending_out; /* the row a stalled bound exchange will write */
    char name[64];
};

/* ------------------------------------------------------------------------------------------ */

/* This process's pid for the per-call fork check. glibc's getpid() is a real system call (~50-100 ns on a
 * VM, twice per exchange before): the pid is cached at the first open and refreshed in a fork child by a
 * pthread_atfork handler (fork() runs it before the child returns, os.fork and multiprocessing's fork start
 * method go through fork()), so a handle inherited across fork still fails with DSPARK_DP2_E_FORK. If the
 * handler cannot be registered, every check calls getpid(). */
static _Atomic int32_t g_pid;
static _Atomic int g_pid_cached;
static pthread_once_t g_pid_once = PTHREAD_ONCE_INIT;

static void pid_after_fork(void) { atomic_store(&g_pid, (int32_t)getpid()); }

static void pid_init(void) {
    atomic_store(&g_pid, (int32_t)getpid());
    atomic_store(&g_pid_cached, pthread_atfork(NULL, NULL, pid_after_fork) == 0);
}

static pid_t current_pid(void) {
    if (atomic_load_explicit(&g_pid_cached, memory_order_relaxed))
        return (pid_t)atomic_load_explicit(&g_pid, memory_order_relaxed);
    return getpid();
}

static uint64_t now_ns(void) {
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) return 0;
    uint64_t v = (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
    return v ? v : 1;
}

static uint64_t fnv1a64(const char *a, const char *b) {
    uint64_t h = UINT64_C(0xcbf29ce484222325);
    for (const unsigned char *p = (const unsigned char *)a; *p; ++p) h = (h ^ *p) * UINT64_C(0x100000001b3);
    h = (h ^ (unsigned char)':') * UINT64_C(0x100000001b3);
    for (const unsigned char *p = (const unsigned char *)b; *p; ++p) h = (h ^ *p) * UINT64_C(0x100000001b3);
    return h;
}

static void make_name(const char *session_id, const char *channel, char *buf, size_t len) {
    snprintf(buf, len, "/dspark_dp2_%016" PRIx64, fnv1a64(session_id, channel));
}

/* Process start time (clock ticks since boot, /proc/<pid>/stat field 22) and state letter.
 * Returns 0 on success, -1 when the process does not exist (or /proc is unreadable). */
static int proc_start_time(pid_t pid, uint64_t *start_time, char *state) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* comm may contain spaces and parentheses */
    if (p == NULL || p[1] != ' ') return -1;
    p += 2;
    if (state) *state = *p;
    /* after ')' : field 3 is state; start time is field 22 -> skip 19 more fields */
    for (int field = 3; field < 22; ++field) {
        p = strchr(p, ' ');
        if (p == NULL) return -1;
        ++p;
    }
    *start_time = strtoull(p, NULL, 10);
    return 0;
}

static long futex_wait(_Atomic uint32_t *addr, uint32_t expected, uint64_t timeout_ns) {
    struct timespec ts = {(time_t)(timeout_ns / 1000000000u), (long)(timeout_ns % 1000000000u)};
    return syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, expected, &ts, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

static const char *code_name(int code) {
    switch (code) {
    case DSPARK_DP2_E_MISMATCH: return "mismatch";
    case DSPARK_DP2_E_OWNERSHIP: return "ownership changed";
    case DSPARK_DP2_E_CLOCK: return "clock failure";
    case DSPARK_DP2_E_SEQUENCE: return "sequence divergence";
    case DSPARK_DP2_E_PEER_DIED: return "peer died";
    case DSPARK_DP2_E_PEER_CLOSED: return "peer closed";
    case DSPARK_DP2_E_TIMEOUT: return "timeout";
    case DSPARK_DP2_E_FUTEX: return "futex failure";
    case DSPARK_DP2_E_LAPPED: return "sequence lapped";
    case DSPARK_DP2_E_ARRIVAL: return "missing peer arrival";
    case DSPARK_DP2_E_UNLINK: return "unlink failure";
    case DSPARK_DP2_E_CALLER: return "caller error";
    default: return "error";
    }
}

/* Publish an error to shared state (first one wins), wake both ranks, fill the caller's message. */
static int publish(dspark_dp2_channel *ch, int code, char *err, size_t errlen, const char *fmt, ...) {
    char msg[DP2_MSG_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    dp2_header *h = &ch->shm->header;
    uint32_t zero = 0;
    /* The claim orders the winner's writes: a rank that sees error_code != 0 (acquire) always sees the
     * winner's rank and message. (Publishing the code first let a peer read it between the two stores and
     * report "(message pending)": a CI failure under load.) A loser returns its own error; the winner's
     * code follows within a few stores, and a winner killed in between is caught as a dead peer. */
    if (atomic_compare_exchange_strong(&h->error_claim, &zero, 1u)) {
        atomic_store_explicit(&h->error_rank, ch->rank, memory_order_relaxed);
        memcpy(h->error_msg, msg, sizeof msg);
        atomic_store_explicit(&h->error_code, (uint32_t)code, memory_order_release);
    }
    for (int r = 0; r < DSPARK_DP2_WORLD_SIZE; ++r) {
        atomic_fetch_add(&ch->shm->ranks[r].epoch, 1);
        futex_wake_all(&ch->shm->ranks[r].epoch);
    }
    set_err(err, errlen, "dp2 channel %s rank %d: %s: %s", ch->name, ch->rank, code_name(code), msg);
    return code;
}

static int report_poisoned(dspark_dp2_channel *ch, uint32_t code, char *err, size_t errlen) {
    dp2_header *h = &ch->shm->header;
    atomic_thread_fence(memory_order_acquire); /* pairs with the release store of error_code */
    const char *msg = h->error_msg;
    set_err(err, errlen, "dp2 channel %s rank %d: channel poisoned: rank %d published error %u (%s): %.*s", ch->name,
            ch->rank, (int)atomic_load(&h->error_rank), code, code_name((int)code), DP2_MSG_LEN, msg);
    return DSPARK_DP2_E_POISONED;
}

/* 0 alive, otherwise writes why the peer is dead into why. *pstate (may be NULL) receives the
 * peer's process state letter from /proc ('?' when unknown). */
static int peer_dead(dp2_rank_block *peer, char *why, size_t whylen, char *pstate) {
    if (pstate) *pstate = '?';
    pid_t pid = (pid_t)atomic_load(&peer->pid);
    if (pid <= 0) return 0; /* not attached yet / closed: timeout or state check decides */
    if (kill(pid, 0) != 0 && errno == ESRCH) {
        snprintf(why, whylen, "pid %d no longer exists", (int)pid);
        return 1;
    }
    uint64_t st = 0;
    char state = '?';
    if (proc_start_time(pid, &st, &state) != 0) {
        if (kill(pid, 0) != 0 && errno == ESRCH) {
            snprintf(why, whylen, "pid %d no longer exists", (int)pid);
            return 1;
        }
        return 0; /* /proc unreadable (hidepid): fall back to kill() only */
    }
    uint64_t want = atomic_load(&peer->start_time);
    if (want != 0 && st != want) {
        snprintf(why, whylen, "pid %d was reused by another process (start time %" PRIu64 ", owner had %" PRIu64 ")",
                 (int)pid, st, want);
        return 1;
    }
    if (state == 'Z' || state == 'X' || state == 'x') {
        snprintf(why, whylen, "pid %d is a zombie (state %c)", (int)pid, state);
        return 1;
    }
    if (pstate) *pstate = state;
    return 0;
}

/* Process states in which the peer cannot make progress on its own: stopped, traced, uninterruptible. */
static int stuck_state(char state) { return state == 'T' || state == 't' || state == 'D'; }

static const char *state_text(char state) {
    switch (state) {
    case 'T': return "stopped";
    case 't': return "stopped by a tracer";
    case 'D': return "in uninterruptible sleep";
    case 'R': return "running";
    case 'S': return "sleeping";
    default: return "state unknown";
    }
}

/* ------------------------------------------------------------------------------------------ */

int dspark_dp2_abi_version(void) { return DSPARK_DP2_ABI_VERSION; }

int dspark_dp2_name_for(const char *session_id, const char *channel, char *buf, size_t buflen) {
    if (session_id == NULL || channel == NULL || buf == NULL || buflen < 32) return DSPARK_DP2_E_ARG;
    make_name(session_id, channel, buf, buflen);
    return DSPARK_DP2_OK;
}

int dspark_dp2_open(const char *session_id, const char *channel, int rank, int world_size, int width,
                    int64_t timeout_ms, int64_t spin_ns, uint64_t config_digest, dspark_dp2_channel **out, char *err,
                    size_t errlen) {
    if (err == NULL || errlen < DSPARK_DP2_ERRBUF_MIN) return DSPARK_DP2_E_ARG;
    err[0] = '\0';
    if (out == NULL) {
        set_err(err, errlen, "dp2 open: out handle pointer is NULL");
        return DSPARK_DP2_E_ARG;
    }
    *out = NULL;
    if (session_id == NULL || session_id[0] == '\0') {
        set_err(err, errlen, "dp2 open: session id must be non-empty");
        return DSPARK_DP2_E_ARG;
    }
    if (channel == NULL || channel[0] == '\0') {
        set_err(err, errlen, "dp2 open: channel name must be non-empty");
        return DSPARK_DP2_E_ARG;
    }
    if (world_size != DSPARK_DP2_WORLD_SIZE) {
        set_err(err, errlen, "dp2 open: world size must be %d, got %d", DSPARK_DP2_WORLD_SIZE, world_size);
        return DSPARK_DP2_E_MISMATCH;
    }
    if (rank < 0 || rank >= DSPARK_DP2_WORLD_SIZE) {
        set_err(err, errlen, "dp2 open: rank must be 0 or 1, got %d", rank);
        return DSPARK_DP2_E_ARG;
    }
    if (width < 1 || width > DSPARK_DP2_MAX_WIDTH) {
        set_err(err, errlen, "dp2 open: payload width must be in 1..%d, got %d", DSPARK_DP2_MAX_WIDTH, width);
        return DSPARK_DP2_E_ARG;
    }
    if (timeout_ms <= 0) {
        set_err(err, errlen, "dp2 open: timeout must be positive, got %" PRId64 " ms", timeout_ms);
        return DSPARK_DP2_E_ARG;
    }
    if (spin_ns < 0) {
        set_err(err, errlen, "dp2 open: spin budget must be >= 0, got %" PRId64 " ns", spin_ns);
        return DSPARK_DP2_E_ARG;
    }

    pthread_once(&g_pid_once, pid_init);
    dspark_dp2_channel *ch = calloc(1, sizeof *ch);
    if (ch == NULL) {
        set_err(err, errlen, "dp2 open: out of memory");
        return DSPARK_DP2_E_SHM;
    }
    make_name(session_id, channel, ch->name, sizeof ch->name);
    ch->rank = rank;
    ch->width = width;
    ch->owner_pid = getpid();
    /* a pid cache that disagrees with the kernel (a fork that ran no atfork handler): stop trusting it */
    if (current_pid() != ch->owner_pid) atomic_store(&g_pid_cached, 0);
    ch->timeout_ns = (uint64_t)timeout_ms * UINT64_C(1000000);
    ch->spin_ns = (uint64_t)spin_ns;

    int fd = shm_open(ch->name, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
        set_err(err, errlen, "dp2 open: shm_open(%s) failed: %s", ch->name, strerror(errno));
        free(ch);
        return DSPARK_DP2_E_SHM;
    }
    int rc = DSPARK_DP2_OK;
    int created = 0;
    /* The name is opened O_CREAT without O_EXCL (the second rank attaches to the first rank's segment),
     * so it may be an object someone else created: use it only if this user owns it and nobody else can
     * read or write it. Checked before flock, so a foreign object cannot even block this open. */
    struct stat own;
    if (fstat(fd, &own) != 0) {
        set_err(err, errlen, "dp2 open: fstat(%s) failed: %s", ch->name, strerror(errno));
        close(fd);
        free(ch);
        return DSPARK_DP2_E_SHM;
    }
    if (own.st_uid != geteuid() || (own.st_mode & 07777) != 0600 || !S_ISREG(own.st_mode)) {
        set_err(err, errlen,
                "dp2 open: /dev/shm%s is not this server's: owner uid %u mode %04o, expected uid %u mode 0600; "
                "refusing to use it (another user's object, or one created with other permissions: remove it, or "
                "use another session id)",
                ch->name, (unsigned)own.st_uid, (unsigned)(own.st_mode & 07777), (unsigned)geteuid());
        close(fd); /* not ours: never unlink it */
        free(ch);
        return DSPARK_DP2_E_OWNED;
    }
    if (flock(fd, LOCK_EX) != 0) {
        set_err(err, errlen, "dp2 open: flock(%s) failed: %s", ch->name, strerror(errno));
        rc = DSPARK_DP2_E_SHM;
        goto fail_fd;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        set_err(err, errlen, "dp2 open: fstat(%s) failed: %s", ch->name, strerror(errno));
        rc = DSPARK_DP2_E_SHM;
        goto fail_fd;
    }
    if (sb.st_size == 0) {
        if (ftruncate(fd, (off_t)sizeof(dp2_shared)) != 0) {
            set_err(err, errlen, "dp2 open: ftruncate(%s) failed: %s", ch->name, strerror(errno));
            rc = DSPARK_DP2_E_SHM;
            goto fail_fd;
        }
        created = 1;
    } else if ((size_t)sb.st_size != sizeof(dp2_shared)) {
        set_err(err, errlen, "dp2 open: %s has size %lld, this build expects %zu (ABI/layout mismatch)", ch->name,
                (long long)sb.st_size, sizeof(dp2_shared));
        rc = DSPARK_DP2_E_MISMATCH;
        goto fail_fd;
    }
    void *map = mmap(NULL, sizeof(dp2_shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        set_err(err, errlen, "dp2 open: mmap(%s) failed: %s", ch->name, strerror(errno));
        rc = DSPARK_DP2_E_SHM;
        goto fail_fd;
    }
    ch->shm = (dp2_shared *)map;
    dp2_header *h = &ch->shm->header;
    if (created) {
        memset(map, 0, sizeof(dp2_shared));
        h->abi_version = DSPARK_DP2_ABI_VERSION;
        h->layout_version = DSPARK_DP2_LAYOUT_VERSION;
        h->world_size = DSPARK_DP2_WORLD_SIZE;
        h->width = (uint32_t)width;
        h->state_size = (uint32_t)sizeof(dp2_shared);
        h->config_digest = config_digest;
        h->timeout_ms = timeout_ms;
        atomic_thread_fence(memory_order_release);
        __atomic_store_n(&h->magic, DP2_MAGIC, __ATOMIC_RELEASE);
    } else {
        uint64_t magic = __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE);
        if (magic == 0) {
            set_err(err, errlen,
                    "dp2 open: %s was abandoned by the rank that created it (it failed during open and removed "
                    "the name); that rank's own error says why",
                    ch->name);
            rc = DSPARK_DP2_E_MISMATCH;
            goto fail_map;
        }
        if (magic != DP2_MAGIC || h->abi_version != DSPARK_DP2_ABI_VERSION ||
            h->layout_version != DSPARK_DP2_LAYOUT_VERSION || h->world_size != DSPARK_DP2_WORLD_SIZE ||
            h->state_size != sizeof(dp2_shared)) {
            set_err(err, errlen,
                    "dp2 open: %s header mismatch: magic %#" PRIx64 " abi %u layout %u world %u size %u; this build: "
                    "magic %#" PRIx64 " abi %d layout %d world %d size %zu",
                    ch->name, magic, h->abi_version, h->layout_version, h->world_size, h->state_size, DP2_MAGIC,
                    DSPARK_DP2_ABI_VERSION, DSPARK_DP2_LAYOUT_VERSION, DSPARK_DP2_WORLD_SIZE, sizeof(dp2_shared));
            rc = DSPARK_DP2_E_MISMATCH;
            goto fail_map;
        }
        if (h->width != (uint32_t)width) {
            /* published so the rank that created the channel stops too instead of timing out */
            publish(ch, DSPARK_DP2_E_MISMATCH, NULL, 0, "payload width mismatch: peer opened with %u, rank %d with %d",
                    h->width, rank, width);
            set_err(err, errlen, "dp2 open: %s payload width mismatch: peer opened with %u, this rank with %d",
                    ch->name, h->width, width);
            rc = DSPARK_DP2_E_MISMATCH;
            goto fail_map;
        }
        if (h->config_digest != config_digest || h->timeout_ms != timeout_ms) {
            publish(ch, DSPARK_DP2_E_MISMATCH, NULL, 0,
                    "configuration mismatch: creator digest %#" PRIx64 " timeout %" PRId64
                    " ms, rank %d digest %#" PRIx64 " timeout %" PRId64 " ms",
                    h->config_digest, h->timeout_ms, rank, config_digest, timeout_ms);
            set_err(err, errlen,
                    "dp2 open: %s configuration mismatch: peer has digest %#" PRIx64 " timeout %" PRId64
                    " ms, this rank digest %#" PRIx64 " timeout %" PRId64 " ms",
                    ch->name, h->config_digest, h->timeout_ms, config_digest, timeout_ms);
            rc = DSPARK_DP2_E_MISMATCH;
            goto fail_map;
        }
    }
    if (mlock(map, sizeof(dp2_shared)) != 0) {
        set_err(err, errlen, "dp2 open: mlock(%s) failed: %s", ch->name, strerror(errno));
        rc = DSPARK_DP2_E_SHM;
        goto fail_map;
    }
    dp2_rank_block *mine = &ch->shm->ranks[rank];
    dp2_rank_block *peer = &ch->shm->ranks[1 - rank];
    int32_t expected = 0;
    if (!atomic_compare_exchange_strong(&mine->pid, &expected, (int32_t)ch->owner_pid)) {
        char why[160];
        if (peer_dead(mine, why, sizeof why, NULL))
            set_err(err, errlen,
                    "dp2 open: %s is stale: rank %d is still owned by dead pid %d (%s); use a new session id or "
                    "remove /dev/shm%s",
                    ch->name, rank, (int)expected, why, ch->name);
        else
            set_err(err, errlen, "dp2 open: %s rank %d is already owned by pid %d", ch->name, rank, (int)expected);
        rc = DSPARK_DP2_E_OWNED;
        goto fail_lock;
    }
    if (atomic_load(&mine->state) == ST_CLOSED || atomic_load(&h->error_code) != 0) {
        atomic_store(&mine->pid, 0);
        set_err(err, errlen, "dp2 open: %s was already used and closed or poisoned (error %u); use a new session id",
                ch->name, atomic_load(&h->error_code));
        rc = DSPARK_DP2_E_OWNED;
        goto fail_lock;
    }
    uint64_t st = 0;
    char state = '?';
    if (proc_start_time(ch->owner_pid, &st, &state) != 0) st = 0; /* no /proc: pid-only liveness */
    atomic_store(&mine->start_time, st);
    atomic_store(&mine->cpu, -1);
    atomic_store(&mine->state, ST_ATTACHED);
    int peer_attached = atomic_load(&peer->pid) > 0;
    flock(fd, LOCK_UN);
    close(fd);
    fd = -1;
    if (peer_attached) {
        uint32_t zero = 0;
        if (atomic_compare_exchange_strong(&h->unlinked, &zero, 1) && shm_unlink(ch->name) != 0 && errno != ENOENT) {
            rc = publish(ch, DSPARK_DP2_E_UNLINK, err, errlen, "shm_unlink(%s) failed: %s", ch->name, strerror(errno));
            atomic_store(&mine->pid, 0);
            munlock(map, sizeof(dp2_shared));
            munmap(map, sizeof(dp2_shared));
            free(ch);
            return rc;
        }
    }
    *out = ch;
    return DSPARK_DP2_OK;

fail_lock:
    munlock(map, sizeof(dp2_shared));
fail_map:
    /* A creator that fails after init clears the magic (still under the flock) before unlinking: a peer
     * blocked in flock on the same inode then fails at once on the header check instead of attaching to
     * an orphaned segment and waiting for its first timeout. */
    if (created) __atomic_store_n(&ch->shm->header.magic, 0, __ATOMIC_RELEASE);
    munmap(map, sizeof(dp2_shared));
fail_fd:
    if (created) shm_unlink(ch->name); /* we created it and failed: leave nothing behind */
    if (fd >= 0) {
        flock(fd, LOCK_UN);
        close(fd);
    }
    free(ch);
    return rc;
}

static int wait_for_peer(dspark_dp2_channel *ch, int64_t *out, dspark_dp2_stats *stats, char *err, size_t errlen,
                         uint64_t period_start);

static int check_handle(dspark_dp2_channel *ch, pid_t me, char *err, size_t errlen) {
    if (ch->closed) {
        set_err(err, errlen, "dp2 channel %s rank %d: handle already closed", ch->name, ch->rank);
        return DSPARK_DP2_E_CLOSED;
    }
    if (me != ch->owner_pid) {
        set_err(err, errlen,
                "dp2 channel %s rank %d: handle used after fork (opened by pid %d, used by pid %d); open a new "
                "channel in the child",
                ch->name, ch->rank, (int)ch->owner_pid, (int)me);
        return DSPARK_DP2_E_FORK;
    }
    return DSPARK_DP2_OK;
}

/* One exchange after the argument checks: publish `local`, wait for the peer, rows into `out`. */
static int exchange_checked(dspark_dp2_channel *ch, const int64_t *local, int64_t *out, dspark_dp2_stats *stats,
                            char *err, size_t errlen) {
    const pid_t me = current_pid();
    int hrc = check_handle(ch, me, err, errlen);
    if (hrc != DSPARK_DP2_OK) return hrc;
    dp2_shared *s = ch->shm;
    dp2_header *h = &s->header;
    uint32_t code = atomic_load_explicit(&h->error_code, memory_order_acquire);
    if (code != 0) return report_poisoned(ch, code, err, errlen);
    if (ch->pending) {
        set_err(err, errlen,
                "dp2 channel %s rank %d: sequence %" PRIu64 " is still waiting for the peer; call "
                "dspark_dp2_wait before the next exchange",
                ch->name, ch->rank, ch->local_seq);
        return DSPARK_DP2_E_ARG;
    }
    const int r = ch->rank, w = ch->width;
    dp2_rank_block *mine = &s->ranks[r];
    if (atomic_load_explicit(&mine->pid, memory_order_relaxed) != (int32_t)me)
        return publish(ch, DSPARK_DP2_E_OWNERSHIP, err, errlen, "rank %d slot now holds pid %d, opened by pid %d", r,
                       (int)atomic_load(&mine->pid), (int)me);
    uint64_t start = now_ns();
    if (start == 0) return publish(ch, DSPARK_DP2_E_CLOCK, err, errlen, "clock_gettime failed: %s", strerror(errno));
    uint64_t seq = ++ch->local_seq;
    uint64_t own_pub = atomic_load_explicit(&mine->published_seq, memory_order_relaxed);
    if (own_pub != seq - 1)
        return publish(ch, DSPARK_DP2_E_SEQUENCE, err, errlen,
                       "rank %d published sequence %" PRIu64 " but its local count expects %" PRIu64, r, own_pub,
                       seq - 1);
    const int slot = (int)(seq & 1u);
    memcpy(mine->payload[slot], local, (size_t)w * sizeof(int64_t));
    mine->arrival_ns[slot] = start;
    const int my_cpu = sched_getcpu();
    atomic_store_explicit(&mine->cpu, my_cpu, memory_order_relaxed);
    atomic_store_explicit(&mine->published_seq, seq, memory_order_seq_cst);
    atomic_fetch_add_explicit(&mine->epoch, 1, memory_order_seq_cst);
    if (atomic_load_explicit(&mine->waiters, memory_order_seq_cst) != 0) futex_wake_all(&mine->epoch);
    ch->pending = 1;
    ch->pending_start = start;
    ch->pending_published_at = now_ns();
    ch->pending_cpu = my_cpu;
    ch->pending_futex_waits = 0;
    /* the first wait period starts with the exchange: no third clock read */
    return wait_for_peer(ch, out, stats, err, errlen, start);
}

int dspark_dp2_exchange(dspark_dp2_channel *ch, const int64_t *local, int64_t *out, dspark_dp2_stats *stats, char *err,
                        size_t errlen) {
    if (err == NULL || errlen < DSPARK_DP2_ERRBUF_MIN) return DSPARK_DP2_E_ARG;
    if (ch == NULL || local == NULL || out == NULL) {
        set_err(err, errlen, "dp2 exchange: NULL argument");
        return DSPARK_DP2_E_ARG;
    }
    return exchange_checked(ch, local, out, stats, err, errlen);
}

int dspark_dp2_wait(dspark_dp2_channel *ch, int64_t *out, dspark_dp2_stats *stats, char *err, size_t errlen) {
    if (err == NULL || errlen < DSPARK_DP2_ERRBUF_MIN) return DSPARK_DP2_E_ARG;
    if (ch == NULL || out == NULL) {
        set_err(err, errlen, "dp2 wait: NULL argument");
        return DSPARK_DP2_E_ARG;
    }
    int hrc = check_handle(ch, current_pid(), err, errlen);
    if (hrc != DSPARK_DP2_OK) return hrc;
    if (!ch->pending) {
        set_err(err, errlen, "dp2 channel %s rank %d: no exchange is waiting for the peer", ch->name, ch->rank);
        return DSPARK_DP2_E_ARG;
    }
    const uint64_t period_start = now_ns();
    if (period_start == 0)
        return publish(ch, DSPARK_DP2_E_CLOCK, err, errlen, "clock_gettime failed: %s", strerror(errno));
    return wait_for_peer(ch, out, stats, err, errlen, period_start);
}

int dspark_dp2_bind(dspark_dp2_channel *ch, const int64_t *req, int64_t *out_base, int64_t out_rows,
                    dspark_dp2_stats *stats, char *err, size_t errlen) {
    if (err == NULL || errlen < DSPARK_DP2_ERRBUF_MIN) return DSPARK_DP2_E_ARG;
    err[0] = '\0';
    if (ch == NULL || req == NULL || out_base == NULL) {
        set_err(err, errlen, "dp2 bind: NULL argument");
        return DSPARK_DP2_E_ARG;
    }
    int hrc = check_handle(ch, current_pid(), err, errlen);
    if (hrc != DSPARK_DP2_OK) return hrc;
    if (out_rows < 1) {
        set_err(err, errlen, "dp2 channel %s rank %d: bind needs at least one output row, got %" PRId64, ch->name,
                ch->rank, out_rows);
        return DSPARK_DP2_E_ARG;
    }
    if (ch->pending) {
        set_err(err, errlen, "dp2 channel %s rank %d: cannot rebind while sequence %" PRIu64 " waits for the peer",
                ch->name, ch->rank, ch->local_seq);
        return DSPARK_DP2_E_ARG;
    }
    ch->bound_req = req;
    ch->bound_out = out_base;
    ch->bound_rows = out_rows;
    ch->bound_stats = stats;
    ch->bound_err = err;
    ch->bound_errlen = errlen;
    ch->bound_pending_out = NULL;
    return DSPARK_DP2_OK;
}

int dspark_dp2_exchange_bound(dspark_dp2_channel *ch) {
    if (ch == NULL || ch->bound_rows < 1) return DSPARK_DP2_E_ARG; /* no message buffer to write to */
    const int64_t row = ch->bound_req[0];
    if (row < 0 || row >= ch->bound_rows) {
        set_err(ch->bound_err, ch->bound_errlen,
                "dp2 channel %s rank %d: output row %" PRId64 " outside the %" PRId64 " bound rows", ch->name, ch->rank,
                row, ch->bound_rows);
        return DSPARK_DP2_E_ARG;
    }
    int64_t *out = ch->bound_out + (size_t)row * 2u * (size_t)ch->width;
    /* the row a stalled exchange completes into (dspark_dp2_wait_bound); while one is pending,
     * exchange_checked refuses this call (poisoned, or "still waiting") and the row stays that one's */
    if (!ch->pending) ch->bound_pending_out = out;
    return exchange_checked(ch, ch->bound_req + 1, out, ch->bound_stats, ch->bound_err, ch->bound_errlen);
}

int dspark_dp2_wait_bound(dspark_dp2_channel *ch) {
    if (ch == NULL || ch->bound_rows < 1) return DSPARK_DP2_E_ARG;
    if (ch->bound_pending_out == NULL || !ch->pending) {
        set_err(ch->bound_err, ch->bound_errlen, "dp2 channel %s rank %d: no bound exchange is waiting for the peer",
                ch->name, ch->rank);
        return DSPARK_DP2_E_ARG;
    }
    return dspark_dp2_wait(ch, ch->bound_pending_out, ch->bound_stats, ch->bound_err, ch->bound_errlen);
}

/* Wait for the peer's row of the pending sequence for one timeout period. Completes (OK), fails
 * (an error published to shared state) or, when the period ends while the peer is attached and
 * provably alive, returns DSPARK_DP2_STALLED without publishing anything: the exchange stays
 * pending and dspark_dp2_wait continues it. */
static int wait_for_peer(dspark_dp2_channel *ch, int64_t *out, dspark_dp2_stats *stats, char *err, size_t errlen,
                         uint64_t period_start) {
    dp2_shared *s = ch->shm;
    dp2_header *h = &s->header;
    const int r = ch->rank, p = 1 - ch->rank, w = ch->width;
    dp2_rank_block *mine = &s->ranks[r];
    dp2_rank_block *peer = &s->ranks[p];
    const uint64_t seq = ch->local_seq;
    const int slot = (int)(seq & 1u);
    const uint64_t start = ch->pending_start, published_at = ch->pending_published_at;
    const int my_cpu = ch->pending_cpu;
    uint32_t code;
    uint32_t futex_waits = ch->pending_futex_waits;
    uint64_t peer_seq = atomic_load_explicit(&peer->published_seq, memory_order_acquire);
    if (peer_seq < seq && ch->spin_ns > 0 && futex_waits == 0) {
        uint64_t spin_until = published_at + ch->spin_ns;
        /* Busy-poll for the peer. If the peer last ran on our CPU it cannot make progress while we
         * spin: yield between polls so it runs. Otherwise spin without yielding (a yield on a busy
         * host can hand our CPU to an unrelated task for a whole time slice). */
        unsigned iter = 0;
        while ((peer_seq = atomic_load_explicit(&peer->published_seq, memory_order_acquire)) < seq) {
            cpu_relax();
            if ((++iter & 15u) == 0) {
                if (now_ns() >= spin_until) break;
                if (atomic_load_explicit(&h->error_code, memory_order_relaxed) != 0) break;
                if (my_cpu >= 0 && atomic_load_explicit(&peer->cpu, memory_order_relaxed) == my_cpu) sched_yield();
            }
        }
    }
    if (ch->debug_hold_until_peer_closed) peer_seq = 0; /* test hook: behave as if the first read was stale */
    while (peer_seq < seq) {
        if (ch->debug_hold_until_peer_closed) {
            /* test hook: hold this waiter between its (stale) sequence read and the state checks until the
             * peer has published and closed, the interleaving that used to report a spurious close */
            char held[192];
            ch->debug_hold_until_peer_closed = 0;
            while (atomic_load(&peer->state) != ST_CLOSED && !peer_dead(peer, held, sizeof held, NULL) &&
                   atomic_load(&h->error_code) == 0 && now_ns() - start < ch->timeout_ns)
                sched_yield();
        }
        code = atomic_load_explicit(&h->error_code, memory_order_acquire);
        if (code != 0) {
            /* as with close and death below: the peer may have published the awaited row and then
             * failed a later step (publishing its error) between our sequence read and this check;
             * that row is valid, so this exchange completes and the next one reports the poison */
            peer_seq = atomic_load_explicit(&peer->published_seq, memory_order_acquire);
            if (peer_seq >= seq) break;
            return report_poisoned(ch, code, err, errlen);
        }
        char why[192];
        char proc_state = '?';
        int dead = peer_dead(peer, why, sizeof why, &proc_state);
        uint32_t pstate = atomic_load(&peer->state);
        if (!dead && pstate == ST_ATTACHED && stuck_state(proc_state)) {
            uint64_t t = now_ns();
            if (ch->peer_stuck_since == 0 || ch->peer_stuck_state != proc_state) {
                ch->peer_stuck_since = t;
                ch->peer_stuck_state = proc_state;
            } else if (ch->peer_stop_ns > 0 && t - ch->peer_stuck_since >= ch->peer_stop_ns) {
                /* alive but unable to arrive: as final as death (the check below still lets an exchange
                 * whose row the peer published before it stopped complete) */
                snprintf(why, sizeof why,
                         "pid %d is %s (state %c) for %.1f s, longer than the limit of %" PRIu64
                         " ms (SGLANG_DSPARK_DP2_SHM_PEER_STOP_MS)",
                         (int)atomic_load(&peer->pid), state_text(proc_state), proc_state,
                         (double)(t - ch->peer_stuck_since) / 1e9, ch->peer_stop_ns / UINT64_C(1000000));
                dead = 1;
            }
        } else {
            ch->peer_stuck_since = 0;
        }
        if (dead || pstate == ST_CLOSED) {
            /* The peer may have published the awaited sequence and then closed or died between our read of
             * its sequence and this check: its data is in shared memory, so this exchange completes. Close
             * or death is reported only for a sequence the peer never reached. */
            peer_seq = atomic_load_explicit(&peer->published_seq, memory_order_acquire);
            if (peer_seq >= seq) break;
            if (dead)
                return publish(ch, DSPARK_DP2_E_PEER_DIED, err, errlen,
                               "peer died: rank %d %s (waiting for sequence %" PRIu64 ")", p, why, seq);
            return publish(ch, DSPARK_DP2_E_PEER_CLOSED, err, errlen,
                           "peer rank %d closed the channel at sequence %" PRIu64 " while rank %d waits for %" PRIu64,
                           p, peer_seq, r, seq);
        }
        uint64_t now = now_ns();
        uint64_t elapsed = now - period_start;
        if (elapsed >= ch->timeout_ns) {
            if (pstate == ST_ATTACHED && atomic_load(&peer->pid) > 0) {
                /* alive (pid + start time checked above) and attached: a stall, not a failure */
                ch->pending_futex_waits = futex_waits;
                set_err(err, errlen,
                        "dp2 channel %s rank %d: peer rank %d (pid %d) alive but has not reached sequence %" PRIu64
                        " after %.1f ms (peer at %" PRIu64 ", process state %c: %s)",
                        ch->name, r, p, (int)atomic_load(&peer->pid), seq, (double)(now - start) / 1e6,
                        atomic_load(&peer->published_seq), proc_state, state_text(proc_state));
                return DSPARK_DP2_STALLED;
            }
            if (pstate == ST_NEVER)
                return publish(ch, DSPARK_DP2_E_TIMEOUT, err, errlen,
                               "timed out after %.1f ms: peer rank %d never attached (wanted sequence %" PRIu64 ")",
                               (double)elapsed / 1e6, p, seq);
            return publish(ch, DSPARK_DP2_E_TIMEOUT, err, errlen,
                           "timed out after %.1f ms waiting for peer rank %d (pid %d): wanted sequence %" PRIu64
                           ", peer at %" PRIu64,
                           (double)elapsed / 1e6, p, (int)atomic_load(&peer->pid), seq,
                           atomic_load(&peer->published_seq));
        }
        uint64_t remaining = ch->timeout_ns - elapsed;
        uint64_t slice = (uint64_t)DSPARK_DP2_WAIT_SLICE_MS * UINT64_C(1000000);
        if (remaining < slice) slice = remaining;
        uint32_t e = atomic_load_explicit(&peer->epoch, memory_order_seq_cst);
        atomic_fetch_add_explicit(&peer->waiters, 1, memory_order_seq_cst);
        peer_seq = atomic_load_explicit(&peer->published_seq, memory_order_seq_cst);
        if (peer_seq < seq && atomic_load_explicit(&h->error_code, memory_order_seq_cst) == 0) {
            ++futex_waits;
            long frc = futex_wait(&peer->epoch, e, slice);
            int ferr = errno;
            if (frc != 0 && ferr != EAGAIN && ferr != EINTR && ferr != ETIMEDOUT) {
                atomic_fetch_sub_explicit(&peer->waiters, 1, memory_order_seq_cst);
                return publish(ch, DSPARK_DP2_E_FUTEX, err, errlen, "futex wait failed: %s", strerror(ferr));
            }
        }
        atomic_fetch_sub_explicit(&peer->waiters, 1, memory_order_seq_cst);
        peer_seq = atomic_load_explicit(&peer->published_seq, memory_order_acquire);
    }
    ch->pending = 0;
    if (peer_seq > seq + 1)
        return publish(ch, DSPARK_DP2_E_LAPPED, err, errlen,
                       "peer rank %d is at sequence %" PRIu64 ", more than one ahead of rank %d at %" PRIu64, p,
                       peer_seq, r, seq);
    uint64_t peer_arrival = peer->arrival_ns[slot];
    if (peer_arrival == 0)
        return publish(ch, DSPARK_DP2_E_ARRIVAL, err, errlen, "peer rank %d has no arrival time for sequence %" PRIu64,
                       p, seq);
    memcpy(out + (size_t)r * (size_t)w, mine->payload[slot], (size_t)w * sizeof(int64_t));
    memcpy(out + (size_t)p * (size_t)w, peer->payload[slot], (size_t)w * sizeof(int64_t));
    /* the peer may be one ahead (it already published seq+1 into the other slot): fine. But if it
     * got two ahead while we copied, the slot we read may have been overwritten. */
    uint64_t after = atomic_load_explicit(&peer->published_seq, memory_order_acquire);
    if (after > seq + 1)
        return publish(ch, DSPARK_DP2_E_LAPPED, err, errlen,
                       "peer rank %d reached sequence %" PRIu64 " while rank %d read sequence %" PRIu64, p, after, r,
                       seq);
    if (stats != NULL) {
        uint64_t finish = now_ns();
        uint64_t latest = start > peer_arrival ? start : peer_arrival;
        stats->sequence = seq;
        stats->total_ns = finish - start;
        stats->peer_wait_ns = finish - published_at;
        stats->arrival_skew_ns = start > peer_arrival ? start - peer_arrival : peer_arrival - start;
        stats->post_latest_arrival_ns = finish > latest ? finish - latest : 0;
        stats->futex_waits = futex_waits;
        const uint64_t v[4] = {stats->total_ns, stats->peer_wait_ns, stats->arrival_skew_ns,
                               stats->post_latest_arrival_ns};
        stats->acc_calls += 1;
        stats->acc_futex_waits += futex_waits;
        for (int i = 0; i < 4; ++i) {
            stats->acc_sum_ns[i] += v[i];
            if (v[i] > stats->acc_max_ns[i]) stats->acc_max_ns[i] = v[i];
            int b = 0;
            while (b < DSPARK_DP2_HIST_BUCKETS - 1 && v[i] > HIST_EDGES_NS[b]) ++b;
            stats->acc_hist[i][b] += 1;
        }
    }
    return DSPARK_DP2_OK;
}

uint64_t dspark_dp2_hist_edge_ns(int b) { return (b >= 0 && b < DSPARK_DP2_HIST_BUCKETS - 1) ? HIST_EDGES_NS[b] : 0; }

int dspark_dp2_close(dspark_dp2_channel *ch, char *err, size_t errlen) {
    if (err == NULL || errlen < DSPARK_DP2_ERRBUF_MIN) return DSPARK_DP2_E_ARG;
    err[0] = '\0';
    if (ch == NULL) return DSPARK_DP2_OK;
    if (getpid() != ch->owner_pid) {
        /* forked child: drop the inherited mapping, never touch the parent's shared state */
        munmap(ch->shm, sizeof(dp2_shared));
        free(ch);
        return DSPARK_DP2_OK;
    }
    dp2_shared *s = ch->shm;
    dp2_rank_block *mine = &s->ranks[ch->rank];
    dp2_rank_block *peer = &s->ranks[1 - ch->rank];
    int rc = DSPARK_DP2_OK;
    atomic_store(&mine->state, ST_CLOSED);
    int32_t me = (int32_t)ch->owner_pid;
    atomic_compare_exchange_strong(&mine->pid, &me, 0);
    atomic_fetch_add(&mine->epoch, 1);
    futex_wake_all(&mine->epoch);
    uint32_t zero = 0;
    if (atomic_load(&peer->pid) <= 0 && atomic_compare_exchange_strong(&s->header.unlinked, &zero, 1)) {
        if (shm_unlink(ch->name) != 0 && errno != ENOENT) {
            set_err(err, errlen, "dp2 close: shm_unlink(%s) failed: %s", ch->name, strerror(errno));
            rc = DSPARK_DP2_E_UNLINK;
        }
    }
    munlock(s, sizeof(dp2_shared));
    munmap(s, sizeof(dp2_shared));
    free(ch);
    return rc;
}

int dspark_dp2_poison(dspark_dp2_channel *ch, const char *msg, char *err, size_t errlen) {
    if (err == NULL || errlen < DSPARK_DP2_ERRBUF_MIN) return DSPARK_DP2_E_ARG;
    if (ch == NULL || msg == NULL) {
        set_err(err, errlen, "dp2 poison: NULL argument");
        return DSPARK_DP2_E_ARG;
    }
    if (getpid() != ch->owner_pid) {
        set_err(err, errlen, "dp2 channel %s rank %d: handle used after fork (opened by pid %d, used by pid %d)",
                ch->name, ch->rank, (int)ch->owner_pid, (int)getpid());
        return DSPARK_DP2_E_FORK;
    }
    return publish(ch, DSPARK_DP2_E_CALLER, err, errlen, "%s", msg);
}

int dspark_dp2_peer_state(dspark_dp2_channel *ch, int32_t *pid, char *state, char *why, size_t whylen) {
    if (ch == NULL || pid == NULL || state == NULL || why == NULL || whylen == 0) return -1;
    why[0] = '\0';
    dp2_rank_block *peer = &ch->shm->ranks[1 - ch->rank];
    int dead = peer_dead(peer, why, whylen, state);
    *pid = atomic_load(&peer->pid);
    if (atomic_load(&peer->state) != ST_ATTACHED) *pid = 0;
    return dead;
}

int dspark_dp2_declare_peer_dead(dspark_dp2_channel *ch, const char *msg, char *err, size_t errlen) {
    if (err == NULL || errlen < DSPARK_DP2_ERRBUF_MIN) return DSPARK_DP2_E_ARG;
    if (ch == NULL || msg == NULL) {
        set_err(err, errlen, "dp2 declare_peer_dead: NULL argument");
        return DSPARK_DP2_E_ARG;
    }
    if (getpid() != ch->owner_pid) {
        set_err(err, errlen, "dp2 channel %s rank %d: handle used after fork (opened by pid %d, used by pid %d)",
                ch->name, ch->rank, (int)ch->owner_pid, (int)getpid());
        return DSPARK_DP2_E_FORK;
    }
    return publish(ch, DSPARK_DP2_E_PEER_DIED, err, errlen, "%s", msg);
}

int dspark_dp2_shared_error(dspark_dp2_channel *ch) {
    if (ch == NULL) return -1;
    return (int)atomic_load(&ch->shm->header.error_code);
}

int dspark_dp2_shm_name(dspark_dp2_channel *ch, char *buf, size_t buflen) {
    if (ch == NULL || buf == NULL || buflen < sizeof ch->name) return DSPARK_DP2_E_ARG;
    memcpy(buf, ch->name, sizeof ch->name);
    return DSPARK_DP2_OK;
}

int dspark_dp2_set_peer_stop_limit(dspark_dp2_channel *ch, int64_t limit_ms, char *err, size_t errlen) {
    if (err == NULL || errlen < DSPARK_DP2_ERRBUF_MIN) return DSPARK_DP2_E_ARG;
    err[0] = '\0';
    if (ch == NULL) {
        set_err(err, errlen, "dp2 set_peer_stop_limit: NULL handle");
        return DSPARK_DP2_E_ARG;
    }
    if (limit_ms < 0) {
        set_err(err, errlen, "dp2 channel %s rank %d: peer stop limit must be >= 0, got %" PRId64 " ms", ch->name,
                ch->rank, limit_ms);
        return DSPARK_DP2_E_ARG;
    }
    ch->peer_stop_ns = (uint64_t)limit_ms * UINT64_C(1000000);
    return DSPARK_DP2_OK;
}

int dspark_dp2_debug_set_start_time(dspark_dp2_channel *ch, int rank, uint64_t start_time) {
    if (ch == NULL || rank < 0 || rank >= DSPARK_DP2_WORLD_SIZE) return DSPARK_DP2_E_ARG;
    atomic_store(&ch->shm->ranks[rank].start_time, start_time);
    return DSPARK_DP2_OK;
}

int dspark_dp2_debug_skip_sequence(dspark_dp2_channel *ch, uint64_t delta, int publish_too) {
    if (ch == NULL) return DSPARK_DP2_E_ARG;
    ch->local_seq += delta;
    if (publish_too) atomic_fetch_add(&ch->shm->ranks[ch->rank].published_seq, delta);
    return DSPARK_DP2_OK;
}

int dspark_dp2_debug_hold_until_peer_closed(dspark_dp2_channel *ch) {
    if (ch == NULL) return DSPARK_DP2_E_ARG;
    ch->debug_hold_until_peer_closed = 1;
    return DSPARK_DP2_OK;
}

int dspark_dp2_debug_set_pid(dspark_dp2_channel *ch, int rank, int32_t pid) {
    if (ch == NULL || rank < 0 || rank >= DSPARK_DP2_WORLD_SIZE) return DSPARK_DP2_E_ARG;
    atomic_store(&ch->shm->ranks[rank].pid, pid);
    return DSPARK_DP2_OK;
}
