// attn_decode(q, kc, vc, scores, o, n, nkv, hd, scale): causal attention of one new token over the
// n cached positions, for query head h = blockIdx.x (GQA: KV head h / (heads / nkv)).
// q is [heads][hd]; kc and vc are [n][nkv][hd]; scores is scratch [heads][n].
// p = softmax(q.k_j * scale); o[h] = sum_j p_j v_j.
// Launch: grid = heads, block = 256 threads (a multiple of 32, >= hd is not required).
extern "C" __global__ void attn_decode(const float* __restrict__ q, const float* __restrict__ kc,
                                       const float* __restrict__ vc, float* __restrict__ scores,
                                       float* __restrict__ o, int n, int nkv, int hd, float scale) {
    pdl_enter();
    __shared__ float scratch[WARP];
    const int h = blockIdx.x, heads = gridDim.x;
    const int g = h / (heads / nkv);
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP, nw = blockDim.x / WARP;
    const float* qh = q + (size_t)h * hd;
    float* sc = scores + (size_t)h * n;
    // One warp per position.
    for (int j = wid; j < n; j += nw) {
        const float* kj = kc + ((size_t)j * nkv + g) * hd;
        float d = 0.0f;
        for (int i = lane; i < hd; i += WARP) d += qh[i] * kj[i];
        d = warp_sum(d);
        if (lane == 0) sc[j] = d * scale;
    }
    __syncthreads();
    float m = NEG_INF;
    for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, sc[j]);
    m = block_max(m, scratch);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float p = expf(sc[j] - m);
        sc[j] = p;
        sum += p;
    }
    sum = block_sum(sum, scratch);  // ends with a barrier-ordered read of every p
    __syncthreads();
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < n; ++j) acc += (sc[j] / sum) * vc[((size_t)j * nkv + g) * hd + i];
        o[(size_t)h * hd + i] = acc;
    }
}

// The device-resident model's attention: both work for any number of new tokens (the prompt or one
// decode step); the position of the first new token is device data (*pos), so a captured decode
// step replays at any position.
#define ATTN_MAX_HD 512
#define ATTN_PER_LANE (ATTN_MAX_HD / WARP)
#define ATTN_WARPS 4

// The KV cache's element type KV: f32, or f16 kept as its bits (u16: written rounded to nearest
// even, read exactly; half the bytes a position). The kernels that write or read the cache are
// templates on it, computing in f32 either way; the f16 entry points end in `_h`.
__device__ __forceinline__ float kv_ld(const float* p) { return *p; }
__device__ __forceinline__ float kv_ld(const u16* p) { return f16_to_f32(*p); }
__device__ __forceinline__ void kv_st(float* p, float v) { *p = v; }
__device__ __forceinline__ void kv_st(u16* p, float v) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    *p = h;
}
// The two halves of an f16x2 word to f32 (lo: the low half, the element of the lower index).
__device__ __forceinline__ void f16x2_to_f32(u32 w, float& lo, float& hi) {
    asm("{.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;}"
        : "=f"(lo), "=f"(hi)
        : "r"(w));
}

// rope_table(cs, positions, rope_dims, theta): cs[pos][i] = {cos, sin} of rope_neox_pairs' angle
// for pair i at pos, rounded to f32 exactly as it rounds them (the double sine, cosine and power
// cost attn_qk_prep ~5 us a call; the table turns them into one load). Launch: grid =
// (positions, ceil(rope_dims / 2 / 32)), block = 32.
extern "C" __global__ void rope_table(float2* __restrict__ cs, int positions, int rope_dims, double theta) {
    pdl_enter();
    const int half = rope_dims / 2, i = blockIdx.y * blockDim.x + threadIdx.x, pos = blockIdx.x;
    if (i >= half || pos >= positions) return;
    const double angle = rope_angle(i, pos, rope_dims, theta);
    cs[(size_t)pos * half + i] = make_float2((float)cos(angle), (float)sin(angle));
}

// rope_neox_pairs with the angles from rope_table's row of pos (cs = that row): the same bits.
__device__ __forceinline__ void rope_neox_pairs_cs(float* h, int rope_dims, const float2* __restrict__ cs, int first,
                                                   int step) {
    const int half = rope_dims / 2;
    for (int i = first; i < half; i += step) {
        const float2 r = cs[i];
        rope_rotate(h, i, half, r.x, r.y);
    }
}

// RoPE of one head in shared memory at pos, first pair `first`, pairs `step` apart: from the
// table when there is one (rope_cs: rope_table's rows), else computed.
__device__ __forceinline__ void rope_neox_any(float* h, int rope_dims, int pos, double theta,
                                              const float2* __restrict__ rope_cs, int first, int step) {
    if (rope_cs != nullptr) rope_neox_pairs_cs(h, rope_dims, rope_cs + (size_t)pos * (rope_dims / 2), first, step);
    else rope_neox_pairs(h, rope_dims, pos, theta, first, step);
}

// attn_qk_prep(qg, kn, vn, q, gate, kc, vc, q_norm, k_norm, pos, nh, nkv, hd, rope_dims, theta, eps,
// rope_cs): (rope_cs: rope_table's rows up to the last position, or null: the angles computed)
// token t = blockIdx.y at position *pos + t. Block x < nh takes query head x of the projection
// qg [t][nh][2][hd] ([query | gate] per head): QK-norm (RMSNorm with q_norm), RoPE, into q
// [t][nh][hd]; the gate half is copied to gate [t][nh][hd]. Block x >= nh takes KV head x - nh
// of kn, vn [t][nkv][hd]: K gets QK-norm (k_norm) and RoPE, and K and V are written to the caches
// kc, vc [ctx][nkv][hd] at the token's position. Launch: grid = (nh + nkv, tokens), block = any
// multiple of 32; hd <= ATTN_MAX_HD. attn_qk_prep_h: the caches in f16.
template <typename KV>
__device__ __forceinline__ void attn_qk_prep_body(const float* __restrict__ qg, const float* __restrict__ kn,
                                                  const float* __restrict__ vn, float* __restrict__ q,
                                                  float* __restrict__ gate, KV* __restrict__ kc, KV* __restrict__ vc,
                                                  const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                                                  const int* __restrict__ pos_ptr, int nh, int nkv, int hd,
                                                  int rope_dims, double theta, float eps,
                                                  const float2* __restrict__ rope_cs) {
    __shared__ float head[ATTN_MAX_HD];
    __shared__ float scratch[WARP];
    const int t = blockIdx.y;
    // The positions were uploaded before the step's first kernel: readable before the wait, as
    // are the norm weights and the RoPE row.
    const int pos = *pos_ptr + t;
    prefetch_l1_block((int)blockIdx.x < nh ? q_norm : k_norm, (size_t)hd * 4);
    if (rope_cs != nullptr) prefetch_l1_block(rope_cs + (size_t)pos * (rope_dims / 2), (size_t)rope_dims / 2 * 8);
    pdl_enter();
    const bool is_q = (int)blockIdx.x < nh;
    const float* src;
    const float* w;
    float* qdst = nullptr;  // a query head's row of q
    KV* kdst = nullptr;     // else the KV head's row of the K cache
    if (is_q) {
        const size_t hh = (size_t)t * nh + blockIdx.x;
        src = qg + hh * 2 * hd;
        w = q_norm;
        qdst = q + hh * hd;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) gate[hh * hd + i] = src[hd + i];
    } else {
        const int g = blockIdx.x - nh;
        src = kn + ((size_t)t * nkv + g) * hd;
        w = k_norm;
        kdst = kc + ((size_t)pos * nkv + g) * hd;
        const float* vs = vn + ((size_t)t * nkv + g) * hd;
        KV* vd = vc + ((size_t)pos * nkv + g) * hd;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) kv_st(vd + i, vs[i]);
    }
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) ss += src[i] * src[i];
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)hd + eps);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) head[i] = src[i] * inv * w[i];
    __syncthreads();
    rope_neox_any(head, rope_dims, pos, theta, rope_cs, threadIdx.x, blockDim.x);
    __syncthreads();
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        if (is_q) qdst[i] = head[i];
        else kv_st(kdst + i, head[i]);
    }
}

extern "C" __global__ void attn_qk_prep(const float* qg, const float* kn, const float* vn, float* q, float* gate,
                                        float* kc, float* vc, const float* q_norm, const float* k_norm,
                                        const int* pos_ptr, int nh, int nkv, int hd, int rope_dims, double theta,
                                        float eps, const float2* rope_cs) {
    attn_qk_prep_body(qg, kn, vn, q, gate, kc, vc, q_norm, k_norm, pos_ptr, nh, nkv, hd, rope_dims, theta, eps, rope_cs);
}
extern "C" __global__ void attn_qk_prep_h(const float* qg, const float* kn, const float* vn, float* q, float* gate,
                                          u16* kc, u16* vc, const float* q_norm, const float* k_norm,
                                          const int* pos_ptr, int nh, int nkv, int hd, int rope_dims, double theta,
                                          float eps, const float2* rope_cs) {
    attn_qk_prep_body(qg, kn, vn, q, gate, kc, vc, q_norm, k_norm, pos_ptr, nh, nkv, hd, rope_dims, theta, eps, rope_cs);
}

