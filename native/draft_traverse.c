/* dspark-harden native DSpark draft-chain traversal (see draft_traverse.h). C11 + POSIX threads. */
#define _GNU_SOURCE
#include "draft_traverse.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tvm_ffi_abi.h"
#include "native_common.h"

/* How long the caller spins for helpers finishing their last job before sleeping on `done`. Both
 * spin loops (this one and a pre-woken worker's) yield the core every SPIN_CHECK iterations: on a
 * host with more runnable threads than cores a spinner must not hold a core that the thread it waits
 * for (or the scheduler's other work) is queued for. */
#define SPIN_DONE_NS 2000000LL
#define SPIN_CHECK 64u

typedef struct {
    const dsh_trav_job *jobs;
    int32_t n_jobs;
    const int64_t *draft;
    int32_t chain;
    int32_t *bits;
    int32_t words;
    atomic_int next;        /* next job index to take */
    atomic_int failed;      /* lowest failing job index, INT_MAX when none */
    pthread_mutex_t err_mu; /* guards code/err (written by the failing thread with the lowest index) */
    int code;
    char err[DSH_TRAV_ERRBUF_MIN];
} task_t;

struct dsh_trav {
    /* bound TVM FFI entry points and xgrammar methods */
    void *lib;
    dsh_TVMFFIFunctionCall_t call;
    dsh_TVMFFIErrorMoveFromRaised_t err_move;
    dsh_TVMFFIObjectDecRef_t decref;
    int (*incref)(void *);
    void *fn_traverse;
    void *fn_is_terminated;
    int32_t matcher_type;
    char type_key[128];
    /* workers */
    int threads;
    int started;
    pthread_t workers[DSH_TRAV_MAX_THREADS];
    struct worker_arg {
        struct dsh_trav *t;
        int idx;
    } args[DSH_TRAV_MAX_THREADS];
    pthread_mutex_t mu;
    pthread_cond_t go[DSH_TRAV_MAX_THREADS]; /* one per worker: only the workers a step needs are woken */
    pthread_cond_t done;
    /* task word: generation * POST_GEN + number of participating workers (workers 0..n-1), published
     * in one store so a worker never pairs one task's generation with another task's participants;
     * the task pointer is published before the word is bumped */
    atomic_uint_fast64_t posted;
    atomic_llong participations;             /* worker entries into a task (diagnostics, tests) */
    uint64_t wake_seq[DSH_TRAV_MAX_THREADS]; /* per worker, bumped by dsh_trav_prewake (under mu) */
    atomic_int active;                       /* workers that have not finished the posted task */
    atomic_int stopping;
    atomic_llong spin_until_ns; /* workers spin for a task until this CLOCK_MONOTONIC time */
    task_t *task;
    pthread_mutex_t run_mu; /* one step at a time */
    pid_t owner;
    /* validation scratch, kept between steps (grown under run_mu): a row flag per batch row and a
     * matcher pointer per job */
    unsigned char *has;
    void **ptrs;
    int32_t has_cap, ptrs_cap;
    /* linear-chain links: row n-1 of `links` holds next-token links of a chain of n nodes */
    int64_t *links;
    int64_t *sibs;
    int32_t links_chain;
};

/* ---------------------------------------------------------------------------------------------- */
/* binding */

static void *find_method(const dsh_TVMFFITypeInfo *info, const char *name) {
    size_t len = strlen(name);
    for (int depth = info->type_depth; depth >= 0; depth--) {
        const dsh_TVMFFITypeInfo *ti = depth == info->type_depth ? info : info->type_ancestors[depth];
        if (!ti) continue;
        for (int32_t i = 0; i < ti->num_methods; i++) {
            const dsh_TVMFFIMethodInfo *m = &ti->methods[i];
            if (m->name.size == len && memcmp(m->name.data, name, len) == 0) {
                if (m->method.type_index != dsh_kTVMFFIFunction || !m->method.v_obj) return NULL;
                return m->method.v_obj;
            }
        }
    }
    return NULL;
}

