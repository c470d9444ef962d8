/* Open MPI one-sided baseline for benches/compare.sh: rank 0 does
 * MPI_Put + MPI_Win_flush of each size into rank 1's window (passive
 * target, lock_all). Bandwidth: a window of puts then one flush, repeated;
 * latency: one put + flush at a time (a full round trip, like a completed
 * RDMA write). Then MPI_Get + MPI_Win_flush bandwidth the same way (a
 * window of gets, one flush). One JSON line per figure from rank 0 (the
 * get lines under LABEL with its first "put" read as "get"); rank 1 checks
 * that the last put landed, rank 0 that the gets read it.
 * Usage: mpirun -np 2 mpi_put LABEL SIZE... */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    const char *label = argc > 1 ? argv[1] : "mpi";
    size_t max = 8;
    for (int k = 2; k < argc; k++) {
        size_t s = strtoull(argv[k], NULL, 10);
        if (s > max) max = s;
    }
    char *base;
    MPI_Win win;
    MPI_Win_allocate(max, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &base, &win);
    memset(base, 0, max);
    char *src = malloc(max);
    memset(src, 7, max);
    char *dst = calloc(max, 1);
    char get_label[256];
    snprintf(get_label, sizeof get_label, "%s", label);
    char *verb = strstr(get_label, "put");
    if (verb) memcpy(verb, "get", 3);
    int got = 1;
    MPI_Win_lock_all(0, win);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) {
        for (int k = 2; k < argc; k++) {
            size_t sz = strtoull(argv[k], NULL, 10);
            long iters = (long)((2ull << 30) / sz);
            if (iters < 8) iters = 8;
            if (iters > 20000) iters = 20000;
            const int window = 16;
            for (long i = 0; i < iters / 10 + 1; i++) {
                MPI_Put(src, (int)sz, MPI_BYTE, 1, 0, (int)sz, MPI_BYTE, win);
                MPI_Win_flush(1, win);
            }
            double t0 = MPI_Wtime();
            for (long i = 0; i < iters; i++) {
                MPI_Put(src, (int)sz, MPI_BYTE, 1, 0, (int)sz, MPI_BYTE, win);
                if ((i + 1) % window == 0) MPI_Win_flush(1, win);
            }
            MPI_Win_flush(1, win);
            double t = MPI_Wtime() - t0;
            long lat_iters = iters < 2000 ? iters : 2000;
            double t1 = MPI_Wtime();
            for (long i = 0; i < lat_iters; i++) {
                MPI_Put(src, (int)sz, MPI_BYTE, 1, 0, (int)sz, MPI_BYTE, win);
                MPI_Win_flush(1, win);
            }
            double lat = (MPI_Wtime() - t1) / lat_iters;
            printf("{\"peer\":\"%s\",\"test\":\"put_flush\",\"bytes\":%zu,\"GBps\":%.4f,\"lat_us\":%.3f}\n", label, sz,
                   sz * (double)iters / t / 1e9, lat * 1e6);
            fflush(stdout);
            for (long i = 0; i < iters / 10 + 1; i++) {
                MPI_Get(dst, (int)sz, MPI_BYTE, 1, 0, (int)sz, MPI_BYTE, win);
                MPI_Win_flush(1, win);
            }
            double t2 = MPI_Wtime();
            for (long i = 0; i < iters; i++) {
                MPI_Get(dst, (int)sz, MPI_BYTE, 1, 0, (int)sz, MPI_BYTE, win);
                if ((i + 1) % window == 0) MPI_Win_flush(1, win);
            }
            MPI_Win_flush(1, win);
            double tg = MPI_Wtime() - t2;
            got = got && dst[0] == 7 && dst[sz - 1] == 7;
            printf("{\"peer\":\"%s\",\"test\":\"get_flush\",\"bytes\":%zu,\"GBps\":%.4f}\n", get_label, sz,
                   sz * (double)iters / tg / 1e9);
            fflush(stdout);
        }
    }
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Win_unlock_all(win);
    int ok = rank != 1 || (base[0] == 7 && base[max - 1] == 7);
    if (!ok) fprintf(stderr, "mpi_put: rank 1: the puts did not land\n");
    if (!got) fprintf(stderr, "mpi_put: rank 0: the gets did not read what the puts left\n");
    ok = ok && got;
    MPI_Win_free(&win);
    free(src);
    free(dst);
    MPI_Finalize();
    return ok ? 0 : 1;
}