// attn_causal(q, kc, vc, gate, o, pos, nkv, hd, scale): causal softmax attention of query token
// t = blockIdx.y (position p = *pos + t) and head h = blockIdx.x (gridDim.x = heads; GQA: KV head
// h / (heads / nkv)) over cache positions 0..p. q and o are [tokens][heads][hd], kc and vc
// [ctx][nkv][hd] (already holding this token's K and V). Each warp walks positions wid, wid + 4,
// ... with a running max, sum and weighted value sum (online softmax); the 4 partial results
// are merged at the end. No scratch memory, any length. When gate is not null ([tokens][heads][hd]),
// o = attention * sigmoid(gate) (the output gate of gated attention, folded in).
// Launch: grid = (heads, tokens), block = 32 * ATTN_WARPS; hd a multiple of 32, <= ATTN_MAX_HD.
// attn_causal_h: the caches in f16.
template <typename KV>
__device__ __forceinline__ void attn_causal_body(const float* __restrict__ q, const KV* __restrict__ kc,
                                                 const KV* __restrict__ vc, const float* __restrict__ gate,
                                                 float* __restrict__ o, const int* __restrict__ pos_ptr, int nkv,
                                                 int hd, float scale) {
    pdl_enter();
    __shared__ float part_m[ATTN_WARPS], part_l[ATTN_WARPS];
    __shared__ float part_acc[ATTN_WARPS * ATTN_MAX_HD];
    const int h = blockIdx.x, heads = gridDim.x, t = blockIdx.y;
    const int g = h / (heads / nkv);
    const int n = *pos_ptr + t + 1;
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    const int per = hd / WARP;
    const float* qh = q + ((size_t)t * heads + h) * hd;
    float qr[ATTN_PER_LANE], acc[ATTN_PER_LANE];
#pragma unroll
    for (int c = 0; c < ATTN_PER_LANE; ++c) {
        qr[c] = c < per ? qh[c * WARP + lane] : 0.0f;
        acc[c] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int j = wid; j < n; j += ATTN_WARPS) {
        const KV* kj = kc + ((size_t)j * nkv + g) * hd;
        float d = 0.0f;
#pragma unroll
        for (int c = 0; c < ATTN_PER_LANE; ++c) {
            if (c < per) d += qr[c] * kv_ld(kj + c * WARP + lane);
        }
        d = warp_sum(d) * scale;
        const float m_new = fmaxf(m, d);
        const float corr = expf(m - m_new);  // 0 on the first position (m = -inf)
        const float p = expf(d - m_new);
        l = l * corr + p;
        const KV* vj = vc + ((size_t)j * nkv + g) * hd;
#pragma unroll
        for (int c = 0; c < ATTN_PER_LANE; ++c) {
            if (c < per) acc[c] = acc[c] * corr + p * kv_ld(vj + c * WARP + lane);
        }
        m = m_new;
    }
    if (lane == 0) {
        part_m[wid] = m;
        part_l[wid] = l;
    }
#pragma unroll
    for (int c = 0; c < ATTN_PER_LANE; ++c) {
        if (c < per) part_acc[wid * ATTN_MAX_HD + c * WARP + lane] = acc[c];
    }
    __syncthreads();
    float mm = NEG_INF;
    for (int w = 0; w < ATTN_WARPS; ++w) mm = fmaxf(mm, part_m[w]);
    float ll = 0.0f;
    for (int w = 0; w < ATTN_WARPS; ++w) {
        if (part_m[w] != NEG_INF) ll += part_l[w] * expf(part_m[w] - mm);
    }
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float a = 0.0f;
        for (int w = 0; w < ATTN_WARPS; ++w) {
            if (part_m[w] != NEG_INF) a += part_acc[w * ATTN_MAX_HD + i] * expf(part_m[w] - mm);
        }
        const size_t at = ((size_t)t * heads + h) * hd + i;
        o[at] = gate == nullptr ? a / ll : (a / ll) * sigmoidf_(gate[at]);
    }
}

extern "C" __global__ void attn_causal(const float* q, const float* kc, const float* vc, const float* gate, float* o,
                                       const int* pos_ptr, int nkv, int hd, float scale) {
    attn_causal_body(q, kc, vc, gate, o, pos_ptr, nkv, hd, scale);
}
extern "C" __global__ void attn_causal_h(const float* q, const u16* kc, const u16* vc, const float* gate, float* o,
                                         const int* pos_ptr, int nkv, int hd, float scale) {
    attn_causal_body(q, kc, vc, gate, o, pos_ptr, nkv, hd, scale);
}

