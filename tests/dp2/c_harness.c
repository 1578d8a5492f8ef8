/* Two processes (fork; each opens its own end after the fork) run N exchanges and check every
 * value: even iterations through dspark_dp2_exchange, odd ones through the bound one-argument call
 * (dspark_dp2_exchange_bound) into a ring of ROWS output rows; once, a request naming a row outside
 * the bound rows must be refused (DSPARK_DP2_E_ARG, nothing published) and the channel stay usable. Built by tests/dp2/test_native_c.py with AddressSanitizer and ThreadSanitizer.
 * usage: c_harness <session-id> <iterations> */
#define _GNU_SOURCE
#include "dp2_exchange.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define WIDTH 11
#define ROWS 7

static int run(const char *session, int rank, long iters) {
    char err[512];
    dspark_dp2_channel *ch = NULL;
    int rc = dspark_dp2_open(session, "mlp", rank, 2, WIDTH, 20000, 50000, 42, &ch, err, sizeof err);
    if (rc != 0) {
        fprintf(stderr, "rank %d open failed (%d): %s\n", rank, rc, err);
        return 2;
    }
    int64_t local[WIDTH], plain_out[2 * WIDTH], req[1 + WIDTH], rows[ROWS][2 * WIDTH];
    dspark_dp2_stats st;
    memset(&st, 0, sizeof st);
    rc = dspark_dp2_bind(ch, req, &rows[0][0], ROWS, &st, err, sizeof err);
    if (rc != 0) {
        fprintf(stderr, "rank %d bind failed (%d): %s\n", rank, rc, err);
        return 2;
    }
    req[0] = ROWS; /* one past the last row: refused before anything is published */
    rc = dspark_dp2_exchange_bound(ch);
    if (rc != DSPARK_DP2_E_ARG || strstr(err, "outside the 7 bound rows") == NULL || dspark_dp2_shared_error(ch) != 0) {
        fprintf(stderr, "rank %d: out-of-range row gave %d (%s), shared error %d\n", rank, rc, err,
                dspark_dp2_shared_error(ch));
        return 7;
    }
    for (long i = 1; i <= iters; ++i) {
        const int bound = (int)(i & 1);
        int64_t *out = bound ? rows[i % ROWS] : plain_out;
        for (int j = 0; j < WIDTH; ++j) local[j] = (int64_t)rank * 1000000000 + (int64_t)i * 16 + j;
        if (bound) {
            req[0] = i % ROWS;
            memcpy(req + 1, local, sizeof local);
            rc = dspark_dp2_exchange_bound(ch);
        } else {
            rc = dspark_dp2_exchange(ch, local, out, &st, err, sizeof err);
        }
        if (rc != 0) {
            fprintf(stderr, "rank %d exchange %ld failed (%d): %s\n", rank, i, rc, err);
            return 3;
        }
        if (st.sequence != (uint64_t)i) {
            fprintf(stderr, "rank %d: sequence %" PRIu64 " != %ld\n", rank, st.sequence, i);
            return 4;
        }
        for (int r = 0; r < 2; ++r)
            for (int j = 0; j < WIDTH; ++j) {
                int64_t want = (int64_t)r * 1000000000 + (int64_t)i * 16 + j;
                if (out[r * WIDTH + j] != want) {
                    fprintf(stderr, "rank %d iter %ld: out[%d][%d] = %" PRId64 " want %" PRId64 "\n", rank, i, r, j,
                            out[r * WIDTH + j], want);
                    return 5;
                }
            }
    }
    char name[64];
    dspark_dp2_shm_name(ch, name, sizeof name);
    rc = dspark_dp2_close(ch, err, sizeof err);
    if (rc != 0) {
        fprintf(stderr, "rank %d close failed (%d): %s\n", rank, rc, err);
        return 6;
    }
    if (rank == 0) printf("%s\n", name);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s <session> <iterations>\n", argv[0]);
        return 1;
    }
    long iters = strtol(argv[2], NULL, 10);
    pid_t child = fork();
    if (child < 0) return 1;
    if (child == 0) _exit(run(argv[1], 1, iters));
    int rc0 = run(argv[1], 0, iters);
    int status = 0;
    waitpid(child, &status, 0);
    int rc1 = WIFEXITED(status) ? WEXITSTATUS(status) : 100 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    if (rc0 || rc1) {
        fprintf(stderr, "rank0 rc %d, rank1 rc %d\n", rc0, rc1);
        return rc0 ? rc0 : rc1;
    }
    printf("ok %ld exchanges\n", iters);
    return 0;
}
