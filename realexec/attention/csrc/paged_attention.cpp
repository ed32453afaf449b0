// Paged attention for the CPU: one call per layer for every sequence of a step
// (decodes, whole prefills, prefill chunks after a cached prefix alike).
//
// Plain C ABI (no torch headers: it compiles in about a second and is loaded with ctypes;
// see realexec/attention/cpu_backend.py). Threads come from OpenMP; the library links the
// same libgomp.so.1 torch already loaded, so it shares torch's thread pool and its
// torch.set_num_threads setting.
//
// Layouts (fp32): q [T, Hq, D] rows of q_stride floats (heads contiguous), k/v new rows
// [T, Hkv, D] with token strides k_stride / v_stride, caches [num_blocks, block_size,
// Hkv, D] contiguous, out [T, Hq, D] contiguous. Sequence i owns rows
// query_start_loc[i] .. query_start_loc[i+1]; its queries sit at positions
// seq_len - q_len .. seq_len - 1 and see keys 0 .. their own position, read through its
// block table row. Slots < 0 are not written; rows of a sequence with seq_len 0 (padding)
// are written as zeros.
//
// Per-layer options: window W > 0 (sliding window) lets the query at position p see only
// keys p - W < j <= p (HF's `kv_idx > q_idx - sliding_window`); blocks wholly before a
// tile's window are not visited. soft_cap c > 0 replaces each scaled score s by
// c * tanh(s / c) before the mask (Gemma 2). 0 turns either off.
//
// Work item = (sequence, kv head, tile of up to `tile` query tokens): the tile's rows are
// its tokens x the query heads sharing the kv head (GQA without copying K/V). Keys are
// visited a chunk of whole blocks (64 keys) at a time through the block table (no gather):
// the chunk's keys are transposed into a [D][64] scratch so q.k vectorizes over keys, then
// groups of 4 rows take one online-softmax step (running max m, sum l) and accumulate p.v
// over D, each key and value row loaded once per group (see attend).
//
// A decode (one query token) is one work item for all heads of its sequence; decodes are
// memory-bound (each K/V float feeds G FMAs), see attend_decode_vec. With fewer work items
// than about twice the threads, long decodes are split into runs of key blocks
// (flash-decoding) whose softmax states are combined after the parallel loop.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <memory>
#include <vector>

#include <omp.h>

namespace {

// exp(v), vectorizable inside an omp simd loop (Cephes expf: range reduction by ln2,
// degree-6 polynomial; max relative error ~2e-7). Arguments below -87.3 (-inf included)
// give 0, above 88.3 exp(88.3).
inline float exp_poly(float v) {
    const bool under = v < -87.3f;
    v = std::min(std::max(v, -87.3f), 88.3f);
    const float k = std::nearbyint(v * 1.44269504088896341f);
    float r = v - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = (static_cast<int32_t>(k) + 127) << 23;
    return under ? 0.0f : p * scale.f;
}

// x[i] = exp(x[i] - shift), vectorized.
inline void exp_shifted(float* __restrict x, float shift, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = exp_poly(x[i] - shift);
}

// One block's scores sr[0:BS] (masked keys -inf) into one query row's online softmax: sr
// becomes exp(score - the new running max m), what the row accumulated in ar[0:D] so far
// is rescaled to that max, and the running sum l takes the block's. The caller then adds
// sr . V into ar.
inline void online_softmax_block(float* __restrict sr, int64_t BS, float& m, float& l, float* __restrict ar,
                                 int64_t D) {
    float mx = m;
#pragma omp simd reduction(max : mx)
    for (int64_t t = 0; t < BS; ++t) mx = std::max(mx, sr[t]);
    exp_shifted(sr, mx, BS);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < BS; ++t) sum += sr[t];
    if (mx != m) {                                  // rescale what was accumulated so far
        const float alpha = m == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m - mx);
        l *= alpha;
        for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
        m = mx;
    }
    l += sum;
}

// ar[0:D] += sum_t p[t] * v[t][0:D] over n value rows `vstride` floats apart. With a
// compile-time D the accumulator is a local array the compiler keeps in registers.
template <int kD>
inline void pv_accumulate(float* __restrict ar, const float* __restrict p, const float* __restrict v,
                          int64_t vstride, int64_t n, int64_t D) {
    if constexpr (kD > 0) {
        float a[kD];
        for (int d = 0; d < kD; ++d) a[d] = ar[d];
        for (int64_t t = 0; t < n; ++t) {
            const float pt = p[t];
            const float* vr = v + t * vstride;
#pragma omp simd
            for (int d = 0; d < kD; ++d) a[d] += pt * vr[d];
        }
        for (int d = 0; d < kD; ++d) ar[d] = a[d];
    } else {
        for (int64_t t = 0; t < n; ++t) {
            const float pt = p[t];
            const float* vr = v + t * vstride;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ar[d] += pt * vr[d];
        }
    }
}

// Scores of 4 query rows (qstride floats apart) against one transposed key block
// kt[d][t]: out[i][t] = q_i . k_t. Four rows share each key load and give the FMA units
// 4 x BS/8 independent accumulator chains (one row alone is latency-bound).
template <int kBS, int kD>
inline void scores4(const float* __restrict q, int64_t qstride, const float* __restrict kt,
                    float* __restrict out) {
    float a0[kBS] = {}, a1[kBS] = {}, a2[kBS] = {}, a3[kBS] = {};
    for (int d = 0; d < kD; ++d) {
        const float* kd = kt + d * kBS;
        const float x0 = q[d], x1 = q[qstride + d], x2 = q[2 * qstride + d], x3 = q[3 * qstride + d];
#pragma omp simd
        for (int t = 0; t < kBS; ++t) {
            a0[t] += x0 * kd[t];
            a1[t] += x1 * kd[t];
            a2[t] += x2 * kd[t];
            a3[t] += x3 * kd[t];
        }
    }
    for (int t = 0; t < kBS; ++t) {
        out[t] = a0[t];
        out[kBS + t] = a1[t];
        out[2 * kBS + t] = a2[t];
        out[3 * kBS + t] = a3[t];
    }
}

struct Item {
    int seq, head, j0, j1;   // sequence, kv head (-1: a decode, all heads), query tokens [j0, j1)
                             // (a decode: its key blocks [j0, j1))
    int64_t cost;            // keys x rows, for ordering the dynamic schedule
    int part = -1;           // a split decode's slot in the partial results (-1: not split)
};

