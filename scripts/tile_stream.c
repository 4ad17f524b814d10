/* How fast a loop shaped like flint's int8 VNNI tile (crates/model/src/kernels/matmul_q8/x86.rs,
 * `vnni`) streams Q4_K weights from memory, against plain reads of the same bytes: the question
 * behind decode's share of the bandwidth ceiling, asked without the rest of flint around it.
 *
 * A 2 GiB huge-page buffer laid out as flint's packed Q4_K panels (per 256 inputs a 64-byte
 * header, then eight 280-byte blocks: 256 bytes of nibbles and 24 of scales), split between the
 * OpenMP threads, each streaming its half once per measurement. Per block the tile-shaped loop
 * prefetches the lines 2,240 bytes ahead into L1 (the tile's `Ahead` on Intel), loads the four
 * 64-byte value vectors, masks their low and high nibbles, and for each of R rows runs eight
 * `vpdpbusd`s with the row's four activation bytes broadcast from memory, then folds the sums
 * into f32 (shift, add, convert, multiply-add). The sums are not flint's (no real scales); only
 * the instruction mix and the memory stream are. Variants:
 *   R1..R3       the loop for 1, 2 and 3 rows (a mixture's experts in a 16-sequence step get 1-3)
 *   R1..R3-reg   the same with the activations in registers (no broadcast loads)
 *   R1..R3-two   two panels at once, block by block (two weight streams per thread)
 *   read         plain reads of the same bytes (four independent vector adds per 256 bytes)
 * Prints one line, the median of REPS alternated measurements of each, in GB/s of weights:
 *
 *   tile_stream threads=2 read=.. R1=.. R2=.. R3=.. R1-reg=.. .. R3-two=..
 *
 * Not part of CI or of any benchmark script: cc -O3 -march=native -fopenmp tile_stream.c
 * (AVX-512 VNNI needed), then OMP_NUM_THREADS=2 ./a.out. Use it on a new CPU before tuning the
 * tile's prefetch or loop: on the 2-core Sapphire Rapids-class Xeon (2026-12-06) it reproduced the
 * Rust tile's streaming rates (R1 29, R2 26.5, R3 24 GB/s while membw read 31-33), so what it
 * shows about the memory pipeline carries over without a model run. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define BYTES ((size_t)2 << 30)
#define HUGE_PAGE ((size_t)2 << 20)
#define REPS 5
#define BLOCK 280                     /* 256 bytes of nibbles, 24 of scales */
#define SUPER (64 + 8 * BLOCK)        /* a header, then eight blocks */
#define PANEL (8 * SUPER)             /* 2048 inputs */
#define AHEAD 2240                    /* the tile's L1 prefetch distance for Q4_K */
#define VARIANTS 10

static char *buf;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* One block of R rows at `p`; `reg` keeps the activations in registers. Inlined per call site,
 * so R and reg are constants there. */
static inline __attribute__((always_inline)) void block(const char *p, const int8_t (*x)[2048], int b, int R,
                                                        int reg, __m512 *f) {
    for (int l = 0; l < BLOCK; l += 64) _mm_prefetch(p + AHEAD + l, _MM_HINT_T0);
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);
    __m512i ia[3], ib[3];
    for (int r = 0; r < R; r++) ia[r] = ib[r] = _mm512_setzero_si512();
    for (int g = 0; g < 4; g++) {
        __m512i v = _mm512_loadu_si512(p + g * 64), lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(v, high);
        for (int r = 0; r < R; r++) {
            int32_t a, c;
            if (reg) {
                a = 0x01020304 + r;
                c = 0x01010101 + g;
            } else {
                memcpy(&a, &x[r][b * 32 + g * 4], 4);
                memcpy(&c, &x[r][b * 32 + 16 + g * 4], 4);
            }
            ia[r] = _mm512_dpbusd_epi32(ia[r], lo, _mm512_set1_epi32(a));
            ib[r] = _mm512_dpbusd_epi32(ib[r], hi, _mm512_set1_epi32(c));
        }
    }
    __m512 scale = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 256))));
    for (int r = 0; r < R; r++) {
        __m512i s = _mm512_add_epi32(ia[r], _mm512_srai_epi32(ib[r], 4));
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, f[r]);
    }
}

