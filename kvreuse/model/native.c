/* Kernels the runtime compiles for the CPU it runs on (kvreuse/model/native.py builds this file with
   -march=native and loads it with ctypes). Plain C with OpenMP: the compiler vectorises the loops marked simd
   for whatever vector width the CPU has, and the prefill attention's inner products are written with GCC's
   vector types (`vec`: 16 floats with AVX-512, 8 without) so that their sums stay in registers. Tensors are
   fp32 or bf16 (positions and lengths int64), read through the strides given, with contiguous rows. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The bf16 dot-product instruction (vdpbf16ps: pairs of bf16 multiplied exactly, added to fp32 sums), on CPUs
   with AVX512-BF16: `panel_rows` of bf16 and the bf16 prefill attention's products are built only there. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define BF16_DOT 1
#else
#define BF16_DOT 0
#endif

/* ---- fp32 and bf16 -------------------------------------------------------------------------------------
   Tensors a kernel takes as fp32 or bf16 are read and written through these; `bf16` is a constant where they
   are called, so each kernel compiles once per type with no branch in its loops. bf16 is widened as it is
   read and rounded to the nearest bf16 (ties to even) as it is written; the sums between are fp32.
   Such a kernel keeps its parallel loop in the function it exports, around calls of inline functions with the
   constants: OpenMP outlines a parallel region before inlining, so a loop inside an inlined function would get
   them as variables (few_rows' fp32 products stopped vectorising that way: 373 us against 35). */

/* element i of base, fp32 or bf16 (the top half of an fp32: widening is a shift) */
static inline float stored(const void *base, int64_t i, const int bf16) {
    if (bf16) {
        union { uint32_t bits; float value; } x = {.bits = (uint32_t)((const uint16_t *)base)[i] << 16};
        return x.value;
    }
    return ((const float *)base)[i];
}

/* v rounded to bf16's precision if bf16, else v */
static inline float rounded_to(float v, const int bf16) {
    if (!bf16) return v;
    union { float value; uint32_t bits; } x = {.value = v};
    x.bits = (x.bits + 0x7fffu + ((x.bits >> 16) & 1u)) & 0xffff0000u;
    return x.value;
}

/* element i of base (fp32, or bf16 if bf16) set to v */
static inline void keep(void *base, int64_t i, float v, const int bf16) {
    if (bf16) {
        union { float value; uint32_t bits; } x = {.value = rounded_to(v, 1)};
        ((uint16_t *)base)[i] = (uint16_t)(x.bits >> 16);
    } else {
        ((float *)base)[i] = v;
    }
}

/* A few rows x [M, in] (fp32) through a plain row-major bf16 weight w [out, in] (and bias b [out], or NULL) into
   bf16 y: y[m, o] = w[o] . x[m] + b[o], row m of y at y + m * y_stride, summed in fp32: a bf16 layer's rows
   where the CPU lacks AVX512-BF16 (fp32 layers, and bf16 ones with it, take `panel_rows`).

   A decoding step of a few sequences is a read of every weight: oneDNN's product of one row reads them at
   25-33 GB/s on a 2-core Zen 4 EPYC, where a sum over the same bytes runs at 40-58. Here each thread streams
   its share of the weight's rows once, in order, each row dotted with every x (held in L1). From 4 rows on,
   oneDNN's product is as fast (kvreuse.model.linear sends it those). M is a constant, so the compiler unrolls
   it. */
static inline __attribute__((always_inline)) void one_output(const float *x, int64_t in, const void *w, int64_t o,
        const void *b, void *y, int64_t y_stride, const int M) {
    for (int m = 0; m < M; m++) {
        const float *xm = x + m * in;
        float sum = 0.f;
        #pragma omp simd reduction(+:sum)
        for (int64_t i = 0; i < in; i++) sum += stored(w, o * in + i, 1) * xm[i];
        keep(y, m * y_stride + o, b ? sum + stored(b, o, 1) : sum, 1);
    }
}

#define ONE_OUTPUT(M) one_output(x, in, w, o, b, y, y_stride, M)

void few_rows(const float *x, int64_t rows, int64_t in, const void *w, int64_t out, const void *b, void *y,
              int64_t y_stride, int threads) {  /* rows <= 3 */
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < out; o++) {
        switch (rows) {
            case 1: ONE_OUTPUT(1); break;
            case 2: ONE_OUTPUT(2); break;
            case 3: ONE_OUTPUT(3); break;
        }
    }
}

/* Whether the kernels that multiply bf16 in vdpbf16ps are built (AVX512-BF16). */
int has_bf16_dot(void) { return BF16_DOT; }

/* Whether the CPU has AMX-BF16 (-march=native defines __AMX_BF16__ where it does): there oneDNN's bf16 products
   and torch's fused bf16 attention run in its tiles, and this file's bf16 panels and causal attention too
   (kvreuse.model.native.bf16_in_amx and most_panel_rows say which the runtime takes). */
#if defined(__AMX_BF16__)
int has_amx_bf16(void) { return 1; }
#else
int has_amx_bf16(void) { return 0; }
#endif

/* The calling thread's idle OpenMP workers released (0 on success; see kvreuse.model.native.release_idle_threads) */
int release_idle_threads(void) { return omp_pause_resource_all(omp_pause_soft); }

/* ---- vectors ------------------------------------------------------------------------------------------
   GCC's vector types (`vec`: 16 floats with AVX-512, 8 without), for the attention kernels' softmax and the
   prefill attention's register tiles. */

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vec __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t veci __attribute__((vector_size(VW * 4), aligned(4)));

static inline vec load(const float *p) { return *(const vec *)p; }
static inline void store(float *p, vec v) { *(vec *)p = v; }
static inline vec splat(float x) { return (vec){} + x; }

/* VW bf16 as fp32 (`stored`'s shift, lane by lane), fp32 rounded to bf16's precision (`rounded_to`), and VW such
   values written as bf16 */
typedef uint16_t vech __attribute__((vector_size(VW * 2), aligned(2)));
typedef uint32_t vecu __attribute__((vector_size(VW * 4), aligned(4)));
static inline vec load_bf16(const uint16_t *p) {
    union { vecu bits; vec value; } x = {.bits = __builtin_convertvector(*(const vech *)p, vecu) << 16};
    return x.value;
}
static inline vec rounded_to_bf16(vec v) {
    union { vec value; vecu bits; } x = {.value = v};
    x.bits = (x.bits + 0x7fffu + ((x.bits >> 16) & 1u)) & 0xffff0000u;
    return x.value;
}
static inline void store_bf16(uint16_t *p, vec rounded) {
    union { vec value; vecu bits; } x = {.value = rounded};
    *(vech *)p = __builtin_convertvector(x.bits >> 16, vech);
}

/* a where the comparison m holds (lanes of all ones), b elsewhere */
static inline vec pick(veci m, vec a, vec b) {
    union { vec f; veci i; } x = {.f = a}, y = {.f = b}, r;
    r.i = (x.i & m) | (y.i & ~m);
    return r.f;
}

/* what GCC's vector types do not spell: a lane-wise maximum, rounding to the nearest whole number, a times 2^n for
   whole numbers n (AVX-512's scalef, one instruction where the shift into an exponent takes three), and whether any
   lane of a is above b's */