struct Args {
    const float* q; int64_t q_stride;
    const float* k_cache; const float* v_cache;
    const int32_t* block_tables; int64_t bt_stride;
    const int32_t* query_start_loc; const int32_t* seq_lens;
    int64_t num_heads, G, D, BS, row;
    float scale;
    int64_t window;     // sliding window (0: none)
    float soft_cap;     // logit soft cap (0: none)
    float* out;
    float* part_ml;     // split decodes: per part, the rows' running max m then sum l
    float* part_acc;    // split decodes: per part, the rows' unnormalized p.v [rows][D]
};

// Soft-cap scores sr[lo, hi) in place: s -> c * tanh(s / c), vectorized as
// tanh(y) = 1 - 2 / (exp(2y) + 1) (absolute error ~1e-7, times c; std::tanh does not
// vectorize and made capped prefills ~2.7x slower).
inline void soft_cap_scores(float* __restrict sr, int64_t lo, int64_t hi, float cap) {
    const float two_inv = 2.0f / cap;
#pragma omp simd
    for (int64_t t = lo; t < hi; ++t) sr[t] = cap * (1.0f - 2.0f / (exp_poly(sr[t] * two_inv) + 1.0f));
}

struct Scratch {   // one per thread
    std::vector<float> qs, acc, kt, s, m, l, alpha;
    std::vector<int> pos;
    std::unique_ptr<float[]> xs;   // decode: [G][block_size][kW] lane-wise partial dot products (uninitialized)
    Scratch(int64_t rows, int64_t D, int64_t BS, int64_t G)
        : qs(rows * D), acc(rows * D), kt(D * BS), s(rows * BS), m(rows), l(rows), alpha(rows), pos(rows),
          xs(new float[G * BS * 16]) {}
};

// ---------------------------------------------------------------------------------------
// Prefill and prefill chunks (`attend`). Keys are taken a chunk of whole cache blocks at a
// time (kChunk = 64 keys at block sizes up to 64), so the online softmax's bookkeeping
// (max, rescale of the accumulator) happens once per 64 keys instead of once per block,
// and query rows go in groups of kRows: a group's scores against the chunk and its p.v
// keep their accumulators in registers, each key (scores) or value row (p.v) loaded
// once for the group. Row groups that lie wholly before the chunk (causal) are skipped and
// a group's scores stop at the last key its last row sees, so the diagonal costs little.
namespace prefill {

constexpr int64_t kChunk = 64;       // keys per softmax update (rounded to whole blocks)
#if defined(__AVX512F__)
constexpr int kVec = 16;             // floats per vector register
constexpr int kRows = 4;             // query rows per group: 4 x 4 accumulators + 4 loads in 32 zmm
constexpr int kAcc = 16;             // accumulator registers p.v may use
#else
constexpr int kVec = 8;              // ymm (wider GCC vectors are split, their shuffles scalarized)
constexpr int kRows = 2;             // 2 x 4 accumulators + 4 loads in 16 ymm
constexpr int kAcc = 8;
#endif
typedef float vec __attribute__((vector_size(kVec * sizeof(float))));

inline vec load(const float* p) { vec v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

// s[i][0 : NV * kVec] = q_i . kt[:, t] for R rows (q rows kD floats apart, kt [kD][ld]).
template <int R, int NV, int kD>
inline void group_scores(const float* __restrict q, const float* __restrict kt, int64_t ld, float* __restrict s) {
    vec acc[R][NV] = {};
    for (int d = 0; d < kD; ++d) {
        vec k[NV];
        for (int j = 0; j < NV; ++j) k[j] = load(kt + d * ld + j * kVec);
        for (int i = 0; i < R; ++i) {
            const float x = q[i * kD + d];
            for (int j = 0; j < NV; ++j) acc[i][j] += x * k[j];
        }
    }
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < NV; ++j) store(s + i * ld + j * kVec, acc[i][j]);
}

// The same for nv vectors of keys, at most 4 at a time (R x 4 accumulators).
template <int R, int kD>
inline void group_scores_nv(int nv, const float* q, const float* kt, int64_t ld, float* s) {
    for (int v0 = 0; v0 < nv; v0 += 4) {
        const float* k = kt + v0 * kVec;
        float* out = s + v0 * kVec;
        switch (std::min(4, nv - v0)) {
            case 1: group_scores<R, 1, kD>(q, k, ld, out); break;
            case 2: group_scores<R, 2, kD>(q, k, ld, out); break;
            case 3: group_scores<R, 3, kD>(q, k, ld, out); break;
            default: group_scores<R, 4, kD>(q, k, ld, out); break;
        }
    }
}

// Any shape: the same, with runtime loops.
inline void group_scores_any(int64_t R, int64_t width, int64_t D, const float* __restrict q,
                             const float* __restrict kt, int64_t ld, float* __restrict s) {
    for (int64_t i = 0; i < R; ++i) {
        float* si = s + i * ld;
        for (int64_t t = 0; t < width; ++t) si[t] = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
            const float x = q[i * D + d];
            const float* kd = kt + d * ld;
#pragma omp simd
            for (int64_t t = 0; t < width; ++t) si[t] += x * kd[t];
        }
    }
}

// acc_i = alpha_i * acc_i + sum_{t in [lo, hi)} p_i[t] * v_t for R rows (acc rows kD floats
// apart, p rows ld apart; value row t at vrow[t]). Keys a row does not see have p = 0.
template <int R, int kD>
inline void group_pv(float* __restrict acc, const float* alpha, const float* __restrict p, int64_t ld,
                     const float* const* vrow, int64_t lo, int64_t hi) {
    constexpr int NV = kD / kVec;
    vec a[R][NV];
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < NV; ++j) a[i][j] = load(acc + i * kD + j * kVec) * alpha[i];
    for (int64_t t = lo; t < hi; ++t) {
        vec v[NV];
        for (int j = 0; j < NV; ++j) v[j] = load(vrow[t] + j * kVec);
        for (int i = 0; i < R; ++i) {
            const float pt = p[i * ld + t];
            for (int j = 0; j < NV; ++j) a[i][j] += pt * v[j];
        }
    }
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < NV; ++j) store(acc + i * kD + j * kVec, a[i][j]);
}