// attn_prompt(q, kc, vc, gate, o, pos, ntok, heads, nkv, hd, scale): attn_causal for the ntok
// tokens of a prompt, a GQA group per block: block (g, b) takes KV head g and the r = heads / nkv
// query heads that read it, for tokens b·QT .. b·QT + QT − 1 (QT = 32 / r): 32 query rows, row
// ri = (token ri / r, head g·r + ri % r), AP_ROWS rows per warp. Key and value rows are staged
// AP_KT at a time in shared memory once for all 32 rows (attn_causal reads them from L2 per
// row); each row keeps attn_causal's online softmax over its own causal range.
// Launch: grid = (nkv, ceil(ntok / QT)), block = 256, dynamic shared memory = 2·AP_KT·hd floats;
// r divides 32, hd a multiple of 32 and <= 32 · AP_PER_LANE. attn_prompt_h: the caches in f16.
#define AP_KT 16
#define AP_ROWS 4
#define AP_PER_LANE 8
template <typename KV>
__device__ __forceinline__ void attn_prompt_body(const float* __restrict__ q, const KV* __restrict__ kc,
                                                 const KV* __restrict__ vc, const float* __restrict__ gate,
                                                 float* __restrict__ o, const int* __restrict__ pos_ptr, int ntok,
                                                 int heads, int nkv, int hd, float scale) {
    pdl_enter();
    extern __shared__ float kv[];
    float* ks = kv;              // [AP_KT][hd]
    float* vs = kv + AP_KT * hd;  // [AP_KT][hd]
    const int g = blockIdx.x, r = heads / nkv, qt = WARP / r;
    const int lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
    const int pos0 = *pos_ptr, per = hd / WARP;
    float qr[AP_ROWS][AP_PER_LANE], acc[AP_ROWS][AP_PER_LANE], m[AP_ROWS], l[AP_ROWS];
    int lim[AP_ROWS];
#pragma unroll
    for (int i = 0; i < AP_ROWS; ++i) {
        const int ri = w * AP_ROWS + i, t = blockIdx.y * qt + ri / r, h = g * r + ri % r;
        lim[i] = t < ntok ? pos0 + t + 1 : 0;  // keys 0 .. lim - 1; none for a row past the prompt
        const float* qh = q + ((size_t)(t < ntok ? t : 0) * heads + h) * hd;
#pragma unroll
        for (int c = 0; c < AP_PER_LANE; ++c) {
            qr[i][c] = c < per ? qh[c * WARP + lane] : 0.0f;
            acc[i][c] = 0.0f;
        }
        m[i] = NEG_INF;
        l[i] = 0.0f;
    }
    const int last = min(ntok, (int)(blockIdx.y + 1) * qt);  // tokens of this block end before it
    const int nkeys = pos0 + last;
    for (int j0 = 0; j0 < nkeys; j0 += AP_KT) {
        const int kt = min(AP_KT, nkeys - j0);
        __syncthreads();  // the previous tile is read
        for (int idx = threadIdx.x; idx < kt * hd; idx += blockDim.x) {
            const int jj = idx / hd, d = idx - jj * hd;
            const size_t at = ((size_t)(j0 + jj) * nkv + g) * hd + d;
            ks[idx] = kv_ld(kc + at);
            vs[idx] = kv_ld(vc + at);
        }
        __syncthreads();
        for (int jj = 0; jj < kt; ++jj) {
            const int j = j0 + jj;
            float kr[AP_PER_LANE], vr[AP_PER_LANE];
#pragma unroll
            for (int c = 0; c < AP_PER_LANE; ++c) {
                kr[c] = c < per ? ks[jj * hd + c * WARP + lane] : 0.0f;
                vr[c] = c < per ? vs[jj * hd + c * WARP + lane] : 0.0f;
            }
#pragma unroll
            for (int i = 0; i < AP_ROWS; ++i) {
                if (j >= lim[i]) continue;  // the same for every lane of the warp
                float d = 0.0f;
#pragma unroll
                for (int c = 0; c < AP_PER_LANE; ++c) d += qr[i][c] * kr[c];
                d = warp_sum(d) * scale;
                const float m_new = fmaxf(m[i], d);
                const float corr = expf(m[i] - m_new);  // 0 on the first position (m = -inf)
                const float p = expf(d - m_new);
                l[i] = l[i] * corr + p;
#pragma unroll
                for (int c = 0; c < AP_PER_LANE; ++c) acc[i][c] = acc[i][c] * corr + p * vr[c];
                m[i] = m_new;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < AP_ROWS; ++i) {
        if (lim[i] == 0) continue;
        const int ri = w * AP_ROWS + i, t = blockIdx.y * qt + ri / r, h = g * r + ri % r;
#pragma unroll
        for (int c = 0; c < AP_PER_LANE; ++c) {
            if (c >= per) continue;
            const size_t at = ((size_t)t * heads + h) * hd + c * WARP + lane;
            const float a = acc[i][c] / l[i];
            o[at] = gate == nullptr ? a : a * sigmoidf_(gate[at]);
        }
    }
}

extern "C" __global__ __launch_bounds__(256) void attn_prompt(const float* q, const float* kc, const float* vc,
                                                              const float* gate, float* o, const int* pos_ptr,
                                                              int ntok, int heads, int nkv, int hd, float scale) {
    attn_prompt_body(q, kc, vc, gate, o, pos_ptr, ntok, heads, nkv, hd, scale);
}
extern "C" __global__ __launch_bounds__(256) void attn_prompt_h(const float* q, const u16* kc, const u16* vc,
                                                                const float* gate, float* o, const int* pos_ptr,
                                                                int ntok, int heads, int nkv, int hd, float scale) {
    attn_prompt_body(q, kc, vc, gate, o, pos_ptr, ntok, heads, nkv, hd, scale);
}

// attn_prompt_mma_<hd>(q, kc, vc, gate, o, pos, ntok, heads, nkv, scale): attn_prompt on the
// tensor cores (the flash-attention form). Block (g, b) takes the same 32 query rows as
// attn_prompt (KV head g, its r query heads × 32 / r tokens), 16 rows per warp. Q (times the
// softmax scale) sits in shared memory as f16; per tile of APM_KT positions K (row-major) and V
// (transposed) are staged as f16, S = Q·Kᵀ is one m16n8k16 product per 16 dims and 8 positions,
// the online softmax runs on S's fragments (each row's max over the 4 lanes that hold it), and
// P (f16, straight from S's fragments) · V accumulates into the f32 output fragments. Inputs are
// rounded to f16 like the prompt GEMMs'. Launch: grid = (nkv, ceil(ntok / (32 / r))), block = 64,
// dynamic shared memory = attn_prompt_mma_shared(hd) bytes; r divides 32. The `_h` forms read an
// f16 cache: the tiles stage its values as they are, which is the rounding the f32 forms apply, so
// both give the same bits for the same (f16-representable) cache.
#define APM_KT 16
#define APM_ROWS 32
template <int HD, typename KV>
__device__ __forceinline__ void attn_prompt_mma_body(const float* __restrict__ q, const KV* __restrict__ kc,
                                                     const KV* __restrict__ vc, const float* __restrict__ gate,
                                                     float* __restrict__ o, const int* __restrict__ pos_ptr,
                                                     int ntok, int heads, int nkv, float scale) {
    constexpr int QP = HD + 8;        // halves per row of Q and K (conflict-free fragment loads)
    constexpr int VP = APM_KT + 8;    // halves per row of Vᵀ
    extern __shared__ __align__(16) u16 apm[];
    u16* qs = apm;                    // [APM_ROWS][QP]
    u16* ks = qs + APM_ROWS * QP;     // [APM_KT][QP]
    u16* vt = ks + APM_KT * QP;       // [HD][VP]
    const int g = blockIdx.x, r = heads / nkv, qt = APM_ROWS / r;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, gq = lane >> 2, c = lane & 3;
    const int pos0 = *pos_ptr;
    const int last = min(ntok, (int)(blockIdx.y + 1) * qt);
    const int nkeys = pos0 + last;

    // Q rows (zeros past the prompt), scaled, as f16.
    for (int idx = tid; idx < APM_ROWS * HD / 2; idx += blockDim.x) {
        const int ri = idx / (HD / 2), d = 2 * (idx % (HD / 2));
        const int t = blockIdx.y * qt + ri / r, h = g * r + ri % r;
        float a = 0.0f, b = 0.0f;
        if (t < ntok) {
            const float* qh = q + ((size_t)t * heads + h) * HD + d;
            a = qh[0] * scale;
            b = qh[1] * scale;
        }
        *(u32*)(qs + ri * QP + d) = pack_f16x2(a, b);
    }
    // This thread's two rows (fragment rows gq and gq + 8 of its warp) and their causal ends.
    int lim[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int ri = 16 * w + gq + 8 * hr, t = blockIdx.y * qt + ri / r;
        lim[hr] = t < ntok ? pos0 + t + 1 : 0;
    }
    float acc[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[i][v] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    for (int j0 = 0; j0 < nkeys; j0 += APM_KT) {
        __syncthreads();  // Q is written; the previous tile is read
        for (int idx = tid; idx < APM_KT * HD / 4; idx += blockDim.x) {
            const int jj = idx / (HD / 4), d = 4 * (idx % (HD / 4));
            // Four values of K and of V as two f16x2 words each (an f16 cache holds them so).
            uint2 kw = make_uint2(0u, 0u), vw = kw;
            if (j0 + jj < nkeys) {
                const size_t at = ((size_t)(j0 + jj) * nkv + g) * HD + d;
                if constexpr (sizeof(KV) == 2) {
                    kw = *(const uint2*)(kc + at);
                    vw = *(const uint2*)(vc + at);
                } else {
                    const float4 kv4 = *(const float4*)(kc + at), vv4 = *(const float4*)(vc + at);
                    kw = make_uint2(pack_f16x2(kv4.x, kv4.y), pack_f16x2(kv4.z, kv4.w));
                    vw = make_uint2(pack_f16x2(vv4.x, vv4.y), pack_f16x2(vv4.z, vv4.w));
                }
            }
            *(u32*)(ks + jj * QP + d) = kw.x;
            *(u32*)(ks + jj * QP + d + 2) = kw.y;
            const u32 v01 = vw.x, v23 = vw.y;
            vt[(d + 0) * VP + jj] = (u16)(v01 & 0xffff);
            vt[(d + 1) * VP + jj] = (u16)(v01 >> 16);
            vt[(d + 2) * VP + jj] = (u16)(v23 & 0xffff);
            vt[(d + 3) * VP + jj] = (u16)(v23 >> 16);
        }
        __syncthreads();
        // S = Q Kᵀ for this warp's 16 rows and the tile's 16 positions (two n8 tiles).
        float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int kd = 0; kd < HD; kd += 16) {
            const u16* pa = qs + (16 * w + gq) * QP + kd + 2 * c;
            const u32 a[4] = {*(const u32*)pa, *(const u32*)(pa + 8 * QP), *(const u32*)(pa + 8),
                              *(const u32*)(pa + 8 * QP + 8)};
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const u16* pb = ks + (nt * 8 + gq) * QP + kd + 2 * c;
                const u32 b[2] = {*(const u32*)pb, *(const u32*)(pb + 8)};
                mma_16816(sc[nt], a, b);
            }
        }
        // Online softmax on the fragments: value v of tile nt is row gq + 8 (v / 2), position
        // j0 + 8 nt + 2 c + v % 2.
        float tmax[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const int j = j0 + 8 * nt + 2 * c + (v & 1), hr = v >> 1;
                if (j >= lim[hr]) sc[nt][v] = NEG_INF;
                tmax[hr] = fmaxf(tmax[hr], sc[nt][v]);
            }
        float corr[2];
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            tmax[hr] = fmaxf(tmax[hr], __shfl_xor_sync(0xffffffffu, tmax[hr], 1));
            tmax[hr] = fmaxf(tmax[hr], __shfl_xor_sync(0xffffffffu, tmax[hr], 2));
            const float m_new = fmaxf(m[hr], tmax[hr]);
            // Nothing seen yet (m_new = -inf): nothing to rescale and every p is 0.
            corr[hr] = m_new == NEG_INF ? 1.0f : expf(m[hr] - m_new);
            m[hr] = m_new;
        }
        float p[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const int hr = v >> 1;
                p[nt][v] = sc[nt][v] == NEG_INF ? 0.0f : expf(sc[nt][v] - m[hr]);
            }
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            l[hr] = l[hr] * corr[hr] + p[0][2 * hr] + p[0][2 * hr + 1] + p[1][2 * hr] + p[1][2 * hr + 1];
        }
#pragma unroll
        for (int i = 0; i < HD / 8; ++i) {
            acc[i][0] *= corr[0];
            acc[i][1] *= corr[0];
            acc[i][2] *= corr[1];
            acc[i][3] *= corr[1];
        }
        // O += P V: P's fragments are S's, as the A operand of one m16n8k16 per 8 dims.
        const u32 pa[4] = {pack_f16x2(p[0][0], p[0][1]), pack_f16x2(p[0][2], p[0][3]),
                           pack_f16x2(p[1][0], p[1][1]), pack_f16x2(p[1][2], p[1][3])};
#pragma unroll
        for (int dt = 0; dt < HD / 8; ++dt) {
            const u16* pb = vt + (dt * 8 + gq) * VP + 2 * c;
            const u32 b[2] = {*(const u32*)pb, *(const u32*)(pb + 8)};
            mma_16816(acc[dt], pa, b);
        }
    }
    // Each row's sum over the 4 lanes that hold it; then o = acc / l (· sigmoid(gate)).
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 1);
        l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 2);
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        if (lim[hr] == 0) continue;
        const int ri = 16 * w + gq + 8 * hr, t = blockIdx.y * qt + ri / r, h = g * r + ri % r;
        float* out = o + ((size_t)t * heads + h) * HD;
        const float* gt = gate == nullptr ? nullptr : gate + ((size_t)t * heads + h) * HD;
#pragma unroll
        for (int dt = 0; dt < HD / 8; ++dt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int d = dt * 8 + 2 * c + e;
                const float a = acc[dt][2 * hr + e] / l[hr];
                out[d] = gt == nullptr ? a : a * sigmoidf_(gt[d]);
            }
        }
    }
}

