/* Decode-row attention read in place: each (row, KV head) unit in one fixed order.
 *
 * A unit is one query row's ``G`` query heads over the keys of one KV head: ``seen`` keys at
 * the positions ``pos`` names in a ``[capacity, D]`` run of a KV page (a session's slot and
 * KV head), no copy. Every unit runs the same arithmetic in the same order whatever else the
 * call holds, so a tree node's row is bitwise the AR step that reads the same keys:
 * row-invariant by construction (``invariant.py`` probes it anyway). Scores, softmax and the
 * weighted sum in fp32; the output rounded to the input dtype. Built by ``native_rows.py``
 * with the machine's C compiler (GCC or Clang: vector extensions); without one the verifier
 * keeps torch's SDPA.
 *
 * A tree's rows over one KV head read the same committed prefix: given as a run, they are
 * attended together, each prefix key and value loaded once for all of them, while every
 * row's sums still run in the order it has alone (a split point changes which loop adds a
 * term, never the order of the terms).
 *
 * A score is a 16-lane dot product summed over its lanes by one halving tree
 * (``lanes_sum``). Where D is a multiple of 16, 16 keys' lanes are summed together by
 * shuffles (``sum_16``): the same tree, lane for lane, so a key's score is the same bits
 * whether it falls in a block of 16 or in the tail.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define MAX_G 16
#define MAX_D 256

typedef uint16_t bf16_t;
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (v16i){__VA_ARGS__})
#endif

static inline float bf16_value(bf16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline bf16_t bf16_round(float f) { /* to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}
/* element i of a bf16 (is_bf16) or fp32 array, as fp32 */
static inline float load1(const void *x, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_value(((const bf16_t *)x)[i]) : ((const float *)x)[i];
}
static inline void store1(void *x, int64_t i, float f, int is_bf16) {
    if (is_bf16)
        ((bf16_t *)x)[i] = bf16_round(f);
    else
        ((float *)x)[i] = f;
}
static inline v16f load16(const void *x, int64_t i, int is_bf16) {
    v16f f;
    if (is_bf16) {
        v16h h;
        memcpy(&h, (const bf16_t *)x + i, sizeof h);
        v16u u = __builtin_convertvector(h, v16u) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, (const float *)x + i, sizeof f);
    }
    return f;
}

/* 16 lanes summed in one fixed halving tree */
static inline float lanes_sum(float *a) {
    for (int l = 0; l < 8; l++) a[l] += a[l + 8];
    for (int l = 0; l < 4; l++) a[l] += a[l + 4];
    for (int l = 0; l < 2; l++) a[l] += a[l + 2];
    return a[0] + a[1];
}