inline void group_pv_any(int64_t R, int64_t D, float* __restrict acc, const float* alpha,
                         const float* __restrict p, int64_t ld, const float* const* vrow, int64_t lo, int64_t hi) {
    for (int64_t i = 0; i < R; ++i) {
        float* ai = acc + i * D;
        for (int64_t d = 0; d < D; ++d) ai[d] *= alpha[i];
        for (int64_t t = lo; t < hi; ++t) {
            const float pt = p[i * ld + t];
            const float* vt = vrow[t];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ai[d] += pt * vt[d];
        }
    }
}

typedef int32_t ivec __attribute__((vector_size(kVec * sizeof(int32_t))));

inline vec splat(float x) { return vec{} + x; }

// exp_poly on every lane (the same steps; k rounded to nearest by the 1.5 * 2^23 trick,
// exact for |k| < 2^22, which the clamp guarantees; no -ffast-math may fold it away).
inline vec exp16(vec v) {
    const ivec under = v < -87.3f;                  // -inf included
    v = v < -87.3f ? splat(-87.3f) : v;
    v = v > 88.3f ? splat(88.3f) : v;
    const vec k = (v * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    vec r = v - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    vec p = splat(1.9875691500E-4f);
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    const ivec bits = (__builtin_convertvector(k, ivec) + 127) << 23;
    return under ? vec{} : p * (vec)bits;           // a vector cast reinterprets the bits
}

template <int by>
inline vec rotate(vec x) {
    ivec idx;
    for (int i = 0; i < kVec; ++i) idx[i] = (i + by) % kVec;
    return __builtin_shuffle(x, idx);
}

inline float hmax(vec x) {   // a tree of 4 steps, not 16 dependent ones
    if constexpr (kVec == 16) x = x > rotate<8>(x) ? x : rotate<8>(x);
    x = x > rotate<4>(x) ? x : rotate<4>(x);
    x = x > rotate<2>(x) ? x : rotate<2>(x);
    x = x > rotate<1>(x) ? x : rotate<1>(x);
    return x[0];
}

inline float hsum(vec x) {
    if constexpr (kVec == 16) x += rotate<8>(x);
    x += rotate<4>(x);
    x += rotate<2>(x);
    x += rotate<1>(x);
    return x[0];
}

// The online-softmax step of R rows (ld floats apart) over a chunk's scores p[i][0 :
// nv * kVec], of which keys [lo[i], hi[i]) are visible to row i (none if hi <= lo): p
// becomes exp(score - the row's new max) there and 0 elsewhere, m / l (the rows' running
// max and sum) are updated, and alpha[i] is the factor row i's accumulator must be scaled
// by. The rows go in lockstep so their reduction trees overlap.
template <int R>
inline void softmax_group(float* __restrict p, int64_t ld, int64_t nv, const int64_t* lo, const int64_t* hi,
                          float* m, float* l, float* alpha) {
    vec iota;
    for (int i = 0; i < kVec; ++i) iota[i] = float(i);
    vec vmx[R], vsum[R];
    for (int i = 0; i < R; ++i) {
        vmx[i] = splat(m[i]);
        vsum[i] = vec{};
    }
    for (int64_t j = 0; j < nv; ++j) {
        const vec idx = iota + float(j * kVec);
        for (int i = 0; i < R; ++i) {
            const vec s = load(p + i * ld + j * kVec);
            const ivec in = (idx >= float(lo[i])) & (idx < float(hi[i])) & (s > vmx[i]);
            vmx[i] = in ? s : vmx[i];
        }
    }
    float mx[R];
    for (int i = 0; i < R; ++i) mx[i] = hmax(vmx[i]);
    for (int64_t j = 0; j < nv; ++j) {
        const vec idx = iota + float(j * kVec);
        for (int i = 0; i < R; ++i) {
            const ivec in = (idx >= float(lo[i])) & (idx < float(hi[i]));
            const vec e = in ? exp16(load(p + i * ld + j * kVec) - mx[i]) : vec{};
            store(p + i * ld + j * kVec, e);
            vsum[i] += e;
        }
    }
    for (int i = 0; i < R; ++i) {
        alpha[i] = 1.0f;
        if (mx[i] != m[i]) {                        // rescale what was accumulated so far
            alpha[i] = m[i] == -std::numeric_limits<float>::infinity() ? 0.0f : exp_poly(m[i] - mx[i]);
            l[i] *= alpha[i];
            m[i] = mx[i];
        }
        l[i] += hsum(vsum[i]);
    }
}

// Off-diagonal blocks of size s of the kVec x kVec matrix r (rows r[i]) swapped: applied for
// s = kVec / 2, ..., 2, 1 it transposes r (two-source shuffles: 64 for 16 x 16 instead of 256
// scalar moves).
template <int s>
inline void swap_blocks(vec* r) {
    ivec lo, hi;
    for (int L = 0; L < kVec; ++L) {
        lo[L] = (L & s) ? kVec + L - s : L;
        hi[L] = (L & s) ? kVec + L : L + s;
    }
    for (int i = 0; i < kVec; ++i)
        if (!(i & s)) {
            const vec a = r[i], b = r[i + s];
            r[i] = __builtin_shuffle(a, b, lo);
            r[i + s] = __builtin_shuffle(a, b, hi);
        }
}

// kt[d][t] = krow[t][d] for cnt <= kVec keys (their head's kD floats at krow[t]); columns
// cnt..kVec-1 become 0 (nothing past a key row is read).
template <int kD>
inline void transpose_keys(const float* const* krow, int64_t cnt, float* __restrict kt, int64_t ld) {
    for (int c = 0; c < kD / kVec; ++c) {
        vec r[kVec];
        for (int t = 0; t < kVec; ++t) r[t] = t < cnt ? load(krow[t] + c * kVec) : vec{};
        if constexpr (kVec == 16) swap_blocks<8>(r);
        swap_blocks<4>(r);
        swap_blocks<2>(r);
        swap_blocks<1>(r);
        for (int j = 0; j < kVec; ++j) store(kt + (c * kVec + j) * ld, r[j]);
    }
}

// Per-thread buffers of the chunk loop (kept across calls; sized on first use).
struct Buffers {
    std::vector<float> kt, p;
    std::vector<const float*> krow, vrow;
};

}  // namespace prefill