#if VW == 16
static inline vec larger(vec a, vec b) { return (vec)_mm512_max_ps((__m512)a, (__m512)b); }
static inline vec rounded(vec a) {
    return (vec)_mm512_roundscale_ps((__m512)a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vec times_two_to(vec a, vec n) { return (vec)_mm512_scalef_ps((__m512)a, (__m512)n); }
static inline int any_above(vec a, vec b) { return _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_GT_OQ) != 0; }
#else
static inline vec larger(vec a, vec b) { return (vec)_mm256_max_ps((__m256)a, (__m256)b); }
static inline vec rounded(vec a) {
    return (vec)_mm256_round_ps((__m256)a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vec times_two_to(vec a, vec n) {  /* n in [-126, 127]: 2^n built as an fp32 */
    union { veci i; vec f; } two_n = {.i = (__builtin_convertvector(n, veci) + 127) << 23};
    return a * two_n.f;
}
static inline int any_above(vec a, vec b) {
    return _mm256_movemask_ps(_mm256_cmp_ps((__m256)a, (__m256)b, _CMP_GT_OQ)) != 0;
}
#endif

/* ---- products of up to a thousand rows, over weights laid out in panels ----------------------------------
   A decoding step's projections: a few rows through every weight of the model, which streams from memory once per
   step. oneDNN's product of so few rows reaches neither the memory's rate nor the FMA units' (16 rows of SmolLM2's
   projections at ~120 GFLOP/s, a third of the step, on a 2-core Zen 4 EPYC), and up to a thousand rows (a reuse
   method's recomputed ones) it stays below this kernel's. Here the weight is laid out once in panels of
   PANEL_WIDTH outputs, [out / PANEL_WIDTH][in][PANEL_WIDTH] (the last zero padded), so that each thread streams
   its panels in order: an input column's PANEL_WIDTH weights are two vectors, multiplied by each row's value of
   that column (a broadcast) into a register tile of PANEL_TILE_ROWS rows x 2 vectors of sums. More rows take the
   panel again from L2. On that EPYC, SmolLM2's fp32 projections at 1-3 rows ran 1.25-1.37x faster than the plain
   weights' dot products, at 16 rows 1.25-1.35x faster than oneDNN's, at 48 1.23x, at 96 1.09x; from 1024 rows on
   they are level. */

#define PANEL_WIDTH (2 * VW)
/* 2 x rows sums, 2 weights and a broadcast in 32 (or AVX2's 16) registers. With AVX2, GCC spilled sums of the tile to
   the stack when it unrolled the loop 4 times (on a 2-core Zen 3 EPYC, SmolLM2's projections at 256 rows: 75-78
   GFLOP/s, against 108-117 not unrolled); AVX2's full tiles take panel_tile_avx2 below. */
#define PANEL_TILE_ROWS (VW == 16 ? 8 : 6)
#define PANEL_UNROLL (VW == 16 ? 4 : 1)
/* Up to this many rows (a decoding step's) a product waits on memory for each panel: see panel_rows. */
#define STREAMING_ROWS 16
/* How far ahead of its input a first tile of 2 or more rows fetches its panel, in panel rows (AVX2: one cache
   line each). On the Zen 3 EPYC, SmolLM2's projections at 2-6 rows: 8 lines 0.87-0.97x the time, 16 lines
   0.83-0.94x, 32 and 64 0.85-1.04x; at one row the tile's loop is short enough that out-of-order execution keeps
   more lines in flight than this (1.02-1.09x), so it does not fetch. */
#define PANEL_FETCH_AHEAD 16
/* Products of 2 to this many rows with AVX-512 (fp32 or int8 weights) fetch, while a panel's first row tile runs,
   the thread's next panel into L2 (a weight's panels lie in turn, and each thread takes its panels in order): over
   so few rows a panel's sums take less time than its weights take to stream in, and the hardware's prefetchers,
   which stop at each page's end, left them waiting. A prompt's layers each stream the weights from memory once. On
   a 2-core Xeon with AMX, fp32 (alternated in one process): decoding steps of 4 sequences 0.85-0.86x the time, of
   16 0.92-0.93x; a naive prefill of hotpotqa's 1.6K prompts (65 rows computed) 0.92-0.97x; 225-400 rows (the other
   reuse methods) level, so larger products do not fetch (full prefill, fetching: 1.01-1.02x). Over int8 weights
   (`--decode-weights int8`): decoding 4 sequences 0.78x, 16 sequences 0.88-0.89x. Into L1 instead, where a panel
   does not fit: 0.91-0.97x at 16-65 rows; in the second row tile, as AVX2's tile fetches (below): no clear
   difference. One row, as above, keeps more in flight by itself (1.07x with this fetch). */
#define PANEL_FETCH_NEXT_ROWS 128
#if VW == 8 && defined(__FMA__)
#define PANEL_TILE_AVX2 1
#else
#define PANEL_TILE_AVX2 0
#endif
#define PRAGMA(x) _Pragma(#x)
#define UNROLL(n) PRAGMA(GCC unroll n)

int panel_width(void) { return PANEL_WIDTH; }

/* The most rows worth sending here rather than to oneDNN (kvreuse.model.linear asks). SmolLM2's projections, 30
   layers, both in turns in one process, time here / oneDNN's. AVX-512 on a 2-core Zen 4 EPYC: 0.81 at 48 rows in
   fp32, 0.92 at 96, 0.97-0.98 at 256, 0.99-1.01 at 1024, 1.01 at 2048; bf16 0.77 at 48, 0.89 at 96, 0.94 at 256,
   0.99 at 2048. AVX2 on a 2-core Zen 3 EPYC (fp32), with the assembly tile: 0.79 at 96 rows, 0.92 at 256 and 512,
   0.91 at 1024, 0.95 at 2048, 0.99 at 4096; with GCC's tile: 0.74 at 16 rows, 0.85 at 96, 1.02 at 256, 0.98-0.99
   at 384-1024, where oneDNN's times move less from run to run. fp32 with AVX-512 takes more rows all the same
   (kvreuse.model.native.most_panel_rows: a prompt's layers then run as the resolved native calls). */
int panel_rows_most(void) { return VW == 16 ? 1024 : PANEL_TILE_AVX2 ? 2048 : 256; }

/* fetch: a constant where called, 1 for a tile that streams its panel from memory (PANEL_FETCH_AHEAD); next: the
   panel to fetch into L2 meanwhile (PANEL_FETCH_NEXT_ROWS), or NULL */
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t x_stride, int64_t in,
        const float *panel, const float *bias, const float *plus, float *y, int64_t y_stride, int64_t columns,
        const int R, const int fetch, const float *next) {
    vec sums[PANEL_TILE_ROWS][2];  /* starting from the bias, so that `plus` is the one addition after */
    for (int r = 0; r < R; r++) sums[r][0] = load(bias), sums[r][1] = load(bias + VW);
    UNROLL(PANEL_UNROLL)
    for (int64_t k = 0; k < in; k++) {
        if (fetch && R > 1) __builtin_prefetch(panel + (k + PANEL_FETCH_AHEAD) * PANEL_WIDTH, 0, 3);
        if (next)
            for (int b = 0; b < PANEL_WIDTH * (int)sizeof(float); b += 64)
                __builtin_prefetch((const char *)(next + k * PANEL_WIDTH) + b, 0, 1);
        vec w0 = load(panel + k * PANEL_WIDTH), w1 = load(panel + k * PANEL_WIDTH + VW);
        for (int r = 0; r < R; r++) {
            vec xr = splat(x[r * x_stride + k]);
            sums[r][0] += xr * w0;
            sums[r][1] += xr * w1;
        }
    }
    for (int r = 0; r < R; r++) {
        float row[PANEL_WIDTH];
        store(row, sums[r][0]);
        store(row + VW, sums[r][1]);
        for (int64_t j = 0; j < columns; j++)
            y[r * y_stride + j] = plus ? row[j] + plus[r * y_stride + j] : row[j];
    }
}

/* AVX2's full tile, 6 rows x 16 outputs, in assembly: 12 sums in ymm0-11, a panel row's two vectors in ymm12-13,
   the rows' broadcasts in ymm14-15, the loop over inputs unrolled 4 times. For the same loop (panel_tile) GCC
   spilled sums when unrolled, and not unrolled it spent about 25 instructions an input, so the front end, not the
   FMA units, set the pace; its intrinsics version folded every weight load into each FMA. Alone with its data in
   L1, this tile runs at ~98% of the FMA units' rate on the Zen 3 EPYC (86 against 88 GFLOP/s a core). Its sums run
   in panel_tile's order, so a row's outputs are the same to the bit in a full tile as alone. Each iteration also
   fetches two cache lines at `ahead` into L2 and moves it on by `ahead_step` bytes (0: it stays, on lines held). */
#if PANEL_TILE_AVX2
#define PANEL_TILE_AVX2_INPUT(W0, W1, X) \
    "vmovups " #W0 "(%[w]), %%ymm12\n\t" "vmovups " #W1 "(%[w]), %%ymm13\n\t" \
    "vbroadcastss " #X "(%[x]), %%ymm14\n\t" \
    "vfmadd231ps %%ymm12, %%ymm14, %%ymm0\n\t" "vfmadd231ps %%ymm13, %%ymm14, %%ymm1\n\t" \
    "vbroadcastss " #X "(%[x],%[s],1), %%ymm15\n\t" \
    "vfmadd231ps %%ymm12, %%ymm15, %%ymm2\n\t" "vfmadd231ps %%ymm13, %%ymm15, %%ymm3\n\t" \
    "vbroadcastss " #X "(%[x],%[s],2), %%ymm14\n\t" \
    "vfmadd231ps %%ymm12, %%ymm14, %%ymm4\n\t" "vfmadd231ps %%ymm13, %%ymm14, %%ymm5\n\t" \
    "vbroadcastss " #X "(%[x],%[s3],1), %%ymm15\n\t" \
    "vfmadd231ps %%ymm12, %%ymm15, %%ymm6\n\t" "vfmadd231ps %%ymm13, %%ymm15, %%ymm7\n\t" \
    "vbroadcastss " #X "(%[x4]), %%ymm14\n\t" \
    "vfmadd231ps %%ymm12, %%ymm14, %%ymm8\n\t" "vfmadd231ps %%ymm13, %%ymm14, %%ymm9\n\t" \
    "vbroadcastss " #X "(%[x4],%[s],1), %%ymm15\n\t" \
    "vfmadd231ps %%ymm12, %%ymm15, %%ymm10\n\t" "vfmadd231ps %%ymm13, %%ymm15, %%ymm11\n\t"

static inline __attribute__((always_inline)) void panel_tile_avx2(const float *x, int64_t x_stride, int64_t in,
        const float *panel, const float *bias, const float *plus, float *y, int64_t y_stride, int64_t columns,
        const char *ahead, int64_t ahead_step, int R) {
    float sums[6][16] __attribute__((aligned(32)));
    const float *x4 = x + 4 * x_stride;  /* rows 0-3 at x + 0-3 strides, rows 4-5 at x4 + 0-1 */
    int64_t s = x_stride * 4, s3 = 3 * s, fours = in / 4, rest = in % 4;
    __asm__ volatile(
        "vmovups (%[b]), %%ymm0\n\t" "vmovups 32(%[b]), %%ymm1\n\t"
        "vmovaps %%ymm0, %%ymm2\n\t" "vmovaps %%ymm1, %%ymm3\n\t" "vmovaps %%ymm0, %%ymm4\n\t"
        "vmovaps %%ymm1, %%ymm5\n\t" "vmovaps %%ymm0, %%ymm6\n\t" "vmovaps %%ymm1, %%ymm7\n\t"
        "vmovaps %%ymm0, %%ymm8\n\t" "vmovaps %%ymm1, %%ymm9\n\t" "vmovaps %%ymm0, %%ymm10\n\t"
        "vmovaps %%ymm1, %%ymm11\n\t"
        "test %[fours], %[fours]\n\t" "jz 2f\n\t"
        ".p2align 5\n"
        "1:\n\t"
        PANEL_TILE_AVX2_INPUT(0, 32, 0) PANEL_TILE_AVX2_INPUT(64, 96, 4)
        "prefetcht1 (%[ahead])\n\t" "prefetcht1 64(%[ahead])\n\t"
        PANEL_TILE_AVX2_INPUT(128, 160, 8) PANEL_TILE_AVX2_INPUT(192, 224, 12)
        "add $256, %[w]\n\t" "add $16, %[x]\n\t" "add $16, %[x4]\n\t" "add %[step], %[ahead]\n\t"
        "dec %[fours]\n\t" "jnz 1b\n"
        "2:\n\t"
        "test %[rest], %[rest]\n\t" "jz 4f\n"
        "3:\n\t"
        PANEL_TILE_AVX2_INPUT(0, 32, 0)
        "add $64, %[w]\n\t" "add $4, %[x]\n\t" "add $4, %[x4]\n\t"
        "dec %[rest]\n\t" "jnz 3b\n"
        "4:\n\t"
        "vmovaps %%ymm0, (%[o])\n\t" "vmovaps %%ymm1, 32(%[o])\n\t" "vmovaps %%ymm2, 64(%[o])\n\t"
        "vmovaps %%ymm3, 96(%[o])\n\t" "vmovaps %%ymm4, 128(%[o])\n\t" "vmovaps %%ymm5, 160(%[o])\n\t"
        "vmovaps %%ymm6, 192(%[o])\n\t" "vmovaps %%ymm7, 224(%[o])\n\t" "vmovaps %%ymm8, 256(%[o])\n\t"
        "vmovaps %%ymm9, 288(%[o])\n\t" "vmovaps %%ymm10, 320(%[o])\n\t" "vmovaps %%ymm11, 352(%[o])\n\t"
        : [w] "+r"(panel), [x] "+r"(x), [x4] "+r"(x4), [fours] "+r"(fours), [rest] "+r"(rest), [ahead] "+r"(ahead)
        : [s] "r"(s), [s3] "r"(s3), [b] "r"(bias), [o] "r"(sums), [step] "r"(ahead_step)
        : "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10", "ymm11", "ymm12",
          "ymm13", "ymm14", "ymm15", "memory", "cc");
    for (int r = 0; r < R; r++)  /* the first R of the six rows are wanted */
        for (int64_t j = 0; j < columns; j++)
            y[r * y_stride + j] = plus ? sums[r][j] + plus[r * y_stride + j] : sums[r][j];
}
#endif

/* The weights' formats in panels: the rows' dtype, and int8 weights for fp32 rows (`format` in the kernels below) */
enum { WEIGHTS_FP32 = 0, WEIGHTS_BF16 = 1, WEIGHTS_INT8 = 2 };

/* ---- AMX tiles ------------------------------------------------------------------------------------------
   Where the CPU has AMX-BF16: eight tiles of up to 16 rows of 64 bytes, whose product instruction multiplies bf16
   pairs exactly and sums them in fp32. Linux hands a process their state only once asked (`amx_permitted`); the
   kernels take the tiles only after it has. */
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && VW == 16
#define AMX_TILES 1
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16
/* GCC's tile loads are asm statements that do not say they read memory: before one reads what C code wrote, this
   tells the compiler to have written it (else it may keep the stores for later, or drop them as never read). */
#define MEMORY_READ_BY_TILES() __asm__ volatile("" ::: "memory")
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

static int amx_granted, amx_panels_allowed = 1;

/* Linux hands a process the tiles' state only once asked (0 when granted) */
int amx_permitted(void) {
    int refused = (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
    amx_granted = !refused;
    return refused;
}

/* The first `count` tiles, each 64 bytes wide: tiles 0-2 of `rows` rows (a panel product's sums and its rows), the
   others of AMX_ROWS */
static void configure_tiles(int count, int64_t rows) {
    TileConfig config = {0};
    config.palette = 1;
    for (int t = 0; t < count; t++) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = t < 3 ? (uint8_t)rows : AMX_ROWS;
    }
    _tile_loadconfig(&config);
}
#else
#define AMX_TILES 0
static int amx_panels_allowed = 1;
int amx_permitted(void) { return -1; }
#endif

/* Whether bf16 `panel_rows` may take the tiles once granted (the default; kvreuse.model.native's
   `bf16_panels_in_vectors` lets the tests run the vector kernel beside them); returns the setting it replaces. */
int allow_amx_panels(int allowed) {
    int before = amx_panels_allowed;
    amx_panels_allowed = allowed;
    return before;
}

#if BF16_DOT
/* bf16 rows through a bf16 weight in panels of pairs, [out / PANEL_WIDTH][in / 2][PANEL_WIDTH][2] (inputs 2k and
   2k + 1 of an output side by side; an odd `in` has a zero column added, as the rows do): a pair of each row
   broadcast, times two vectors of pairs in vdpbf16ps (exact products, fp32 sums). Each output is rounded to bf16
   once, with its bias added in fp32; `plus` is added after, to that rounded product, as torch adds a residual to
   a bf16 layer's output. On the Zen 4 EPYC, SmolLM2's bf16 projections at 16 rows ran 1.30x faster than oneDNN's,
   at 4 1.65x, at 48 1.4x; at 1-3 rows 1.06-1.37x faster than the plain weights' dot products. */
static inline __attribute__((always_inline)) void panel_tile_bf16(const uint16_t *x, int64_t x_stride,
        int64_t pairs, const uint32_t *panel, const float *bias, const uint16_t *plus, uint16_t *y, int64_t y_stride,
        int64_t columns, const int R) {
    __m512 sums[PANEL_TILE_ROWS][2];
    for (int r = 0; r < R; r++) sums[r][0] = _mm512_loadu_ps(bias), sums[r][1] = _mm512_loadu_ps(bias + VW);
    #pragma GCC unroll 4
    for (int64_t k = 0; k < pairs; k++) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + k * PANEL_WIDTH);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + k * PANEL_WIDTH + VW);
        for (int r = 0; r < R; r++) {
            __m512bh xr = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)(x + r * x_stride))[k]);
            sums[r][0] = _mm512_dpbf16_ps(sums[r][0], xr, w0);
            sums[r][1] = _mm512_dpbf16_ps(sums[r][1], xr, w1);
        }
    }
    for (int r = 0; r < R; r++) {
        float row[PANEL_WIDTH];
        _mm512_storeu_ps(row, sums[r][0]);
        _mm512_storeu_ps(row + VW, sums[r][1]);
        for (int64_t j = 0; j < columns; j++) {
            int64_t at = r * y_stride + j;
            keep(y, at, plus ? rounded_to(row[j], 1) + stored(plus, at, 1) : row[j], 1);
        }
    }
}
#endif

/* bf16 rows, one tile of them (`tile_rows`, at most AMX_ROWS, readable from x), through one bf16 panel
   (`panel_tile_bf16`'s layout: 128 bytes a pair of inputs, the panel's 32 outputs side by side) in AMX tiles: per
   16 pairs of inputs, the rows' 32 inputs in tile 2 times the panel's 16 pairs of outputs 0-15 (tile 3) and 16-31
   (tile 4), rows 128 bytes apart, summed into tiles 0 and 1, which start from the bias. The first `rows` rows'
   outputs are rounded to bf16 once, `plus` added after, as `panel_tile_bf16` does. A decoding step's products read
   every weight once, and here 16 pairs of inputs of a panel take five instructions where vdpbf16ps takes a
   broadcast and two products per pair and row: SmolLM2's 30 layers in turn read their weights at 20-22 GB/s at 1-16
   rows, against 9-21 in vdpbf16ps (native.AMX_BF16_PANEL_ROWS has the figures). */
#if AMX_TILES
static inline void amx_panel_tile(const uint16_t *x, int64_t x_stride, int64_t pairs, const char *panel,
                                  const float *bias, const uint16_t *plus, uint16_t *y, int64_t y_stride,
                                  int64_t columns, int64_t rows, int64_t tile_rows) {
    float sums[AMX_ROWS * PANEL_WIDTH] __attribute__((aligned(64)));
    for (int64_t r = 0; r < tile_rows; r++) memcpy(sums + r * PANEL_WIDTH, bias, PANEL_WIDTH * sizeof(float));
    MEMORY_READ_BY_TILES();
    _tile_loadd(0, sums, PANEL_WIDTH * sizeof(float));
    _tile_loadd(1, sums + 16, PANEL_WIDTH * sizeof(float));
    for (int64_t k = 0; k < pairs; k += 16) {
        _tile_loadd(2, x + 2 * k, x_stride * 2);
        _tile_loadd(3, panel + k * 128, 128);
        _tile_loadd(4, panel + k * 128 + 64, 128);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, sums, PANEL_WIDTH * sizeof(float));
    _tile_stored(1, sums + 16, PANEL_WIDTH * sizeof(float));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < columns; j++) {
            int64_t at = r * y_stride + j;
            float sum = sums[r * PANEL_WIDTH + j];
            keep(y, at, plus ? rounded_to(sum, 1) + stored(plus, at, 1) : sum, 1);
        }
}

/* A product's rows as the tiles take them, AMX_ROWS at a time: x's own rows, and a last block of fewer rows after
   whole ones copied into `tail` with zero rows after them (the tiles of a call are all one height, and a tile
   reads all of its rows). Fewer rows than a tile are one tile of their height. */
typedef struct {
    const uint16_t *x, *tail;
    int64_t x_stride, rows, tile_rows, blocks;
} AmxRows;

static int amx_rows(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t pairs, AmxRows *a) {
    *a = (AmxRows){x, 0, x_stride, rows, rows < AMX_ROWS ? rows : AMX_ROWS, (rows + AMX_ROWS - 1) / AMX_ROWS};
    int64_t whole = rows / AMX_ROWS * AMX_ROWS;
    if (rows > AMX_ROWS && whole < rows) {
        uint16_t *tail = calloc(AMX_ROWS * 2 * pairs, sizeof(uint16_t));
        if (!tail) return -1;
        for (int64_t r = whole; r < rows; r++)
            memcpy(tail + (r - whole) * 2 * pairs, x + r * x_stride, 2 * pairs * sizeof(uint16_t));
        a->tail = tail;
    }
    return 0;
}

