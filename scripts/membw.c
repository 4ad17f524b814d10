/* Memory bandwidth of this machine, the ceiling for decode (which streams every weight once per
 * token): a read-only sum and a STREAM-style triad (a = b + s·c, 12 bytes per element), on
 * OpenMP threads, over 1 GiB arrays, each with ordinary 4 KiB pages and with transparent huge
 * pages (MADV_HUGEPAGE, as flint's weights use). Prints one line per page size:
 *
 *   membw pages=4k threads=2 read_best=.. read_median=.. triad_best=.. triad_median=..  (GB/s)
 *
 * Built and run by scripts/bench_vs_llamacpp.sh: cc -O3 -march=native -fopenmp membw.c */
#define _GNU_SOURCE
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define N ((size_t)1 << 28) /* floats per array: 1 GiB */
#define REPS 7
#define HUGE_PAGE ((size_t)2 << 20)

#define SPAN (N * sizeof(float) + HUGE_PAGE)

/* A 2 MiB-aligned array inside a mapping of SPAN bytes at *base. */
static float *array(int huge, void **base) {
    char *p = mmap(NULL, SPAN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("membw: mmap");
        exit(1);
    }
    *base = p;
    p = (char *)(((size_t)p + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1));
    madvise(p, N * sizeof(float), huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    return (float *)p;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void run(int huge) {
    void *ma, *mb, *mc;
    float *a = array(huge, &ma), *b = array(huge, &mb), *c = array(huge, &mc);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < N; i++) {
        a[i] = 1.0f;
        b[i] = 2.0f;
        c[i] = 0.5f;
    }
    double read[REPS], triad[REPS];
    float sink = 0;
    for (int r = 0; r < REPS; r++) {
        double t = omp_get_wtime();
        float s = 0;
        /* 16 independent partial sums per thread: one vector add per 64 bytes, not a chain. */
#pragma omp parallel reduction(+ : s)
        {
            float acc[16] = {0};
#pragma omp for schedule(static)
            for (size_t i = 0; i < N; i += 16)
                for (int j = 0; j < 16; j++) acc[j] += b[i + j];
            for (int j = 0; j < 16; j++) s += acc[j];
        }
        read[r] = N * sizeof(float) / (omp_get_wtime() - t) / 1e9;
        sink += s;
        t = omp_get_wtime();
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < N; i++) a[i] = b[i] + 3.0f * c[i];
        triad[r] = 3 * N * sizeof(float) / (omp_get_wtime() - t) / 1e9;
    }
    qsort(read, REPS, sizeof(double), cmp);
    qsort(triad, REPS, sizeof(double), cmp);
    printf("membw pages=%s threads=%d read_best=%.1f read_median=%.1f triad_best=%.1f triad_median=%.1f\n",
           huge ? "huge" : "4k", omp_get_max_threads(), read[REPS - 1], read[REPS / 2], triad[REPS - 1],
           triad[REPS / 2]);
    if (sink < 0) printf("%f\n", sink + a[N / 2]);
    munmap(ma, SPAN);
    munmap(mb, SPAN);
    munmap(mc, SPAN);
}

int main(void) {
    run(0);
    run(1);
    return 0;
}