// One prefill work item: query tokens [j0, j1) of sequence `seq` x the G query heads of kv
// head `head`. kBS / kD: compile-time block size and head size (0: the runtime values).
template <int kBS, int kD>
void attend(const Args& a, const Item& it, Scratch& sc) {
    namespace pf = prefill;
    const int64_t BS = kBS ? kBS : a.BS, D = kD ? kD : a.D, G = a.G, row = a.row;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int32_t qs0 = a.query_start_loc[it.seq];
    const int q_len = a.query_start_loc[it.seq + 1] - qs0;
    const int ctx = a.seq_lens[it.seq] - q_len;
    const int32_t* table = a.block_tables + it.seq * a.bt_stride;
    const int64_t rows = int64_t(it.j1 - it.j0) * G;
    // Keys per chunk: whole blocks, about pf::kChunk; ld: a chunk row padded to whole vectors.
    const int64_t chunk = std::max<int64_t>(1, pf::kChunk / BS) * BS;
    const int64_t ld = (chunk + pf::kVec - 1) / pf::kVec * pf::kVec;
    // The vector kernels need a chunk of at most 4 vectors and a head of whole vectors.
    constexpr bool fast = kBS > 0 && kD > 0 && kD % pf::kVec == 0 && kBS <= pf::kChunk &&
                          pf::kChunk % (kBS > 0 ? kBS : 1) == 0;
    static thread_local pf::Buffers buf;
    if (int64_t(buf.kt.size()) < D * ld) buf.kt.resize(D * ld);
    if (int64_t(buf.p.size()) < pf::kRows * ld) buf.p.resize(pf::kRows * ld);
    if (int64_t(buf.vrow.size()) < chunk) {
        buf.krow.resize(chunk);
        buf.vrow.resize(chunk);
    }
    float* __restrict qs = sc.qs.data();
    float* __restrict acc = sc.acc.data();
    float* __restrict kt = buf.kt.data();
    float* __restrict p = buf.p.data();
    const float** krow = buf.krow.data();
    const float** vrow = buf.vrow.data();
    float* m = sc.m.data();
    float* l = sc.l.data();
    int* pos = sc.pos.data();
    // Row r = (token j0 + r / G, query head head * G + r % G), pre-scaled; positions never
    // decrease with r, which the causal skips below rely on.
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = qs0 + it.j0 + r / G, hq = it.head * G + r % G;
        const float* src = a.q + t * a.q_stride + hq * D;
        for (int64_t d = 0; d < D; ++d) qs[r * D + d] = src[d] * a.scale;
        pos[r] = ctx + it.j0 + int(r / G);
        m[r] = neg_inf;
        l[r] = 0.0f;
    }
    std::fill(acc, acc + rows * D, 0.0f);
    const int64_t num_keys = ctx + it.j1;   // the tile's last query sees keys [0, num_keys)
    // The tile's first query sees keys from ctx + j0 - W + 1 on: earlier blocks are skipped.
    const int64_t first_key = a.window > 0 ? std::max<int64_t>(0, ctx + it.j0 - a.window + 1) : 0;
    for (int64_t c0 = first_key / BS * BS; c0 < num_keys; c0 += chunk) {
        const int64_t n = std::min<int64_t>(chunk, num_keys - c0);   // keys of this chunk
        // kt[d][t] = K[c0 + t][d], columns past n up to whole vectors 0 (finite junk the
        // masks below hide); krow[t] / vrow[t]: the key / value row of key c0 + t.
        for (int64_t t = 0; t < n; ++t) {
            const int64_t key = c0 + t;
            const int64_t off = (int64_t(table[key / BS]) * BS + key % BS) * row + it.head * D;
            krow[t] = a.k_cache + off;
            vrow[t] = a.v_cache + off;
        }
        if constexpr (fast) {
            for (int64_t t0 = 0; t0 < n; t0 += pf::kVec)
                pf::transpose_keys<kD>(krow + t0, std::min<int64_t>(pf::kVec, n - t0), kt + t0, ld);
        } else {
            for (int64_t t = 0; t < n; ++t)
                for (int64_t d = 0; d < D; ++d) kt[d * ld + t] = krow[t][d];
            const int64_t n_pad = std::min<int64_t>(ld, (n + pf::kVec - 1) / pf::kVec * pf::kVec);
            for (int64_t t = n; t < n_pad; ++t)
                for (int64_t d = 0; d < D; ++d) kt[d * ld + t] = 0.0f;
        }
        for (int64_t r0 = 0; r0 < rows; r0 += pf::kRows) {
            const int64_t R = std::min<int64_t>(pf::kRows, rows - r0);
            const int64_t last = pos[r0 + R - 1];
            if (last < c0) continue;                                  // the chunk lies after every row
            if (a.window > 0 && pos[r0] - a.window + 1 >= c0 + n) continue;   // ... before every window
            // Scores up to the last key the group's last row sees (whole vectors).
            const int64_t width = std::min<int64_t>(n, last - c0 + 1);
            const int64_t nv = (width + pf::kVec - 1) / pf::kVec;
            const float* qg = qs + r0 * D;
            if constexpr (fast) {
                switch (R) {
                    case 4: if constexpr (pf::kRows >= 4) pf::group_scores_nv<4, kD>(int(nv), qg, kt, ld, p); break;
                    case 3: if constexpr (pf::kRows >= 3) pf::group_scores_nv<3, kD>(int(nv), qg, kt, ld, p); break;
                    case 2: pf::group_scores_nv<2, kD>(int(nv), qg, kt, ld, p); break;
                    default: pf::group_scores_nv<1, kD>(int(nv), qg, kt, ld, p); break;
                }
            } else {
                pf::group_scores_any(R, std::min(ld, nv * pf::kVec), D, qg, kt, ld, p);
            }
            // Online softmax per row over the chunk: keys [lo, hi) are visible to row r.
            float alpha[pf::kRows];
            int64_t lo[pf::kRows], hi[pf::kRows];
            int64_t g_lo = width, g_hi = 0;   // the keys any row of the group sees
            for (int64_t i = 0; i < R; ++i) {
                const int64_t r = r0 + i;
                hi[i] = std::min<int64_t>(n, pos[r] - c0 + 1);
                lo[i] = a.window > 0 ? std::max<int64_t>(0, pos[r] - a.window + 1 - c0) : 0;
                if (hi[i] <= lo[i]) continue;                         // sees nothing here
                g_lo = std::min(g_lo, lo[i]);
                g_hi = std::max(g_hi, hi[i]);
                if (a.soft_cap > 0.0f) soft_cap_scores(p + i * ld, lo[i], hi[i], a.soft_cap);
            }
            switch (R) {
                case 4: if constexpr (pf::kRows >= 4) pf::softmax_group<4>(p, ld, nv, lo, hi, m + r0, l + r0, alpha); break;
                case 3: if constexpr (pf::kRows >= 3) pf::softmax_group<3>(p, ld, nv, lo, hi, m + r0, l + r0, alpha); break;
                case 2: pf::softmax_group<2>(p, ld, nv, lo, hi, m + r0, l + r0, alpha); break;
                default: pf::softmax_group<1>(p, ld, nv, lo, hi, m + r0, l + r0, alpha); break;
            }
            if (g_hi <= g_lo) continue;
            float* ag = acc + r0 * D;
            if constexpr (fast) {
                // p.v for as many rows at a time as their accumulators fit in registers.
                constexpr int step = std::max(1, std::min(pf::kRows, pf::kAcc / (kD / pf::kVec)));
                for (int64_t i = 0; i < R; i += step) {
                    const int64_t k = std::min<int64_t>(step, R - i);
                    float* ai = ag + i * D;
                    const float* pi = p + i * ld;
                    switch (k) {
                        case 4: if constexpr (step >= 4) pf::group_pv<4, kD>(ai, alpha + i, pi, ld, vrow, g_lo, g_hi); break;
                        case 3: if constexpr (step >= 3) pf::group_pv<3, kD>(ai, alpha + i, pi, ld, vrow, g_lo, g_hi); break;
                        case 2: if constexpr (step >= 2) pf::group_pv<2, kD>(ai, alpha + i, pi, ld, vrow, g_lo, g_hi); break;
                        default: pf::group_pv<1, kD>(ai, alpha + i, pi, ld, vrow, g_lo, g_hi); break;
                    }
                }
            } else {
                pf::group_pv_any(R, D, ag, alpha, p, ld, vrow, g_lo, g_hi);
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = qs0 + it.j0 + r / G, hq = it.head * G + r % G;
        float* dst = a.out + (t * a.num_heads + hq) * D;
        const float inv = 1.0f / l[r];
        const float* ar = acc + r * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = ar[d] * inv;
    }
}

// A decode (one query token): one item covers all heads of the sequence, so every cache
// block is read front to back once (block_size x Hkv x D contiguous floats), and q.k is a
// dot product over D (a transpose would cost more than the G rows that reuse it).
template <int kBS, int kD>
void attend_decode(const Args& a, const Item& it, Scratch& sc) {
    const int64_t BS = kBS ? kBS : a.BS, D = kD ? kD : a.D, G = a.G, row = a.row;
    const int64_t rows = a.num_heads;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int32_t t_out = a.query_start_loc[it.seq];
    const int64_t num_keys = a.seq_lens[it.seq];
    const int32_t* table = a.block_tables + it.seq * a.bt_stride;
    float* __restrict qs = sc.qs.data();
    float* __restrict acc = sc.acc.data();
    float* __restrict s = sc.s.data();
    float* m = sc.m.data();
    float* l = sc.l.data();
    const float* src = a.q + t_out * a.q_stride;
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t d = 0; d < D; ++d) qs[r * D + d] = src[r * D + d] * a.scale;
        m[r] = neg_inf;
        l[r] = 0.0f;
    }
    std::fill(acc, acc + rows * D, 0.0f);
    // With a window only the last W keys count: start at the block holding the first one.
    const int64_t first_key = a.window > 0 ? std::max<int64_t>(0, num_keys - a.window) : 0;
    for (int64_t b0 = first_key / BS * BS; b0 < num_keys; b0 += BS) {
        const int64_t n = std::min<int64_t>(BS, num_keys - b0);
        const int64_t lo = std::max<int64_t>(0, first_key - b0);   // keys before lo: outside the window
        const float* kb = a.k_cache + int64_t(table[b0 / BS]) * BS * row;
        const float* vb = a.v_cache + int64_t(table[b0 / BS]) * BS * row;
        if (b0 + BS < num_keys) {                  // the next block sits elsewhere: fetch ahead
            const char* nk = reinterpret_cast<const char*>(a.k_cache + int64_t(table[b0 / BS + 1]) * BS * row);
            const char* nv = reinterpret_cast<const char*>(a.v_cache + int64_t(table[b0 / BS + 1]) * BS * row);
            for (int64_t off = 0; off < BS * row * int64_t(sizeof(float)); off += 64) {
                __builtin_prefetch(nk + off);
                __builtin_prefetch(nv + off);
            }
        }
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t h = r / G;
            const float* qr = qs + r * D;
            float* sr = s + r * BS;
            for (int64_t t = lo; t < n; ++t) {
                const float* kr = kb + t * row + h * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
                sr[t] = dot;
            }
            if (a.soft_cap > 0.0f) soft_cap_scores(sr, lo, n, a.soft_cap);
            for (int64_t t = 0; t < lo; ++t) sr[t] = neg_inf;
            for (int64_t t = n; t < BS; ++t) sr[t] = neg_inf;
            float* ar = acc + r * D;
            online_softmax_block(sr, BS, m[r], l[r], ar, D);
            pv_accumulate<kD>(ar, sr + lo, vb + lo * row + h * D, row, n - lo, D);
        }
    }
    float* dst = a.out + t_out * a.num_heads * D;
    for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; ++d) dst[r * D + d] = acc[r * D + d] * inv;
    }
}