extern "C" __global__ __launch_bounds__(64) void attn_prompt_mma_64(const float* q, const float* kc, const float* vc,
                                                                    const float* gate, float* o, const int* pos, int ntok,
                                                                    int heads, int nkv, float scale) {
    pdl_enter();
    attn_prompt_mma_body<64>(q, kc, vc, gate, o, pos, ntok, heads, nkv, scale);
}
extern "C" __global__ __launch_bounds__(64) void attn_prompt_mma_64_h(const float* q, const u16* kc, const u16* vc,
                                                                      const float* gate, float* o, const int* pos, int ntok,
                                                                      int heads, int nkv, float scale) {
    pdl_enter();
    attn_prompt_mma_body<64>(q, kc, vc, gate, o, pos, ntok, heads, nkv, scale);
}
extern "C" __global__ __launch_bounds__(64) void attn_prompt_mma_128(const float* q, const float* kc, const float* vc,
                                                                     const float* gate, float* o, const int* pos, int ntok,
                                                                     int heads, int nkv, float scale) {
    pdl_enter();
    attn_prompt_mma_body<128>(q, kc, vc, gate, o, pos, ntok, heads, nkv, scale);
}
extern "C" __global__ __launch_bounds__(64) void attn_prompt_mma_128_h(const float* q, const u16* kc, const u16* vc,
                                                                       const float* gate, float* o, const int* pos, int ntok,
                                                                       int heads, int nkv, float scale) {
    pdl_enter();
    attn_prompt_mma_body<128>(q, kc, vc, gate, o, pos, ntok, heads, nkv, scale);
}
extern "C" __global__ __launch_bounds__(64) void attn_prompt_mma_256(const float* q, const float* kc, const float* vc,
                                                                     const float* gate, float* o, const int* pos, int ntok,
                                                                     int heads, int nkv, float scale) {
    pdl_enter();
    attn_prompt_mma_body<256>(q, kc, vc, gate, o, pos, ntok, heads, nkv, scale);
}
extern "C" __global__ __launch_bounds__(64) void attn_prompt_mma_256_h(const float* q, const u16* kc, const u16* vc,
                                                                       const float* gate, float* o, const int* pos, int ntok,
                                                                       int heads, int nkv, float scale) {
    pdl_enter();
    attn_prompt_mma_body<256>(q, kc, vc, gate, o, pos, ntok, heads, nkv, scale);
}

// Decode attention split over the cache length (flash-decoding), for new tokens t = blockIdx.z at
// positions p = *pos + t (n = p + 1 cache rows each; their K/V rows are all written first, and
// row t reads only rows <= p, so each row is what a one-token step at p computes, bit for bit:
// the verify pass of speculative decoding): attn_split computes each chunk's partial softmax,
// attn_merge combines the chunks. Both derive the same chunking from n: chunk = max(min_chunk, ceil(n /
// splits)) rounded up to a multiple of 4, active chunks = ceil(n / chunk) (splits = gridDim.y of
// attn_split); chunks past the active ones do nothing.
// Positions per step of a warp in attn_split (their K and V rows loaded before any arithmetic);
// REDLITE_CUDA_DEFINES=ATTN_UNROLL=8 tries more loads in flight (an experiment for long contexts).
#ifndef ATTN_UNROLL
#define ATTN_UNROLL 4
#endif

__device__ __forceinline__ int attn_chunk(int n, int splits, int min_chunk) {
    int c = (n + splits - 1) / splits;
    c = c > min_chunk ? c : min_chunk;
    return (c + ATTN_UNROLL - 1) / ATTN_UNROLL * ATTN_UNROLL;
}

// attn_split(q, kc, vc, part, pos, heads, nkv, hd, scale, min_chunk): block (g, c) = (blockIdx.x,
// blockIdx.y) takes KV head g and chunk c; its warp w takes query head g * (heads / nkv) + w (the
// query heads of a KV head read the same K and V rows, through L1). A warp walks its chunk
// ATTN_UNROLL positions at a time (K and V rows of all of them loaded first), with a running max,
// sum and weighted V sum; it writes part[h][c] = {max, sum, acc[hd]}.
// Launch: grid = (nkv, splits, tokens), block = 32 * (heads / nkv) threads; hd a multiple of 32,
// <= ATTN_MAX_HD; part holds tokens * heads * splits * (hd + 2) floats.
template <int PER, typename KV>
__device__ __forceinline__ void attn_split_body(const float* __restrict__ q, const KV* __restrict__ kc,
                                                const KV* __restrict__ vc, float* __restrict__ part,
                                                const int* __restrict__ pos_ptr, int heads, int nkv, int hd,
                                                float scale, int min_chunk) {
    const int g = blockIdx.x, c = blockIdx.y, splits = gridDim.y, t = blockIdx.z;
    const int n = *pos_ptr + 1 + t;
    const int chunk = attn_chunk(n, splits, min_chunk);
    const int j0 = c * chunk;
    if (j0 >= n) return;
    const int j1 = min(n, j0 + chunk);
    const int lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
    const int h = g * (heads / nkv) + w;
    const int per = hd / WARP;
    const float* qh = q + ((size_t)t * heads + h) * hd;
    float qr[PER], acc[PER];
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        qr[e] = e < per ? qh[e * WARP + lane] : 0.0f;
        acc[e] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int j = j0; j < j1; j += ATTN_UNROLL) {
        float kr[ATTN_UNROLL][PER], vr[ATTN_UNROLL][PER];
#pragma unroll
        for (int uu = 0; uu < ATTN_UNROLL; ++uu) {
            const int jj = j + uu < j1 ? j + uu : j1 - 1;  // past the end: a copy of the last row, weight 0
            const KV* kj = kc + ((size_t)jj * nkv + g) * hd;
            const KV* vj = vc + ((size_t)jj * nkv + g) * hd;
#pragma unroll
            for (int e = 0; e < PER; ++e) {
                kr[uu][e] = e < per ? kv_ld(kj + e * WARP + lane) : 0.0f;
                vr[uu][e] = e < per ? kv_ld(vj + e * WARP + lane) : 0.0f;
            }
        }
        float d[ATTN_UNROLL];
        float mx = m;
#pragma unroll
        for (int uu = 0; uu < ATTN_UNROLL; ++uu) {
            float s = 0.0f;
#pragma unroll
            for (int e = 0; e < PER; ++e) s += qr[e] * kr[uu][e];
            s = warp_sum(s) * scale;
            d[uu] = j + uu < j1 ? s : NEG_INF;
            mx = fmaxf(mx, d[uu]);
        }
        const float corr = expf(m - mx);  // 0 on the first rows (m = -inf)
        l *= corr;
#pragma unroll
        for (int e = 0; e < PER; ++e) acc[e] *= corr;
#pragma unroll
        for (int uu = 0; uu < ATTN_UNROLL; ++uu) {
            const float p = expf(d[uu] - mx);  // 0 past the end
            l += p;
#pragma unroll
            for (int e = 0; e < PER; ++e) acc[e] += p * vr[uu][e];
        }
        m = mx;
    }
    float* out = part + (((size_t)t * heads + h) * splits + c) * (hd + 2);
    if (lane == 0) {
        out[0] = m;
        out[1] = l;
    }
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        if (e < per) out[2 + e * WARP + lane] = acc[e];
    }
}

// Registers sized for the head: PER = hd / 32 rounded up to a power of two. attn_split_h: the
// caches in f16.
template <typename KV>
__device__ __forceinline__ void attn_split_any_body(const float* __restrict__ q, const KV* __restrict__ kc,
                                               const KV* __restrict__ vc, float* __restrict__ part,
                                               const int* __restrict__ pos_ptr, int heads, int nkv, int hd,
                                               float scale, int min_chunk) {
    pdl_enter();
    const int per = hd / WARP;
    if (per <= 2) attn_split_body<2>(q, kc, vc, part, pos_ptr, heads, nkv, hd, scale, min_chunk);
    else if (per <= 4) attn_split_body<4>(q, kc, vc, part, pos_ptr, heads, nkv, hd, scale, min_chunk);
    else if (per <= 8) attn_split_body<8>(q, kc, vc, part, pos_ptr, heads, nkv, hd, scale, min_chunk);
    else attn_split_body<ATTN_PER_LANE>(q, kc, vc, part, pos_ptr, heads, nkv, hd, scale, min_chunk);
}

extern "C" __global__ void attn_split(const float* q, const float* kc, const float* vc, float* part,
                                      const int* pos_ptr, int heads, int nkv, int hd, float scale, int min_chunk) {
    attn_split_any_body(q, kc, vc, part, pos_ptr, heads, nkv, hd, scale, min_chunk);
}
extern "C" __global__ void attn_split_h(const float* q, const u16* kc, const u16* vc, float* part,
                                        const int* pos_ptr, int heads, int nkv, int hd, float scale, int min_chunk) {
    attn_split_any_body(q, kc, vc, part, pos_ptr, heads, nkv, hd, scale, min_chunk);
}