static int bind(dsh_trav *t, const char *libpath, void *probe, char *err, size_t errlen) {
    t->lib = dlopen(libpath, RTLD_NOW | RTLD_NOLOAD);
    if (!t->lib) {
        set_err(err, errlen, "TVM FFI library %s is not loaded in this process (import xgrammar first): %s", libpath,
                dlerror());
        return DSH_TRAV_E_BIND;
    }
    dsh_TVMFFIGetVersion_t get_version = (dsh_TVMFFIGetVersion_t)dlsym(t->lib, "TVMFFIGetVersion");
    dsh_TVMFFIGetTypeInfo_t get_type_info = (dsh_TVMFFIGetTypeInfo_t)dlsym(t->lib, "TVMFFIGetTypeInfo");
    t->call = (dsh_TVMFFIFunctionCall_t)dlsym(t->lib, "TVMFFIFunctionCall");
    t->err_move = (dsh_TVMFFIErrorMoveFromRaised_t)dlsym(t->lib, "TVMFFIErrorMoveFromRaised");
    t->decref = (dsh_TVMFFIObjectDecRef_t)dlsym(t->lib, "TVMFFIObjectDecRef");
    t->incref = (int (*)(void *))dlsym(t->lib, "TVMFFIObjectIncRef");
    if (!get_version || !get_type_info || !t->call || !t->err_move || !t->decref || !t->incref) {
        set_err(err, errlen, "TVM FFI library %s lacks a C API entry point this traversal needs", libpath);
        return DSH_TRAV_E_BIND;
    }
    dsh_TVMFFIVersion v = {0, 0, 0};
    get_version(&v);
    if (v.major != DSH_TVM_FFI_ABI_MAJOR || v.minor != DSH_TVM_FFI_ABI_MINOR) {
        set_err(err, errlen, "TVM FFI C ABI %u.%u.%u is not the %d.%d ABI this traversal was built for", v.major,
                v.minor, v.patch, DSH_TVM_FFI_ABI_MAJOR, DSH_TVM_FFI_ABI_MINOR);
        return DSH_TRAV_E_BIND;
    }
    if (!probe) {
        set_err(err, errlen, "no probe GrammarMatcher handle");
        return DSH_TRAV_E_ARG;
    }
    int32_t type_index = ((const dsh_TVMFFIObject *)probe)->type_index;
    const dsh_TVMFFITypeInfo *info = type_index >= dsh_kTVMFFIStaticObjectBegin ? get_type_info(type_index) : NULL;
    if (!info) {
        set_err(err, errlen, "probe matcher has no TVM FFI type info (type index %d)", type_index);
        return DSH_TRAV_E_BIND;
    }
    snprintf(t->type_key, sizeof t->type_key, "%.*s", (int)info->type_key.size, info->type_key.data);
    t->fn_traverse = find_method(info, "traverse_draft_tree");
    t->fn_is_terminated = find_method(info, "is_terminated");
    if (!t->fn_traverse || !t->fn_is_terminated) {
        set_err(err, errlen, "TVM FFI type %s has no traverse_draft_tree / is_terminated method", t->type_key);
        return DSH_TRAV_E_BIND;
    }
    t->incref(t->fn_traverse);
    t->incref(t->fn_is_terminated);
    t->matcher_type = type_index;
    return DSH_TRAV_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* one chain */

static int raised(dsh_trav *t, const char *what, char *err, size_t errlen) {
    void *e = NULL;
    t->err_move(&e);
    if (!e) {
        set_err(err, errlen, "%s failed without an error object", what);
        return DSH_TRAV_E_CALL;
    }
    const dsh_TVMFFIErrorCellPrefix *cell =
        (const dsh_TVMFFIErrorCellPrefix *)((const char *)e + sizeof(dsh_TVMFFIObject));
    set_err(err, errlen, "%s raised %.*s: %.*s", what, (int)cell->kind.size, cell->kind.data, (int)cell->message.size,
            cell->message.data);
    t->decref(e);
    return DSH_TRAV_E_CALL;
}

static int call_bool(dsh_trav *t, void *fn, dsh_TVMFFIAny *args, int n, const char *what, int *out, char *err,
                     size_t errlen) {
    dsh_TVMFFIAny res;
    memset(&res, 0, sizeof res);
    res.type_index = dsh_kTVMFFINone;
    if (t->call(fn, args, n, &res) != 0) return raised(t, what, err, errlen);
    if (res.type_index != dsh_kTVMFFIBool && res.type_index != dsh_kTVMFFIInt) {
        if (res.type_index >= dsh_kTVMFFIStaticObjectBegin && res.v_obj) t->decref(res.v_obj);
        set_err(err, errlen, "%s returned type index %d, expected a bool", what, res.type_index);
        return DSH_TRAV_E_CALL;
    }
    *out = res.v_int64 != 0;
    return DSH_TRAV_OK;
}

static void fill_ones(int32_t *bits, int32_t words, int64_t first_row, int64_t rows) {
    if (rows > 0) memset(bits + first_row * words, 0xFF, (size_t)rows * (size_t)words * sizeof(int32_t));
}

static int one_job(dsh_trav *t, task_t *k, const dsh_trav_job *j, char *err, size_t errlen) {
    const int32_t chain = k->chain, words = k->words;
    const int64_t base = (int64_t)j->row * chain;
    int64_t n = j->end - j->root;
    if (((const dsh_TVMFFIObject *)j->matcher)->type_index != t->matcher_type) {
        set_err(err, errlen, "matcher object has TVM FFI type index %d, not %s",
                ((const dsh_TVMFFIObject *)j->matcher)->type_index, t->type_key);
        return DSH_TRAV_E_TYPE;
    }
    int64_t shape2[2] = {n, words};
    dsh_DLTensor nxt = {t->links + (n - 1) * chain, {1, 0}, 1, {0, 64, 1}, &n, NULL, 0};
    dsh_DLTensor sib = {t->sibs, {1, 0}, 1, {0, 64, 1}, &n, NULL, 0};
    dsh_DLTensor tok = {(void *)(k->draft + base + j->root), {1, 0}, 1, {0, 64, 1}, &n, NULL, 0};
    dsh_DLTensor bm = {k->bits + (base + j->root) * words, {1, 0}, 2, {0, 32, 1}, shape2, NULL, 0};
    dsh_TVMFFIAny args[7];
    memset(args, 0, sizeof args);
    args[0].type_index = ((const dsh_TVMFFIObject *)j->matcher)->type_index;
    args[0].v_ptr = j->matcher;
    args[1].type_index = dsh_kTVMFFIDLTensorPtr, args[1].v_ptr = &nxt;
    args[2].type_index = dsh_kTVMFFIDLTensorPtr, args[2].v_ptr = &sib;
    args[3].type_index = dsh_kTVMFFIDLTensorPtr, args[3].v_ptr = &tok;
    args[4].type_index = dsh_kTVMFFIDLTensorPtr, args[4].v_ptr = &bm;
    args[5].type_index = dsh_kTVMFFIFloat, args[5].v_float64 = -1.0;
    args[6].type_index = dsh_kTVMFFINone;
    int ok = 0, rc = call_bool(t, t->fn_traverse, args, 7, "GrammarMatcher.traverse_draft_tree", &ok, err, errlen);
    if (rc) return rc;
    if (!ok) {
        set_err(err, errlen, "native draft-tree traversal did not complete");
        return DSH_TRAV_E_INCOMPLETE;
    }
    /* Stock-equivalence repair (see draft_traverse.h): the first rejected node, or the first
     * accepted node whose token is a stop token, ends what stock fills. */
    const int64_t *row = k->draft + base;
    int64_t cut = -1;
    for (int64_t i = j->root + 1; i < j->end; i++) {
        int64_t tk = row[i];
        if (tk < 0 || tk >= (int64_t)words * 32) {
            set_err(err, errlen, "draft token %lld at chain position %lld is outside the %d-word mask", (long long)tk,
                    (long long)i, words);
            return DSH_TRAV_E_ARG;
        }
        uint32_t word = (uint32_t)k->bits[(base + i - 1) * words + (tk >> 5)];
        if (!((word >> (tk & 31)) & 1u)) {
            cut = i;
            break;
        }
        int stop = 0;
        for (int32_t s = 0; s < j->n_stop; s++)
            if (j->stop[s] == tk) stop = 1;
        if (stop) {
            cut = i;
            break;
        }
    }
    if (cut == j->root + 1 || j->end == j->root + 1) {
        const int32_t *r0 = k->bits + (base + j->root) * words;
        int zero = 1;
        for (int32_t w = 0; w < words && zero; w++) zero = r0[w] == 0;
        if (zero) {
            int term = 0;
            rc = call_bool(t, t->fn_is_terminated, args, 1, "GrammarMatcher.is_terminated", &term, err, errlen);
            if (rc) return rc;
            if (term) cut = j->root;
        }
    }
    if (cut >= 0) fill_ones(k->bits, words, base + cut, j->end - cut);
    return DSH_TRAV_OK;
}

static void work(dsh_trav *t, task_t *k) {
    char err[DSH_TRAV_ERRBUF_MIN];
    for (;;) {
        int i = atomic_fetch_add_explicit(&k->next, 1, memory_order_relaxed);
        if (i >= k->n_jobs) return;
        if (atomic_load_explicit(&k->failed, memory_order_relaxed) < i) return; /* an earlier job failed */
        err[0] = 0;
        int rc = one_job(t, k, &k->jobs[i], err, sizeof err);
        if (rc) {
            pthread_mutex_lock(&k->err_mu);
            if (i < atomic_load(&k->failed)) {
                atomic_store(&k->failed, i);
                k->code = rc;
                memcpy(k->err, err, sizeof err);
            }
            pthread_mutex_unlock(&k->err_mu);
        }
    }
}

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Workers sleep on `go` between steps. dsh_trav_prewake wakes them a little before a step (while
 * the caller resolves jobs) and they spin until the task is posted or spin_until_ns passes, so the
 * wake-up latency of a sleeping thread is not on the step's critical path. */
#define POST_GEN 128u /* > DSH_TRAV_MAX_THREADS - 1 */
_Static_assert(POST_GEN > DSH_TRAV_MAX_THREADS, "participant count must fit below one generation step");

static void *worker_main(void *arg) {
    struct worker_arg *wa = (struct worker_arg *)arg;
    dsh_trav *t = wa->t;
    const int idx = wa->idx;
    uint64_t seen = 0, woken = 0;
    for (;;) {
        pthread_mutex_lock(&t->mu);
        while (!atomic_load(&t->stopping) &&
               (atomic_load(&t->posted) == seen || (int)(atomic_load(&t->posted) % POST_GEN) <= idx) &&
               t->wake_seq[idx] == woken)
            pthread_cond_wait(&t->go[idx], &t->mu);
        woken = t->wake_seq[idx];
        pthread_mutex_unlock(&t->mu);
        if (atomic_load(&t->stopping)) break;
        uint64_t gen;
        int mine = 0;
        for (;;) {
            gen = atomic_load_explicit(&t->posted, memory_order_acquire);
            for (unsigned spins = 0; gen == seen; spins++) {
                if ((spins % SPIN_CHECK) == SPIN_CHECK - 1) {
                    if (atomic_load(&t->stopping) || now_ns() > atomic_load(&t->spin_until_ns)) break;
                    sched_yield();
                }
                cpu_relax();
                gen = atomic_load_explicit(&t->posted, memory_order_acquire);
            }
            if (gen == seen) break; /* spun out (or stopping): sleep again */
            seen = gen;
            /* a worker outside this task's participants skips it without touching the task or `active`
             * (and keeps spinning if it was woken for a later step); a participant keeps the task alive
             * (run waits for `active`) until it has decremented */
            if ((int)(gen % POST_GEN) > idx) {
                mine = 1;
                break;
            }
        }
        if (!mine) continue;
        atomic_fetch_add_explicit(&t->participations, 1, memory_order_relaxed);
        work(t, t->task);
        if (atomic_fetch_sub_explicit(&t->active, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&t->mu);
            pthread_cond_signal(&t->done);
            pthread_mutex_unlock(&t->mu);
        }
    }
    return NULL;
}

void dsh_trav_prewake(dsh_trav *t, int spin_us, int workers) {
    if (!t || t->started == 0 || getpid() != t->owner) return;
    int n = workers < 0 || workers > t->started ? t->started : workers;
    if (n == 0) return;
    atomic_store(&t->spin_until_ns, now_ns() + (long long)(spin_us > 0 ? spin_us : 0) * 1000LL);
    pthread_mutex_lock(&t->mu);
    for (int i = 0; i < n; i++) {
        t->wake_seq[i]++;
        pthread_cond_signal(&t->go[i]);
    }
    pthread_mutex_unlock(&t->mu);
}

/* ---------------------------------------------------------------------------------------------- */
/* public API */

int dsh_trav_open(const char *libpath, void *probe_matcher, int threads, dsh_trav **out, char *err, size_t errlen) {
    if (!out || !libpath) {
        set_err(err, errlen, "null argument");
        return DSH_TRAV_E_ARG;
    }
    *out = NULL;
    if (threads < 1 || threads > DSH_TRAV_MAX_THREADS) {
        set_err(err, errlen, "threads must be in [1, %d], got %d", DSH_TRAV_MAX_THREADS, threads);
        return DSH_TRAV_E_ARG;
    }
    dsh_trav *t = calloc(1, sizeof *t);
    if (!t) {
        set_err(err, errlen, "out of memory");
        return DSH_TRAV_E_ARG;
    }
    int rc = bind(t, libpath, probe_matcher, err, errlen);
    if (rc) {
        if (t->lib) dlclose(t->lib);
        free(t);
        return rc;
    }
    pthread_mutex_init(&t->mu, NULL);
    pthread_mutex_init(&t->run_mu, NULL);
    for (int i = 0; i < DSH_TRAV_MAX_THREADS; i++) pthread_cond_init(&t->go[i], NULL);
    pthread_cond_init(&t->done, NULL);
    t->owner = getpid();
    t->threads = threads;
    for (int i = 0; i < threads - 1; i++) {
        t->args[i].t = t;
        t->args[i].idx = i;
        int e = pthread_create(&t->workers[i], NULL, worker_main, &t->args[i]);
        if (e) {
            set_err(err, errlen, "pthread_create: %s", strerror(e));
            dsh_trav_close(t);
            return DSH_TRAV_E_THREAD;
        }
        t->started++;
    }
    *out = t;
    return DSH_TRAV_OK;
}

int dsh_trav_threads(const dsh_trav *t) { return t ? t->threads : 0; }

long long dsh_trav_participations(dsh_trav *t) { return t ? atomic_load(&t->participations) : -1; }

static int cmp_ptr(const void *a, const void *b) {
    uintptr_t x = (uintptr_t)(*(void *const *)a), y = (uintptr_t)(*(void *const *)b);
    return x < y ? -1 : x > y;
}

/* grows t->has to >= bs entries and t->ptrs to >= n (under run_mu); -1 when out of memory */
static int ensure_scratch(dsh_trav *t, int32_t bs, int32_t n) {
    if (bs > t->has_cap) {
        unsigned char *has = malloc((size_t)bs);
        if (!has) return -1;
        free(t->has);
        t->has = has;
        t->has_cap = bs;
    }
    if (n > t->ptrs_cap) {
        void **ptrs = malloc((size_t)n * sizeof(void *));
        if (!ptrs) return -1;
        free(t->ptrs);
        t->ptrs = ptrs;
        t->ptrs_cap = n;
    }
    return 0;
}

static int validate_and_prefill(dsh_trav *t, dsh_trav_job *jobs, int32_t n, const int64_t *draft, int32_t bs,
                                int32_t chain, int32_t vocab, int32_t *bits, int32_t words, int32_t *failed, char *err,
                                size_t errlen) {
    if (ensure_scratch(t, bs, n)) {
        set_err(err, errlen, "out of memory");
        return DSH_TRAV_E_ARG;
    }
    unsigned char *has = t->has;
    void **ptrs = t->ptrs;
    memset(has, 0, (size_t)bs);
    int rc = DSH_TRAV_OK;
    for (int32_t i = 0; i < n && !rc; i++) {
        dsh_trav_job *j = &jobs[i];
        if (!j->matcher || j->row < 0 || j->row >= bs || j->root < 0 || j->root >= j->end || j->end > chain ||
            j->n_stop < 0 || (j->n_stop && !j->stop)) {
            set_err(err, errlen, "job row=%d root=%d end=%d outside batch %dx%d (or no matcher)", j->row, j->root,
                    j->end, bs, chain);
            rc = DSH_TRAV_E_ARG;
        } else if (has[j->row]) {
            set_err(err, errlen, "batch row %d assigned to two matchers", j->row);
            rc = DSH_TRAV_E_ARG;
        } else {
            has[j->row] = 1;
            ptrs[i] = j->matcher;
            const int64_t *row = draft + (int64_t)j->row * chain;
            for (int32_t c = j->root + 1; c < j->end; c++) {
                if (row[c] >= vocab) {
                    j->end = c; /* stock rejects it (and fills nothing from it on) */
                    break;
                }
                if (row[c] < 0) {
                    set_err(err, errlen, "negative draft token %lld at chain position %d", (long long)row[c], c);
                    rc = DSH_TRAV_E_ARG;
                    break;
                }
            }
        }
        if (rc) *failed = i;
    }
    if (!rc && n > 1) {
        qsort(ptrs, (size_t)n, sizeof(void *), cmp_ptr);
        for (int32_t i = 1; i < n; i++)
            if (ptrs[i] == ptrs[i - 1]) {
                int32_t first = -1, second = -1;
                for (int32_t a = 0; a < n && second < 0; a++)
                    if (jobs[a].matcher == ptrs[i]) {
                        if (first < 0)
                            first = a;
                        else
                            second = a;
                    }
                *failed = second;
                set_err(err, errlen, "its GrammarMatcher is shared with batch row %d (rows are traversed concurrently)",
                        jobs[first].row);
                rc = DSH_TRAV_E_ARG;
                break;
            }
    }
    if (!rc) {
        for (int32_t r = 0; r < bs; r++)
            if (!has[r]) fill_ones(bits, words, (int64_t)r * chain, chain);
        for (int32_t i = 0; i < n; i++) {
            const dsh_trav_job *j = &jobs[i];
            fill_ones(bits, words, (int64_t)j->row * chain, j->root);
            fill_ones(bits, words, (int64_t)j->row * chain + j->end, chain - j->end);
        }
    }
    return rc;
}

static int ensure_links(dsh_trav *t, int32_t chain) {
    if (t->links_chain == chain) return 0;
    int64_t *links = malloc((size_t)chain * (size_t)chain * sizeof(int64_t));
    int64_t *sibs = malloc((size_t)chain * sizeof(int64_t));
    if (!links || !sibs) {
        free(links);
        free(sibs);
        return -1;
    }
    for (int32_t n = 1; n <= chain; n++)
        for (int32_t i = 0; i < n; i++) links[(int64_t)(n - 1) * chain + i] = i + 1 < n ? i + 1 : -1;
    for (int32_t i = 0; i < chain; i++) sibs[i] = -1;
    free(t->links);
    free(t->sibs);
    t->links = links;
    t->sibs = sibs;
    t->links_chain = chain;
    return 0;
}

int dsh_trav_run(dsh_trav *t, dsh_trav_job *jobs, int32_t n_jobs, const int64_t *draft, int32_t bs, int32_t chain,
                 int32_t vocab_size, int32_t *bits, int32_t words, int32_t *failed_job, char *err, size_t errlen) {
    int32_t dummy;
    if (!failed_job) failed_job = &dummy;
    *failed_job = -1;
    if (!t || !draft || !bits || (n_jobs && !jobs) || n_jobs < 0 || bs <= 0 || chain <= 0 || words <= 0 ||
        vocab_size <= 0 || vocab_size > words * 32) {
        set_err(err, errlen, "null traversal, buffers or bad geometry (bs=%d chain=%d vocab=%d words=%d jobs=%d)", bs,
                chain, vocab_size, words, n_jobs);
        return DSH_TRAV_E_ARG;
    }
    if (getpid() != t->owner) {
        set_err(err, errlen, "native traversal used in pid %d, opened in pid %d (worker threads do not survive fork)",
                (int)getpid(), (int)t->owner);
        return DSH_TRAV_E_THREAD;
    }
    pthread_mutex_lock(&t->run_mu);
    int rc = validate_and_prefill(t, jobs, n_jobs, draft, bs, chain, vocab_size, bits, words, failed_job, err, errlen);
    if (!rc && ensure_links(t, chain)) {
        set_err(err, errlen, "out of memory");
        rc = DSH_TRAV_E_ARG;
    }
    if (rc || n_jobs == 0) {
        pthread_mutex_unlock(&t->run_mu);
        return rc;
    }
    task_t k;
    memset(&k, 0, sizeof k);
    k.jobs = jobs, k.n_jobs = n_jobs, k.draft = draft, k.chain = chain, k.bits = bits, k.words = words;
    atomic_init(&k.next, 0);
    atomic_init(&k.failed, INT_MAX);
    pthread_mutex_init(&k.err_mu, NULL);
    int helpers = t->started < n_jobs - 1 ? t->started : n_jobs - 1;
    if (helpers > 0) {
        t->task = &k;
        /* only the workers that have a job take part: the step never waits for the wake-up of a worker
         * it does not need, and idle workers stay asleep */
        atomic_store(&t->active, helpers);
        /* spinning participants see the new generation at once; sleeping ones are woken */
        uint_fast64_t word = atomic_load_explicit(&t->posted, memory_order_relaxed);
        atomic_store_explicit(&t->posted, (word / POST_GEN + 1) * POST_GEN + (uint_fast64_t)helpers,
                              memory_order_release);
        pthread_mutex_lock(&t->mu);
        for (int i = 0; i < helpers; i++) pthread_cond_signal(&t->go[i]);
        pthread_mutex_unlock(&t->mu);
    }
    work(t, &k);
    if (helpers > 0) {
        /* the helpers are on their last job: spin briefly before sleeping on `done` */
        long long until = now_ns() + SPIN_DONE_NS;
        for (unsigned spins = 0; atomic_load_explicit(&t->active, memory_order_acquire) > 0; spins++) {
            if ((spins % SPIN_CHECK) == SPIN_CHECK - 1) {
                if (now_ns() > until) break;
                sched_yield();
            }
            cpu_relax();
        }
        pthread_mutex_lock(&t->mu);
        while (atomic_load(&t->active) > 0) pthread_cond_wait(&t->done, &t->mu);
        pthread_mutex_unlock(&t->mu);
        t->task = NULL;
    }
    pthread_mutex_destroy(&k.err_mu);
    int failed = atomic_load(&k.failed);
    if (failed != INT_MAX) {
        *failed_job = failed;
        set_err(err, errlen, "%s", k.err);
        rc = k.code;
    }
    pthread_mutex_unlock(&t->run_mu);
    return rc;
}

void dsh_trav_close(dsh_trav *t) {
    if (!t) return;
    if (getpid() == t->owner) {
        pthread_mutex_lock(&t->run_mu); /* a step still running finishes first (item 8: close vs run) */
        pthread_mutex_lock(&t->mu);
        atomic_store(&t->stopping, 1);
        for (int i = 0; i < t->started; i++) pthread_cond_signal(&t->go[i]);
        pthread_mutex_unlock(&t->mu);
        for (int i = 0; i < t->started; i++) pthread_join(t->workers[i], NULL);
        pthread_mutex_unlock(&t->run_mu);
        if (t->fn_traverse) t->decref(t->fn_traverse);
        if (t->fn_is_terminated) t->decref(t->fn_is_terminated);
    }
    pthread_mutex_destroy(&t->mu);
    pthread_mutex_destroy(&t->run_mu);
    for (int i = 0; i < DSH_TRAV_MAX_THREADS; i++) pthread_cond_destroy(&t->go[i]);
    pthread_cond_destroy(&t->done);
    if (t->lib) dlclose(t->lib);
    free(t->links);
    free(t->sibs);
    free(t->has);
    free(t->ptrs);
    free(t);
}