// ---------------------------------------------------------------------------------------
// Vectorized decode (block size and head size multiples of the vector width, the common
// shapes): GCC vector extensions, so the same source builds zmm code on AVX-512 and ymm
// code elsewhere.
#if defined(__AVX512F__)
constexpr int kW = 16;
#else
constexpr int kW = 8;
#endif
typedef float vf __attribute__((vector_size(kW * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kW * sizeof(int32_t))));

inline vf loadu(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void storeu(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// One level of the horizontal-sum tree: x and y each hold keys in chunks of c lanes; the
// result holds twice the keys in chunks of c / 2 (x's chunk i folded into lanes
// [i*c, i*c + c/2), y's into [i*c + c/2, (i+1)*c)).
template <int c>
inline vf fold_pair(vf x, vf y) {
    vi lo, hi;
    for (int L = 0; L < kW; ++L) {
        lo[L] = L % c < c / 2 ? L : kW + L - c / 2;
        hi[L] = lo[L] + c / 2;
    }
    return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

// r[t] = sum of the lanes of x[t], t < kW: the dot products of kW keys from their
// lane-wise partial sums, with kW - 1 shuffle pairs instead of a reduction per key. Pairing
// t with t + half at each level leaves key t in lane t at the end.
inline vf hsum_keys(vf* x) {
    for (int t = 0; t < kW / 2; ++t) x[t] = fold_pair<kW>(x[t], x[t + kW / 2]);
    for (int t = 0; t < kW / 4; ++t) x[t] = fold_pair<kW / 2>(x[t], x[t + kW / 4]);
    for (int t = 0; t < kW / 8; ++t) x[t] = fold_pair<kW / 4>(x[t], x[t + kW / 8]);
    if constexpr (kW == 16) x[0] = fold_pair<2>(x[0], x[1]);
    return x[0];
}

// exp_poly over a vector (the same steps, so the same results lane by lane); rounding to
// the nearest integer by adding and subtracting 1.5 * 2^23 (|v * log2 e| < 128 here; this
// relies on no -ffast-math, which could fold the pair away).
inline vf exp_vec(vf v) {
    const vf lo = v < -87.3f ? vf{} + 1.0f : vf{};   // lanes that underflow (-inf included)
    v = v < -87.3f ? vf{} - 87.3f : v;
    v = v > 88.3f ? vf{} + 88.3f : v;
    const vf k = (v * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    vf r = v - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    vf p = vf{} + 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    const vi bits = (__builtin_convertvector(k, vi) + 127) << 23;
    return lo != 0.0f ? vf{} : p * (vf)bits;   // a vector cast reinterprets the bits
}

// x with its lanes rotated by `by` (the steps of a reduction tree).
template <int by>
inline vf rotate(vf x) {
    vi idx;
    for (int L = 0; L < kW; ++L) idx[L] = (L + by) % kW;
    return __builtin_shuffle(x, idx);
}

inline float hmax(vf x) {
    if constexpr (kW == 16) x = x > rotate<8>(x) ? x : rotate<8>(x);
    x = x > rotate<4>(x) ? x : rotate<4>(x);
    x = x > rotate<2>(x) ? x : rotate<2>(x);
    x = x > rotate<1>(x) ? x : rotate<1>(x);
    return x[0];
}

inline float hsum(vf x) {   // a tree, not a chain of kW dependent adds
    if constexpr (kW == 16) x += rotate<8>(x);
    x += rotate<4>(x);
    x += rotate<2>(x);
    x += rotate<1>(x);
    return x[0];
}

// p.v for NR query rows of one kv head over keys [lo, n) of a block: each value row is
// loaded once for the NR rows (NR x NV accumulators in registers), what the rows
// accumulated so far is first rescaled by their alpha.
template <int NR, int NV>
inline void pv_rows(float* __restrict acc, const float* __restrict p, int64_t pstride, const float* alpha,
                    const float* __restrict vh, int64_t row, int64_t lo, int64_t n) {
    vf a[NR][NV];
    for (int i = 0; i < NR; ++i)
        for (int j = 0; j < NV; ++j) a[i][j] = loadu(acc + (i * NV + j) * kW) * alpha[i];
    for (int64_t t = lo; t < n; ++t) {
        const float* vt = vh + t * row;
        vf v[NV];
        for (int j = 0; j < NV; ++j) v[j] = loadu(vt + j * kW);
        for (int i = 0; i < NR; ++i) {
            const float pt = p[i * pstride + t];
            for (int j = 0; j < NV; ++j) a[i][j] += pt * v[j];
        }
    }
    for (int i = 0; i < NR; ++i)
        for (int j = 0; j < NV; ++j) storeu(acc + (i * NV + j) * kW, a[i][j]);
}

// attend_decode for kBS % kW == 0 and kD % kW == 0. Per block and kv head: the G query
// rows' q.k for each key as a lane-wise product over D (a vector, no reduction per key),
// with the key's value row prefetched alongside so K and V stream together; then per row
// one horizontal-sum tree turns kW such vectors into kW scores, and the online softmax
// runs on vectors; p.v loads each value row once for up to 16 / NV rows at a time.
template <int kBS, int kD>
void attend_decode_vec(const Args& a, const Item& it, Scratch& sc) {
    static_assert(kBS % kW == 0 && kD % kW == 0, "vector shapes");
    constexpr int NV = kD / kW, NB = kBS / kW;
    constexpr int kRows = NV >= 16 ? 1 : 16 / NV;   // p.v rows per pass (accumulators <= 16 vectors: 4 or 2)
    const int64_t G = a.G, row = a.row, H = a.num_heads / a.G, rows = a.num_heads;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int32_t t_out = a.query_start_loc[it.seq];
    const int64_t num_keys = a.seq_lens[it.seq];
    const int32_t* table = a.block_tables + it.seq * a.bt_stride;
    float* __restrict qs = sc.qs.data();
    float* __restrict acc = sc.acc.data();
    float* __restrict xs = sc.xs.get();
    float* __restrict ps = sc.s.data();      // [g][key] probabilities of the block
    float* m = sc.m.data();
    float* l = sc.l.data();
    float* alpha = sc.alpha.data();
    const float* src = a.q + t_out * a.q_stride;
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t d = 0; d < kD; ++d) qs[r * kD + d] = src[r * kD + d] * a.scale;
        m[r] = neg_inf;
        l[r] = 0.0f;
    }
    std::fill(acc, acc + rows * kD, 0.0f);
    vi iota;
    for (int L = 0; L < kW; ++L) iota[L] = L;
    const int64_t first_key = a.window > 0 ? std::max<int64_t>(0, num_keys - a.window) : 0;
    // The item's key blocks (a split decode's share of them); first_key's block or later.
    const int64_t end = std::min<int64_t>(num_keys, int64_t(it.j1) * kBS);
    for (int64_t b0 = int64_t(it.j0) * kBS; b0 < end; b0 += kBS) {
        const int64_t n = std::min<int64_t>(kBS, num_keys - b0);
        const int64_t lo = std::max<int64_t>(0, first_key - b0);   // keys before lo: outside the window
        const float* kb = a.k_cache + int64_t(table[b0 / kBS]) * kBS * row;
        const float* vb = a.v_cache + int64_t(table[b0 / kBS]) * kBS * row;
        for (int64_t h = 0; h < H; ++h) {
            const float* kh = kb + h * kD;
            const float* vh = vb + h * kD;
            // 1. Lane-wise q.k of the group's rows for every key of the block.
            for (int64_t t = lo; t < n; ++t) {
                const float* kt = kh + t * row;
                for (int j = 0; j < kD; j += 16) __builtin_prefetch(vh + t * row + j);
                vf kv[NV];
                for (int j = 0; j < NV; ++j) kv[j] = loadu(kt + j * kW);
                for (int64_t g = 0; g < G; ++g) {
                    const float* qr = qs + (h * G + g) * kD;
                    vf y = loadu(qr) * kv[0];
                    for (int j = 1; j < NV; ++j) y += loadu(qr + j * kW) * kv[j];
                    storeu(xs + (g * kBS + t) * kW, y);
                }
            }
            // 2. Per row: the block's scores, masked, soft-capped, into the online softmax.
            for (int64_t g = 0; g < G; ++g) {
                const int64_t r = h * G + g;
                vf sv[NB];
                for (int c = 0; c < NB; ++c) {
                    vf x[kW];
                    for (int t = 0; t < kW; ++t) {   // keys outside [lo, n) were not computed
                        const int64_t key = c * kW + t;
                        x[t] = key >= lo && key < n ? loadu(xs + (g * kBS + key) * kW) : vf{};
                    }
                    sv[c] = hsum_keys(x);
                }
                float mx = m[r];
                for (int c = 0; c < NB; ++c) {
                    const vi key = iota + c * kW;
                    if (a.soft_cap > 0.0f)   // c * tanh(s / c) = c * (1 - 2 / (exp(2 s / c) + 1))
                        sv[c] = a.soft_cap * (1.0f - 2.0f / (exp_vec(sv[c] * (2.0f / a.soft_cap)) + 1.0f));
                    sv[c] = key >= int(lo) && key < int(n) ? sv[c] : vf{} + neg_inf;
                    mx = std::max(mx, hmax(sv[c]));
                }
                // alpha rescales what the row accumulated so far to the new running max.
                alpha[g] = mx == m[r] ? 1.0f : m[r] == neg_inf ? 0.0f : std::exp(m[r] - mx);
                float sum = 0.0f;
                for (int c = 0; c < NB; ++c) {
                    const vf p = exp_vec(sv[c] - mx);
                    sum += hsum(p);
                    storeu(ps + g * kBS + c * kW, p);
                }
                l[r] = l[r] * alpha[g] + sum;
                m[r] = mx;
            }
            // 3. p.v, kRows rows at a time.
            float* ah = acc + h * G * kD;
            for (int64_t g = 0; g < G;) {
                const int64_t nr = std::min<int64_t>(kRows, G - g);
                float* ag = ah + g * kD;
                const float* pg = ps + g * kBS;
                if (nr >= 4 && kRows >= 4) pv_rows<kRows >= 4 ? 4 : 1, NV>(ag, pg, kBS, alpha + g, vh, row, lo, n);
                else if (nr == 3) pv_rows<kRows >= 3 ? 3 : 1, NV>(ag, pg, kBS, alpha + g, vh, row, lo, n);
                else if (nr == 2) pv_rows<kRows >= 2 ? 2 : 1, NV>(ag, pg, kBS, alpha + g, vh, row, lo, n);
                else pv_rows<1, NV>(ag, pg, kBS, alpha + g, vh, row, lo, n);
                g += nr >= 4 && kRows >= 4 ? 4 : nr == 3 ? 3 : nr == 2 ? 2 : 1;
            }
        }
    }
    if (it.part >= 0) {   // a share of a split decode: the combine step normalizes
        float* ml = a.part_ml + int64_t(it.part) * 2 * rows;
        std::copy(m, m + rows, ml);
        std::copy(l, l + rows, ml + rows);
        std::copy(acc, acc + rows * kD, a.part_acc + int64_t(it.part) * rows * kD);
        return;
    }
    float* dst = a.out + t_out * rows * kD;
    for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < kD; ++d) dst[r * kD + d] = acc[r * kD + d] * inv;
    }
}

