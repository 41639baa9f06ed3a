/* Kernels the runtime compiles for the CPU it runs on (kvreuse/model/native.py builds this file with
   -march=native and loads it with ctypes). Plain C with OpenMP: the compiler vectorises the loops marked simd
   for whatever vector width the CPU has. Every tensor is fp32 (positions and lengths int64), read through the
   strides given, with contiguous rows. */

#include <omp.h>
#include <stdint.h>

/* A few rows x [M, in] through a plain row-major weight w [out, in] (and bias b [out], or NULL):
   y[m, o] = w[o] . x[m] + b[o], row m of y at y + m * y_stride.

   A decoding step of a few sequences is a read of every weight: oneDNN's product of one row reads them at
   25-33 GB/s on a 2-core Zen 4 EPYC, where a sum over the same bytes runs at 40-58. Here each thread streams
   its share of the weight's rows once, in order, each row dotted with every x (held in L1). From 4 rows on,
   oneDNN's product is as fast (kvreuse.model.linear sends it those). M is a constant, so the compiler unrolls
   it. */
static inline __attribute__((always_inline)) void rows_through(const float *x, int64_t in, const float *w,
        int64_t out, const float *b, float *y, int64_t y_stride, int threads, const int M) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < out; o++) {
        const float *row = w + o * in;
        for (int m = 0; m < M; m++) {
            const float *xm = x + m * in;
            float sum = 0.f;
            #pragma omp simd reduction(+:sum)
            for (int64_t i = 0; i < in; i++) sum += row[i] * xm[i];
            y[m * y_stride + o] = b ? sum + b[o] : sum;
        }
    }
}

void few_rows(const float *x, int64_t rows, int64_t in, const float *w, int64_t out, const float *b, float *y,
              int64_t y_stride, int threads) {
    switch (rows) {
        case 1: rows_through(x, in, w, out, b, y, y_stride, threads, 1); break;
        case 2: rows_through(x, in, w, out, b, y, y_stride, threads, 2); break;
        case 3: rows_through(x, in, w, out, b, y, y_stride, threads, 3); break;
    }
}

/* The G query heads q [G, D] that share one KV head, over that head's keys and values (row j at j * row_stride),
   rows j < len whose position pos[j] is visible (lo_pos < pos[j] <= hi_pos): softmax(q k^T * scale) v into
   out [G, D]. Scores go through `scores` [G, stride]. G and D are constants where the caller can make them,
   so the compiler unrolls the heads and keeps their sums in registers. */
static inline __attribute__((always_inline)) void attend_head(
        const float *q, const float *keys, const float *values, int64_t row_stride, const int64_t *pos,
        int64_t len, int64_t lo_pos, int64_t hi_pos, float scale, float *out, float *scores, int64_t stride,
        const int G, const int D) {
    const float hidden = -3.0e38f;  /* finite: -ffast-math assumes no infinities */
    float top[G], inverse[G], sums[G * D];
    for (int g = 0; g < G; g++) top[g] = hidden;
    for (int64_t j = 0; j < len; j++) {
        const float *key = keys + j * row_stride;
        int visible = pos[j] <= hi_pos && pos[j] > lo_pos;
        for (int g = 0; g < G; g++) {
            float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (int i = 0; i < D; i++) dot += q[g * D + i] * key[i];
            dot = visible ? dot * scale : hidden;
            scores[g * stride + j] = dot;
            top[g] = dot > top[g] ? dot : top[g];
        }
    }
    for (int g = 0; g < G; g++) {
        float *row = scores + g * stride, total = 0.f;
        #pragma omp simd reduction(+:total)
        for (int64_t j = 0; j < len; j++) {
            float weight = row[j] > 0.5f * hidden ? expf(row[j] - top[g]) : 0.f;
            row[j] = weight;
            total += weight;
        }
        inverse[g] = total > 0.f ? 1.f / total : 0.f;  /* no visible key: zeros, never NaN */
    }
    for (int i = 0; i < G * D; i++) sums[i] = 0.f;
    for (int64_t j = 0; j < len; j++) {
        const float *value = values + j * row_stride;
        for (int g = 0; g < G; g++) {
            float weight = scores[g * stride + j];
            #pragma omp simd
            for (int i = 0; i < D; i++) sums[g * D + i] += weight * value[i];
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < D; i++) out[g * D + i] = sums[g * D + i] * inverse[g];
}

#define ATTEND_HEAD(G, D) \
    attend_head(qh, kh, vh, row_stride, ph, lengths[s], lo, hi, scale, oh, scores, longest, G, D)

/* Decoding attention, one query position per sequence: for each sequence s < seqs and KV head h, the query heads
   q[s, h, :, :] ([seqs, heads, groups, dim]) attend the rows j < lengths[s] of keys and values (element
   s * seq_stride + h * head_stride + j * row_stride + i) whose position pos[s * pos_stride + j] is visible from
   qpos[s]: at or before it, and within `window` positions of it if window > 0. `longest` is the largest of
   the lengths. The causal mask comes from the positions themselves, never materialised.
   scratch: threads x groups x longest floats, the scores of each thread's current head. out: [seqs, heads,
   groups, dim].

   At 16 sequences of 544 tokens over SmolLM2's 30 layers (2-core Zen 4 EPYC, fp32) this reads the KV at about
   29 GB/s, where torch's fused kernel with an additive mask read it at 16. */
void decode_attention(const float *q, const float *keys, const float *values, int64_t seq_stride,
                      int64_t head_stride, int64_t row_stride, const int64_t *pos, int64_t pos_stride,
                      const int64_t *lengths, const int64_t *qpos, int64_t seqs, int64_t heads, int64_t groups,
                      int64_t dim, int64_t longest, int64_t window, float scale, float *scratch, float *out,
                      int threads) {
    #pragma omp parallel num_threads(threads)
    {
        float *scores = scratch + omp_get_thread_num() * groups * longest;  /* each thread's own rows */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < seqs * heads; task++) {
            int64_t s = task / heads, h = task % heads;
            const float *qh = q + task * groups * dim;
            const float *kh = keys + s * seq_stride + h * head_stride;
            const float *vh = values + s * seq_stride + h * head_stride;
            const int64_t *ph = pos + s * pos_stride;
            float *oh = out + task * groups * dim;
            int64_t hi = qpos[s], lo = window > 0 ? hi - window : INT64_MIN;
            /* common shapes as constants (SmolLM2-135M: 3 query heads per KV head of 64); any other shape runs
               the same code with them as variables */
            if (groups == 3 && dim == 64) ATTEND_HEAD(3, 64);
            else if (groups == 4 && dim == 64) ATTEND_HEAD(4, 64);
            else if (groups == 8 && dim == 64) ATTEND_HEAD(8, 64);
            else if (groups == 4 && dim == 128) ATTEND_HEAD(4, 128);
            else if (groups == 8 && dim == 128) ATTEND_HEAD(8, 128);
            else ATTEND_HEAD((int)groups, (int)dim);
        }
    }
}
