/* Open MPI reference for `titan bench comm`: bus bandwidth of MPI_Allreduce (sum, float) on the
 * same sizes, median of ITERS after one warm-up, NCCL's busbw definition (2·(n−1)/n · bytes / t).
 *   mpicc -O2 scripts/mpi_allreduce_bench.c -o /tmp/mpi_allreduce_bench
 *   mpirun --allow-run-as-root --oversubscribe -np 2 /tmp/mpi_allreduce_bench
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#define ITERS 5

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int mib[] = {1, 4, 16, 64, 256};
    if (rank == 0) printf("%9s %16s   (MPI_Allreduce bus bandwidth GB/s, %d ranks, median of %d)\n", "size", "all_reduce", size, ITERS);
    for (int s = 0; s < 5; s++) {
        size_t n = ((size_t)mib[s] << 20) / 4;
        float *buf = malloc(n * sizeof(float));
        for (size_t i = 0; i < n; i++) buf[i] = 1.0f;
        double t[ITERS];
        MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        for (int it = 0; it < ITERS; it++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            t[it] = MPI_Wtime() - t0;
        }
        qsort(t, ITERS, sizeof(double), cmp);
        double bytes = (double)n * 4.0;
        if (rank == 0) printf("%6d MiB %16.2f\n", mib[s], bytes / t[ITERS / 2] * 2.0 * (size - 1) / size / 1e9);
        free(buf);
    }
    MPI_Finalize();
    return 0;
}