// attn_split_gqa(q, kc, vc, part, pos, heads, nkv, hd, scale, min_chunk): attn_split with the warps
// over positions instead of query heads: block (g, c) takes KV head g and chunk c as attn_split
// does (same chunking, same part layout), each of its warps takes ATTN_GQA_P positions at a time,
// positions j0 + w * P, j0 + (w + nw) * P, ... (the block walks the chunk in order, every K and V row
// loaded once per block, PER consecutive values per lane by 16-byte loads), and scores them
// against all G = heads / nkv query heads (q and the running softmax of every head in registers).
// The warps' partial softmaxes are then merged in warp order through shared memory. More loads in
// flight per byte of the cache than attn_split, whose G warps all read the same rows.
// Launch: as attn_split (block = 32 * G threads), for G in {1, 2, 4, 8} and PER = hd / 32 in
// {2, 4, 8}; the same chunking gives row t of a several-token call the one-token call's bits.
// attn_split_gqa4: the same with 4 positions per warp step (255 registers, no spills).
template <int PER>
__device__ __forceinline__ void ld_lane_row(const float* __restrict__ p, float (&r)[PER]) {
    if constexpr (PER % 4 == 0) {
#pragma unroll
        for (int i = 0; i < PER / 4; ++i) {
            const float4 v = ((const float4*)p)[i];
            r[4 * i] = v.x;
            r[4 * i + 1] = v.y;
            r[4 * i + 2] = v.z;
            r[4 * i + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < PER / 2; ++i) {
            const float2 v = ((const float2*)p)[i];
            r[2 * i] = v.x;
            r[2 * i + 1] = v.y;
        }
    }
}

// KvLane<KV, PER>: a lane's PER consecutive values of one cache row as loaded (load: 16-byte loads
// where PER allows) and widened to f32 where they are used: f32 as they are; f16 kept packed two a
// word, so a warp step holds twice the rows of an f32 one in the same registers.
template <typename KV, int PER>
struct KvLane;
template <int PER>
struct KvLane<float, PER> {
    float v[PER];
    __device__ __forceinline__ void load(const float* __restrict__ p) { ld_lane_row<PER>(p, v); }
    __device__ __forceinline__ void widen(float (&r)[PER]) const {
#pragma unroll
        for (int e = 0; e < PER; ++e) r[e] = v[e];
    }
};
template <int PER>
struct KvLane<u16, PER> {
    u32 w[PER / 2];
    __device__ __forceinline__ void load(const u16* __restrict__ p) {
        if constexpr (PER % 8 == 0) {
#pragma unroll
            for (int i = 0; i < PER / 8; ++i) {
                const uint4 x = ((const uint4*)p)[i];
                w[4 * i] = x.x;
                w[4 * i + 1] = x.y;
                w[4 * i + 2] = x.z;
                w[4 * i + 3] = x.w;
            }
        } else if constexpr (PER % 4 == 0) {
#pragma unroll
            for (int i = 0; i < PER / 4; ++i) {
                const uint2 x = ((const uint2*)p)[i];
                w[2 * i] = x.x;
                w[2 * i + 1] = x.y;
            }
        } else {
#pragma unroll
            for (int i = 0; i < PER / 2; ++i) w[i] = ((const u32*)p)[i];
        }
    }
    __device__ __forceinline__ void widen(float (&r)[PER]) const {
#pragma unroll
        for (int i = 0; i < PER / 2; ++i) f16x2_to_f32(w[i], r[2 * i], r[2 * i + 1]);
    }
};

// xr_reduce(v, lane): the transposed butterfly. In: 32 partial sums a lane; out: lane l holds the
// warp-wide sum of v[l]. Five stages, offsets 16, 8, 4, 2, 1: at offset o a lane with bit o set
// keeps the upper o of the 2 o values it still holds and sends the lower o to its partner (lane
// ^ o), the other lane the reverse, and each adds what it receives; 31 shuffles for the 32 sums
// (32 warp_sums take 160). Each sum takes warp_sum's tree (the same offsets in the same order, each
// lane adding its partner's partial to its own), so each keeps warp_sum's bits.
template <int O>
__device__ __forceinline__ void xr_stage(float (&v)[WARP], int lane) {
    const bool up = (lane & O) != 0;
#pragma unroll
    for (int i = 0; i < O; ++i) {
        const float send = up ? v[i] : v[i + O];
        const float keep = up ? v[i + O] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
}

__device__ __forceinline__ float xr_reduce(float (&v)[WARP], int lane) {
    xr_stage<16>(v, lane);
    xr_stage<8>(v, lane);
    xr_stage<4>(v, lane);
    xr_stage<2>(v, lane);
    xr_stage<1>(v, lane);
    return v[0];
}

// qgrp: the G query rows (hd apart) of the block's KV head and token.
// XR (with G P = 32, attn_split_gqa4x): the G P scores of a warp step reduced by xr_reduce, lane
// h P + u holding head h's score of position u: that lane takes the exps (one each instead of
// every lane all G (P + 1)), head h's running max and sum live in its P lanes, and the
// corrections and weights reach every lane by shuffles; the scores, maxima, weights and the
// accumulators' updates are the same operations in the same order as without XR (a head's rescale
// skipped where its max did not move: x * 1 = x). Only the softmax sum differs: l · corr +
// ((p0 + p1) + (p2 + p3)) where the old code added the four weights one by one.
// LP: the rows a warp loads a step (its positions j .. j + LP - 1, warps LP apart), taken in
// sub-steps of P (LP = P but for attn_split_gqa8x_h; LP > P changes which warp takes which rows,
// so its bits are its own). PF: the next step's rows loaded ahead (the same bits).
// HSPLIT: the KV head's query heads over HSPLIT blocks of G each (block x takes query heads
// x G .. x G + G - 1 of KV head x / HSPLIT; HSPLIT = 1: all of them), so that a lane holds
// HSPLIT times fewer heads' q and accumulators; each block reads the KV head's rows.
template <int PER, int G, int P, bool XR, typename KV, int LP, bool PF, int HSPLIT = 1>
__device__ __forceinline__ void attn_split_gqa_body(const float* __restrict__ qgrp, const KV* __restrict__ kc,
                                                    const KV* __restrict__ vc, float* __restrict__ part,
                                                    const int* __restrict__ pos_ptr, int heads, int nkv, int hd,
                                                    float scale, int min_chunk, float (*sm)[8], float (*sl)[8],
                                                    float* sacc) {
    // sm[warp][head], sl[warp][head]: the warps' maxima and sums; sacc[head * hd + i]: the block's.
    const int g = blockIdx.x, c = blockIdx.y, splits = gridDim.y, t = blockIdx.z;
    const int n = *pos_ptr + 1 + t;
    const int chunk = attn_chunk(n, splits, min_chunk);
    const int j0 = c * chunk;
    if (j0 >= n) return;  // the whole block
    const int j1 = min(n, j0 + chunk);
    const int lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
    float qr[G][PER], acc[G][PER], m[G], l[G];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        ld_lane_row<PER>(qgrp + (size_t)h * hd + PER * lane, qr[h]);
        m[h] = NEG_INF;
        l[h] = 0.0f;
#pragma unroll
        for (int e = 0; e < PER; ++e) acc[h][e] = 0.0f;
    }
    constexpr bool XRED = XR && G * P == WARP;
    const int hl = lane / P, ul = lane % P;  // XRED: the lane's head and position
    float m_own = NEG_INF, l_own = 0.0f;     // XRED: head hl's running max and sum
    // The K and V rows of the warp step at j (past the end: copies of the last row, weight 0).
    auto load_step = [&](int j, KvLane<KV, PER>(&kl)[LP], KvLane<KV, PER>(&vl)[LP]) {
#pragma unroll
        for (int u = 0; u < LP; ++u) {
            const int jj = j + u < j1 ? j + u : j1 - 1;
            kl[u].load(kc + ((size_t)jj * nkv + g / HSPLIT) * hd + PER * lane);
            vl[u].load(vc + ((size_t)jj * nkv + g / HSPLIT) * hd + PER * lane);
        }
    };
    // PF: the next step's rows are loaded before this step's arithmetic (kn, vn), so their
    // latency runs under it; else each step loads its rows, then waits for them.
    KvLane<KV, PER> kn[PF ? LP : 1], vn[PF ? LP : 1];
    if constexpr (PF) {
        if (j0 + w * LP < j1) load_step(j0 + w * LP, kn, vn);
    }
    for (int j = j0 + w * LP; j < j1; j += G * LP) {
        KvLane<KV, PER> kl[LP], vl[LP];
        if constexpr (PF) {
#pragma unroll
            for (int u = 0; u < LP; ++u) {
                kl[u] = kn[u];
                vl[u] = vn[u];
            }
            if (j + G * LP < j1) load_step(j + G * LP, kn, vn);
        } else {
            load_step(j, kl, vl);
        }
        // The LP rows in sub-steps of P (one sub-step unless LP > P).
#pragma unroll
        for (int sub = 0; sub < LP / P; ++sub) {
            const int js = j + sub * P;
            if constexpr (XRED) {
                float v[WARP];
#pragma unroll
                for (int u = 0; u < P; ++u) {
                    float kr[PER];
                    kl[sub * P + u].widen(kr);
#pragma unroll
                    for (int h = 0; h < G; ++h) {
                        float s = 0.0f;
#pragma unroll
                        for (int e = 0; e < PER; ++e) s += qr[h][e] * kr[e];
                        v[h * P + u] = s;
                    }
                }
                const float s = xr_reduce(v, lane) * scale;
                const float d = js + ul < j1 ? s : NEG_INF;
                float mx = d;
#pragma unroll
                for (int o = 1; o < P; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
                mx = fmaxf(m_own, mx);
                const float corr = expf(m_own - mx);  // 0 on the first rows (m = -inf)
                const float pr = expf(d - mx);        // 0 past the end
                float ps = pr;
#pragma unroll
                for (int o = 1; o < P; o *= 2) ps += __shfl_xor_sync(0xffffffffu, ps, o);
                l_own = l_own * corr + ps;
                m_own = mx;
#pragma unroll
                for (int h = 0; h < G; ++h) {
                    const float ch = __shfl_sync(0xffffffffu, corr, h * P);
                    if (ch != 1.0f) {  // the warp's max of head h moved (x * 1 = x: the same bits)
#pragma unroll
                        for (int e = 0; e < PER; ++e) acc[h][e] *= ch;
                    }
                }
                // Row by row, each head's weight times the row: every acc[h][e] takes its
                // rescale, then the rows in order, as when the heads went first.
#pragma unroll
                for (int u = 0; u < P; ++u) {
                    float vr[PER];
                    vl[sub * P + u].widen(vr);
#pragma unroll
                    for (int h = 0; h < G; ++h) {
                        const float p = __shfl_sync(0xffffffffu, pr, h * P + u);
#pragma unroll
                        for (int e = 0; e < PER; ++e) acc[h][e] += p * vr[e];
                    }
                }
            } else {
                float kr[P][PER], vr[P][PER];
#pragma unroll
                for (int u = 0; u < P; ++u) {
                    kl[sub * P + u].widen(kr[u]);
                    vl[sub * P + u].widen(vr[u]);
                }
#pragma unroll
                for (int h = 0; h < G; ++h) {
                    float d[P];
                    float mx = m[h];
#pragma unroll
                    for (int u = 0; u < P; ++u) {
                        float s = 0.0f;
#pragma unroll
                        for (int e = 0; e < PER; ++e) s += qr[h][e] * kr[u][e];
                        s = warp_sum(s) * scale;
                        d[u] = js + u < j1 ? s : NEG_INF;
                        mx = fmaxf(mx, d[u]);
                    }
                    const float corr = expf(m[h] - mx);  // 0 on the first rows (m = -inf)
                    l[h] *= corr;
#pragma unroll
                    for (int e = 0; e < PER; ++e) acc[h][e] *= corr;
#pragma unroll
                    for (int u = 0; u < P; ++u) {
                        const float p = expf(d[u] - mx);  // 0 past the end
                        l[h] += p;
#pragma unroll
                        for (int e = 0; e < PER; ++e) acc[h][e] += p * vr[u][e];
                    }
                    m[h] = mx;
                }
            }
        }
    }
    // The warps' partials merged in warp order (warps without positions: m = -inf, weight 0).
    if constexpr (XRED) {
        if (ul == 0) {
            sm[w][hl] = m_own;
            sl[w][hl] = l_own;
        }
    } else if (lane == 0) {
#pragma unroll
        for (int h = 0; h < G; ++h) {
            sm[w][h] = m[h];
            sl[w][h] = l[h];
        }
    }
    __syncthreads();
    if constexpr (XRED) {
#pragma unroll
        for (int h = 0; h < G; ++h) m[h] = sm[w][h];
    }
    // Rounds for the warps that had positions only (the first `act`): a warp without any
    // has m = -inf, l = 0 and acc = 0, and adding its f = 0 times acc = 0 leaves every sum as
    // it is (no sum is -0: the first round's 0 + x is never -0), so skipping it keeps the
    // bits (the maxima and sums below still run over all G warps: -inf and 0 change
    // nothing there either, and fixed trip counts keep the code short). The shared row of
    // head h holds value i at i + i / 32 (one float of padding per 32): a lane's PER
    // consecutive values (i = PER lane + e) and a warp's 32 consecutive values both fall in
    // 32 different banks (value i at PER lane + e unpadded put lanes PER floats apart: a
    // PER-way conflict on every access).
    const int act = min(G, (j1 - j0 + LP - 1) / LP);
    constexpr int SROW = PER * WARP + PER;  // hd + hd / 32
    float f[G];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        float mm = NEG_INF;
        for (int k = 0; k < G; ++k) mm = fmaxf(mm, sm[k][h]);
        f[h] = m[h] == NEG_INF ? 0.0f : expf(m[h] - mm);
    }
    const int base = PER * lane + (PER * lane) / WARP;  // e < PER never crosses a 32 boundary
#pragma unroll 1
    for (int k = 0; k < act; ++k) {
        if (w == k) {
#pragma unroll
            for (int h = 0; h < G; ++h) {
#pragma unroll
                for (int e = 0; e < PER; ++e) {
                    float* a = &sacc[h * SROW + base + e];
                    *a = (k == 0 ? 0.0f : *a) + acc[h][e] * f[h];
                }
            }
        }
        __syncthreads();
    }
    // Warp h writes head h's {max, sum, acc}.
    const int h = w;
    float mm = NEG_INF;
    for (int k = 0; k < G; ++k) mm = fmaxf(mm, sm[k][h]);
    float* out = part + (((size_t)t * heads + g * G + h) * splits + c) * (hd + 2);
    if (lane == 0) {
        float ll = 0.0f;
        for (int k = 0; k < G; ++k) ll += sm[k][h] == NEG_INF ? 0.0f : sl[k][h] * expf(sm[k][h] - mm);
        out[0] = mm;
        out[1] = ll;
    }
#pragma unroll
    for (int r = 0; r < PER; ++r) out[2 + r * WARP + lane] = sacc[h * SROW + r * (WARP + 1) + lane];
}

template <int P, bool XR, typename KV, int LP = P, bool PF = false>
__device__ __forceinline__ void attn_split_gqa_p_body(const float* __restrict__ q, const KV* __restrict__ kc,
                                                   const KV* __restrict__ vc, float* __restrict__ part,
                                                   const int* __restrict__ pos_ptr, int heads, int nkv, int hd,
                                                   float scale, int min_chunk) {
    __shared__ float sm[8][8], sl[8][8];
    __shared__ float sacc[8 * (8 * WARP + 8)];  // G * (hd + hd / 32) at most
    pdl_enter();
    const int per = hd / WARP, grp = heads / nkv;
#define ATTN_GQA_CASE(PP, GG)                                                                                      \
    if (per == PP && grp == GG)                                                                                    \
        return attn_split_gqa_body<PP, GG, P, XR, KV, LP, PF>(q + ((size_t)blockIdx.z * heads + blockIdx.x * GG) * hd, kc, vc,   \
                                                  part, pos_ptr, heads, nkv, hd, scale, min_chunk, sm, sl, sacc);
#define ATTN_GQA_CASES(PP) ATTN_GQA_CASE(PP, 1) ATTN_GQA_CASE(PP, 2) ATTN_GQA_CASE(PP, 4) ATTN_GQA_CASE(PP, 8)
    ATTN_GQA_CASES(2)
    ATTN_GQA_CASES(4)
    ATTN_GQA_CASES(8)
#undef ATTN_GQA_CASES
#undef ATTN_GQA_CASE
}

extern "C" __global__ __launch_bounds__(256, 1) void attn_split_gqa(const float* q, const float* kc, const float* vc, float* part,
                                                                    const int* pos_ptr, int heads, int nkv, int hd, float scale, int min_chunk) {
    attn_split_gqa_p_body<2, false>(q, kc, vc, part, pos_ptr, heads, nkv, hd, scale, min_chunk);
}
extern "C" __global__ __launch_bounds__(256, 1) void attn_split_gqa4(const float* q, const float* kc, const float* vc, float* part,
                                                                     const int* pos_ptr, int heads, int nkv, int hd, float scale, int min_chunk) {
    attn_split_gqa_p_body<4, false>(q, kc, vc, part, pos_ptr, heads, nkv, hd, scale, min_chunk);
}
// attn_split_gqa4x: attn_split_gqa4 with XR (one score a lane, above): the decode attention's
// default (REDLITE_CUDA_ATTN_XR; session 23: +4.5 % decode at position 32,768 on the H200).
extern "C" __global__ __launch_bounds__(256, 1) void attn_split_gqa4x(const float* q, const float* kc, const float* vc, float* part,
                                                                      const int* pos_ptr, int heads, int nkv, int hd, float scale, int min_chunk) {
    attn_split_gqa_p_body<4, true>(q, kc, vc, part, pos_ptr, heads, nkv, hd, scale, min_chunk);
}
// The same three on an f16 cache.
extern "C" __global__ __launch_bounds__(256, 1) void attn_split_gqa_h(const float* q, const u16* kc, const u16* vc, float* part,
                                                                      const int* pos_ptr, int heads, int nkv, int hd, float scale, int min_chunk) {
    attn_split_gqa_p_body<2, false>(q, kc, vc, part, pos_ptr, heads, nkv, hd, scale, min_chunk);
}
extern "C" __global__ __launch_bounds__(256, 1) void attn_split_gqa4_h(const float* q, const u16* kc, const u16* vc, float* part,
                                                                       const int* pos_ptr, int heads, int nkv, int hd, float scale, int min_chunk) {
    attn_split_gqa_p_body<4, false>(q, kc, vc, part, pos_ptr, heads, nkv, hd, scale, min_chunk);
}
extern "C" __global__ __launch_bounds__(256, 1) void attn_split_gqa4x_h(const float* q, const u16* kc, const u16* vc, float* part,
                                                                        const int* pos_ptr, int heads, int nkv, int hd, float scale, int min_chunk) {
    attn_split_gqa_p_body<4, true>(q, kc, vc, part, pos_ptr, heads, nkv, hd, scale, min_chunk);
}
// attn_split_gqa8x_h: attn_split_gqa4x_h with 8 rows loaded a warp step (two XR sub-steps of 4):
// the packed f16 rows of 8 positions take the registers of 4 f32 ones, twice the bytes in flight.
extern "C" __global__ __launch_bounds__(256, 1) void attn_split_gqa8x_h(const float* q, const u16* kc, const u16* vc, float* part,
                                                                        const int* pos_ptr, int heads, int nkv, int hd, float scale, int min_chunk) {
    attn_split_gqa_p_body<4, true, u16, 8>(q, kc, vc, part, pos_ptr, heads, nkv, hd, scale, min_chunk);
}
// attn_split_gqa4xp_h: attn_split_gqa4x_h with the next warp step's rows loaded ahead (PF above):
// the same rows for the same warps, so its bits are attn_split_gqa4x_h's.
extern "C" __global__ __launch_bounds__(256, 1) void attn_split_gqa4xp_h(const float* q, const u16* kc, const u16* vc, float* part,
                                                                         const int* pos_ptr, int heads, int nkv, int hd, float scale, int min_chunk) {
    attn_split_gqa_p_body<4, true, u16, 4, true>(q, kc, vc, part, pos_ptr, heads, nkv, hd, scale, min_chunk);
}

// attn_split_gqa8xh3_h: the f16 split with a KV head's query heads over two blocks (HSPLIT = 2;
// head_dim 256 and 8 query heads a KV head only: 4 heads and 4 warps a block, 8 rows a warp step
// for XR's 32 scores a warp), so that more warps fit an SM than attn_split_gqa4x_h's 212
// registers allow (one 8-warp block): at most 168 registers a thread (161 with NVRTC 13.0, no
// spills) and three blocks (12 warps) an SM. The model's default where the shape fits (session
// 27 on the H200: short decode +1.3 % against 4xp, position 32,768 even; alone at 32K 32.0 µs
// against 4xp's 32.6). A (128, 4) bound (16 warps an SM, 128 registers with the accumulators
// spilled around their rescale) was slower: 34.3 µs alone, short +1.0 %, 32K −0.5 %; removed.
// Launch: grid = (2 nkv, splits, tokens), block = 32 * heads / nkv / 2 threads; splits as many
// as fill one wave.
__device__ __forceinline__ void attn_split_gqa8xh_body(const float* q, const u16* kc, const u16* vc, float* part,
                                                       const int* pos_ptr, int heads, int nkv, int hd, float scale,
                                                       int min_chunk) {
    __shared__ float sm[8][8], sl[8][8];
    __shared__ float sacc[4 * (8 * WARP + 8)];
    pdl_enter();
    if (hd != 8 * WARP || heads != 8 * nkv) __trap();  // the host launches it for this shape only
    attn_split_gqa_body<8, 4, 8, true, u16, 8, false, 2>(q + ((size_t)blockIdx.z * heads + blockIdx.x * 4) * hd, kc,
                                                         vc, part, pos_ptr, heads, nkv, hd, scale, min_chunk, sm, sl,
                                                         sacc);
}
extern "C" __global__ __launch_bounds__(128, 3) void attn_split_gqa8xh3_h(const float* q, const u16* kc, const u16* vc, float* part,
                                                                          const int* pos_ptr, int heads, int nkv, int hd, float scale, int min_chunk) {
    attn_split_gqa8xh_body(q, kc, vc, part, pos_ptr, heads, nkv, hd, scale, min_chunk);
}

// attn_split_mma_h(q, kc, vc, part, pos, heads, nkv, hd, scale, min_chunk): attn_split_gqa on the
// tensor cores, for an f16 cache and head_dim 64, 128 or 256 (REDLITE_CUDA_ATTN_H=mma). Same
// launch, chunking and part layout as attn_split_gqa (block (g, c, t), 32 · G threads for the G =
// heads / nkv query heads of KV head g, so attn_merge is unchanged); warp w takes the chunk's tiles
// of 16 positions j0 + 16 (w + k · warps), with Q (times the scale, rounded to f16, as the prompt
// kernels do) and P in f16, products summed in f32:
// - S = Q · Kᵀ (m16n8k16; rows = the G heads, rows G..15 zero; two n8 tiles of positions j + n).
//   Kᵀ is the col-major B operand, so its fragments come straight from the cache rows: lane
//   (gq, cq) (gq = lane / 4, cq = lane % 4) loads 16 bytes of row j + 8 nt + gq at dims
//   32 s + 8 cq .. + 7 and uses words 0–1 for one k-step and 2–3 for the next. A dot product does
//   not care which k-slot a dimension takes as long as Q and K agree, and Q's fragments (staged once
//   in shared memory, the same for every warp) are permuted the same way.
// - The online softmax on S's fragments: a head's max over the 4 lanes that hold its row.
// - Oᵀ = Vᵀ · Pᵀ (rows = 16 dims, cols = the 8 heads, k = 16 positions): Pᵀ's B fragments are
//   S's accumulators as they are (lane (gq, cq): head gq, positions j + 2 cq, + 1, + 8, + 9), and
//   Vᵀ's A fragments pair two positions of one dimension: lane (gq, cq) loads rows j + 2 cq, + 1,
//   + 8, + 9 at dims (hd / 8) gq .. + hd / 8 - 1 and pairs them with byte permutes (M tile mt takes
//   dims (hd / 8) gq + 2 mt and + 1 as rows gq and gq + 8). Lane (gq, cq) ends with heads 2 cq,
//   2 cq + 1 of those dims.
// New bits (f16 Q and P): the prompt kernels' tolerance against the f64 reference; rows of a
// several-token call keep the one-token call's bits (same chunking, same tiles).
#define AMMA_MAX_G 8
template <int HD>
__device__ __forceinline__ void attn_split_mma_body(const float* __restrict__ q, const u16* __restrict__ kc,
                                                    const u16* __restrict__ vc, float* __restrict__ part,
                                                    const int* __restrict__ pos_ptr, int heads, int nkv,
                                                    float scale, int min_chunk) {
    constexpr int KS = HD / 32;  // 16-byte K pieces of a lane per row (two k-steps each)
    constexpr int MT = HD / 16;  // M tiles of Oᵀ (16 dims each); a lane's V words per row
    constexpr int VW = HD / 64;  // 16-byte V pieces of a lane per row
    // Shared rows of the block's heads: value i at i + i / 32, rows SROW apart (SROW % 32 = 4:
    // lanes of one store fall in 32 different banks for head_dim 256).
    constexpr int SROW = (HD + HD / 32 + 31) / 32 * 32 + 4;
    __shared__ uint4 qs[KS * WARP];
    __shared__ float sm[AMMA_MAX_G][AMMA_MAX_G], sl[AMMA_MAX_G][AMMA_MAX_G];
    __shared__ float sacc[AMMA_MAX_G * SROW];
    const int g = blockIdx.x, c = blockIdx.y, splits = gridDim.y, t = blockIdx.z;
    const int n = *pos_ptr + 1 + t;
    const int chunk = attn_chunk(n, splits, min_chunk);
    const int j0 = c * chunk;
    if (j0 >= n) return;  // the whole block
    const int j1 = min(n, j0 + chunk);
    const int G = heads / nkv;  // = the block's warps
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, nw = blockDim.x >> 5;
    const int gq = lane >> 2, cq = lane & 3;
    // Q's A fragments: entry s · 32 + l holds head l / 4's dims 32 s + 8 (l % 4) .. + 7.
    const float* qg = q + ((size_t)t * heads + (size_t)g * G) * HD;
    for (int i = tid; i < KS * WARP; i += blockDim.x) {
        const int s = i / WARP, hq = (i % WARP) >> 2, d = 32 * s + 8 * (i & 3);
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (hq < G) {
            const float4 a = *(const float4*)(qg + (size_t)hq * HD + d);
            const float4 b = *(const float4*)(qg + (size_t)hq * HD + d + 4);
            v = make_uint4(pack_f16x2(a.x * scale, a.y * scale), pack_f16x2(a.z * scale, a.w * scale),
                           pack_f16x2(b.x * scale, b.y * scale), pack_f16x2(b.z * scale, b.w * scale));
        }
        qs[i] = v;
    }
    __syncthreads();
    float acc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][e] = 0.0f;
    float m = NEG_INF, l = 0.0f;  // head gq's running max (the same in its 4 lanes), this lane's sum
    const size_t rs = (size_t)nkv * HD;  // elements between cache rows
    for (int j = j0 + 16 * w; j < j1; j += 16 * nw) {
        // Every load of the tile first (past the chunk: copies of its last row, weight 0).
        uint4 ka[KS], kb[KS], va[VW], vb[VW], vcc[VW], vd[VW];
        {
            const u16* k0 = kc + (size_t)min(j + gq, j1 - 1) * rs + (size_t)g * HD + 8 * cq;
            const u16* k1 = kc + (size_t)min(j + 8 + gq, j1 - 1) * rs + (size_t)g * HD + 8 * cq;
#pragma unroll
            for (int s = 0; s < KS; ++s) {
                ka[s] = *(const uint4*)(k0 + 32 * s);
                kb[s] = *(const uint4*)(k1 + 32 * s);
            }
            const u16* v0 = vc + (size_t)g * HD + (HD / 8) * gq;
            const u16* pa = v0 + (size_t)min(j + 2 * cq, j1 - 1) * rs;
            const u16* pb = v0 + (size_t)min(j + 2 * cq + 1, j1 - 1) * rs;
            const u16* pc = v0 + (size_t)min(j + 2 * cq + 8, j1 - 1) * rs;
            const u16* pd = v0 + (size_t)min(j + 2 * cq + 9, j1 - 1) * rs;
#pragma unroll
            for (int i = 0; i < VW; ++i) {
                va[i] = *(const uint4*)(pa + 8 * i);
                vb[i] = *(const uint4*)(pb + 8 * i);
                vcc[i] = *(const uint4*)(pc + 8 * i);
                vd[i] = *(const uint4*)(pd + 8 * i);
            }
        }
        // S: s0 positions j + 2 cq, + 1 (values 0, 1), s1 positions j + 8 + 2 cq, + 1.
        float s0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int s = 0; s < KS; ++s) {
            const uint4 qw = qs[s * WARP + lane];
            const u32 a0[4] = {qw.x, 0u, qw.y, 0u}, a1[4] = {qw.z, 0u, qw.w, 0u};
            const u32 b00[2] = {ka[s].x, ka[s].y}, b01[2] = {ka[s].z, ka[s].w};
            const u32 b10[2] = {kb[s].x, kb[s].y}, b11[2] = {kb[s].z, kb[s].w};
            mma_16816(s0, a0, b00);
            mma_16816(s0, a1, b01);
            mma_16816(s1, a0, b10);
            mma_16816(s1, a1, b11);
        }
        const int jb = j + 2 * cq;
        float sc[4] = {jb < j1 ? s0[0] : NEG_INF, jb + 1 < j1 ? s0[1] : NEG_INF, jb + 8 < j1 ? s1[0] : NEG_INF,
                       jb + 9 < j1 ? s1[1] : NEG_INF};
        float tmax = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
        const float mn = fmaxf(m, tmax);       // finite: position j is in the chunk
        const float corr = expf(m - mn);       // 0 on the first tile (m = -inf)
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) p[e] = expf(sc[e] - mn);  // 0 past the chunk
        l = l * corr + ((p[0] + p[1]) + (p[2] + p[3]));
        m = mn;
        // Oᵀ's columns 2 cq, 2 cq + 1 are heads 2 cq, 2 cq + 1: their rescales from lanes 8 cq, 8 cq + 4.
        const float ca = __shfl_sync(0xffffffffu, corr, 8 * cq), cb = __shfl_sync(0xffffffffu, corr, 8 * cq + 4);
        const u32 pf[2] = {pack_f16x2(p[0], p[1]), pack_f16x2(p[2], p[3])};
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const u32 wa = ((const u32*)&va[mt / 4])[mt % 4], wb = ((const u32*)&vb[mt / 4])[mt % 4];
            const u32 wc = ((const u32*)&vcc[mt / 4])[mt % 4], wd = ((const u32*)&vd[mt / 4])[mt % 4];
            const u32 a[4] = {__byte_perm(wa, wb, 0x5410), __byte_perm(wa, wb, 0x7632), __byte_perm(wc, wd, 0x5410),
                              __byte_perm(wc, wd, 0x7632)};
            acc[mt][0] *= ca;
            acc[mt][1] *= cb;
            acc[mt][2] *= ca;
            acc[mt][3] *= cb;
            mma_16816(acc[mt], a, pf);
        }
    }
    // The warps' partials merged in warp order, as attn_split_gqa does (warps without a tile:
    // m = -inf, weight 0, skipped).
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (cq == 0 && gq < G) {
        sm[w][gq] = m;
        sl[w][gq] = l;
    }
    __syncthreads();
    const int ha = 2 * cq, hb = 2 * cq + 1;
    // This warp's weights for heads ha and hb (0 for heads past G).
    auto weight = [&](int hh) {
        if (hh >= G) return 0.0f;
        float mx = NEG_INF;
        for (int k = 0; k < nw; ++k) mx = fmaxf(mx, sm[k][hh]);
        return sm[w][hh] == NEG_INF ? 0.0f : expf(sm[w][hh] - mx);
    };
    const float fa = weight(ha), fb = weight(hb);
    const int act = min(nw, (j1 - j0 + 15) / 16);
    const int base = (HD / 8) * gq + ((HD / 8) * gq) / WARP;  // a lane's dims never cross a 32 boundary