// The vectorized decode's shapes (also the ones a decode may be split for).
inline bool decode_vec_shape(int64_t BS, int64_t D) {
    return (BS == 16 && (D == 32 || D == 64 || D == 128)) || (BS == 32 && (D == 64 || D == 128));
}

struct Split {
    int seq, part0, parts;   // a decode split into parts [part0, part0 + parts)
};

// Flash-decoding's combine: the parts' softmax states rescaled to their common max.
void combine_split(const Split& sp, const int32_t* query_start_loc, int64_t rows, int64_t D, const float* part_ml,
                   const float* part_acc, float* out) {
    float* dst = out + int64_t(query_start_loc[sp.seq]) * rows * D;
    for (int64_t r = 0; r < rows; ++r) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int p = 0; p < sp.parts; ++p) mx = std::max(mx, part_ml[int64_t(sp.part0 + p) * 2 * rows + r]);
        float* o = dst + r * D;
        std::fill(o, o + D, 0.0f);
        float sum = 0.0f;
        for (int p = 0; p < sp.parts; ++p) {
            const float* ml = part_ml + int64_t(sp.part0 + p) * 2 * rows;
            const float w = std::exp(ml[r] - mx);
            sum += w * ml[rows + r];
            const float* ar = part_acc + (int64_t(sp.part0 + p) * rows + r) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] += w * ar[d];
        }
        const float inv = 1.0f / sum;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
}

}  // namespace