#define AT(panel, b) ((panel) + ((b) / 8) * SUPER + 64 + ((b) % 8) * BLOCK)

/* Variant v over this thread's share; returns a value the compiler cannot drop. */
static float stream(int v, const char *base, size_t panels) {
    static __thread int8_t x[3][2048] __attribute__((aligned(64)));
    for (int r = 0; r < 3; r++)
        for (int i = 0; i < 2048; i++) x[r][i] = (int8_t)(i * 7 + r);
    __m512 f[6];
    for (int i = 0; i < 6; i++) f[i] = _mm512_setzero_ps();
    if (v == 9) { /* read */
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
        for (const char *p = base; p < base + panels * PANEL; p += 256) {
            a0 = _mm512_add_epi32(a0, _mm512_loadu_si512(p));
            a1 = _mm512_add_epi32(a1, _mm512_loadu_si512(p + 64));
            a2 = _mm512_add_epi32(a2, _mm512_loadu_si512(p + 128));
            a3 = _mm512_add_epi32(a3, _mm512_loadu_si512(p + 192));
        }
        return (float)_mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)));
    }
    int R = v % 3 + 1, kind = v / 3; /* 0 tile, 1 registers, 2 two panels */
    for (size_t q = 0; q + (kind == 2 ? 2 : 1) <= panels; q += (kind == 2 ? 2 : 1)) {
        const char *pa = base + q * PANEL;
        for (int b = 0; b < 64; b++) {
#define CASE(RR)                                                   \
    case RR:                                                       \
        if (kind == 1) {                                           \
            block(AT(pa, b), x, b, RR, 1, f);                      \
        } else {                                                   \
            block(AT(pa, b), x, b, RR, 0, f);                      \
            if (kind == 2) block(AT(pa + PANEL, b), x, b, RR, 0, f + 3); \
        }                                                          \
        break;
            switch (R) { CASE(1) CASE(2) CASE(3) }
        }
    }
    float s = 0;
    for (int i = 0; i < 6; i++) s += _mm512_reduce_add_ps(f[i]);
    return s;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(void) {
    char *m = mmap(NULL, BYTES + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
        perror("tile_stream: mmap");
        return 1;
    }
    buf = (char *)(((size_t)m + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1));
    madvise(buf, BYTES, MADV_HUGEPAGE);
    for (size_t i = 0; i < BYTES; i++) buf[i] = (char)(i * 131 + 7);
    int threads = omp_get_max_threads();
    size_t panels = BYTES / threads / PANEL & ~(size_t)1; /* even, for the two-panel variant */
    double gbs[VARIANTS][REPS];
    volatile float sink = 0;
    for (int rep = 0; rep < REPS; rep++)
        for (int v = 0; v < VARIANTS; v++) {
            double t = now();
            float s = 0;
#pragma omp parallel reduction(+ : s)
            s += stream(v, buf + (size_t)omp_get_thread_num() * (BYTES / threads), panels);
            sink += s;
            gbs[v][rep] = (double)panels * PANEL * threads / (now() - t) / 1e9;
        }
    static const char *names[VARIANTS] = {"R1", "R2", "R3", "R1-reg", "R2-reg", "R3-reg", "R1-two", "R2-two", "R3-two", "read"};
    printf("tile_stream threads=%d read=", threads);
    qsort(gbs[9], REPS, sizeof(double), cmp);
    printf("%.1f", gbs[9][REPS / 2]);
    for (int v = 0; v < 9; v++) {
        qsort(gbs[v], REPS, sizeof(double), cmp);
        printf(" %s=%.1f", names[v], gbs[v][REPS / 2]);
    }
    printf("\n");
    return sink == 12345.0f;
}