#pragma unroll 1
    for (int k = 0; k < act; ++k) {
        if (w == k && ha < G) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float* xa = &sacc[ha * SROW + base + 2 * mt];
                xa[0] = (k == 0 ? 0.0f : xa[0]) + acc[mt][0] * fa;
                xa[1] = (k == 0 ? 0.0f : xa[1]) + acc[mt][2] * fa;
                if (hb < G) {
                    float* xb = &sacc[hb * SROW + base + 2 * mt];
                    xb[0] = (k == 0 ? 0.0f : xb[0]) + acc[mt][1] * fb;
                    xb[1] = (k == 0 ? 0.0f : xb[1]) + acc[mt][3] * fb;
                }
            }
        }
        __syncthreads();
    }
    // Warp h writes head h's {max, sum, acc}.
    const int h = w;
    float mm = NEG_INF;
    for (int k = 0; k < nw; ++k) mm = fmaxf(mm, sm[k][h]);
    float* out = part + (((size_t)t * heads + (size_t)g * G + h) * splits + c) * (HD + 2);
    if (lane == 0) {
        float ll = 0.0f;
        for (int k = 0; k < nw; ++k) ll += sm[k][h] == NEG_INF ? 0.0f : sl[k][h] * expf(sm[k][h] - mm);
        out[0] = mm;
        out[1] = ll;
    }