extern "C" {

int twinserve_paged_attention_abi_version() { return 2; }

// Returns 0 on success, a negative code for an argument the kernel cannot handle.
int twinserve_paged_attention_f32(
    const float* q, int64_t q_stride,
    const float* k, int64_t k_stride, const float* v, int64_t v_stride,
    float* k_cache, float* v_cache, const int64_t* slot_mapping, int64_t num_tokens,
    const int32_t* block_tables, int64_t bt_stride,
    const int32_t* query_start_loc, const int32_t* seq_lens, int64_t num_seqs,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
    float scale, int64_t window, float soft_cap, int64_t tile, float* out) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || block_size <= 0 || tile <= 0)
        return -1;
    if (window < 0 || !(soft_cap >= 0.0f) || std::isinf(soft_cap)) return -5;
    const int64_t H = num_kv_heads, D = head_dim, G = num_heads / num_kv_heads, BS = block_size;
    const int64_t row = H * D;   // floats per token in a cache block

    // Validate everything that addresses memory before touching it (serial; O(T + blocks)).
    for (int64_t t = 0; t < num_tokens; ++t)
        if (slot_mapping[t] >= num_blocks * BS) return -2;
    if (query_start_loc[0] != 0 || query_start_loc[num_seqs] > num_tokens) return -3;
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int q_len = query_start_loc[i + 1] - query_start_loc[i];
        if (q_len < 0) return -3;
        if (q_len == 0 || seq_lens[i] < q_len) continue;   // padding: nothing is read
        const int64_t used = (seq_lens[i] + BS - 1) / BS;
        if (used > bt_stride) return -4;
        for (int64_t b = 0; b < used; ++b)
            if (block_tables[i * bt_stride + b] < 0 || block_tables[i * bt_stride + b] >= num_blocks) return -4;
    }

    // 1. Scatter the new K/V rows into the cache (each token's Hkv x D floats are contiguous).
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        std::memcpy(k_cache + slot * row, k + t * k_stride, row * sizeof(float));
        std::memcpy(v_cache + slot * row, v + t * v_stride, row * sizeof(float));
    }

    // Rows after the last sequence's (padding tokens of no sequence) are zeros.
    if (query_start_loc[num_seqs] < num_tokens)
        std::memset(out + int64_t(query_start_loc[num_seqs]) * num_heads * D, 0,
                    (num_tokens - query_start_loc[num_seqs]) * num_heads * D * sizeof(float));

    // 2. Work items, costliest first (long prefills) so the dynamic schedule balances.
    std::vector<Item> items;
    items.reserve(num_seqs * H);
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int q_len = query_start_loc[i + 1] - query_start_loc[i];
        const int seq_len = seq_lens[i];
        if (q_len <= 0) continue;
        if (seq_len < q_len) {   // padding row (seq_len 0) or inconsistent metadata: zeros
            for (int j = 0; j < q_len; ++j)
                std::memset(out + (query_start_loc[i] + j) * num_heads * D, 0, num_heads * D * sizeof(float));
            continue;
        }
        if (q_len == 1) {
            const int64_t keys = window > 0 ? std::min<int64_t>(seq_len, window) : seq_len;
            const int64_t first = seq_len - keys;   // the first key in the window
            items.push_back({int(i), -1, int(first / BS), int((seq_len + BS - 1) / BS), keys * num_heads});
            continue;
        }
        for (int j0 = 0; j0 < q_len; j0 += tile) {
            const int j1 = std::min<int>(q_len, j0 + tile);
            const int64_t first = window > 0 ? std::max<int64_t>(0, seq_len - q_len + j0 - window + 1) : 0;
            const int64_t cost = (seq_len - q_len + j1 - first) * (j1 - j0) * G;
            for (int h = 0; h < H; ++h) items.push_back({int(i), h, j0, j1, cost});
        }
    }
    // Split-K (flash-decoding): with fewer work items than about twice the threads, long
    // decodes are cut into runs of key blocks computed in parallel, then combined.
    std::vector<Split> splits;
    int num_parts = 0;
    const int64_t nthreads = omp_get_max_threads();
    if (nthreads > 1 && int64_t(items.size()) < 2 * nthreads && decode_vec_shape(BS, D)) {
        constexpr int kMinBlocksPerPart = 4;
        const int64_t want = (2 * nthreads + int64_t(items.size()) - 1) / int64_t(items.size());
        std::vector<Item> split_items;
        for (const Item& it : items) {
            const int blocks = it.j1 - it.j0;
            const int parts = it.head >= 0 ? 1 : int(std::min<int64_t>(want, blocks / kMinBlocksPerPart));
            if (parts < 2) {
                split_items.push_back(it);
                continue;
            }
            splits.push_back({it.seq, num_parts, parts});
            for (int p = 0; p < parts; ++p) {
                const int b_lo = it.j0 + int(int64_t(blocks) * p / parts);
                const int b_hi = it.j0 + int(int64_t(blocks) * (p + 1) / parts);
                split_items.push_back({it.seq, -1, b_lo, b_hi, it.cost * (b_hi - b_lo) / blocks, num_parts + p});
            }
            num_parts += parts;
        }
        items.swap(split_items);
    }
    std::vector<float> part_ml(int64_t(num_parts) * 2 * num_heads), part_acc(int64_t(num_parts) * num_heads * D);

    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
    const int64_t num_items = static_cast<int64_t>(items.size());
    const int64_t num_splits = static_cast<int64_t>(splits.size());