/* t[k]'s 16 lanes summed into lane k, for 16 vectors at once: lanes_sum's tree exactly */
static inline v16f sum_16(const v16f *t) {
    v16f u[8], w[4], r[2];
    for (int i = 0; i < 8; i++) /* lane m of a key plus lane m + 8: keys 2i, 2i+1, 8 lanes each */
        u[i] = SHUFFLE(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUFFLE(t[2 * i], t[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++) /* then m + 4: 4 keys, 4 lanes each */
        w[i] = SHUFFLE(u[2 * i], u[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SHUFFLE(u[2 * i], u[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++) /* then m + 2: 8 keys, 2 lanes each */
        r[i] = SHUFFLE(w[2 * i], w[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SHUFFLE(w[2 * i], w[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE(r[0], r[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(r[0], r[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* exp(x) for x <= 0: 2^(x log2 e) as 2^e (e the nearest integer) times a degree-6 polynomial
 * on [-0.5, 0.5] (relative error ~2e-7); below -87 it is exp(-87). 16 at once, or one alone
 * by the same operations. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_ROUND 12582912.0f /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
#define EXP_POLY(y, f)                       \
    y = f * 0.0f + 1.5353362e-4f;            \
    y = y * f + 1.3398874e-3f;               \
    y = y * f + 9.6180325e-3f;               \
    y = y * f + 5.5504112e-2f;               \
    y = y * f + 2.4022652e-1f;               \
    y = y * f + 6.9314718e-1f;               \
    y = y * f + 1.0f;

static inline v16f exp16_nonpositive(v16f x) {
    const v16f floor_at = x - x - 87.0f;
    const v16i below = x < floor_at;
    x = (v16f)(((v16i)x & ~below) | ((v16i)floor_at & below));
    v16f t = x * EXP_LOG2E, e = (t + EXP_ROUND) - EXP_ROUND, f = t - e, y;
    EXP_POLY(y, f)
    return y * (v16f)((__builtin_convertvector(e, v16i) + 127) << 23);
}

static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * EXP_LOG2E, e = (t + EXP_ROUND) - EXP_ROUND, f = t - e, y, scale;
    EXP_POLY(y, f)
    int32_t bits = ((int32_t)e + 127) << 23;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

/* The scores of T query rows (fp32, scaled; ``q[t * D ...]``) against the keys at positions
 * p[j0..j1) of the run at ``kbase``, into s[t * W + j]. A key is loaded once for all T rows;
 * a score's arithmetic is the same whatever T, j0 and j1 are. */
static void key_scores(const float *q, int64_t T, const void *kbase, const int64_t *p, int64_t j0, int64_t j1,
                       int64_t D, int64_t W, int is_bf16, float *s) {
    int64_t j = j0;
    if (D % LANES == 0) {
        float key[LANES][MAX_D] __attribute__((aligned(64)));
        for (; j + LANES <= j1; j += LANES) {
            for (int k = 0; k < LANES; k++)
                for (int64_t d = 0; d < D; d += LANES) {
                    v16f x = load16(kbase, p[j + k] * D + d, is_bf16);
                    memcpy(&key[k][d], &x, sizeof x);
                }
            for (int64_t t = 0; t < T; t++) {
                const float *qt = q + t * D;
                v16f part[LANES] = {0}; /* 16 keys' sums side by side: 16 chains, not one */
                for (int64_t d = 0; d < D; d += LANES) {
                    v16f qv;
                    memcpy(&qv, qt + d, sizeof qv);
                    for (int k = 0; k < LANES; k++) {
                        v16f kv;
                        memcpy(&kv, &key[k][d], sizeof kv);
                        part[k] += qv * kv;
                    }
                }
                v16f sums = sum_16(part);
                memcpy(s + t * W + j, &sums, sizeof sums);
            }
        }
    }
    for (; j < j1; j++) { /* the tail (or any D): one key at a time, the same tree */
        float row[MAX_D];
        for (int64_t d = 0; d < D; d++) row[d] = load1(kbase, p[j] * D + d, is_bf16);
        for (int64_t t = 0; t < T; t++) {
            const float *qt = q + t * D;
            float acc[LANES] = {0};
            int64_t d = 0;
            for (; d + LANES <= D; d += LANES)
                for (int l = 0; l < LANES; l++) acc[l] += qt[d + l] * row[d + l];
            for (int l = 0; d < D; d++, l++) acc[l] += qt[d] * row[d];
            s[t * W + j] = lanes_sum(acc);
        }
    }
}

/* A row's softmax weights over its n scores, unnormalised, in place; returns 1 / their sum. */
static float softmax_weights(float *s, int64_t n) {
    float acc[LANES] = {0}, mx = -INFINITY;
    int64_t j = 0;
    v16f top = {0}; /* the max 16 lanes at a time (a max is exact: any order gives it) */
    top -= INFINITY;
    for (; j + LANES <= n; j += LANES) {
        v16f x;
        memcpy(&x, s + j, sizeof x);
        const v16i above = x > top;
        top = (v16f)(((v16i)x & above) | ((v16i)top & ~above));
    }
    for (int l = 0; l < LANES; l++) mx = top[l] > mx ? top[l] : mx;
    for (; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    j = 0;
    for (; j + LANES <= n; j += LANES) {
        v16f x;
        memcpy(&x, s + j, sizeof x);
        x = exp16_nonpositive(x - mx);
        memcpy(s + j, &x, sizeof x);
    }
    for (; j < n; j++) s[j] = exp_nonpositive(s[j] - mx);
    j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += s[j + l];
    for (int l = 0; j < n; j++, l++) acc[l] += s[j];
    return 1.0f / lanes_sum(acc);
}

/* head_dim 64: rows t's weighted values continued over the keys p[j0..j1) (j0 even), in
 * registers, TILE rows at a time sharing each value row's load. A row's sums: its even keys'
 * and its odd keys' apart (acc[t * 128 ...] and acc[t * 128 + 64 ...]), each in key order, the
 * last key of an odd count with the even ones. ``zeros``: W weights for a tile's unused rows. */
#define TILE 3
static void value_sums64(const float *w, int64_t T, const void *vbase, const int64_t *p, int64_t j0, int64_t j1,
                         int64_t W, int is_bf16, float *acc, const float *zeros) {
    if (j1 <= j0) return;
    for (int64_t t0 = 0; t0 < T; t0 += TILE) {
        const float *wt[TILE];
        v16f even[TILE][4], odd[TILE][4];
        for (int i = 0; i < TILE; i++) {
            wt[i] = t0 + i < T ? w + (t0 + i) * W : zeros;
            for (int b = 0; b < 4; b++) {
                even[i][b] = odd[i][b] = (v16f){0};
                if (t0 + i < T) {
                    memcpy(&even[i][b], acc + (t0 + i) * 128 + 16 * b, sizeof(v16f));
                    memcpy(&odd[i][b], acc + (t0 + i) * 128 + 64 + 16 * b, sizeof(v16f));
                }
            }
        }
        int64_t j = j0;
        for (; j + 2 <= j1; j += 2)
            for (int b = 0; b < 4; b++) {
                const v16f ve = load16(vbase, p[j] * 64 + 16 * b, is_bf16);
                const v16f vo = load16(vbase, p[j + 1] * 64 + 16 * b, is_bf16);
                for (int i = 0; i < TILE; i++) {
                    even[i][b] += wt[i][j] * ve;
                    odd[i][b] += wt[i][j + 1] * vo;
                }
            }
        if (j < j1)
            for (int b = 0; b < 4; b++) {
                const v16f ve = load16(vbase, p[j] * 64 + 16 * b, is_bf16);
                for (int i = 0; i < TILE; i++) even[i][b] += wt[i][j] * ve;
            }
        for (int i = 0; i < TILE && t0 + i < T; i++)
            for (int b = 0; b < 4; b++) {
                memcpy(acc + (t0 + i) * 128 + 16 * b, &even[i][b], sizeof(v16f));
                memcpy(acc + (t0 + i) * 128 + 64 + 16 * b, &odd[i][b], sizeof(v16f));
            }
    }
}

/* any head_dim: rows t's weighted values continued over the keys p[j0..j1), one sum in key
 * order (acc[t * D ...]), each value row loaded once for all T rows */
static void value_sums(const float *w, int64_t T, const void *vbase, const int64_t *p, int64_t j0, int64_t j1,
                       int64_t D, int64_t W, int is_bf16, float *acc) {
    for (int64_t j = j0; j < j1; j++) {
        float row[MAX_D];
        for (int64_t d = 0; d < D; d++) row[d] = load1(vbase, p[j] * D + d, is_bf16);
        for (int64_t t = 0; t < T; t++) {
            const float wj = w[t * W + j];
            float *o = acc + t * D;
            for (int64_t d = 0; d < D; d++) o[d] += wj * row[d];
        }
    }
}

/* One run of m units (a unit alone, or a tree's rows over one KV head): their scores, softmax
 * and weighted values, the first ``shared`` keys read once for all of them. ``q``, ``s``,
 * ``acc``, ``inv``: room for m * G rows. */
static void attend_run(const void *query, const void *keys, const void *values, void *out, const int64_t *kv_offset,
                       const int64_t *pos, const int64_t *pos_row, const int64_t *seen, const int64_t *unit,
                       int64_t m, int64_t shared, int64_t G, int64_t D, int64_t W, float scaling, int is_bf16,
                       float *q, float *s, float *acc, float *inv, const float *zeros) {
    const size_t item = is_bf16 ? sizeof(bf16_t) : sizeof(float);
    const char *kbase = (const char *)keys + kv_offset[unit[0]] * item;
    const char *vbase = (const char *)values + kv_offset[unit[0]] * item;
    const int64_t T = m * G, stride = D == 64 ? 128 : D;
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = 0; d < D; d++)
                q[(i * G + g) * D + d] = load1(query, (unit[i] * G + g) * D + d, is_bf16) * scaling;
    const int64_t *p_shared = pos + pos_row[unit[0]] * W;
    key_scores(q, T, kbase, p_shared, 0, shared, D, W, is_bf16, s);
    for (int64_t i = 0; i < m; i++)
        key_scores(q + i * G * D, G, kbase, pos + pos_row[unit[i]] * W, shared, seen[unit[i]], D, W, is_bf16,
                   s + i * G * W);
    for (int64_t t = 0; t < T; t++) { /* a row that sees no key (none does: it sees itself) gets 0s */
        const int64_t n = seen[unit[t / G]];
        inv[t] = n > 0 ? softmax_weights(s + t * W, n) : 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(T * stride));
    if (D == 64) { /* the shared keys in pairs, so that each row's even/odd split is its own */
        const int64_t pairs = shared & ~(int64_t)1;
        value_sums64(s, T, vbase, p_shared, 0, pairs, W, is_bf16, acc, zeros);
        for (int64_t i = 0; i < m; i++)
            value_sums64(s + i * G * W, G, vbase, pos + pos_row[unit[i]] * W, pairs, seen[unit[i]], W, is_bf16,
                         acc + i * G * stride, zeros);
    } else {
        value_sums(s, T, vbase, p_shared, 0, shared, D, W, is_bf16, acc);
        for (int64_t i = 0; i < m; i++)
            value_sums(s + i * G * W, G, vbase, pos + pos_row[unit[i]] * W, shared, seen[unit[i]], D, W, is_bf16,
                       acc + i * G * stride);
    }
    for (int64_t t = 0; t < T; t++) {
        const float *o = acc + t * stride;
        const int64_t at = (unit[t / G] * G + t % G) * D;
        for (int64_t d = 0; d < D; d++)
            store1(out, at + d, (D == 64 ? o[d] + o[64 + d] : o[d]) * inv[t], is_bf16);
    }
}

static int attend(const void *query, const void *keys, const void *values, void *out, const int64_t *kv_offset,
                  const int64_t *pos, const int64_t *pos_row, const int64_t *seen, const int64_t *order,
                  const int64_t *run_start, const int64_t *run_shared, int64_t runs, int64_t units, int64_t G,
                  int64_t D, int64_t W, float scaling, int is_bf16) {
    if (G > MAX_G || D > MAX_D) return 1;
    int64_t most = 1; /* units in the largest run */
    for (int64_t r = 0; order && r < runs; r++)
        most = run_start[r + 1] - run_start[r] > most ? run_start[r + 1] - run_start[r] : most;
    const size_t rows = (size_t)(most * G), width = (size_t)(W > 0 ? W : 1);
    float *q = malloc(sizeof(float) * rows * (size_t)D), *s = malloc(sizeof(float) * rows * width);
    float *acc = malloc(sizeof(float) * rows * 2 * (size_t)D), *inv = malloc(sizeof(float) * rows);
    float *zeros = calloc(width, sizeof(float));
    int status = q && s && acc && inv && zeros ? 0 : 2;
    if (!order) /* each unit alone */
        for (int64_t u = 0; !status && u < units; u++)
            attend_run(query, keys, values, out, kv_offset, pos, pos_row, seen, &u, 1, 0, G, D, W, scaling,
                       is_bf16, q, s, acc, inv, zeros);
    for (int64_t r = 0; order && !status && r < runs; r++)
        attend_run(query, keys, values, out, kv_offset, pos, pos_row, seen, order + run_start[r],
                   run_start[r + 1] - run_start[r], run_shared[r], G, D, W, scaling, is_bf16, q, s, acc, inv,
                   zeros);
    free(q), free(s), free(acc), free(inv), free(zeros);
    return status;
}

/* query, out [units, G, D]; keys, values: unit u's run starts kv_offset[u] elements in, its
 * key j at row pos[pos_row[u] * W + j]; the first seen[u] of a pos row are the unit's keys.
 * ``order`` NULL: each unit alone. Else units order[run_start[r] .. run_start[r + 1]) form run
 * r: one kv_offset, and the same first run_shared[r] (<= each one's seen) positions, read once
 * for all of them. Returns 0, or 1 for shapes past MAX_G / MAX_D, 2 out of memory. */
int row_attention_bf16(const bf16_t *query, const bf16_t *keys, const bf16_t *values, bf16_t *out,
                       const int64_t *kv_offset, const int64_t *pos, const int64_t *pos_row, const int64_t *seen,
                       const int64_t *order, const int64_t *run_start, const int64_t *run_shared, int64_t runs,
                       int64_t units, int64_t G, int64_t D, int64_t W, float scaling) {
    return attend(query, keys, values, out, kv_offset, pos, pos_row, seen, order, run_start, run_shared, runs,
                  units, G, D, W, scaling, 1);
}

int row_attention_f32(const float *query, const float *keys, const float *values, float *out,
                      const int64_t *kv_offset, const int64_t *pos, const int64_t *pos_row, const int64_t *seen,
                      const int64_t *order, const int64_t *run_start, const int64_t *run_shared, int64_t runs,
                      int64_t units, int64_t G, int64_t D, int64_t W, float scaling) {
    return attend(query, keys, values, out, kv_offset, pos, pos_row, seen, order, run_start, run_shared, runs,
                  units, G, D, W, scaling, 0);
}
