/* Single-thread memcpy ceiling for benches/compare.sh: one JSON line per size
 * given on the command line (bytes). Build: cc -O2 memcpy_bw.c */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    for (int k = 1; k < argc; k++) {
        size_t n = strtoull(argv[k], NULL, 10);
        char *a = malloc(n), *b = malloc(n);
        if (!a || !b) return 1;
        memset(a, 1, n);
        memset(b, 2, n);
        size_t it = (2ull << 30) / n; /* about 2 GiB moved */
        if (it < 8) it = 8;
        if (it > 2000000) it = 2000000;
        for (size_t i = 0; i < it / 10 + 1; i++) memcpy(b, a, n);
        double t0 = now();
        for (size_t i = 0; i < it; i++) {
            memcpy(b, a, n);
            __asm__ volatile("" ::"r"(b) : "memory");
        }
        double t = now() - t0;
        printf("{\"peer\":\"memcpy\",\"test\":\"bw\",\"link\":\"shm\",\"bytes\":%zu,\"GBps\":%.4f}\n", n, n * (double)it / t / 1e9);
        free(a);
        free(b);
    }
    return 0;
}
