// Fused elementwise ops of the Llama-family decoder layers on the CPU (fp32): RMSNorm,
// residual add + RMSNorm, SiLU(gate) * up, and rotate-half rotary embedding of q and k in
// one call; and the greedy sampler's argmax over each row of logits. Plain C ABI (no torch
// headers), loaded with ctypes by realexec/models/cpu_ops.py, whose torch code is the
// oracle. The norm and rotary loops are simple enough for GCC's -O3 -march=native
// auto-vectorizer (checked with -fopt-info-vec; the sum of squares keeps 16 partial sums so
// it vectorizes without -ffast-math); SiLU runs on GCC vector types (its clamps otherwise
// became masked branches with three divisions); rows are spread over OpenMP threads
// (libgomp: torch's pool) only when a call has enough work
// (`twinserve_cpu_ops_set_parallel_min`), as waking the pool costs more than a small call's
// work.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// Elements a call needs before it goes parallel: ATen's grain size. On the shared 2-core box
// 2 threads beat 1 from 64 rows x 576 (norm 10.6 vs 13.8 us), and lose badly whenever the
// second core is taken by another process, so small calls stay on one thread.
int64_t parallel_min = 32768;

inline float inv_rms(const float* __restrict x, int64_t dim, float eps) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16)
        for (int j = 0; j < 16; ++j) acc[j] += x[i + j] * x[i + j];
    float s = 0.f;
    for (; i < dim; ++i) s += x[i] * x[i];
    float t = 0.f;
    for (int j = 0; j < 16; ++j) t += acc[j];
    s += t;
    return 1.0f / std::sqrt(s / (float)dim + eps);
}

// 16 floats as one GCC vector (one AVX-512 register; split by the compiler on narrower ISAs:
// only lane-wise arithmetic here, no shuffles).
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

// exp(x): Cody-Waite range reduction + degree-6 polynomial (Cephes expf coefficients),
// about 1 ulp; inputs clamped to [-87.3, 88.4] (no inf/denormal results).
inline vf16 vexp(vf16 x) {
    const vf16 hi = vf16{} + 88.3762626647949f, lo = vf16{} - 87.3365447504f;
    x = x < hi ? x : hi;
    x = x > lo ? x : lo;
    const vf16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   // round to nearest
    vf16 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf16 p = r * 1.9875691500E-4f + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    const vi16 e = (__builtin_convertvector(n, vi16) + 127) << 23;
    return p * (vf16)e;
}

// o = w * (x * rsqrt(mean(x^2) + eps)) for one row.
inline void norm_row(const float* __restrict x, const float* __restrict w, float* __restrict o, int64_t dim,
                     float eps) {
    const float s = inv_rms(x, dim, eps);
    for (int64_t i = 0; i < dim; ++i) o[i] = w[i] * (x[i] * s);
}

inline float silu_mul(float x, float u) { return x / (1.0f + std::exp(-x)) * u; }

}  // namespace

extern "C" {

int twinserve_cpu_ops_abi_version() { return 2; }

void twinserve_cpu_ops_set_parallel_min(int64_t elements) { parallel_min = elements; }

// out[r] = w * (x[r] * rsqrt(mean(x[r]^2) + eps)); x rows at x_stride floats, out contiguous.
void twinserve_rms_norm_f32(const float* x, int64_t x_stride, const float* w, float* out,
                            int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows > 1 && rows * dim >= parallel_min)
    for (int64_t r = 0; r < rows; ++r) norm_row(x + r * x_stride, w, out + r * dim, dim, eps);
}

// h_out = h + delta; normed = w * (h_out * rsqrt(mean(h_out^2) + eps)); all contiguous rows of dim.
void twinserve_add_rms_norm_f32(const float* h, const float* delta, float* h_out, const float* w,
                                float* normed, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows > 1 && rows * dim >= parallel_min)
    for (int64_t r = 0; r < rows; ++r) {
        const float* __restrict hr = h + r * dim;
        const float* __restrict dr = delta + r * dim;
        float* __restrict ho = h_out + r * dim;
        for (int64_t i = 0; i < dim; ++i) ho[i] = hr[i] + dr[i];
        norm_row(ho, w, normed + r * dim, dim, eps);
    }
}