#pragma unroll
    for (int i = lane; i < HD; i += WARP) out[2 + i] = sacc[h * SROW + i + i / WARP];
}

// The wait, then the body for the head dimension (64, 128 or 256; the host checks it).
__device__ __forceinline__ void attn_split_mma_hd_body(const float* q, const u16* kc, const u16* vc, float* part,
                                                       const int* pos_ptr, int heads, int nkv, int hd, float scale,
                                                       int min_chunk) {
    pdl_enter();
    if (hd == 64) attn_split_mma_body<64>(q, kc, vc, part, pos_ptr, heads, nkv, scale, min_chunk);
    else if (hd == 128) attn_split_mma_body<128>(q, kc, vc, part, pos_ptr, heads, nkv, scale, min_chunk);
    else if (hd == 256) attn_split_mma_body<256>(q, kc, vc, part, pos_ptr, heads, nkv, scale, min_chunk);
}
extern "C" __global__ __launch_bounds__(256, 1) void attn_split_mma_h(const float* q, const u16* kc, const u16* vc, float* part,
                                                                      const int* pos_ptr, int heads, int nkv, int hd, float scale, int min_chunk) {
    attn_split_mma_hd_body(q, kc, vc, part, pos_ptr, heads, nkv, hd, scale, min_chunk);
}
// (Session 27: the same body at __launch_bounds__(256, 2), two blocks an SM at 128 registers with
// a 24-byte stack, took 33.8 µs alone at 32K against this one's 30.3: removed.)