/* Block b's first row, its row stride into *stride and its rows into *count */
static inline const uint16_t *amx_block(const AmxRows *a, int64_t b, int64_t pairs, int64_t *stride, int64_t *count) {
    int64_t first = b * AMX_ROWS;
    *count = a->rows - first < AMX_ROWS ? a->rows - first : AMX_ROWS;
    if (*count < a->tile_rows) {
        *stride = 2 * pairs;
        return a->tail;
    }
    *stride = a->x_stride;
    return a->x + first * a->x_stride;
}

#endif

/* Whether a product of `rows` bf16 rows over panels `pairs` deep runs in AMX tiles: granted, whole tiles of pairs.
   (The runtime sends bf16 products of up to native.AMX_BF16_PANEL_ROWS rows to panels there.) */
static inline int amx_panels_take(int64_t rows, int64_t pairs, int format) {
#if AMX_TILES
    return amx_granted && amx_panels_allowed && format == WEIGHTS_BF16 && rows > 0 && pairs % 16 == 0;
#else
    return 0;
#endif
}

/* fp32 rows through int8 weights in panels, [out / PANEL_WIDTH][in][PANEL_WIDTH] int8 followed by the panel's
   PANEL_WIDTH fp32 scales (one an output: the largest |weight| of the output's row over 127): a decoding step's
   products where the user asked for int8 weights (kvreuse.model.native.int8_panels). A decoding step reads every
   weight once, so it takes a quarter of fp32's bytes; each panel row's PANEL_WIDTH bytes are widened to fp32 and
   multiplied as panel_tile does, and each output's sum scaled once at the end. One or two rows keep two sets of
   sums, for even and odd inputs: a single chain of FMAs an input would wait on each FMA's latency, where the
   memory gives a panel row every few cycles. */
static inline vec widened(const int8_t *p) {  /* VW int8 as fp32 (GCC's vector conversion of them is scalar) */
#if VW == 16
    return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vec out;
    for (int i = 0; i < VW; i++) out[i] = p[i];
    return out;
#endif
}

static inline __attribute__((always_inline)) void panel_tile_int8(const float *x, int64_t x_stride, int64_t in,
        const int8_t *panel, const float *scale, const float *bias, const float *plus, float *y, int64_t y_stride,
        int64_t columns, const int R, const int8_t *next) {
    const int sets = R <= 2 ? 2 : 1;
    vec sums[2][PANEL_TILE_ROWS][2];
    for (int s = 0; s < sets; s++)
        for (int r = 0; r < R; r++) sums[s][r][0] = sums[s][r][1] = splat(0.f);
    int64_t k = 0;
    UNROLL(PANEL_UNROLL)
    for (; k + sets <= in; k += sets) {
        if (next && k % 2 == 0) __builtin_prefetch(next + k * PANEL_WIDTH, 0, 1);  /* a line: 2 inputs' weights */
        for (int s = 0; s < sets; s++) {
            vec w0 = widened(panel + (k + s) * PANEL_WIDTH), w1 = widened(panel + (k + s) * PANEL_WIDTH + VW);
            for (int r = 0; r < R; r++) {
                vec xr = splat(x[r * x_stride + k + s]);
                sums[s][r][0] += xr * w0;
                sums[s][r][1] += xr * w1;
            }
        }
    }
    for (; k < in; k++) {  /* an odd input count's last input, with two sets */
        vec w0 = widened(panel + k * PANEL_WIDTH), w1 = widened(panel + k * PANEL_WIDTH + VW);
        for (int r = 0; r < R; r++) {
            vec xr = splat(x[r * x_stride + k]);
            sums[0][r][0] += xr * w0;
            sums[0][r][1] += xr * w1;
        }
    }
    for (int r = 0; r < R; r++) {
        vec s0 = sets == 2 ? sums[0][r][0] + sums[1][r][0] : sums[0][r][0];
        vec s1 = sets == 2 ? sums[0][r][1] + sums[1][r][1] : sums[0][r][1];
        float row[PANEL_WIDTH];
        store(row, s0 * load(scale) + load(bias));
        store(row + VW, s1 * load(scale + VW) + load(bias + VW));
        for (int64_t j = 0; j < columns; j++)
            y[r * y_stride + j] = plus ? row[j] + plus[r * y_stride + j] : row[j];
    }
}

#if PANEL_TILE_AVX2
/* panel_tile_avx2 as row tile `tile` of panel p of `count`: the first row tile of a panel waits on memory for it;
   the next ones compute from L2 while the memory idles, so the second and third fetch the next panel into L2, half
   each (two lines an iteration of 4 inputs). SmolLM2's projections, 30 layers, on the Zen 3 EPYC: 0.78-0.94x the
   time at 12-24 rows, 0.93-1.00 at 89, level from 1024; all of it in the second tile where that is the last full
   one, four lines an iteration: 1.04-1.18x that at 12-16 rows. */
static inline __attribute__((always_inline)) void panel_tile_avx2_at(const float *x, int64_t x_stride,
        int64_t depth, const float *panel, int64_t p, int64_t count, int64_t tile, const float *bias,
        const float *plus, float *y, int64_t y_stride, int64_t columns, int R) {
    int64_t step = 0, half = depth * PANEL_WIDTH * sizeof(float) / 2;
    const char *ahead = (const char *)panel;
    if (p + 1 < count && (tile == 1 || tile == 2)) {
        ahead = (const char *)(panel + depth * PANEL_WIDTH) + (tile - 1) * half;
        step = 128;  /* the two lines an iteration fetches: `depth / 4` iterations, a half */
    }
    panel_tile_avx2(x, x_stride, depth, panel, bias, plus, y, y_stride, columns, ahead, step, R);
}
#endif

/* y [rows, out] (row stride y_stride; plus, if given, has the same layout and is added) = x [rows, ...] (row stride
   x_stride) through a weight in panels (kvreuse.model.native.panels: `depth` inputs a panel row, or pairs of them
   if bf16) and bias b [out] or NULL; all fp32, or all bf16 (taken only where BF16_DOT is built), or fp32 with the
   weight in int8 (`format`: WEIGHTS_INT8).
   Up to STREAMING_ROWS fp32 rows with AVX2 (a decoding step's) the products wait on memory, not on the FMA units:
   a panel's first tile streams it in, fetching ahead (GCC's tile, with `fetch`, also at six rows, where the
   assembly tile fetches only for the next panel), and a last tile of fewer than six rows after full ones runs in
   the assembly tile over its rows and zero rows (copied once per call), so that it fetches the next panel as the
   full tiles do. Zen 3 EPYC, SmolLM2's projections, 30 layers, alternated in one process: 0.83-0.94x the time at
   2-16 rows; one row, and 17 rows on, level. */

/* Panel p of weights in panels of `depth` rows (inputs, or pairs of them in bf16) */
static inline const char *panel_at(const void *panels, int64_t p, int64_t depth, int format) {
    int64_t bytes = format == WEIGHTS_INT8 ? depth * PANEL_WIDTH + PANEL_WIDTH * (int64_t)sizeof(float)
                                           : depth * PANEL_WIDTH * (int64_t)sizeof(float);
    return (const char *)panels + p * bytes;
}

/* The last tile's rows, then zero rows, six in all, where `panel_rows` streams more than six rows with a partial
   last tile (see there); NULL elsewhere. The caller frees it. */
static float *padded_tail(const void *x, int64_t x_stride, int64_t rows, int64_t depth, int streaming) {
    float *padded = 0;
#if PANEL_TILE_AVX2
    int64_t tail = rows % 6;
    if (streaming && rows > 6 && tail && (padded = calloc(6 * depth, sizeof(float))))
        for (int64_t r = 0; r < tail; r++)
            memcpy(padded + r * depth, (const float *)x + (rows - tail + r) * x_stride, depth * sizeof(float));
#endif
    return padded;
}

/* Panel p's bias as fp32 (zeros past `out`, or all zeros without one) into `bias`; returns the panel's columns */
static inline int64_t panel_bias(const void *b, int64_t p, int64_t out, float *bias, int bf16) {
    int64_t first = p * PANEL_WIDTH, columns = out - first < PANEL_WIDTH ? out - first : PANEL_WIDTH;
    for (int64_t j = 0; j < PANEL_WIDTH; j++) bias[j] = b && j < columns ? stored(b, first + j, bf16) : 0.f;
    return columns;
}

/* Whether a product of `rows` rows fetches each thread's next panel (PANEL_FETCH_NEXT_ROWS) */
static inline int fetches_next_panel(int64_t rows, int format) {
    return VW == 16 && (format == WEIGHTS_FP32 || format == WEIGHTS_INT8) && rows > 1
           && rows <= PANEL_FETCH_NEXT_ROWS;
}

/* The R rows (R <= PANEL_TILE_ROWS) from row m of a product, xm, through panel p of `count` into ym (+ pm), in the
   tile that suits them (see panel_rows) */
static inline __attribute__((always_inline)) void row_tile(const char *xm, int64_t x_stride, int64_t depth,
        const char *panel_bytes, int64_t p, int64_t count, int64_t m, const float *bias, const char *pm, char *ym,
        int64_t y_stride, int64_t columns, int R, int streaming, int fetch_next, const float *padded, int format) {
    /* R a constant in each call: the tile's loops unroll and its sums stay in registers */
    const float *panel = (const float *)panel_bytes;
#define PANEL_TILE_INT8(R) case R: panel_tile_int8((const float *)xm, x_stride, depth, (const int8_t *)panel_bytes, \
            (const float *)(panel_bytes + depth * PANEL_WIDTH), bias, (const float *)pm, (float *)ym, y_stride, \
            columns, R, (const int8_t *)next); break;
    const char *next = fetch_next && m == 0 && p + 1 < count ? panel_at(panel_bytes, 1, depth, format) : 0;
    if (format == WEIGHTS_INT8) {
        switch (R) {
            PANEL_TILE_INT8(1) PANEL_TILE_INT8(2) PANEL_TILE_INT8(3) PANEL_TILE_INT8(4) PANEL_TILE_INT8(5)
            PANEL_TILE_INT8(6)
#if PANEL_TILE_ROWS == 8
            PANEL_TILE_INT8(7) PANEL_TILE_INT8(8)
#endif
        }
        return;
    }
#if BF16_DOT
#define PANEL_TILE_BF16(R) case R: panel_tile_bf16((const uint16_t *)xm, x_stride, depth, \
            (const uint32_t *)panel, bias, (const uint16_t *)pm, (uint16_t *)ym, y_stride, columns, R); break;
    if (format == WEIGHTS_BF16) {
        switch (R) {
            PANEL_TILE_BF16(1) PANEL_TILE_BF16(2) PANEL_TILE_BF16(3) PANEL_TILE_BF16(4)
            PANEL_TILE_BF16(5) PANEL_TILE_BF16(6) PANEL_TILE_BF16(7) PANEL_TILE_BF16(8)
        }
        return;
    }
#endif
    const int fetch = streaming && m == 0;
#if PANEL_TILE_AVX2
    if ((R == 6 && !fetch) || (R < 6 && padded)) {
        const float *rows_in = R == 6 ? (const float *)xm : padded;
        panel_tile_avx2_at(rows_in, R == 6 ? x_stride : depth, depth, panel, p, count, m / 6, bias,
                           (const float *)pm, (float *)ym, y_stride, columns, R);
        return;
    }
#endif
#define PANEL_TILE(R) case R: \
            if (fetch) panel_tile((const float *)xm, x_stride, depth, panel, bias, (const float *)pm, (float *)ym, \
                                  y_stride, columns, R, 1, 0); \
            else panel_tile((const float *)xm, x_stride, depth, panel, bias, (const float *)pm, (float *)ym, \
                            y_stride, columns, R, 0, (const float *)next); \
            break;
    switch (R) {
        PANEL_TILE(1) PANEL_TILE(2) PANEL_TILE(3) PANEL_TILE(4) PANEL_TILE(5) PANEL_TILE(6)
#if PANEL_TILE_ROWS == 8
        PANEL_TILE(7) PANEL_TILE(8)
#endif
    }
}

/* `panel_rows` and `gated_panel_rows` of bf16 rows in AMX tiles (below, beside the activation it applies) */
static int amx_panel_rows(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t pairs, const void *panels,
                          int64_t out, const void *b, const uint16_t *plus, uint16_t *y, int64_t y_stride,
                          int64_t intermediate, int threads);

void panel_rows(const void *x, int64_t x_stride, int64_t rows, int64_t depth, const void *panels, int64_t out,
                const void *b, const void *plus, void *y, int64_t y_stride, int threads, int format) {
    if (amx_panels_take(rows, depth, format)
            && !amx_panel_rows(x, x_stride, rows, depth, panels, out, b, plus, y, y_stride, 0, threads))
        return;
    const int bf16 = format == WEIGHTS_BF16;
    int64_t count = (out + PANEL_WIDTH - 1) / PANEL_WIDTH, size = bf16 ? 2 : 4;
    const int streaming = PANEL_TILE_AVX2 && format == WEIGHTS_FP32 && rows <= STREAMING_ROWS;
    const int fetch_next = fetches_next_panel(rows, format);
    float *padded = padded_tail(x, x_stride, rows, depth, streaming);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < count; p++) {
        float bias[PANEL_WIDTH];
        int64_t columns = panel_bias(b, p, out, bias, bf16), first = p * PANEL_WIDTH;
        const char *panel = panel_at(panels, p, depth, format);
        for (int64_t m = 0; m < rows; m += PANEL_TILE_ROWS) {
            int R = rows - m < PANEL_TILE_ROWS ? (int)(rows - m) : PANEL_TILE_ROWS;
            const char *pm = plus ? (const char *)plus + (m * y_stride + first) * size : 0;
            row_tile((const char *)x + m * x_stride * size, x_stride, depth, panel, p, count, m, bias, pm,
                     (char *)y + (m * y_stride + first) * size, y_stride, columns, R, streaming, fetch_next, padded,
                     format);
        }
    }
    free(padded);
}

/* e^x for x <= 8 (a score minus its row's maximum; in the prefill kernel, minus a running maximum that may lag
   behind by HEADROOM) or, for SiLU, x <= 88, as 2^n 2^f with n = x log2(e) rounded and |f| <= 1/2, 2^f from its
   Taylor series to the 6th power (relative error ~3e-7). Inline: a call to the vector maths library saves and
   restores the registers the tiles live in, and libm's expf held 30% of the decoding kernel's time. Scores are not
   taken to base 2 before this (by scaling the queries): scores of a few hundred would lose 1e-4 to that rounding.
   Below e^-87 it returns 2^-126, which adds nothing to a sum that holds a 1. */