#pragma omp parallel
    {
        Scratch sc(std::max(tile * G, num_heads), D, BS, G);
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < num_items; ++w) {
            const Args a{q, q_stride, k_cache, v_cache, block_tables, bt_stride, query_start_loc, seq_lens,
                         num_heads, G, D, BS, row, scale, window, soft_cap, out, part_ml.data(), part_acc.data()};
            if (items[w].head < 0) {
                if (BS == 16 && D == 32) attend_decode_vec<16, 32>(a, items[w], sc);
                else if (BS == 16 && D == 64) attend_decode_vec<16, 64>(a, items[w], sc);
                else if (BS == 16 && D == 128) attend_decode_vec<16, 128>(a, items[w], sc);
                else if (BS == 32 && D == 64) attend_decode_vec<32, 64>(a, items[w], sc);
                else if (BS == 32 && D == 128) attend_decode_vec<32, 128>(a, items[w], sc);
                else attend_decode<0, 0>(a, items[w], sc);   // other shapes: never split
            } else if (BS == 16 && D == 64) attend<16, 64>(a, items[w], sc);
            else if (BS == 16 && D == 128) attend<16, 128>(a, items[w], sc);
            else if (BS == 32 && D == 64) attend<32, 64>(a, items[w], sc);
            else attend<0, 0>(a, items[w], sc);
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_splits; ++i)
            combine_split(splits[i], query_start_loc, num_heads, D, part_ml.data(), part_acc.data(), out);
    }
    return 0;
}

}  // extern "C"