// out[r, j] = silu(g[r, j]) * g[r, width + j], rows of g at g_stride floats, out contiguous [rows, width].
void twinserve_silu_and_mul_f32(const float* g, int64_t g_stride, float* out, int64_t rows, int64_t width) {
#pragma omp parallel for if (rows > 1 && rows * width >= parallel_min)
    for (int64_t r = 0; r < rows; ++r) {
        const float* __restrict gate = g + r * g_stride;
        const float* __restrict up = g + r * g_stride + width;
        float* __restrict o = out + r * width;
        int64_t j = 0;
        for (; j + 16 <= width; j += 16) {
            vf16 x, u;
            std::memcpy(&x, gate + j, sizeof x);
            std::memcpy(&u, up + j, sizeof u);
            const vf16 y = x / (1.0f + vexp(-x)) * u;
            std::memcpy(o + j, &y, sizeof y);
        }
        for (; j < width; ++j) o[j] = silu_mul(gate[j], up[j]);
    }
}

// Rotate-half rotary embedding (HF Llama, full rotary): for each token t and head,
// o[:h] = x[:h] cos - x[h:] sin, o[h:] = x[h:] cos + x[:h] sin (h = dim / 2), cos/sin rows of
// h floats at cs_stride per token. q: [T, hq, dim] at q_stride per token (heads contiguous),
// k likewise; outputs contiguous [T, hq, dim] and [T, hk, dim].
void twinserve_rotary_qk_f32(const float* q, int64_t q_stride, const float* k, int64_t k_stride,
                             const float* cos, const float* sin, int64_t cs_stride,
                             float* q_out, float* k_out, int64_t tokens, int64_t hq, int64_t hk, int64_t dim) {
    const int64_t half = dim / 2;
#pragma omp parallel for if (tokens > 1 && tokens * (hq + hk) * dim >= parallel_min)
    for (int64_t t = 0; t < tokens; ++t) {
        const float* __restrict c = cos + t * cs_stride;
        const float* __restrict s = sin + t * cs_stride;
        for (int64_t h = 0; h < hq + hk; ++h) {
            const float* __restrict x = h < hq ? q + t * q_stride + h * dim : k + t * k_stride + (h - hq) * dim;
            float* __restrict o = h < hq ? q_out + (t * hq + h) * dim : k_out + (t * hk + h - hq) * dim;
            for (int64_t i = 0; i < half; ++i) {
                o[i] = x[i] * c[i] - x[half + i] * s[i];
                o[half + i] = x[half + i] * c[i] + x[i] * s[i];
            }
        }
    }
}

// out[r] = the index of row r's largest value, the first one among equals; a row holding NaN
// gives its first NaN (torch.argmax's answer). Rows of x at x_stride floats. Two passes: a
// vectorized max (16 lanes, NaN-blind: a comparison with NaN is false), then a scan for the
// first lane equal to it, which stops early and finds the row still in L1/L2. torch's argmax
// tracks an index per element: 3.4x slower than this on a [64, 49152] greedy step (2.8 against
// 0.8 ms, 2 threads, the Emerald Rapids dev host).
void twinserve_argmax_rows_f32(const float* x, int64_t x_stride, int64_t* out, int64_t rows, int64_t cols) {
#pragma omp parallel for if (rows > 1 && rows * cols >= parallel_min)
    for (int64_t r = 0; r < rows; ++r) {
        const float* __restrict xr = x + r * x_stride;
        vf16 mx = vf16{} - __builtin_inff(), nan = vf16{};
        int64_t j = 0;
        for (; j + 16 <= cols; j += 16) {
            vf16 v;
            std::memcpy(&v, xr + j, sizeof v);
            mx = v > mx ? v : mx;
            nan = v != v ? vf16{} + 1.0f : nan;
        }
        float m = -__builtin_inff();
        bool has_nan = false;
        for (int L = 0; L < 16; ++L) {
            m = mx[L] > m ? mx[L] : m;
            has_nan |= nan[L] != 0.0f;
        }
        for (; j < cols; ++j) {
            m = xr[j] > m ? xr[j] : m;
            has_nan |= xr[j] != xr[j];
        }
        int64_t best = 0;
        for (int64_t i = 0; i < cols; ++i)
            if (has_nan ? xr[i] != xr[i] : xr[i] == m) {
                best = i;
                break;
            }
        out[r] = best;
    }
}

}  // extern "C"