static inline vec exp_of_score(vec x) {
    x = larger(x * 1.4426950408889634f, splat(-126.f));
    vec n = rounded(x), f = x - n;
    vec p = splat(1.5403530393381606e-4f);
    p = p * f + 1.3333558146428443e-3f; p = p * f + 9.618129107628477e-3f; p = p * f + 5.550410866482158e-2f;
    p = p * f + 0.2402265069591007f; p = p * f + 0.6931471805599453f; p = p * f + 1.f;
    return times_two_to(p, n);
}

#define HIDDEN (-3.0e38f)  /* a masked score; finite, as -ffast-math assumes no infinities */

/* Rows a decoding task asks the memory for ahead of its reads: the scores' pass asks for the keys and the values
   PREFETCH_ROWS rows ahead, so that the values' pass finds them in the cache. Decoding 16 sequences of 544 rows
   (SmolLM2, 30 layers in turn, out of the caches) went from 0.69 to 0.40 ms a layer in bf16 and from 0.86 to 0.65
   in fp32 on a 2-core Xeon with AMX: the hardware prefetchers alone left the loads to wait behind each row's
   dot products (8, 16, 32 and 64 rows ahead measured; 32 kept). */
#define PREFETCH_ROWS 32

static inline __attribute__((always_inline)) void prefetch_head(const void *base, int64_t element, const int D,
                                                                 const int bf16) {
    const char *at = (const char *)base + element * (bf16 ? 2 : 4);
    for (int64_t b = 0; b < D * (bf16 ? 2 : 4); b += 64) __builtin_prefetch(at + b);
}

/* The G query heads of each of H KV heads, q [H, G, D], over those heads' keys and values (fp32 or bf16; row j's
   element i of head h at offset + h * head_stride + j * row_stride + i), rows j < len whose position pos[j] is
   visible (lo_pos < pos[j] <= hi_pos), unnormalised: into head h's part (parts + h * part_stride), [G, D] sums of
   exp(score - top) v, then each query head's top score [G] and its sum of exp(score - top) [G] (`combine_parts`
   divides; a head's rows may come in several parts). Summed in fp32. Scores go through `scores` [H * G, stride].
   H is 1 where a head's rows are contiguous (a pool's layout); a cache's rows hold every head side by side, and
   then all H heads of a row are read together: one head at a time read a third of each row's bytes and streamed
   them from memory at 14 GB/s, all of a row's at once at 32, a pool's layout's rate (one sequence of 4K tokens,
   30 layers in turn, on a 2-core Zen 4 EPYC).
   H, G and D are constants where the caller can make them, so the compiler unrolls the heads and keeps their sums
   in registers. */
static inline __attribute__((always_inline)) void attend_heads(
        const float *q, const void *keys, const void *values, int64_t offset, int64_t head_stride, int64_t row_stride,
        const int64_t *pos, int64_t len, int64_t lo_pos, int64_t hi_pos, float scale, float *parts,
        int64_t part_stride, float *scores, int64_t stride, const int H, const int G, const int D, const int bf16) {
    float top[H * G], totals[H * G], sums[H * G * D];
    for (int t = 0; t < H * G; t++) top[t] = HIDDEN;
    for (int64_t j = 0; j < len; j++) {
        int visible = pos[j] <= hi_pos && pos[j] > lo_pos;
        if (j + PREFETCH_ROWS < len)
            for (int h = 0; h < H; h++) {
                int64_t ahead = offset + h * head_stride + (j + PREFETCH_ROWS) * row_stride;
                prefetch_head(keys, ahead, D, bf16);
                prefetch_head(values, ahead, D, bf16);
            }
        for (int h = 0; h < H; h++) {
            int64_t key = offset + h * head_stride + j * row_stride;
            for (int g = 0; g < G; g++) {
                int t = h * G + g;
                float dot = 0.f;
                #pragma omp simd reduction(+:dot)
                for (int i = 0; i < D; i++) dot += q[t * D + i] * stored(keys, key + i, bf16);
                dot = visible ? dot * scale : HIDDEN;
                scores[t * stride + j] = dot;
                top[t] = dot > top[t] ? dot : top[t];
            }
        }
    }
    for (int t = 0; t < H * G; t++) {
        float *row = scores + t * stride, total = 0.f;
        vec sums = (vec){}, shift = splat(top[t]);
        int64_t j = 0;
        for (; j + VW <= len; j += VW) {
            vec x = load(row + j), weight = pick(x > splat(0.5f * HIDDEN), exp_of_score(x - shift), (vec){});
            store(row + j, weight);
            sums += weight;
        }
        for (int i = 0; i < VW; i++) total += sums[i];
        for (; j < len; j++) {
            float weight = row[j] > 0.5f * HIDDEN ? exp_of_score(splat(row[j] - top[t]))[0] : 0.f;
            row[j] = weight;
            total += weight;
        }
        totals[t] = total;
    }
    for (int i = 0; i < H * G * D; i++) sums[i] = 0.f;
    for (int64_t j = 0; j < len; j++) {
        for (int h = 0; h < H; h++) {
            int64_t value = offset + h * head_stride + j * row_stride;
            for (int g = 0; g < G; g++) {
                int t = h * G + g;
                float weight = scores[t * stride + j];
                #pragma omp simd
                for (int i = 0; i < D; i++) sums[t * D + i] += weight * stored(values, value + i, bf16);
            }
        }
    }
    for (int h = 0; h < H; h++) {
        float *part = parts + h * part_stride;
        for (int i = 0; i < G * D; i++) part[i] = sums[h * G * D + i];
        for (int g = 0; g < G; g++) {
            part[G * D + g] = top[h * G + g];
            part[G * D + G + g] = totals[h * G + g];
        }
    }
}

/* softmax(q k^T * scale) v of G heads [G, D] from the `count` parts `attend_head` left of their rows, one after
   another: each part's sums weighted by exp(its top - the largest top). One part's weight is exp(0) = 1, so a head
   in one part comes out as its sums times 1 / its total. */
static void combine_parts(const float *parts, int64_t count, int64_t G, int64_t D, float *out) {
    const int64_t size = G * (D + 2);
    float weight[count];
    for (int64_t g = 0; g < G; g++) {
        float top = HIDDEN, total = 0.f;
        for (int64_t p = 0; p < count; p++) top = fmaxf(top, parts[p * size + G * D + g]);
        for (int64_t p = 0; p < count; p++) {
            weight[p] = expf(parts[p * size + G * D + g] - top);
            total += weight[p] * parts[p * size + G * D + G + g];
        }
        float inverse = total > 0.f ? 1.f / total : 0.f;  /* no visible key: zeros, never NaN */
        for (int64_t i = 0; i < D; i++) {
            float sum = 0.f;
            for (int64_t p = 0; p < count; p++) sum += weight[p] * parts[p * size + g * D + i];
            out[g * D + i] = sum * inverse;
        }
    }
}

#define ATTEND_HEADS(H, G, D, BF16) \
    attend_heads(qh, keys, values, offset + from * row_stride, head_stride, row_stride, ph + from, to - from, lo, hi, \
                 scale, part, part_stride, scores, longest, H, G, D, BF16)
/* common shapes as constants (SmolLM2-135M: 3 KV heads of 3 query heads of 64); any other shape runs the same code
   with them as variables */
#define ATTEND_ANY_SHAPE(H, BF16) \
    if (groups == 3 && dim == 64) ATTEND_HEADS(H, 3, 64, BF16); \
    else if (groups == 4 && dim == 64) ATTEND_HEADS(H, 4, 64, BF16); \
    else if (groups == 8 && dim == 64) ATTEND_HEADS(H, 8, 64, BF16); \
    else if (groups == 4 && dim == 128) ATTEND_HEADS(H, 4, 128, BF16); \
    else if (groups == 8 && dim == 128) ATTEND_HEADS(H, 8, 128, BF16); \
    else ATTEND_HEADS(H, (int)groups, (int)dim, BF16)
#define ATTEND_ANY_HEADS(BF16) \
    if (heads_a_piece == 1) { ATTEND_ANY_SHAPE(1, BF16); } \
    else if (heads_a_piece == 3) { ATTEND_ANY_SHAPE(3, BF16); } \
    else { ATTEND_ANY_SHAPE((int)heads_a_piece, BF16); }

/* A task's rows below which its decoding attention stays in one part. */
#define LEAST_ROWS_A_PART 128

/* How many parts each of `tasks` tasks' rows are cut into, so that the threads share the tasks evenly: one
   sequence has fewer KV heads (3 for SmolLM2) than there are threads, or a number the threads do not divide, and
   then one thread would read most of the KV while the other idles (decoding one sequence of 4K tokens on a 2-core
   Zen 3: 0.94x the step's time in parts). At most `threads`, and parts of at least LEAST_ROWS_A_PART rows of the
   longest sequence. */
int64_t decode_attention_parts(int64_t tasks, int64_t longest, int threads) {
    int64_t a = tasks, b = threads;
    while (b) { int64_t r = a % b; a = b; b = r; }  /* a = gcd(tasks, threads) */
    int64_t even = threads / a, most = longest / LEAST_ROWS_A_PART;
    return even < most ? even : (most > 1 ? most : 1);
}

/* Whether a layout's rows hold every head side by side (a cache's [rows, heads, dim]): then a task is a sequence
   and all its heads, else a (sequence, head). */
static inline int heads_in_a_row(int64_t heads, int64_t head_stride, int64_t row_stride) {
    return heads > 1 && head_stride < row_stride;
}

/* Floats of scratch `decode_attention` needs for either layout: each thread's scores, then every part's sums, top
   scores and totals. */
int64_t decode_attention_scratch(int64_t seqs, int64_t heads, int64_t groups, int64_t dim, int64_t longest,
                                 int threads) {
    int64_t by_head = decode_attention_parts(seqs * heads, longest, threads);
    int64_t by_row = decode_attention_parts(seqs, longest, threads);
    int64_t parts = by_head > by_row ? by_head : by_row;
    return threads * heads * groups * longest + seqs * heads * parts * groups * (dim + 2);
}

/* Decoding attention, one query position per sequence: for each sequence s < seqs and KV head h, the query heads
   q[s, h, :, :] ([seqs, heads, groups, dim], fp32) attend the rows j < lengths[s] of keys and values (fp32, or
   bf16 if `bf16`; element s * seq_stride + h * head_stride + j * row_stride + i) whose position
   pos[s * pos_stride + j] is visible from qpos[s]: at or before it, and within `window` positions of it if
   window > 0. `longest` is the largest of the lengths. The causal mask comes from the positions themselves, never
   materialised. A task is a sequence's head (s, h), or a sequence and all its heads where its rows hold the
   heads side by side (`attend_heads`); each task may be cut into consecutive parts of its rows
   (`decode_attention_parts`), attended apart and combined. scratch: `decode_attention_scratch` floats, the
   scores of each thread's current part, then seqs x heads x parts x groups x (dim + 2), the parts. out: [seqs,
   heads, groups, dim], fp32.

   At 16 sequences of 544 tokens over SmolLM2's 30 layers (2-core Zen 4 EPYC, fp32) this reads the KV at about
   29 GB/s, where torch's fused kernel with an additive mask read it at 16. */
void decode_attention(const float *q, const void *keys, const void *values, int bf16, int64_t seq_stride,
                      int64_t head_stride, int64_t row_stride, const int64_t *pos, int64_t pos_stride,
                      const int64_t *lengths, const int64_t *qpos, int64_t seqs, int64_t heads, int64_t groups,
                      int64_t dim, int64_t longest, int64_t window, float scale, float *scratch, float *out,
                      int threads) {
    const int64_t heads_a_piece = heads_in_a_row(heads, head_stride, row_stride) ? heads : 1;
    const int64_t tasks = seqs * heads, parts = decode_attention_parts(tasks / heads_a_piece, longest, threads);
    const int64_t part_size = groups * (dim + 2), part_stride = parts * part_size;
    float *all_parts = scratch + (int64_t)threads * heads * groups * longest;
    #pragma omp parallel num_threads(threads)
    {
        float *scores = scratch + omp_get_thread_num() * heads * groups * longest;  /* each thread's own rows */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t piece = 0; piece < tasks / heads_a_piece * parts; piece++) {
            int64_t task = piece / parts * heads_a_piece, s = task / heads, h = task % heads;
            int64_t offset = s * seq_stride + h * head_stride;
            int64_t from = lengths[s] * (piece % parts) / parts, to = lengths[s] * (piece % parts + 1) / parts;
            const float *qh = q + task * groups * dim;
            const int64_t *ph = pos + s * pos_stride;
            float *part = all_parts + task * part_stride + piece % parts * part_size;
            int64_t hi = qpos[s], lo = window > 0 ? hi - window : INT64_MIN;
            if (bf16) { ATTEND_ANY_HEADS(1); }
            else { ATTEND_ANY_HEADS(0); }
        }
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++)
            combine_parts(all_parts + task * part_stride, parts, groups, dim, out + task * groups * dim);
    }
}

/* ---- pointwise steps of a layer ----------------------------------------------------------------------------
   Each is one pass over its rows where torch runs several ops (a norm: square, mean, add, rsqrt, two products), so
   a prefill reads and writes its activations once, and a decoding step of a few rows pays one call's overhead.
   Their tensors are all fp32 or all bf16. */

/* Llama's RMSNorm of one row: out = weight * x / sqrt(mean(x^2) + eps). In bf16 the normalised row is rounded
   before the weight multiplies it, as transformers' module does. */
static inline __attribute__((always_inline)) void norm_row(const void *x, int64_t row, int64_t width,
        const void *weight, float eps, void *out, int64_t to, const int bf16) {
    float squares = 0.f;
    #pragma omp simd reduction(+:squares)
    for (int64_t j = 0; j < width; j++) squares += stored(x, row + j, bf16) * stored(x, row + j, bf16);
    float scale = 1.f / sqrtf(squares / width + eps);
    #pragma omp simd
    for (int64_t j = 0; j < width; j++)
        keep(out, to + j, stored(weight, j, bf16) * rounded_to(stored(x, row + j, bf16) * scale, bf16), bf16);
}

/* RMSNorm of n rows of `width` at the given strides */
void rms_norm(const void *x, int64_t x_stride, int64_t n, int64_t width, const void *weight, float eps, void *out,
              int64_t out_stride, int threads, int bf16) {
    #pragma omp parallel for num_threads(n > 1 ? threads : 1) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        if (bf16) norm_row(x, i * x_stride, width, weight, eps, out, i * out_stride, 1);
        else norm_row(x, i * x_stride, width, weight, eps, out, i * out_stride, 0);
    }
}

