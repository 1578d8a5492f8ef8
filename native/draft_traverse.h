/* dspark-harden native DSpark draft-chain traversal: public C API.
 *
 * One call per verify step walks every active chain with xgrammar's own native
 * GrammarMatcher.traverse_draft_tree, called through the TVM FFI C ABI (the same entry the Python
 * binding uses) from a persistent pool of native threads, without the GIL, and writes the bitmask
 * stock SGLang 0.5.23's Python DFS would write, bit for bit:
 *
 *   - rows outside [root, end) of every job and all rows of batch entries without a job: -1;
 *   - [root, end): xgrammar's masks, then the rows from the first rejected node, from the first
 *     node whose token is a stop token (the grammar terminates there), or from the root of a
 *     matcher that was already terminated, up to end: -1 (xgrammar writes zero rows there; stock
 *     never fills them).
 *
 * Matchers are left as found (traverse_draft_tree rolls back). Jobs must name distinct matchers
 * and distinct rows (checked). Header is #included by draft_traverse.c and cdef'd by cffi
 * (native/build_traverse.py strips preprocessor lines: constants are enums).
 */
#ifndef DSPARK_DRAFT_TRAVERSE_H
#define DSPARK_DRAFT_TRAVERSE_H

#include <stddef.h>
#include <stdint.h>

enum { DSH_TRAV_ABI_VERSION = 3, DSH_TRAV_MAX_THREADS = 64, DSH_TRAV_ERRBUF_MIN = 256 };

enum {
    DSH_TRAV_OK = 0,
    DSH_TRAV_E_ARG = 1,        /* bad geometry / job (row, range, duplicate row or matcher) */
    DSH_TRAV_E_BIND = 2,       /* TVM FFI library or xgrammar method not found, ABI mismatch */
    DSH_TRAV_E_TYPE = 3,       /* a job's matcher is not the bound xgrammar GrammarMatcher type */
    DSH_TRAV_E_CALL = 4,       /* the xgrammar call raised */
    DSH_TRAV_E_INCOMPLETE = 5, /* traverse_draft_tree returned false */
    DSH_TRAV_E_THREAD = 6      /* could not start the worker threads */
};

typedef struct dsh_trav dsh_trav;

typedef struct {
    void *matcher;  /* TVMFFIObjectHandle of an xgrammar GrammarMatcher (borrowed) */
    int32_t row;    /* batch row */
    int32_t root;   /* first chain position filled from the matcher's current state */
    int32_t end;    /* exclusive upper bound (<= chain); clipped in C at the first draft token
                             >= vocab_size after root (stock rejects it without asking the grammar) */
    int32_t n_stop; /* the matcher's stop token ids */
    const int32_t *stop;
} dsh_trav_job;

/* Binds to the already loaded TVM FFI library at `libpath` (RTLD_NOLOAD: the very instance xgrammar
 * uses), finds GrammarMatcher.traverse_draft_tree / is_terminated on the type of `probe_matcher`
 * and starts threads-1 workers (the calling thread is the last one). */
int dsh_trav_open(const char *libpath, void *probe_matcher, int threads, dsh_trav **out, char *err, size_t errlen);

/* draft: (bs, chain) int64, row-major; bits: (>= bs*chain, words) int32, row-major; a negative
 * draft token after a job's root (before its end) is an error (stock has no meaning for it).
 * On error *failed_job is the lowest failing job index (-1 when no single job is to blame). */
int dsh_trav_run(dsh_trav *t, dsh_trav_job *jobs, int32_t n_jobs, const int64_t *draft, int32_t bs, int32_t chain,
                 int32_t vocab_size, int32_t *bits, int32_t words, int32_t *failed_job, char *err, size_t errlen);

/* Wakes the worker threads ahead of a step: they spin up to `spin_us` microseconds for the next
 * dsh_trav_run, then sleep again. Optional; takes the thread wake-up latency off the step. */
void dsh_trav_prewake(dsh_trav *t, int spin_us, int workers);

/* How many times a worker thread took part in a step (the caller's own thread not counted): a step
 * with n jobs wakes and waits for min(threads - 1, n - 1) workers, no more. */
long long dsh_trav_participations(dsh_trav *t);

int dsh_trav_threads(const dsh_trav *t);
void dsh_trav_close(dsh_trav *t);

#endif