// attn_merge(part, gate, o, pos, splits, hd, min_chunk): query head h = blockIdx.x, values
// i = 32 blockIdx.y + lane: o[h][i] = (sum_c acc_c[i] e^(m_c - M)) / (sum_c l_c e^(m_c - M)) *
// sigmoid(gate[h][i]) over the active chunks of attn_split (M = max m_c); gate may be null. The
// chunk weights are computed once per block (threads over chunks), then warp w adds up chunks
// w, w + ATTN_MERGE_WARPS, ... (loads of several chunks in flight) and the warps' sums are added
// in order. splits <= ATTN_MAX_SPLITS.
// Token t = blockIdx.z, as attn_split. Launch: grid = (heads, ceil(hd / 32), tokens),
// block = 32 * ATTN_MERGE_WARPS.
#define ATTN_MAX_SPLITS 512
#define ATTN_MERGE_WARPS 8
extern "C" __global__ void attn_merge(const float* __restrict__ part, const float* __restrict__ gate,
                                      float* __restrict__ o, const int* __restrict__ pos_ptr, int splits, int hd,
                                      int min_chunk) {
    pdl_enter();
    __shared__ float wc[ATTN_MAX_SPLITS];
    __shared__ float scratch[WARP];
    __shared__ float red[ATTN_MERGE_WARPS][WARP];
    const int h = blockIdx.x, lane = threadIdx.x % WARP, w = threadIdx.x / WARP, t = blockIdx.z;
    const int i = blockIdx.y * WARP + lane;
    const int n = *pos_ptr + 1 + t;
    const int chunk = attn_chunk(n, splits, min_chunk);
    const int active = min((n + chunk - 1) / chunk, ATTN_MAX_SPLITS);
    const size_t stride = (size_t)hd + 2;
    const size_t th = (size_t)t * gridDim.x + h;  // (token, head)
    const float* ph = part + th * splits * stride;
    float mm = NEG_INF;
    for (int c = threadIdx.x; c < active; c += blockDim.x) mm = fmaxf(mm, ph[c * stride]);
    mm = block_max(mm, scratch);
    float ll = 0.0f;
    for (int c = threadIdx.x; c < active; c += blockDim.x) {
        const float f = expf(ph[c * stride] - mm);
        wc[c] = f;
        ll += ph[c * stride + 1] * f;
    }
    ll = block_sum(ll, scratch);  // its barriers also publish wc
    float a = 0.0f;
    if (i < hd) {
#pragma unroll 4
        for (int c = w; c < active; c += ATTN_MERGE_WARPS) a += ph[c * stride + 2 + i] * wc[c];
    }
    red[w][lane] = a;
    __syncthreads();
    if (w == 0 && i < hd) {
        float sum = 0.0f;
        for (int k = 0; k < ATTN_MERGE_WARPS; ++k) sum += red[k][lane];
        const size_t at = th * hd + i;
        o[at] = gate == nullptr ? sum / ll : (sum / ll) * sigmoidf_(gate[at]);
    }
}