/* One row of the gated MLP's activation: out[j] = silu(gate[j]) * up[j]. In bf16 silu's result is rounded before
   the product, as torch's two ops do. fp32 takes whole vectors through the inline e^x: the vector maths library's
   expf, a call every VW values (every half tile in gated_panel_rows), held ~2.5% of a 1K-token prefill on a 2-core
   Zen 4 EPYC; inline, silu_mul of 1024 x 1536 took 0.67x the time and a 1K-token prefill 0.94-0.98x (2K and 4K:
   level). bf16 too, widened and rounded as `stored` and `keep` do: level on the Zen 4; on a 2-core Xeon with AMX,
   where bf16's products run 9x faster than fp32's, silu_mul of 2048 x 1536 bf16 rows took 1.25 ms element by
   element and 0.91 in vectors (fp32's 0.71). */
static inline __attribute__((always_inline)) void silu_mul_row(const void *gate, const void *up, int64_t row,
        int64_t width, void *out, int64_t to, const int bf16) {
    int64_t vectors = width - width % VW;
    for (int64_t j = 0; j < vectors; j += VW) {
        if (bf16) {
            vec g = load_bf16((const uint16_t *)gate + row + j);
            vec silu = rounded_to_bf16(g / (1.f + exp_of_score(-larger(g, splat(-88.f)))));
            store_bf16((uint16_t *)out + to + j, rounded_to_bf16(silu * load_bf16((const uint16_t *)up + row + j)));
        } else {
            vec g = load((const float *)gate + row + j);
            vec e = exp_of_score(-larger(g, splat(-88.f)));
            store((float *)out + to + j, g / (1.f + e) * load((const float *)up + row + j));
        }
    }
    #pragma omp simd
    for (int64_t j = vectors; j < width; j++) {  /* e^-g below 88: no infinity where -ffast-math assumes none */
        float g = stored(gate, row + j, bf16);
        keep(out, to + j, rounded_to(g / (1.f + expf(fminf(-g, 88.f))), bf16) * stored(up, row + j, bf16), bf16);
    }
}

/* silu(gate) * up for n rows, gate and up rows at the given stride (two halves of one product's rows), out
   contiguous */
void silu_mul(const void *gate, const void *up, int64_t stride, int64_t n, int64_t width, void *out, int threads,
              int bf16) {
    #pragma omp parallel for num_threads(n * width >= 4096 ? threads : 1) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        if (bf16) silu_mul_row(gate, up, i * stride, width, out, i * width, 1);
        else silu_mul_row(gate, up, i * stride, width, out, i * width, 0);
    }
}

/* `panel_rows` of bf16 rows in AMX tiles (amx_panels_take), or with `intermediate` outputs of a gated MLP (its
   weight's `2 * intermediate` outputs gate then up, `out`) `gated_panel_rows`: silu(gate) * up into y (row stride
   `y_stride`, = intermediate) as each gate panel and its up panel come. Each thread takes its panels in turn, each
   panel through every block of rows while it is in the caches. -1, having done nothing, if its memory could not
   be had. */
static int amx_panel_rows(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t pairs, const void *panels,
                          int64_t out, const void *b, const uint16_t *plus, uint16_t *y, int64_t y_stride,
                          int64_t intermediate, int threads) {
#if AMX_TILES
    int64_t count = intermediate ? intermediate / PANEL_WIDTH : (out + PANEL_WIDTH - 1) / PANEL_WIDTH;
    AmxRows a;
    if (amx_rows(x, x_stride, rows, pairs, &a)) return -1;
    #pragma omp parallel num_threads(threads)
    {
        configure_tiles(5, a.tile_rows);  /* sums 0-1 and rows 2 of the rows' height, a panel's pairs 3-4 */
        uint16_t gate[AMX_ROWS * PANEL_WIDTH], up[AMX_ROWS * PANEL_WIDTH];
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < count; p++) {
            float bias[PANEL_WIDTH], up_bias[PANEL_WIDTH];
            int64_t columns = panel_bias(b, p, out, bias, 1), first = p * PANEL_WIDTH;
            const char *panel = panel_at(panels, p, pairs, WEIGHTS_BF16);
            const char *up_panel = intermediate ? panel_at(panels, count + p, pairs, WEIGHTS_BF16) : 0;
            if (intermediate) panel_bias(b, count + p, out, up_bias, 1);
            for (int64_t block = 0; block < a.blocks; block++) {
                int64_t stride, block_rows, at = block * AMX_ROWS * y_stride + first;
                const uint16_t *xb = amx_block(&a, block, pairs, &stride, &block_rows);
                if (!intermediate) {
                    amx_panel_tile(xb, stride, pairs, panel, bias, plus ? plus + at : 0, y + at, y_stride, columns,
                                   block_rows, a.tile_rows);
                    continue;
                }
                amx_panel_tile(xb, stride, pairs, panel, bias, 0, gate, PANEL_WIDTH, PANEL_WIDTH, block_rows,
                               a.tile_rows);
                amx_panel_tile(xb, stride, pairs, up_panel, up_bias, 0, up, PANEL_WIDTH, PANEL_WIDTH, block_rows,
                               a.tile_rows);
                for (int64_t r = 0; r < block_rows; r++)
                    silu_mul_row(gate, up, r * PANEL_WIDTH, PANEL_WIDTH, y, at + r * y_stride, 1);
            }
        }
        _tile_release();
    }
    free((void *)a.tail);
    return 0;
#else
    return -1;
#endif
}

/* The gated MLP's activation [rows, intermediate] = silu(gate) * up, gate and up the two halves of x's product
   with a weight [2 * intermediate, in] in panels (+ bias), for an intermediate width of whole panels: each row tile
   of a gate panel and of the up panel of the same outputs goes through silu_mul_row as the tiles come, so that the
   gate and up values never leave L1 (`panel_rows` writes them, 25 MB a layer for a 2K-token prefill of
   SmolLM2, and `silu_mul` reads them back). The same sums and rounding as the two kernels one after the other. */
static void gated_panel_rows(const void *x, int64_t x_stride, int64_t rows, int64_t depth, const void *panels,
                             int64_t intermediate, const void *b, void *activation, int threads, int format) {
    if (amx_panels_take(rows, depth, format)
            && !amx_panel_rows(x, x_stride, rows, depth, panels, 2 * intermediate, b, 0, activation, intermediate,
                               intermediate, threads))
        return;
    const int bf16 = format == WEIGHTS_BF16;
    int64_t half = intermediate / PANEL_WIDTH, size = bf16 ? 2 : 4;
    const int streaming = PANEL_TILE_AVX2 && format == WEIGHTS_FP32 && rows <= STREAMING_ROWS;
    const int fetch_next = fetches_next_panel(rows, format);
    float *padded = padded_tail(x, x_stride, rows, depth, streaming);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < half; p++) {
        float gate_bias[PANEL_WIDTH], up_bias[PANEL_WIDTH];
        panel_bias(b, p, 2 * intermediate, gate_bias, bf16);
        panel_bias(b, half + p, 2 * intermediate, up_bias, bf16);
        const char *gate_panel = panel_at(panels, p, depth, format), *up_panel = panel_at(panels, half + p, depth, format);
        /* one row tile's gate and up outputs, each row of them PANEL_WIDTH apart (in fp32, or bf16: half of it) */
        float gate[PANEL_TILE_ROWS * PANEL_WIDTH], up[PANEL_TILE_ROWS * PANEL_WIDTH];
        for (int64_t m = 0; m < rows; m += PANEL_TILE_ROWS) {
            int R = rows - m < PANEL_TILE_ROWS ? (int)(rows - m) : PANEL_TILE_ROWS;
            const char *xm = (const char *)x + m * x_stride * size;
            row_tile(xm, x_stride, depth, gate_panel, p, half, m, gate_bias, 0, (char *)gate, PANEL_WIDTH, PANEL_WIDTH,
                     R, streaming, fetch_next, padded, format);
            row_tile(xm, x_stride, depth, up_panel, p, half, m, up_bias, 0, (char *)up, PANEL_WIDTH, PANEL_WIDTH, R,
                     streaming, fetch_next, padded, format);
            for (int r = 0; r < R; r++) {
                int64_t to = (m + r) * intermediate + p * PANEL_WIDTH;
                if (bf16) silu_mul_row(gate, up, r * PANEL_WIDTH, PANEL_WIDTH, activation, to, 1);
                else silu_mul_row(gate, up, r * PANEL_WIDTH, PANEL_WIDTH, activation, to, 0);
            }
        }
    }
    free(padded);
}

/* ---- a layer's parts in one call each ---------------------------------------------------------------------
   The runtime's kernels one after another, for rows whose products all run in panels: a decoding step made about
   nine calls of these kernels a layer, each with its Python checks and allocations around it, which took a third
   of one sequence's step. The sums are the separate kernels' to the bit. */

/* Panels' depth for `width` inputs: fp32 and int8 one a row, bf16 in pairs (the caller keeps bf16 widths even). */
static inline int64_t panel_depth(int64_t width, int format) { return format == WEIGHTS_BF16 ? width / 2 : width; }

/* RMSNorm of rows x [n, width] (row stride x_stride) into `scratch` [n, width], then those rows' product with a
   weight in panels (+ bias) into y [n, out] */
void normed_panel_rows(const void *x, int64_t x_stride, int64_t rows, int64_t width, const void *norm_weight,
                       float eps, const void *panels, int64_t out, const void *b, void *scratch, void *y,
                       int threads, int format) {
    rms_norm(x, x_stride, rows, width, norm_weight, eps, scratch, width, threads, format == WEIGHTS_BF16);
    panel_rows(scratch, width, rows, panel_depth(width, format), panels, out, b, 0, y, out, threads, format);
}

/* The end of a Llama layer for attended rows attn [n, attn_width] (contiguous) and their residual [n, hidden]
   (contiguous): h = attn @ o + residual, then y = h + down(silu(gate(norm(h))) * up(norm(h))), the MLP's gate and
   up one product of `2 * intermediate` outputs. The intermediate rows go to h and normed [n, hidden], gate_up
   [n, 2 * intermediate] (only for an intermediate width of no whole number of panels; else gated_panel_rows) and
   activation [n, intermediate]. */
void layer_end(const void *attn, int64_t rows, int64_t attn_width, const void *residual, int64_t hidden,
               const void *o_panels, const void *o_bias, const void *norm_weight, float eps,
               const void *gate_up_panels, const void *gate_up_bias, int64_t intermediate, const void *down_panels,
               const void *down_bias, void *h, void *normed, void *gate_up, void *activation, void *y, int threads,
               int format) {
    const int bf16 = format == WEIGHTS_BF16;
    int64_t size = bf16 ? 2 : 4;
    panel_rows(attn, attn_width, rows, panel_depth(attn_width, format), o_panels, hidden, o_bias, residual, h, hidden,
               threads, format);
    rms_norm(h, hidden, rows, hidden, norm_weight, eps, normed, hidden, threads, bf16);
    if (intermediate % PANEL_WIDTH == 0) {  /* gate_up is not used */
        gated_panel_rows(normed, hidden, rows, panel_depth(hidden, format), gate_up_panels, intermediate, gate_up_bias,
                         activation, threads, format);
    } else {
        panel_rows(normed, hidden, rows, panel_depth(hidden, format), gate_up_panels, 2 * intermediate, gate_up_bias, 0,
                   gate_up, 2 * intermediate, threads, format);
        silu_mul(gate_up, (char *)gate_up + intermediate * size, 2 * intermediate, rows, intermediate, activation,
                 threads, bf16);
    }
    panel_rows(activation, intermediate, rows, panel_depth(intermediate, format), down_panels, hidden, down_bias, h, y,
               hidden, threads, format);
}

/* RoPE of one row's heads (heads contiguous, from offset `from`) by the row's tables cos, sin [dim] (from offset
   `table`) into out (from `to`): the two halves of each head turn as x * cos + rotate_half(x) * sin,
   rotate_half(x) = [-x2, x1]. In bf16, x * cos is rounded before the other product is added to it, as torch's ops
   do (the runtime's way without this kernel). */
static inline __attribute__((always_inline)) void rope_row(const void *x, int64_t from, int64_t heads, int64_t dim,
        const void *cos, const void *sin, int64_t table, void *out, int64_t to, const int bf16) {
    int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++, from += dim, to += dim) {
        #pragma omp simd
        for (int64_t d = 0; d < half; d++) {
            float x1 = stored(x, from + d, bf16), x2 = stored(x, from + d + half, bf16);
            keep(out, to + d,
                 rounded_to(x1 * stored(cos, table + d, bf16), bf16) - x2 * stored(sin, table + d, bf16), bf16);
            keep(out, to + d + half, rounded_to(x2 * stored(cos, table + d + half, bf16), bf16)
                                     + x1 * stored(sin, table + d + half, bf16), bf16);
        }
    }
}

/* RoPE of rows x [n, heads, dim] (row i at i * x_stride) by their tables (row i at i * table_stride) into out (row
   i at i * out_stride, not x's memory) */
void rope(const void *x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim, const void *cos, const void *sin,
          int64_t table_stride, void *out, int64_t out_stride, int threads, int bf16) {
    #pragma omp parallel for num_threads(n * heads * dim >= 4096 ? threads : 1) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        if (bf16) rope_row(x, i * x_stride, heads, dim, cos, sin, i * table_stride, out, i * out_stride, 1);
        else rope_row(x, i * x_stride, heads, dim, cos, sin, i * table_stride, out, i * out_stride, 0);
    }
}

/* Stored KV of `layers` layers, in parts, placed in a cache in one pass (no joined copy first): in each layer l, row
   i of the parts in turn goes to cache row to[i] (or first + i if to is NULL; rows row_stride apart) of
   cache_keys[l] and cache_values[l], its keys rotated by row i of cos[l] and sin[l] as `rope` turns them, its values
   copied. Part p holds held[p] rows of keys and of values [held[p], heads, dim] a layer, each layer contiguous and
   key_layer_strides[p] (value_layer_strides[p]) elements after the one before, and gives counts[p] of them:
   picks[p][0..counts[p]) where picks and picks[p] are not NULL, else its first counts[p] in order. Picking here spares
   a sparse read of a tier that keeps tensors (CacheTune's rows) a gathered copy of its own; placing a read's layers
   in one call spares the caller a call (and its checks) for each. Returns -1, nothing written, if a pick is not one
   of its part's rows; else 0. */
