/* Helpers shared by the native modules (dp2_exchange.c, draft_traverse.c). */
#ifndef DSPARK_NATIVE_COMMON_H
#define DSPARK_NATIVE_COMMON_H

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

/* Spin-wait hint. */
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Writes a NUL-terminated message into the caller's error buffer (ignored when there is none). */
static inline __attribute__((format(printf, 3, 4))) void set_err(char *err, size_t errlen, const char *fmt, ...) {
    if (err == NULL || errlen == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

#endif
