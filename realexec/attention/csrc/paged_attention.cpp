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
// Work item = (sequence, kv head, tile of up to `tile` query tokens): the tile's rows are
// its tokens x the query heads sharing the kv head (GQA without copying K/V). Keys are
// visited block by block (no gather): a block's keys are transposed into a [D][block_size]
// scratch so q.k vectorizes over keys, then an online softmax (running max m, sum l)
// accumulates p.v over D.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

namespace {

// exp(x) for a vector of floats, vectorizable (Cephes expf: range reduction by ln2, degree-6
// polynomial; max relative error ~2e-7). x < -87.3 (including -inf) gives exactly 0.
inline void exp_inplace(float* __restrict x, int n) {
#pragma omp simd
    for (int i = 0; i < n; ++i) {
        float v = x[i];
        const bool under = v < -87.3f;
        v = std::min(std::max(v, -87.3f), 88.3f);
        const float k = std::floor(v * 1.44269504088896341f + 0.5f);
        float r = v - k * 0.693359375f;
        r = r - k * -2.12194440e-4f;
        float p = 1.9875691500E-4f;
        p = p * r + 1.3981999507E-3f;
        p = p * r + 8.3334519073E-3f;
        p = p * r + 4.1665795894E-2f;
        p = p * r + 1.6666665459E-1f;
        p = p * r + 5.0000001201E-1f;
        p = p * r * r + r + 1.0f;
        const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
        float scale;
        std::memcpy(&scale, &bits, sizeof scale);
        x[i] = under ? 0.0f : p * scale;
    }
}

struct Item {
    int seq, head, j0, j1;   // sequence, kv head, query tokens [j0, j1) of the sequence
    int64_t cost;            // keys x rows, for ordering the dynamic schedule
};

}  // namespace

extern "C" {

int twinserve_paged_attention_abi_version() { return 1; }

// Returns 0 on success, a negative code for an argument the kernel cannot handle.
int twinserve_paged_attention_f32(
    const float* q, int64_t q_stride,
    const float* k, int64_t k_stride, const float* v, int64_t v_stride,
    float* k_cache, float* v_cache, const int64_t* slot_mapping, int64_t num_tokens,
    const int32_t* block_tables, int64_t bt_stride,
    const int32_t* query_start_loc, const int32_t* seq_lens, int64_t num_seqs,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
    float scale, int64_t tile, float* out) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || block_size <= 0 || tile <= 0)
        return -1;
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
        for (int j0 = 0; j0 < q_len; j0 += tile) {
            const int j1 = std::min<int>(q_len, j0 + tile);
            const int64_t cost = int64_t(seq_len - q_len + j1) * (j1 - j0) * G;
            for (int h = 0; h < H; ++h) items.push_back({int(i), h, j0, j1, cost});
        }
    }
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
    const int64_t num_items = static_cast<int64_t>(items.size());
    const float neg_inf = -std::numeric_limits<float>::infinity();

#pragma omp parallel
    {
        const int64_t max_rows = tile * G;
        std::vector<float> qs(max_rows * D), acc(max_rows * D), kt(D * BS), s(max_rows * BS);
        std::vector<float> m(max_rows), l(max_rows);
        std::vector<int> pos(max_rows);
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < num_items; ++w) {
            const Item it = items[w];
            const int32_t qs0 = query_start_loc[it.seq];
            const int q_len = query_start_loc[it.seq + 1] - qs0;
            const int ctx = seq_lens[it.seq] - q_len;
            const int32_t* table = block_tables + it.seq * bt_stride;
            const int64_t rows = int64_t(it.j1 - it.j0) * G;
            // Row r = (token j0 + r / G, query head head * G + r % G), pre-scaled.
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t t = qs0 + it.j0 + r / G, hq = it.head * G + r % G;
                const float* src = q + t * q_stride + hq * D;
                float* dst = qs.data() + r * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
                pos[r] = ctx + it.j0 + int(r / G);
                m[r] = neg_inf;
                l[r] = 0.0f;
            }
            std::fill(acc.begin(), acc.begin() + rows * D, 0.0f);
            const int64_t num_keys = ctx + it.j1;   // the tile's last query sees keys [0, num_keys)
            for (int64_t b0 = 0; b0 < num_keys; b0 += BS) {
                const int64_t n = std::min<int64_t>(BS, num_keys - b0);
                const int64_t base = int64_t(table[b0 / BS]) * BS * row + it.head * D;
                for (int64_t t = 0; t < n; ++t) {        // kt[d][t] = K[b0 + t][d]
                    const float* kr = k_cache + base + t * row;
                    for (int64_t d = 0; d < D; ++d) kt[d * BS + t] = kr[d];
                }
                for (int64_t r = 0; r < rows; ++r) {
                    float* sr = s.data() + r * BS;
                    const float* qr = qs.data() + r * D;
                    std::fill(sr, sr + n, 0.0f);
                    for (int64_t d = 0; d < D; ++d) {
                        const float qd = qr[d];
                        const float* kd = kt.data() + d * BS;
#pragma omp simd
                        for (int64_t t = 0; t < n; ++t) sr[t] += qd * kd[t];
                    }
                    const int64_t visible = std::min<int64_t>(n, pos[r] - b0 + 1);   // causal
                    if (visible <= 0) continue;          // the whole block lies after this query
                    float mx = m[r];
                    for (int64_t t = 0; t < visible; ++t) mx = std::max(mx, sr[t]);
                    for (int64_t t = 0; t < visible; ++t) sr[t] -= mx;
                    exp_inplace(sr, int(visible));
                    float sum = 0.0f;
                    for (int64_t t = 0; t < visible; ++t) sum += sr[t];
                    float* ar = acc.data() + r * D;
                    if (mx != m[r]) {                    // rescale what was accumulated so far
                        const float alpha = m[r] == neg_inf ? 0.0f : std::exp(m[r] - mx);
                        l[r] *= alpha;
#pragma omp simd
                        for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
                        m[r] = mx;
                    }
                    l[r] += sum;
                    for (int64_t t = 0; t < visible; ++t) {
                        const float p = sr[t];
                        const float* vr = v_cache + base + t * row;
#pragma omp simd
                        for (int64_t d = 0; d < D; ++d) ar[d] += p * vr[d];
                    }
                }
            }
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t t = qs0 + it.j0 + r / G, hq = it.head * G + r % G;
                float* dst = out + (t * num_heads + hq) * D;
                const float inv = 1.0f / l[r];
                const float* ar = acc.data() + r * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) dst[d] = ar[d] * inv;
            }
        }
    }
    return 0;
}

}  // extern "C"