int place_layers(int64_t layers, int64_t parts, const void *const *keys, const void *const *values,
                 const int64_t *key_layer_strides, const int64_t *value_layer_strides, const int64_t *counts,
                 const int64_t *const *picks, const int64_t *held, int64_t heads, int64_t dim,
                 const void *const *cos, const void *const *sin, int64_t table_stride, const int64_t *to,
                 int64_t first, void *const *cache_keys, void *const *cache_values, int64_t row_stride, int threads,
                 int bf16) {
    int64_t total = 0, width = heads * dim, size = bf16 ? 2 : 4;
    for (int64_t p = 0; p < parts; p++) {
        total += counts[p];
        for (int64_t r = 0; picks && picks[p] && r < counts[p]; r++)
            if (picks[p][r] < 0 || picks[p][r] >= held[p]) return -1;
    }
    #pragma omp parallel for num_threads(layers * total * width >= 4096 ? threads : 1) schedule(static)
    for (int64_t i = 0; i < layers * total; i++) {
        int64_t l = i / total, row = i % total, placed = row, p = 0;
        while (row >= counts[p]) row -= counts[p++];
        if (picks && picks[p]) row = picks[p][row];
        int64_t at = (to ? to[placed] : first + placed) * row_stride;
        const char *k = (const char *)keys[p] + l * key_layer_strides[p] * size;
        const char *v = (const char *)values[p] + (l * value_layer_strides[p] + row * width) * size;
        if (bf16) rope_row(k, row * width, heads, dim, cos[l], sin[l], placed * table_stride, cache_keys[l], at, 1);
        else rope_row(k, row * width, heads, dim, cos[l], sin[l], placed * table_stride, cache_keys[l], at, 0);
        memcpy((char *)cache_values[l] + at * size, v, width * size);
    }
    return 0;
}

/* ---- prefill attention ------------------------------------------------------------------------------------ */

#define KEY_TILE 64   /* keys per tile: one row of scores is KEY_TILE / VW vectors */
#define TILE_ROWS 6   /* query rows per register tile: 6 x SCORE_VECTORS score vectors, or 6 x 4 output vectors */
/* Vectors of keys a score tile sums at once: 6 x 4 sums fill AVX-512's 32 registers with room for the keys (5-7%
   faster than 6 x 2 on Zen 4); AVX2's 16 registers hold 6 x 2. */
#if VW == 16
#define SCORE_VECTORS 4
#else
#define SCORE_VECTORS 2
#endif

/* scores [TILE_ROWS, KEY_TILE] (row stride KEY_TILE) of `vectors` vectors of keys from key j: queries
   q [TILE_ROWS, dim] times the transposed keys kt [dim, ...] (row stride kt_stride), their sums in registers */
static inline __attribute__((always_inline)) void scores_vectors(const float *q, int64_t dim, const float *kt,
        int64_t kt_stride, float *scores, int j, const int vectors) {
    vec sums[TILE_ROWS][SCORE_VECTORS];  /* vectors <= SCORE_VECTORS */
    for (int r = 0; r < TILE_ROWS; r++)
        for (int i = 0; i < vectors; i++) sums[r][i] = (vec){};
    for (int64_t d = 0; d < dim; d++) {
        vec k[SCORE_VECTORS];
        for (int i = 0; i < vectors; i++) k[i] = load(kt + d * kt_stride + j + i * VW);
        for (int r = 0; r < TILE_ROWS; r++) {
            vec qd = splat(q[r * dim + d]);
            for (int i = 0; i < vectors; i++) sums[r][i] += qd * k[i];
        }
    }
    for (int r = 0; r < TILE_ROWS; r++)
        for (int i = 0; i < vectors; i++) store(scores + r * KEY_TILE + j + i * VW, sums[r][i]);
}

/* Vectors of keys a score tile sums from key j of the first `count`: SCORE_VECTORS, or what is left */
static inline int vectors_from(int j, int64_t count) {
    int64_t left = (count - j + VW - 1) / VW;
    return left < SCORE_VECTORS ? (int)left : SCORE_VECTORS;
}

/* the scores of a key tile's first `count` keys (whole vectors of them; the rest of the row is left as it was) */
static inline __attribute__((always_inline)) void scores_tile(const float *q, int64_t dim, const float *kt,
        int64_t kt_stride, float *scores, int64_t count) {
    for (int j = 0; j < count; j += SCORE_VECTORS * VW) {
        switch (vectors_from(j, count)) {  /* a constant in each call, so that the sums stay in registers */
            case 1: scores_vectors(q, dim, kt, kt_stride, scores, j, 1); break;
#if SCORE_VECTORS == 4
            case 2: scores_vectors(q, dim, kt, kt_stride, scores, j, 2); break;
            case 3: scores_vectors(q, dim, kt, kt_stride, scores, j, 3); break;
#endif
            default: scores_vectors(q, dim, kt, kt_stride, scores, j, SCORE_VECTORS);
        }
    }
}

/* Vectors of the output a values tile sums at once: 6 x 4 with AVX-512; AVX2's 16 registers hold 6 x 2 (GCC spilled
   6 x 4 of them to the stack: on a 2-core Zen 3 EPYC, SmolLM2's causal attention over 1K / 2K tokens took 0.80x /
   0.82x the time in 6 x 2, with the same sums). */
#define VALUE_VECTORS (VW == 16 ? 4 : 2)

/* out [TILE_ROWS, dim] += weights [TILE_ROWS, count] (row stride KEY_TILE) times the value rows (row stride
   row_stride), VALUE_VECTORS * VW columns at a time; dim is a multiple of VW (`prefill_attention_vector_width`) */
static inline __attribute__((always_inline)) void values_tile(const float *weights, const float *values,
        int64_t row_stride, int64_t count, float *out, int64_t dim) {
    int64_t d = 0;
    for (; d + VALUE_VECTORS * VW <= dim; d += VALUE_VECTORS * VW) {
        vec sums[TILE_ROWS][VALUE_VECTORS];
        for (int r = 0; r < TILE_ROWS; r++)
            for (int i = 0; i < VALUE_VECTORS; i++) sums[r][i] = load(out + r * dim + d + i * VW);
        for (int64_t j = 0; j < count; j++) {
            const float *v = values + j * row_stride + d;
            vec vs[VALUE_VECTORS];
            for (int i = 0; i < VALUE_VECTORS; i++) vs[i] = load(v + i * VW);
            for (int r = 0; r < TILE_ROWS; r++) {
                vec w = splat(weights[r * KEY_TILE + j]);
                for (int i = 0; i < VALUE_VECTORS; i++) sums[r][i] += w * vs[i];
            }
        }
        for (int r = 0; r < TILE_ROWS; r++)
            for (int i = 0; i < VALUE_VECTORS; i++) store(out + r * dim + d + i * VW, sums[r][i]);
    }
    for (; d < dim; d += VW) {
        vec sums[TILE_ROWS];
        for (int r = 0; r < TILE_ROWS; r++) sums[r] = load(out + r * dim + d);
        for (int64_t j = 0; j < count; j++) {
            vec v = load(values + j * row_stride + d);
            for (int r = 0; r < TILE_ROWS; r++) sums[r] += splat(weights[r * KEY_TILE + j]) * v;
        }
        for (int r = 0; r < TILE_ROWS; r++) store(out + r * dim + d, sums[r]);
    }
}

/* One row's scores of a key tile into softmax weights, online. The weights are e^(score - top), with `top` the
   row's running maximum, moved (and the row's sum and output so far rescaled) only when a score passes it by more
   than HEADROOM: a weight of up to e^8 is exact enough, and most tiles then skip finding their maximum. `total`
   holds the row's sum by lanes, added up at the end. Masked scores (HIDDEN) weigh 0; a `whole` tile has none, and
   callers pass it as a constant so that such tiles compile without the masking. */
#define HEADROOM 8.f
static inline __attribute__((always_inline)) void softmax_tile(float *scores, float *top, float *total, float *out,
        int64_t dim, int whole) {
    vec row[KEY_TILE / VW];
    row[0] = load(scores);
    vec highest = row[0];
    for (int i = 1; i < KEY_TILE / VW; i++) {
        row[i] = load(scores + i * VW);
        highest = larger(highest, row[i]);
    }
    if (any_above(highest, splat(*top + HEADROOM))) {
        float new_top = *top;
        for (int j = 0; j < KEY_TILE; j++) new_top = scores[j] > new_top ? scores[j] : new_top;
        float shrink = exp_of_score(splat(*top - new_top))[0];
        store(total, load(total) * shrink);
        for (int64_t d = 0; d < dim; d++) out[d] *= shrink;
        *top = new_top;
    }
    vec sum = load(total), shift = splat(*top);
    for (int i = 0; i < KEY_TILE / VW; i++) {
        vec w = exp_of_score(row[i] - shift);
        if (!whole) w = pick(row[i] > splat(0.5f * HIDDEN), w, (vec){});
        store(scores + i * VW, w);
        sum += w;
    }
    store(total, sum);
}

/* bf16 attention on CPUs with AVX512-BF16 (elsewhere it is WIDENED): both products in vdpbf16ps, which
   multiplies pairs of bf16 exactly and adds them to fp32 sums at twice the rate of fp32 FMAs. Queries and keys
   are taken as they come (each score is exact up to fp32 summation, as the fp32 kernel's); the softmax weights,
   fp32 like the fp32 kernel's, are rounded to bf16 for the product with the values, which is where torch's bf16
   attention rounds them too (its scores are rounded to bf16 as well; these are not). Operands are laid out as the
   instruction pairs them: keys as [dim / 2, KEY_TILE] pairs of neighbouring dims of one key, values as
   [KEY_TILE / 2, dim] pairs of two neighbouring keys' same dim, weights as pairs of neighbouring keys. */
#if BF16_DOT
static inline __m512bh pairs_at(const uint32_t *p) { return (__m512bh)_mm512_loadu_si512(p); }
static inline __m512bh pair_splat(uint32_t pair) { return (__m512bh)_mm512_set1_epi32((int)pair); }

/* scores [TILE_ROWS, KEY_TILE] of `vectors` vectors of keys from key j: scale * queries [TILE_ROWS, dim / 2 pairs]
   times a tile's keys kt [dim / 2, KEY_TILE] pairs, their sums in registers */
static inline __attribute__((always_inline)) void scores_vectors_bf16(const uint32_t *q, int64_t dim_pairs,
        const uint32_t *kt, float scale, float *scores, int j, const int vectors) {
    __m512 sums[TILE_ROWS][SCORE_VECTORS];  /* vectors <= SCORE_VECTORS */
    for (int r = 0; r < TILE_ROWS; r++)
        for (int i = 0; i < vectors; i++) sums[r][i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < dim_pairs; p++) {
        __m512bh k[SCORE_VECTORS];
        for (int i = 0; i < vectors; i++) k[i] = pairs_at(kt + p * KEY_TILE + j + i * VW);
        for (int r = 0; r < TILE_ROWS; r++) {
            __m512bh qp = pair_splat(q[r * dim_pairs + p]);
            for (int i = 0; i < vectors; i++) sums[r][i] = _mm512_dpbf16_ps(sums[r][i], qp, k[i]);
        }
    }
    __m512 by = _mm512_set1_ps(scale);
    for (int r = 0; r < TILE_ROWS; r++)
        for (int i = 0; i < vectors; i++)
            _mm512_storeu_ps(scores + r * KEY_TILE + j + i * VW, _mm512_mul_ps(sums[r][i], by));
}

/* `scores_tile` in bf16 pairs */
static inline __attribute__((always_inline)) void scores_tile_bf16(const uint32_t *q, int64_t dim_pairs,
        const uint32_t *kt, float scale, float *scores, int64_t count) {
    for (int j = 0; j < count; j += SCORE_VECTORS * VW) {
        switch (vectors_from(j, count)) {
            case 1: scores_vectors_bf16(q, dim_pairs, kt, scale, scores, j, 1); break;
            case 2: scores_vectors_bf16(q, dim_pairs, kt, scale, scores, j, 2); break;
            case 3: scores_vectors_bf16(q, dim_pairs, kt, scale, scores, j, 3); break;
            default: scores_vectors_bf16(q, dim_pairs, kt, scale, scores, j, SCORE_VECTORS);
        }
    }
}

/* out [TILE_ROWS, dim] += weights [TILE_ROWS, KEY_TILE / 2] pairs times a tile's values [KEY_TILE / 2, dim] pairs,
   the first `pairs` of them, 4 * VW columns at a time; dim is a multiple of VW */
static inline __attribute__((always_inline)) void values_tile_bf16(const uint32_t *weights, const uint32_t *values,
        int64_t pairs, float *out, int64_t dim) {
    int64_t d = 0;
    for (; d + 4 * VW <= dim; d += 4 * VW) {
        __m512 sums[TILE_ROWS][4];
        for (int r = 0; r < TILE_ROWS; r++)
            for (int i = 0; i < 4; i++) sums[r][i] = _mm512_loadu_ps(out + r * dim + d + i * VW);
        for (int64_t p = 0; p < pairs; p++) {
            const uint32_t *v = values + p * dim + d;
            __m512bh v0 = pairs_at(v), v1 = pairs_at(v + VW), v2 = pairs_at(v + 2 * VW), v3 = pairs_at(v + 3 * VW);
            for (int r = 0; r < TILE_ROWS; r++) {
                __m512bh w = pair_splat(weights[r * KEY_TILE / 2 + p]);
                sums[r][0] = _mm512_dpbf16_ps(sums[r][0], w, v0); sums[r][1] = _mm512_dpbf16_ps(sums[r][1], w, v1);
                sums[r][2] = _mm512_dpbf16_ps(sums[r][2], w, v2); sums[r][3] = _mm512_dpbf16_ps(sums[r][3], w, v3);
            }
        }
        for (int r = 0; r < TILE_ROWS; r++)
            for (int i = 0; i < 4; i++) _mm512_storeu_ps(out + r * dim + d + i * VW, sums[r][i]);
    }
    for (; d < dim; d += VW) {
        __m512 sums[TILE_ROWS];
        for (int r = 0; r < TILE_ROWS; r++) sums[r] = _mm512_loadu_ps(out + r * dim + d);
        for (int64_t p = 0; p < pairs; p++) {
            __m512bh v = pairs_at(values + p * dim + d);
            for (int r = 0; r < TILE_ROWS; r++)
                sums[r] = _mm512_dpbf16_ps(sums[r], pair_splat(weights[r * KEY_TILE / 2 + p]), v);
        }
        for (int r = 0; r < TILE_ROWS; r++) _mm512_storeu_ps(out + r * dim + d, sums[r]);
    }
}

/* a row of KEY_TILE fp32 weights rounded to bf16 (to nearest, ties to even), in order */
static inline void weights_to_bf16(const float *w, uint32_t *to) {
    for (int i = 0; i < KEY_TILE; i += 2 * VW)
        _mm512_storeu_si512(to + i / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(w + i + VW),
                                                                      _mm512_loadu_ps(w + i)));
}

