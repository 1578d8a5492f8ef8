/* Spin-wait hint shared by the native modules (dp2_exchange.c, draft_traverse.c). */
#ifndef DSPARK_SPIN_H
#define DSPARK_SPIN_H

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

#endif
