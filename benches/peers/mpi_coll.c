/* Open MPI collectives baseline for benches/compare.sh, timed as
 * rdma_bench times rmacomm's (nccl-tests' method): per size, a barrier,
 * the warm-up, a barrier, ITERS calls back to back timed with MPI_Wtime on
 * every rank; the per-iteration time averaged over the ranks (and the
 * slowest rank's); then one call on a known pattern whose result every
 * rank checks element by element (the wrong count is summed over ranks).
 *
 * Sizes mean what they mean in rdma_bench and nccl-tests: all_reduce and
 * broadcast move SIZE bytes; all_gather's output, reduce_scatter's input
 * and all_to_all's buffers are SIZE bytes (SIZE / n per rank's block).
 * f32, MPI_SUM. Iterations: about 256 MiB per size (20 ..= 1000), warm-up
 * a tenth (5 ..= 100), as rdma_bench's defaults.
 *
 * Operations: all_reduce (MPI_Allreduce, MPI_IN_PLACE), all_gather
 * (MPI_Allgather), reduce_scatter (MPI_Reduce_scatter_block), all_to_all
 * (MPI_Alltoall), broadcast (MPI_Bcast from rank 0).
 * Prints one JSON line per size from rank 0, in rdma_bench's collective
 * record form plus "peer": LABEL.
 * Usage: mpirun -np N mpi_coll LABEL OP SIZE...   (exit 1 if a check fails) */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static float value(int rank, long k) { return (float)(1 + (k * 7 + rank * 3) % 5); }

static long clampl(long v, long lo, long hi) { return v < lo ? lo : v > hi ? hi : v; }

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (argc < 4) {
        if (rank == 0) fprintf(stderr, "usage: mpi_coll LABEL all_reduce|all_gather|reduce_scatter|all_to_all|broadcast SIZE...\n");
        MPI_Finalize();
        return 2;
    }
    const char *label = argv[1], *op = argv[2];
    int kind = !strcmp(op, "all_reduce") ? 0 : !strcmp(op, "all_gather") ? 1 : !strcmp(op, "reduce_scatter") ? 2
             : !strcmp(op, "all_to_all") ? 3 : !strcmp(op, "broadcast") ? 4 : -1;
    if (kind < 0) {
        if (rank == 0) fprintf(stderr, "mpi_coll: unknown operation %s\n", op);
        MPI_Finalize();
        return 2;
    }
    size_t max = 4 * (size_t)n;
    for (int a = 3; a < argc; a++) {
        size_t s = strtoull(argv[a], NULL, 10);
        if (s > max) max = s;
    }
    float *in = malloc(max), *out = malloc(max);
    int failed = 0;
    for (int a = 3; a < argc; a++) {
        size_t size = strtoull(argv[a], NULL, 10);
        long unit = (kind == 1 || kind == 2 || kind == 3) ? 4L * n : 4L;
        size -= size % unit;
        if (size == 0) size = unit;
        long elems = (long)(size / 4);
        long block = (kind == 1 || kind == 2 || kind == 3) ? elems / n : elems; /* nccl-tests' count */
        long iters = clampl((long)((256L << 20) / (long)size), 20, 1000);
        long warm = clampl(iters / 10, 5, 100);
        /* Timed data: zeros for the in-place all_reduce (stays finite),
         * the pattern elsewhere; written, so every page is mapped. */
        for (long k = 0; k < elems; k++) {
            in[k] = kind == 0 ? 0.0f : value(rank, k);
            out[k] = 0.0f;
        }
#define CALL()                                                                                        \
    do {                                                                                              \
        switch (kind) {                                                                               \
        case 0: MPI_Allreduce(MPI_IN_PLACE, in, (int)elems, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); break; \
        case 1: MPI_Allgather(in, (int)block, MPI_FLOAT, out, (int)block, MPI_FLOAT, MPI_COMM_WORLD); break; \
        case 2: MPI_Reduce_scatter_block(in, out, (int)block, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); break; \
        case 3: MPI_Alltoall(in, (int)block, MPI_FLOAT, out, (int)block, MPI_FLOAT, MPI_COMM_WORLD); break; \
        default: MPI_Bcast(in, (int)elems, MPI_FLOAT, 0, MPI_COMM_WORLD); break;                      \
        }                                                                                             \
    } while (0)
        MPI_Barrier(MPI_COMM_WORLD);
        for (long i = 0; i < warm; i++) CALL();
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (long i = 0; i < iters; i++) CALL();
        double per = (MPI_Wtime() - t0) / iters, sum = 0, slowest = 0;
        MPI_Reduce(&per, &sum, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
        MPI_Reduce(&per, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);

        /* The check. */
        for (long k = 0; k < elems; k++) {
            in[k] = (kind == 4 && rank != 0) ? -1.0f : value(rank, k);
            out[k] = -7.0f;
        }
        CALL();
        long wrong = 0;
        const float *res = (kind == 0 || kind == 4) ? in : out;
        long res_elems = kind == 2 ? block : elems;
        for (long k = 0; k < res_elems; k++) {
            float want = 0;
            switch (kind) {
            case 0: for (int r = 0; r < n; r++) want += value(r, k); break;
            case 1: want = value((int)(k / block), k % block); break;
            case 2: for (int r = 0; r < n; r++) want += value(r, rank * block + k); break;
            case 3: want = value((int)(k / block), rank * block + k % block); break;
            default: want = value(0, k); break;
            }
            if (res[k] != want) wrong++;
        }
        long wrong_all = 0;
        MPI_Reduce(&wrong, &wrong_all, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            double t = sum / n, algbw = size / t / 1e9;
            double factor = kind == 0 ? 2.0 * (n - 1) / n : kind == 4 ? 1.0 : (double)(n - 1) / n;
            printf("{\"peer\":\"%s\",\"op\":\"%s\",\"bytes\":%zu,\"count\":%ld,\"type\":\"f32\",\"redop\":%s,"
                   "\"root\":%s,\"ranks\":%d,\"iterations\":%ld,\"time_us\":%.3f,\"time_max_us\":%.3f,"
                   "\"algbw_GBps\":%.4f,\"busbw_GBps\":%.4f,\"wrong\":%ld}\n",
                   label, op, size, block, (kind == 0 || kind == 2) ? "\"sum\"" : "null", kind == 4 ? "0" : "null", n,
                   iters, t * 1e6, slowest * 1e6, algbw, algbw * factor, wrong_all);
            fflush(stdout);
            if (wrong_all) {
                fprintf(stderr, "mpi_coll: %s of %zu B: %ld wrong elements\n", op, size, wrong_all);
                failed = 1;
            }
        }
    }
    MPI_Bcast(&failed, 1, MPI_INT, 0, MPI_COMM_WORLD);
    free(in);
    free(out);
    MPI_Finalize();
    return failed;
}