/* A key tile of one head (`valid` rows, row_stride elements apart) laid out as both products take it: keys
   [dim / 2, KEY_TILE] pairs into kt, values [KEY_TILE / 2, dim] pairs into vt. Past the keys, the values are zeros
   (a masked weight of 0 times whatever the scratch held could be a NaN); the keys are left as they are, since
   their scores are masked. */
static void pack_tile_bf16(const uint16_t *keys, const uint16_t *values, int64_t row_stride, int64_t valid,
                           int64_t dim, uint32_t *kt, uint16_t *vt) {
    for (int64_t p = 0; p < dim / 2; p++)
        for (int64_t j = 0; j < valid; j++) memcpy(kt + p * KEY_TILE + j, keys + j * row_stride + 2 * p, 4);
    for (int64_t j = 0; j < KEY_TILE; j++) {
        uint16_t *to = vt + (j / 2) * dim * 2 + j % 2;
        if (j < valid) {
            const uint16_t *from = values + j * row_stride;
            for (int64_t d = 0; d < dim; d++) to[2 * d] = from[d];
        } else {
            for (int64_t d = 0; d < dim; d++) to[2 * d] = 0;
        }
    }
}
#endif

int prefill_attention_vector_width(void) { return VW; }

/* Floats of scratch each query row of a thread's block needs: its query, output, scores, weights rounded to bf16
   (pairs), running maximum and sums by lanes. */
#define FLOATS_PER_ROW(dim) (2 * (dim) + KEY_TILE + KEY_TILE / 2 + 1 + VW)

/* A key tile of one head (`valid` rows from element `from`, row_stride apart; fp32, or bf16 widened) transposed
   into `to` [dim, KEY_TILE], a row of the tile at a time (its writes are one vector store), zeros past the keys
   (masked anyway). */
static inline __attribute__((always_inline)) void transpose_tile(const void *keys, int64_t from, int64_t row_stride,
        int64_t valid, int64_t dim, float *to, const int bf16) {
    for (int64_t d = 0; d < dim; d++) {
        #pragma omp simd
        for (int64_t j = 0; j < valid; j++) to[d * KEY_TILE + j] = stored(keys, from + j * row_stride + d, bf16);
        for (int64_t j = valid; j < KEY_TILE; j++) to[d * KEY_TILE + j] = 0.f;
    }
}

/* bf16 attention where the bf16 dot-product instruction is not built: widened to fp32 as the tiles are laid out
   (keys transposed, values in rows of their own), then the fp32 kernel's products. */
#define WIDENED(bf16) ((bf16) && !BF16_DOT)

/* Bytes of scratch `prefill_attention` needs, for the keys transposed (in bf16: keys and values packed in pairs,
   the same bytes; widened bf16: the values too), each key tile's positions and each thread's query block. */
int64_t prefill_attention_scratch(int64_t keys, int64_t heads, int64_t groups, int64_t dim, int64_t block_queries,
                                  int threads, int bf16) {
    int64_t tiles = (keys + KEY_TILE - 1) / KEY_TILE;
    int64_t rows = (block_queries * groups + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    int64_t laid_out = heads * dim * tiles * KEY_TILE * (WIDENED(bf16) ? 2 : 1);
    return (laid_out + threads * rows * FLOATS_PER_ROW(dim)) * (int64_t)sizeof(float)
           + 2 * tiles * (int64_t)sizeof(int64_t) + threads * rows * (int64_t)sizeof(int64_t);
}

/* What the tasks of one call share: its arguments, and the keys laid out by tile with each tile's positions. */
typedef struct {
    const void *q, *keys, *values;
    const int64_t *qpos, *kpos;
    int64_t q_stride, n, row_stride, m, heads, groups, dim, window, block_queries, tiles;
    float scale;
    float *transposed;     /* [heads, tiles, dim, KEY_TILE]: a tile's keys are one block (bf16: keys and values
                              packed in pairs, the values' in the second half) */
    float *widened;        /* [heads, tiles, KEY_TILE, dim]: widened bf16's values */
    int64_t *tile_bounds;  /* [tiles, 2]: each tile's lowest and highest key position */
    int bf16;
} AttentionCall;

/* One thread's block of queries of one KV head (their query heads stacked as rows) and its running softmax. */
typedef struct {
    float *q, *out, *scores, *top, *total;  /* top: each row's running maximum; total: its sums by VW lanes */
    uint32_t *weights;                      /* bf16: the scores' weights, rounded, in pairs */
    int64_t *pos;
    int64_t rows;                           /* a multiple of TILE_ROWS; rows past the block's repeat its last */
    int64_t h, first, count, lowest, highest;
} QueryBlock;

/* Task `task` of the first pass: key tile `task % tiles` of head `task / tiles` laid out, and on head 0 the
   tile's lowest and highest positions. */
static inline __attribute__((always_inline)) void lay_out_key_tile(const AttentionCall *c, int64_t task) {
    const int64_t tiles = c->tiles, dim = c->dim, row_stride = c->row_stride, m = c->m;
    int64_t h = task / tiles, tile = task % tiles, first = tile * KEY_TILE;
    int64_t valid = m - first < KEY_TILE ? m - first : KEY_TILE, from = first * row_stride + h * dim;
#if BF16_DOT
    if (c->bf16) {  /* the keys' pairs in the first half of the block, the values' in the second */
        uint32_t *packed = (uint32_t *)(c->transposed + task * dim * KEY_TILE / 2);
        pack_tile_bf16((const uint16_t *)c->keys + from, (const uint16_t *)c->values + from, row_stride, valid, dim,
                       packed, (uint16_t *)(packed + c->heads * tiles * dim * KEY_TILE / 2));
    } else
#endif
    if (WIDENED(c->bf16)) {
        transpose_tile(c->keys, from, row_stride, valid, dim, c->transposed + task * dim * KEY_TILE, 1);
        float *values_to = c->widened + task * KEY_TILE * dim;
        for (int64_t j = 0; j < valid; j++)
            for (int64_t d = 0; d < dim; d++)
                values_to[j * dim + d] = stored(c->values, from + j * row_stride + d, 1);
    } else {
        transpose_tile(c->keys, from, row_stride, valid, dim, c->transposed + task * dim * KEY_TILE, 0);
    }
    if (h == 0) {
        int64_t lo = INT64_MAX, hi = INT64_MIN;
        for (int64_t j = first; j < first + KEY_TILE && j < m; j++) {
            lo = c->kpos[j] < lo ? c->kpos[j] : lo;
            hi = c->kpos[j] > hi ? c->kpos[j] : hi;
        }
        c->tile_bounds[2 * tile] = lo;
        c->tile_bounds[2 * tile + 1] = hi;
    }
}

/* Task `task` of the second pass: its queries (scaled as scores) and positions into the block, the softmax's
   state reset. */
static inline __attribute__((always_inline)) void load_query_block(const AttentionCall *c, QueryBlock *b,
                                                                     int64_t task) {
    const int64_t groups = c->groups, dim = c->dim, bf16 = c->bf16, rows = b->rows;
    const float scale = c->scale;
    float *const q = b->q, *const top = b->top, *const total = b->total;
    int64_t *const pos = b->pos;
    /* a KV head's blocks one after another (its laid-out keys stay in the caches; a 4K-token prompt's fp32 attention
       took 0.87-0.9x the time of heads taken in turn on a 2-core Xeon), the last first: they see the most keys */
    const int64_t blocks = (c->n + c->block_queries - 1) / c->block_queries;
    const int64_t h = task / blocks, first = (blocks - 1 - task % blocks) * c->block_queries;
    const int64_t count = c->n - first < c->block_queries ? c->n - first : c->block_queries;
    int64_t lowest = INT64_MAX, highest = INT64_MIN;
    for (int64_t r = 0; r < rows; r++) {
        int64_t i = first + (r / groups < count ? r / groups : count - 1), g = r % groups;
        int64_t from = i * c->q_stride + (h * groups + g) * dim;
        if (WIDENED(bf16))
            for (int64_t d = 0; d < dim; d++) q[r * dim + d] = stored(c->q, from + d, 1) * scale;
        else if (bf16)  /* scaled as scores, not rounded again here */
            memcpy((uint16_t *)q + r * dim, (const uint16_t *)c->q + from, dim * sizeof(uint16_t));
        else
            for (int64_t d = 0; d < dim; d++) q[r * dim + d] = ((const float *)c->q)[from + d] * scale;
        pos[r] = c->qpos[i];
        lowest = pos[r] < lowest ? pos[r] : lowest;
        highest = pos[r] > highest ? pos[r] : highest;
        top[r] = HIDDEN;
        store(total + r * VW, (vec){});
    }
    memset(b->out, 0, rows * dim * sizeof(float));
    b->h = h, b->first = first, b->count = count, b->lowest = lowest, b->highest = highest;
}

/* The block's rows over key tile `tile`: scored, masked by position unless every row sees the whole tile, the
   running softmax updated and the values weighed in. A tile no row sees is skipped. */
static inline __attribute__((always_inline)) void attend_key_tile(const AttentionCall *c, QueryBlock *b,
                                                                    int64_t tile) {
    const int64_t dim = c->dim, window = c->window, rows = b->rows, h = b->h, tiles = c->tiles;
    const int64_t lowest = b->lowest, highest = b->highest, bf16 = c->bf16;
    float *const q = b->q, *const out = b->out, *const top = b->top, *const total = b->total;
    uint32_t *const weights = b->weights;
    const int64_t *const pos = b->pos;
    const float *const transposed = c->transposed, *const widened = c->widened;
    const int64_t heads = c->heads, m = c->m, row_stride = c->row_stride, *const kpos = c->kpos;
    const void *const values = c->values;
    int64_t lo = c->tile_bounds[2 * tile], hi = c->tile_bounds[2 * tile + 1], j0 = tile * KEY_TILE;
    if (lo > highest || (window > 0 && hi <= lowest - window)) return;  /* seen by none */
    int64_t valid = m - j0 < KEY_TILE ? m - j0 : KEY_TILE;
    int whole = valid == KEY_TILE && hi <= lowest && (window <= 0 || lo > highest - window);
    /* Keys after the last one a query of the block sees are neither scored nor weighed: on the diagonal of causal
       attention, about half a tile. lo <= highest, so one key at least is seen. */
    const int64_t *tile_pos = kpos + j0;
    int64_t seen = valid;
    if (!whole)
        while (tile_pos[seen - 1] > highest) seen--;
    float *scores = b->scores;
#if BF16_DOT
    const uint32_t *packed = (const uint32_t *)(transposed + (h * tiles + tile) * dim * KEY_TILE / 2);
    if (bf16)
        for (int64_t r = 0; r < rows; r += TILE_ROWS)
            scores_tile_bf16((const uint32_t *)q + r * dim / 2, dim / 2, packed, c->scale, scores + r * KEY_TILE,
                             seen);
    else
#endif
    for (int64_t r = 0; r < rows; r += TILE_ROWS)
        scores_tile(q + r * dim, dim, transposed + (h * tiles + tile) * dim * KEY_TILE, KEY_TILE,
                    scores + r * KEY_TILE, seen);
    for (int64_t r = 0; r < rows; r++) {
        float *row = scores + r * KEY_TILE;
        if (!whole) {
            int64_t p = pos[r];
            #pragma omp simd
            for (int64_t j = 0; j < seen; j++) {
                int visible = tile_pos[j] <= p && (window <= 0 || tile_pos[j] > p - window);
                row[j] = visible ? row[j] : HIDDEN;
            }
            for (int64_t j = seen; j < KEY_TILE; j++) row[j] = HIDDEN;
        }
        if (whole) softmax_tile(row, top + r, total + r * VW, out + r * dim, dim, 1);
        else softmax_tile(row, top + r, total + r * VW, out + r * dim, dim, 0);
#if BF16_DOT
        if (bf16) weights_to_bf16(row, weights + r * KEY_TILE / 2);
#endif
    }
#if BF16_DOT
    if (bf16)
        for (int64_t r = 0; r < rows; r += TILE_ROWS)
            values_tile_bf16(weights + r * KEY_TILE / 2, packed + heads * tiles * dim * KEY_TILE / 2,
                             (seen + 1) / 2, out + r * dim, dim);
    else
#endif
    if (WIDENED(bf16))
        for (int64_t r = 0; r < rows; r += TILE_ROWS)
            values_tile(scores + r * KEY_TILE, widened + (h * tiles + tile) * KEY_TILE * dim, dim, seen,
                        out + r * dim, dim);
    else
        for (int64_t r = 0; r < rows; r += TILE_ROWS)
            values_tile(scores + r * KEY_TILE, (const float *)values + j0 * row_stride + h * dim,
                        row_stride, seen, out + r * dim, dim);
}

/* The block's rows, each divided by its softmax's sum, into `out` [n, heads * groups * dim]. */
static inline __attribute__((always_inline)) void write_query_block(const AttentionCall *c, const QueryBlock *b,
                                                                      void *out) {
    const int64_t dim = c->dim, groups = c->groups, heads = c->heads;
    for (int64_t r = 0; r < b->count * groups; r++) {
        float sum = 0.f;
        for (int i = 0; i < VW; i++) sum += b->total[r * VW + i];
        float inverse = sum > 0.f ? 1.f / sum : 0.f;  /* no visible key: zeros, never NaN */
        int64_t to = (b->first + r / groups) * heads * groups * dim + (b->h * groups + r % groups) * dim;
        if (c->bf16)
            for (int64_t d = 0; d < dim; d++) keep(out, to + d, b->out[r * dim + d] * inverse, 1);
        else
            for (int64_t d = 0; d < dim; d++) ((float *)out)[to + d] = b->out[r * dim + d] * inverse;
    }
}

/* Queries of one sequence at any positions over its keys: for each query i and KV head h, the query heads
   q[i, h * groups + g] ([n, heads * groups, dim], row i at i * q_stride) attend the key rows j < m (keys and
   values: row j at j * row_stride, head h at h * dim) whose position kpos[j] is visible from qpos[i]: at or
   before it, and within `window` positions of it if window > 0. out: [n, heads * groups * dim].

   Flash attention's order of work: each task takes block_queries queries of one KV head (their query heads
   stacked as rows, so every key is read once for all of them), walks the keys in tiles of KEY_TILE and keeps a
   running softmax. A tile whose positions no query of the block can see is skipped, so causal attention does
   about half of a square's work whatever the order of rows; a tile every query sees whole is not masked. Keys are
   transposed once per call, so that a score tile is a product of registers over the head dimension.

   q, keys, values and out are fp32, or all bf16 (bf16 != 0): then both products run in the bf16 dot-product
   instruction where it is built, with the softmax in fp32 between them, else on the bf16 widened to fp32.

   On a 2-core Zen 4 EPYC (SmolLM2's 9 query heads over 3 KV heads of 64) this ran 1-4K causal rows 1.4-1.8x
   faster than torch's fused kernel, and 300 rows scattered over 2069 keys 2.6-2.9x faster than its masked call
   (docs/RESULTS.md, "Native prefill attention" and "The prefill kernel's keys in blocks"). */
void prefill_attention(const void *q, int64_t q_stride, const int64_t *qpos, int64_t n, const void *keys,
                       const void *values, int64_t row_stride, const int64_t *kpos, int64_t m, int64_t heads,
                       int64_t groups, int64_t dim, int64_t window, float scale, int64_t block_queries,
                       char *scratch, void *out, int threads, int bf16) {
    int64_t tiles = (m + KEY_TILE - 1) / KEY_TILE;
    int64_t block_rows = (block_queries * groups + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    int64_t blocks = (n + block_queries - 1) / block_queries;
    float *transposed = (float *)scratch;
    float *widened = transposed + heads * tiles * dim * KEY_TILE;
    float *per_thread = widened + (WIDENED(bf16) ? heads * tiles * KEY_TILE * dim : 0);
    int64_t *tile_bounds = (int64_t *)(per_thread + threads * block_rows * FLOATS_PER_ROW(dim));
    int64_t *row_positions = tile_bounds + 2 * tiles;
    #pragma omp parallel num_threads(threads)
    {
        const AttentionCall call = {q, keys, values, qpos, kpos, q_stride, n, row_stride, m, heads, groups, dim,
                                    window, block_queries, tiles, scale, transposed, widened, tile_bounds, bf16};
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < heads * tiles; task++) lay_out_key_tile(&call, task);
        int thread = omp_get_thread_num();
        QueryBlock block = {.rows = block_rows, .pos = row_positions + thread * block_rows};
        block.q = per_thread + thread * block_rows * FLOATS_PER_ROW(dim);  /* bf16: pairs, half of it */
        block.out = block.q + block_rows * dim;
        block.scores = block.out + block_rows * dim;
        block.weights = (uint32_t *)(block.scores + block_rows * KEY_TILE);
        block.top = (float *)(block.weights + block_rows * KEY_TILE / 2);
        block.total = block.top + block_rows;  /* VW lanes a row */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < heads * blocks; task++) {
            load_query_block(&call, &block, task);
            for (int64_t tile = 0; tile < tiles; tile++) attend_key_tile(&call, &block, tile);
            write_query_block(&call, &block, out);
        }
    }
}

/* ---- causal bf16 attention in AMX tiles --------------------------------------------------------------------
   Where the CPU has AMX-BF16, bf16 queries at any positions (a prompt's, a continuation's, a fusion plan's
   recomputed rows) over the keys at or before them, key row j at position j, heads of 64. On a 2-core Xeon with
   AMX, SmolLM2's heads, against torch's fused kernel (which multiplies in the tiles too): 1.8x as fast on 1024
   causal rows, 1.5x on 2048 and 4096 (0.65-0.73 -> 1.0-1.07 TFLOP/s of attention's products); 2.2-4x on rows
   scattered over 1-4K keys (2%, 15% or 35% of them and the last 32), where torch's calls take a mask.

   Per task, 16 query rows of one query head, in two passes over the key blocks of 32 up to their last position:
   the first takes their scores (Q K^T in tiles 0 and 1, kept for the second) and each row's top score; the second
   the weights e^(score - top) in fp32, rounded to bf16, and their products with the values summed in tiles 2-5,
   which need no rescaling (the top is known), then divided by the weights' sum. Both products run in the tiles
   (bf16 pairs multiplied exactly, summed in fp32): Q K^T from each head's keys laid out once per call as the
   instruction takes its second operand (each key's dims in pairs, 16 keys side by side), P V from the values
   likewise (pairs of keys, 16 dims side by side). Tried: the scores computed again in the second pass, not kept
   (1.20-1.77x torch's speed at 512-4096 rows, against 1.50-1.91x kept); before that, the tasks' query heads taken
   in turn across KV heads (1.08-1.71x, 1.08 at 4K: three heads' keys and values outgrow L2). Without the
   exponentials the kernel took 0.8x its time at 2-4K, without the first pass 0.8x. */

#if AMX_TILES
#define AMX_KEYS 32
#define AMX_DIM 64  /* four tiles of sums: the tiles left beside the scores' two and the operands' two */

/* Head h's keys [k0, k0 + 32) laid out for Q K^T: per 32 dims, a 16 x 16 block of dim pairs for each 16 keys
   (row = pair, column = key); keys past m are zeros. */
static void lay_out_amx_keys(const uint16_t *keys, int64_t row_stride, int64_t m, int64_t h, int64_t dim, int64_t k0,
                             uint32_t *to) {
    for (int64_t half = 0; half < 2; half++)
        for (int64_t c = 0; c < dim / 32; c++) {
            uint32_t *block = to + (half * (dim / 32) + c) * 256;
            for (int64_t j = 0; j < 16; j++) {
                int64_t key = k0 + half * 16 + j;
                const uint32_t *pairs = (const uint32_t *)(keys + key * row_stride + h * dim + c * 32);
                for (int64_t p = 0; p < 16; p++) block[p * 16 + j] = key < m ? pairs[p] : 0;
            }
        }
}

/* Head h's values of keys [k0, k0 + 32) laid out for P V: per 16 dims, a block of 16 rows (key pairs) of the
   16 dims' pairs; keys past m are zeros. */
static void lay_out_amx_values(const uint16_t *values, int64_t row_stride, int64_t m, int64_t h, int64_t dim,
                               int64_t k0, uint16_t *to) {
    for (int64_t c = 0; c < dim / 16; c++) {
        uint16_t *block = to + c * 512;
        for (int64_t p = 0; p < 16; p++)
            for (int64_t t = 0; t < 2; t++) {
                int64_t key = k0 + 2 * p + t;
                const uint16_t *row = values + key * row_stride + h * dim + c * 16;
                for (int64_t d = 0; d < 16; d++) block[p * 32 + 2 * d + t] = key < m ? row[d] : 0;
            }
    }
}

/* scores [16][32] of 16 query rows (tile 6 holds their dims [32c, 32c + 32) in turn) over one key block: tiles
   0 and 1, then stored */
static inline void amx_scores(const uint16_t *q, int64_t q_bytes, const uint32_t *keys, float *scores) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < AMX_DIM / 32; c++) {
        _tile_loadd(6, q + c * 32, q_bytes);
        _tile_loadd(7, keys + c * 256, 64);
        _tile_dpbf16ps(0, 6, 7);
        _tile_loadd(7, keys + (AMX_DIM / 32 + c) * 256, 64);
        _tile_dpbf16ps(1, 6, 7);
    }
    _tile_stored(0, scores, 128);
    _tile_stored(1, scores + 16, 128);
}

int amx_causal_attention(const void *q, int64_t q_stride, const int64_t *qpos, int64_t n, const void *keys,
                         const void *values, int64_t row_stride, int64_t m, int64_t heads, int64_t groups,
                         float scale, void *out, int threads) {
    const int64_t dim = AMX_DIM;
    int64_t blocks = (m + AMX_KEYS - 1) / AMX_KEYS, q_blocks = (n + AMX_ROWS - 1) / AMX_ROWS;
    int64_t block_elements = AMX_KEYS * dim;  /* bf16 elements of one laid-out key (or value) block */
    uint16_t *laid_out = aligned_alloc(64, 2 * heads * blocks * block_elements * sizeof(uint16_t));
    /* each thread's scores of its query block over every key block, from the first pass for the second */
    float *all_scores = aligned_alloc(64, threads * blocks * AMX_ROWS * AMX_KEYS * sizeof(float));
    if (!laid_out || !all_scores) {
        free(laid_out);
        free(all_scores);
        return -1;
    }
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < heads * blocks; task++) {
            int64_t h = task / blocks, b = task % blocks;
            uint16_t *to = laid_out + 2 * task * block_elements;
            lay_out_amx_keys(keys, row_stride, m, h, dim, b * AMX_KEYS, (uint32_t *)to);
            lay_out_amx_values(values, row_stride, m, h, dim, b * AMX_KEYS, to + block_elements);
        }
        configure_tiles(8, AMX_ROWS);  /* every tile 16 x 32 bf16 operands, or 16 x 16 fp32 sums */
        float *thread_scores = all_scores + omp_get_thread_num() * blocks * AMX_ROWS * AMX_KEYS;
        float sums[AMX_ROWS * AMX_DIM] __attribute__((aligned(64)));
        uint16_t weights[AMX_ROWS * AMX_KEYS] __attribute__((aligned(64)));
        uint16_t partial[AMX_ROWS * AMX_DIM] __attribute__((aligned(64)));  /* a last block's rows, zeros past n */
        float top[AMX_ROWS];
        vec tops[AMX_ROWS], totals[AMX_ROWS];
        const vec lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < heads * groups * q_blocks; task++) {
            /* a KV head at a time (its laid-out keys and values stay in the caches), the last query blocks first:
               they see the most keys */
            int64_t h = task / (q_blocks * groups), qb = q_blocks - 1 - task % (q_blocks * groups) / groups;
            int64_t qh = h * groups + task % groups;
            int64_t r0 = qb * AMX_ROWS, rows = n - r0 < AMX_ROWS ? n - r0 : AMX_ROWS;
            int64_t lo = qpos[r0], hi = qpos[r0];  /* the block's positions: keys up to lo all its rows see */
            for (int64_t i = 1; i < rows; i++) {
                lo = qpos[r0 + i] < lo ? qpos[r0 + i] : lo;
                hi = qpos[r0 + i] > hi ? qpos[r0 + i] : hi;
            }
            const uint16_t *qrows = (const uint16_t *)q + r0 * q_stride + qh * dim;
            int64_t q_bytes = q_stride * 2;
            if (rows < AMX_ROWS) {
                memset(partial, 0, sizeof(partial));
                for (int64_t i = 0; i < rows; i++) memcpy(partial + i * dim, qrows + i * q_stride, dim * 2);
                qrows = partial;
                q_bytes = dim * 2;
                MEMORY_READ_BY_TILES();
            }
            int64_t seen = (hi + AMX_KEYS) / AMX_KEYS;  /* key blocks up to the block's last position */
            seen = seen < blocks ? seen : blocks;
            const uint16_t *head_blocks = laid_out + 2 * h * blocks * block_elements;
            for (int64_t i = 0; i < AMX_ROWS; i++) tops[i] = splat(HIDDEN), totals[i] = splat(0.f);
            for (int64_t b = 0; b < seen; b++) {  /* each row's top score over the keys it sees, by lanes */
                float *scores = thread_scores + b * AMX_ROWS * AMX_KEYS;
                amx_scores(qrows, q_bytes, (const uint32_t *)(head_blocks + 2 * b * block_elements), scores);
                int every_key = b * AMX_KEYS + AMX_KEYS - 1 <= lo;  /* every row sees the whole block */
                for (int64_t i = 0; i < rows; i++) {
                    vec s0 = load(scores + i * AMX_KEYS), s1 = load(scores + i * AMX_KEYS + 16);
                    if (!every_key) {
                        float visible = (float)(qpos[r0 + i] - b * AMX_KEYS + 1);
                        s0 = pick(lanes < visible, s0, splat(HIDDEN));
                        s1 = pick(lanes + 16.f < visible, s1, splat(HIDDEN));
                    }
                    tops[i] = larger(tops[i], larger(s0, s1));
                }
            }
            for (int64_t i = 0; i < AMX_ROWS; i++)  /* rows past n: weights of 0, from any finite top */
                top[i] = i < rows ? _mm512_reduce_max_ps((__m512)tops[i]) : 0.f;
            _tile_zero(2);
            _tile_zero(3);
            _tile_zero(4);
            _tile_zero(5);
            for (int64_t b = 0; b < seen; b++) {
                const uint16_t *block = head_blocks + 2 * b * block_elements;
                const float *scores = thread_scores + b * AMX_ROWS * AMX_KEYS;
                int every_key = b * AMX_KEYS + AMX_KEYS - 1 <= lo && rows == AMX_ROWS;
                for (int64_t i = 0; i < AMX_ROWS; i++) {
                    float visible = i < rows ? (float)(qpos[r0 + i] - b * AMX_KEYS + 1) : 0.f;
                    for (int64_t half = 0; half < 2; half++) {
                        vec x = (load(scores + i * AMX_KEYS + half * 16) - top[i]) * scale;
                        vec w;
                        if (every_key) {
                            w = rounded_to_bf16(exp_of_score(x));
                        } else {  /* a masked score may be above the top */
                            w = rounded_to_bf16(exp_of_score(-larger(-x, splat(0.f))));
                            w = pick(lanes + (float)(half * 16) < visible, w, splat(0.f));
                        }
                        totals[i] += w;
                        store_bf16(weights + i * AMX_KEYS + half * 16, w);
                    }
                }
                MEMORY_READ_BY_TILES();
                _tile_loadd(6, weights, 64);
                _tile_loadd(7, block + block_elements, 64);
                _tile_dpbf16ps(2, 6, 7);
                _tile_loadd(7, block + block_elements + 512, 64);
                _tile_dpbf16ps(3, 6, 7);
                _tile_loadd(7, block + block_elements + 1024, 64);
                _tile_dpbf16ps(4, 6, 7);
                _tile_loadd(7, block + block_elements + 1536, 64);
                _tile_dpbf16ps(5, 6, 7);
            }
            _tile_stored(2, sums, AMX_DIM * 4);
            _tile_stored(3, sums + 16, AMX_DIM * 4);
            _tile_stored(4, sums + 32, AMX_DIM * 4);
            _tile_stored(5, sums + 48, AMX_DIM * 4);
            for (int64_t i = 0; i < rows; i++) {
                float total = _mm512_reduce_add_ps((__m512)totals[i]);
                uint16_t *to = (uint16_t *)out + (r0 + i) * heads * groups * dim + qh * dim;
                for (int64_t d = 0; d < dim; d += 16)
                    store_bf16(to + d, rounded_to_bf16(load(sums + i * dim + d) / total));
            }
        }
        _tile_release();
    }
    free(laid_out);
    free(all_scores);
    return 0;
}
#else
int amx_causal_attention(const void *q, int64_t q_stride, const int64_t *qpos, int64_t n, const void *keys,
                         const void *values, int64_t row_stride, int64_t m, int64_t heads, int64_t groups,
                         float scale, void *out, int threads) { return -1; }
#endif
