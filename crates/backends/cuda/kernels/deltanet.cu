// Gated DeltaNet, one decode step (the recurrent form). The pieces, in order:
//   dn_conv_step   causal depthwise conv over [state | new input], SiLU, state shifted
//   l2_normalize   (norm.cu) q and k per QK head, q also scaled by 1/sqrt(dk)
//   dn_gates       beta = sigmoid(b), g = A * softplus(a + dt_bias) per V head
//   dn_delta_step  S <- exp(g) S; m = S^T k; S += k (beta (v - m))^T; o = S^T q
//   rms_norm_gated (norm.cu) RMSNorm(o) w * silu(z)
// and their multi-token forms for the device-resident model (prompt and decode alike):
//   dn_conv_seq    the conv over n tokens, state carried through
//   dn_qk_norm     L2 norm of q and k of every QK head of every token, in place in the conv output
//   dn_delta_seq   the recurrence over n tokens in one launch (tokens in order, heads in parallel)

// dn_conv_step(x, state, w, y, ch, kern): channel c = thread; history = state rows 0..kern-2
// ([kern-1][ch], oldest first) then x; y[c] = silu(sum_j w[c][j] * history[j][c]); the state then
// drops its oldest row and appends x. Launch: ceil(ch / block) blocks.
extern "C" __global__ void dn_conv_step(const float* __restrict__ x, float* __restrict__ state,
                                        const float* __restrict__ w, float* __restrict__ y, int ch, int kern) {
    pdl_enter();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= ch) return;
    float acc = 0.0f;
    for (int j = 0; j < kern - 1; ++j) acc += w[(size_t)c * kern + j] * state[(size_t)j * ch + c];
    acc += w[(size_t)c * kern + kern - 1] * x[c];
    y[c] = siluf_(acc);
    for (int j = 0; j + 1 < kern - 1; ++j) state[(size_t)j * ch + c] = state[(size_t)(j + 1) * ch + c];
    if (kern > 1) state[(size_t)(kern - 2) * ch + c] = x[c];
}

__device__ __forceinline__ float softplusf_(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// dn_gates(ba, a, dt_bias, beta, g, nv, r): ba is grouped per QK head, [b-logits of its r V heads |
// a-logits of its r V heads]. Launch: ceil(nv / block) blocks.
// Token t = blockIdx.y reads ba[t] ([2 nv]) and writes beta[t], g[t] ([nv]); gridDim.y = tokens.
extern "C" __global__ void dn_gates(const float* __restrict__ ba, const float* __restrict__ a,
                                    const float* __restrict__ dt_bias, float* __restrict__ beta,
                                    float* __restrict__ g, int nv, int r) {
    pdl_enter();
    const int h = blockIdx.x * blockDim.x + threadIdx.x;
    if (h >= nv) return;
    const size_t t = blockIdx.y;
    const float* bat = ba + t * 2 * nv;
    const int grp = h / r, j = h % r;
    beta[t * nv + h] = sigmoidf_(bat[grp * 2 * r + j]);
    g[t * nv + h] = a[h] * softplusf_(bat[grp * 2 * r + r + j] + dt_bias[h]);
}

// dn_delta_step(qkv, beta, g, s, o, nk, dk, dv): one token of the gated delta rule for V head
// h = blockIdx.x. qkv is the conv output [q (nk*dk) | k (nk*dk) | v (nv*dv)] with q and k already
// normalised; V head h reads QK head h / (nv / nk). s is [nv][dk][dv]; thread j owns column j.
// Launch: grid = nv, block = dv threads (dv <= 1024), dynamic shared memory = 2 * dk floats.
extern "C" __global__ void dn_delta_step(const float* __restrict__ qkv, const float* __restrict__ beta,
                                         const float* __restrict__ g, float* __restrict__ s,
                                         float* __restrict__ o, int nk, int dk, int dv) {
    pdl_enter();
    extern __shared__ float qk[];  // q then k of this head's QK head
    const int h = blockIdx.x, nv = gridDim.x;
    const int kh = h / (nv / nk);
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        qk[i] = qkv[kh * dk + i];
        qk[dk + i] = qkv[nk * dk + kh * dk + i];
    }
    __syncthreads();
    const int j = threadIdx.x;
    if (j >= dv) return;
    float* sh = s + (size_t)h * dk * dv;
    const float alpha = expf(g[h]);
    const float v = qkv[2 * nk * dk + h * dv + j];
    float m = 0.0f;
    for (int i = 0; i < dk; ++i) {
        const float x = sh[(size_t)i * dv + j] * alpha;
        sh[(size_t)i * dv + j] = x;
        m += x * qk[dk + i];
    }
    const float delta = beta[h] * (v - m);
    float out = 0.0f;
    for (int i = 0; i < dk; ++i) {
        const float x = sh[(size_t)i * dv + j] + qk[dk + i] * delta;
        sh[(size_t)i * dv + j] = x;
        out += x * qk[i];
    }
    o[(size_t)h * dv + j] = out;
}

#define DN_MAX_KERN 8

// Tokens t0 .. t1 - 1 of channel c through the causal conv + SiLU: y[t][c] = silu(Σ_j w[c][j] ·
// window[j]), the window (hist: the kern − 1 previous inputs, oldest first, then x[t]) moved along
// in registers; hist ends as the last kern − 1 inputs.
__device__ __forceinline__ void dn_conv_tokens(const float* __restrict__ x, float* __restrict__ y,
                                               const float* wc, float* hist, int t0, int t1, int ch, int c,
                                               int kern) {
    for (int t = t0; t < t1; ++t) {
        const float xt = x[(size_t)t * ch + c];
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < DN_MAX_KERN - 1; ++j) {
            if (j < kern - 1) acc += wc[j] * hist[j];
        }
        acc += wc[kern - 1] * xt;
        y[(size_t)t * ch + c] = siluf_(acc);
#pragma unroll
        for (int j = 0; j < DN_MAX_KERN - 1; ++j) {
            if (j + 1 < kern - 1) hist[j] = hist[j + 1];
            else if (j + 1 == kern - 1) hist[j] = xt;
        }
    }
}

// dn_conv_seq(x, state, w, y, n, ch, kern): the causal depthwise conv over n tokens, x and y
// [n][ch]; channel c = thread keeps its window in registers. y[t][c] = silu(sum_j w[c][j] *
// history[t + j][c]) over [state (kern-1 rows, oldest first) | x]; the state ends as the last kern-1
// inputs. kern <= DN_MAX_KERN. Launch: ceil(ch / block) blocks.
extern "C" __global__ void dn_conv_seq(const float* __restrict__ x, float* __restrict__ state,
                                       const float* __restrict__ w, float* __restrict__ y, int n, int ch,
                                       int kern) {
    pdl_enter();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= ch) return;
    float wc[DN_MAX_KERN], hist[DN_MAX_KERN];
#pragma unroll
    for (int j = 0; j < DN_MAX_KERN; ++j) {
        wc[j] = j < kern ? w[(size_t)c * kern + j] : 0.0f;
        hist[j] = j < kern - 1 ? state[(size_t)j * ch + c] : 0.0f;
    }
    dn_conv_tokens(x, y, wc, hist, 0, n, ch, c, kern);
#pragma unroll
    for (int j = 0; j < DN_MAX_KERN - 1; ++j) {
        if (j < kern - 1) state[(size_t)j * ch + c] = hist[j];
    }
}

// dn_conv_prompt(x, state, w, y, n, ch, kern): dn_conv_seq's outputs for a prompt with every
// (token tile, channel) in parallel (the conv is not recurrent: row t reads inputs t − kern + 1 ..
// t of [state | x]); the same arithmetic per output as dn_conv_seq, bit for bit. The state is
// left as it was: dn_conv_shift moves it afterwards. Launch: grid = (ceil(ch / 128),
// ceil(n / DNC_TOK)), block = 128.
#define DNC_TOK 32
extern "C" __global__ void dn_conv_prompt(const float* __restrict__ x, const float* __restrict__ state,
                                          const float* __restrict__ w, float* __restrict__ y, int n, int ch,
                                          int kern) {
    pdl_enter();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= ch) return;
    const int t0 = blockIdx.y * DNC_TOK, t1 = min(n, t0 + DNC_TOK);
    float wc[DN_MAX_KERN], hist[DN_MAX_KERN];
#pragma unroll
    for (int j = 0; j < DN_MAX_KERN; ++j) {
        const int src = t0 - (kern - 1) + j;  // index into x; negative: the state's rows
        wc[j] = j < kern ? w[(size_t)c * kern + j] : 0.0f;
        hist[j] = j < kern - 1 ? (src >= 0 ? x[(size_t)src * ch + c] : state[(size_t)(kern - 1 + src) * ch + c])
                               : 0.0f;
    }
    dn_conv_tokens(x, y, wc, hist, t0, t1, ch, c, kern);
}

// dn_conv_shift(x, state, n, ch, kern): the conv state after n tokens of x: the last kern − 1
// inputs of [state | x]. Launch: ceil(ch / 128) blocks of 128.
extern "C" __global__ void dn_conv_shift(const float* __restrict__ x, float* __restrict__ state, int n, int ch,
                                         int kern) {
    pdl_enter();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= ch) return;
    float nw[DN_MAX_KERN];
    for (int j = 0; j < kern - 1; ++j) {
        const int m = n + j;  // index into [state rows | tokens]
        nw[j] = m < kern - 1 ? state[(size_t)m * ch + c] : x[(size_t)(m - (kern - 1)) * ch + c];
    }
    for (int j = 0; j < kern - 1; ++j) state[(size_t)j * ch + c] = nw[j];
}

// dn_qk_norm(qkv, ch, nk, dk, eps, q_scale): in place on the conv output [n][ch] (ch starts with
// q of the nk QK heads, then k): row r = blockIdx.x of token t = blockIdx.y (r < nk: q head r,
// else k head r - nk) becomes x * rsqrt(sum x^2 + eps), q rows then times q_scale.
// Launch: grid = (2 nk, n), block = any multiple of 32.
extern "C" __global__ void dn_qk_norm(float* __restrict__ qkv, int ch, int nk, int dk, float eps, float q_scale) {
    pdl_enter();
    __shared__ float scratch[WARP];
    float* xr = qkv + (size_t)blockIdx.y * ch + (size_t)blockIdx.x * dk;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss + eps);
    const float s = (int)blockIdx.x < nk ? q_scale : 1.0f;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) xr[i] = (xr[i] * inv) * s;
}

// dn_delta_seq(qkv, beta, g, s, o, n, ch, nk, dk, dv): the gated delta rule over n tokens, in
// order (the recurrent form of dn_delta_step, token after token in one launch). qkv [n][ch] is the
// normalised conv output, beta and g [n][nv], s [nv][dk][dv] is updated, o is [n][nv][dv].
// Block (h, c) = (blockIdx.x, blockIdx.y) takes V head h, state columns j = 32c + lane; warp w
// holds rows 32w .. 32w + 31 of those columns in registers for the whole run (read once, written
// once), and the two column sums per token (S^T k, then S^T q) are added up over the warps
// through shared memory.
// Launch: grid = (nv, ceil(dv / 32)), block = 32 * ceil(dk / 32) threads (dk <= 1024),
// dynamic shared memory = (2 * dk + blockDim.x) floats.
#define DN_ROWS 32
// dn_delta_seq's per-warp column sums as this many interleaved chains (1: the plain sequential
// sum; 4: an experiment, not yet measured on a GPU, for prompts where the 32-long chain of
// dependent multiply-adds per token is the critical path).
#ifndef DN_SEQ_CHAINS
#define DN_SEQ_CHAINS 1
#endif
__device__ __forceinline__ float dn_chains_sum(const float* c) {
    if (DN_SEQ_CHAINS == 1) return c[0];
    float s = 0.0f;
#pragma unroll
    for (int q = 0; q < DN_SEQ_CHAINS; ++q) s += c[q];
    return s;
}
extern "C" __global__ void dn_delta_seq(const float* __restrict__ qkv, const float* __restrict__ beta,
                                        const float* __restrict__ g, float* __restrict__ s,
                                        float* __restrict__ o, int n, int ch, int nk, int dk, int dv) {
    pdl_enter();
    extern __shared__ float sm[];
    float* qs = sm;              // q of this head's QK head, current token
    float* ks = sm + dk;         // k
    float* part = sm + 2 * dk;   // [warps][32] partial column sums
    const int h = blockIdx.x, nv = gridDim.x;
    const int kh = h / (nv / nk);
    const int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, warps = blockDim.x / WARP;
    const int j = blockIdx.y * WARP + lane;
    const bool col = j < dv;
    const int i0 = w * DN_ROWS;
    float* sh = s + (size_t)h * dk * dv;
    float st[DN_ROWS];
#pragma unroll
    for (int r = 0; r < DN_ROWS; ++r) {
        const int i = i0 + r;
        st[r] = (col && i < dk) ? sh[(size_t)i * dv + j] : 0.0f;
    }
    // This thread's share of a token's inputs (blockDim.x >= dk: element threadIdx.x of q and k),
    // fetched one token ahead so the loads' latency overlaps the previous token's arithmetic.
    const int li = threadIdx.x;
    float nq = 0.0f, nkv = 0.0f, nvv = 0.0f, ng = 0.0f, nb = 0.0f;
    auto fetch = [&](int t) {
        const float* row = qkv + (size_t)t * ch;
        if (li < dk) {
            nq = row[kh * dk + li];
            nkv = row[nk * dk + kh * dk + li];
        }
        nvv = col ? row[2 * nk * dk + h * dv + j] : 0.0f;
        ng = g[(size_t)t * nv + h];
        nb = beta[(size_t)t * nv + h];
    };
    if (n > 0) fetch(0);
    for (int t = 0; t < n; ++t) {
        __syncthreads();  // the previous token's q, k and partial sums are no longer read
        if (li < dk) {
            qs[li] = nq;
            ks[li] = nkv;
        }
        const float alpha = expf(ng), v = nvv, bt = nb;
        __syncthreads();
        if (t + 1 < n) fetch(t + 1);
        // The column sums over this warp's rows: one chain, or DN_SEQ_CHAINS interleaved chains
        // added at the end (a shorter dependency chain per token; another summation order).
        float mc[DN_SEQ_CHAINS];
#pragma unroll
        for (int q = 0; q < DN_SEQ_CHAINS; ++q) mc[q] = 0.0f;
#pragma unroll
        for (int r = 0; r < DN_ROWS; ++r) {
            if (i0 + r < dk) {
                st[r] *= alpha;
                mc[r % DN_SEQ_CHAINS] += st[r] * ks[i0 + r];
            }
        }
        part[w * WARP + lane] = dn_chains_sum(mc);
        __syncthreads();
        float mt = 0.0f;
        for (int ww = 0; ww < warps; ++ww) mt += part[ww * WARP + lane];
        const float delta = bt * (v - mt);
        float oc[DN_SEQ_CHAINS];
#pragma unroll
        for (int q = 0; q < DN_SEQ_CHAINS; ++q) oc[q] = 0.0f;
#pragma unroll
        for (int r = 0; r < DN_ROWS; ++r) {
            if (i0 + r < dk) {
                st[r] += ks[i0 + r] * delta;
                oc[r % DN_SEQ_CHAINS] += st[r] * qs[i0 + r];
            }
        }
        __syncthreads();  // every warp has read the S^T k sums
        part[w * WARP + lane] = dn_chains_sum(oc);
        __syncthreads();
        if (w == 0 && col) {
            float ot = 0.0f;
            for (int ww = 0; ww < warps; ++ww) ot += part[ww * WARP + lane];
            o[((size_t)t * nv + h) * dv + j] = ot;
        }
    }
#pragma unroll
    for (int r = 0; r < DN_ROWS; ++r) {
        const int i = i0 + r;
        if (col && i < dk) sh[(size_t)i * dv + j] = st[r];
    }
}

// dn_delta_warp_<dk>(qkv, beta, g, s, o, n, ch, nk, dv): the recurrence of dn_delta_seq (same
// arguments, same per-row operations) for prompts, dk = 64 or 128, dv a multiple of 32. Block
// (h, c) takes V head h, state columns 32c .. 32c + 31; warp w takes 8 of them, lane = 4 cl + p
// holds column j = 32c + 8w + cl, rows p dk/4 .. (p + 1) dk/4 - 1, in registers. A token's column
// sums S^T k and S^T q are the lane's own rows (4 interleaved chains) and two xor-shuffles over
// the column's 4 lanes (each lane ends with the same sum): no barrier per token. The inputs come
// in chunks of DNW_T tokens staged in shared memory (q and k of the head's QK head, the block's 32
// v columns, g, beta): the next chunk's loads are issued into registers before this chunk's
// tokens run and stored after them, one barrier per chunk. (dn_delta_seq's 4 barriers per token
// made it ≈ 1 µs a token a layer on the H200; one-token-ahead register prefetch without the
// barriers, 0.8 µs: the loads' latency was the critical path.)
// Launch: grid = (nv, dv / 32), block = 128 threads.
#define DNW_T 16
template <int DK>
__device__ __forceinline__ void dn_delta_warp_body(const float* __restrict__ qkv, const float* __restrict__ beta,
                                                   const float* __restrict__ g, float* __restrict__ s,
                                                   float* __restrict__ o, int n, int ch, int nk, int dv) {
    constexpr int R = DK / 4;          // state rows per lane
    constexpr int QP = R + 4;          // a quarter's pitch in shared memory (padding: no bank conflicts)
    constexpr int TOK = 8 * QP;        // floats per token: q quarters, then k quarters
    constexpr int QK4 = 2 * DK / 4;    // float4s of q and k per token
    constexpr int LOADS = DNW_T * QK4 / 128;  // float4s of q/k per thread per chunk
    static_assert(DNW_T * QK4 % 128 == 0 && DNW_T * 8 == 128, "chunk shape");
    __shared__ __align__(16) float qk_s[2][DNW_T * TOK];
    __shared__ __align__(16) float v_s[2][DNW_T * 32];
    __shared__ float gb_s[2][2 * DNW_T];

    const int h = blockIdx.x, nv = gridDim.x, kh = h / (nv / nk);
    const int tid = threadIdx.x, lane = tid % WARP, w = tid / WARP;
    const int c0 = blockIdx.y * 32;
    const int jl = 8 * w + lane / 4, j = c0 + jl, p = lane % 4, i0 = p * R;
    float* sh = s + (size_t)h * DK * dv;
    float st[R];
#pragma unroll
    for (int r = 0; r < R; ++r) st[r] = sh[(size_t)(i0 + r) * dv + j];

    // The staging registers of one chunk's inputs and where they go.
    float4 lq[LOADS], lv;
    float lgb = 0.0f;
    auto load = [&](int t0) {
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int f = tid + 128 * u, tok = f / QK4, e = 4 * (f % QK4);  // e < 2 DK: q then k
            const int t = t0 + tok;
            const int src = e < DK ? kh * DK + e : nk * DK + kh * DK + (e - DK);
            lq[u] = t < n ? *(const float4*)(qkv + (size_t)t * ch + src) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        {
            const int tok = tid / 8, t = t0 + tok;
            lv = t < n ? *(const float4*)(qkv + (size_t)t * ch + 2 * nk * DK + h * dv + c0 + 4 * (tid % 8))
                       : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        if (tid < 2 * DNW_T) {
            const int t = t0 + tid % DNW_T;
            lgb = t < n ? (tid < DNW_T ? g : beta)[(size_t)t * nv + h] : 0.0f;
        }
    };
    auto store = [&](int b) {
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int f = tid + 128 * u, tok = f / QK4, e = 4 * (f % QK4);
            const int which = e / DK, ee = e % DK;  // 0 q, 1 k; element of the head
            *(float4*)(qk_s[b] + tok * TOK + which * 4 * QP + (ee / R) * QP + ee % R) = lq[u];
        }
        *(float4*)(v_s[b] + 4 * tid) = lv;
        if (tid < 2 * DNW_T) gb_s[b][tid] = lgb;
    };

    if (n > 0) {
        load(0);
        store(0);
    }
    __syncthreads();
    for (int t0 = 0, b = 0; t0 < n; t0 += DNW_T, b ^= 1) {
        const bool more = t0 + DNW_T < n;
        if (more) load(t0 + DNW_T);  // in flight while this chunk's tokens run
        const int nt = min(DNW_T, n - t0);
        for (int tt = 0; tt < nt; ++tt) {
            const float* qs = qk_s[b] + tt * TOK + p * QP;
            const float* ks = qs + 4 * QP;
            const float alpha = expf(gb_s[b][tt]), bt = gb_s[b][DNW_T + tt], v = v_s[b][tt * 32 + jl];
            float k[R];
#pragma unroll
            for (int r = 0; r < R; r += 4) {
                const float4 k4 = *(const float4*)(ks + r);
                k[r] = k4.x, k[r + 1] = k4.y, k[r + 2] = k4.z, k[r + 3] = k4.w;
            }
            float m[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int r = 0; r < R; ++r) {
                st[r] *= alpha;
                m[r % 4] += st[r] * k[r];
            }
            float sk = (m[0] + m[1]) + (m[2] + m[3]);
            sk += __shfl_xor_sync(0xffffffffu, sk, 1);
            sk += __shfl_xor_sync(0xffffffffu, sk, 2);
            const float delta = bt * (v - sk);
            float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int r = 0; r < R; r += 4) {
                const float4 q4 = *(const float4*)(qs + r);
                const float q[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    st[r + u] += k[r + u] * delta;
                    a[u] += st[r + u] * q[u];
                }
            }
            float out = (a[0] + a[1]) + (a[2] + a[3]);
            out += __shfl_xor_sync(0xffffffffu, out, 1);
            out += __shfl_xor_sync(0xffffffffu, out, 2);
            if (p == 0) o[((size_t)(t0 + tt) * nv + h) * dv + j] = out;
        }
        if (more) store(b ^ 1);  // the other buffer: last read before the previous barrier
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < R; ++r) sh[(size_t)(i0 + r) * dv + j] = st[r];
}

extern "C" __global__ __launch_bounds__(128) void dn_delta_warp_64(const float* __restrict__ qkv,
                                                                   const float* __restrict__ beta,
                                                                   const float* __restrict__ g, float* __restrict__ s,
                                                                   float* __restrict__ o, int n, int ch, int nk,
                                                                   int dv) {
    pdl_enter();
    dn_delta_warp_body<64>(qkv, beta, g, s, o, n, ch, nk, dv);
}

extern "C" __global__ __launch_bounds__(128) void dn_delta_warp_128(const float* __restrict__ qkv,
                                                                    const float* __restrict__ beta,
                                                                    const float* __restrict__ g, float* __restrict__ s,
                                                                    float* __restrict__ o, int n, int ch, int nk,
                                                                    int dv) {
    pdl_enter();
    dn_delta_warp_body<128>(qkv, beta, g, s, o, n, ch, nk, dv);
}

#define DNF_ROWS 32
#define DNF_MAX_THREADS 1024

// The pieces of dn_fused_seq that dn_fused_cols shares (one source, so the same operations and
// the same contractions in both: their outputs agree bit for bit).

// Conv + SiLU of channel c for token t; history = [conv_state (kern - 1 rows) | qkv rows 0 .. t].
// tr (null: none): conv_trace's row t at channel c (dnf_conv_trace's values), written from the
// inputs read here: the window after token t is inputs t - kern + 2 .. t.
__device__ __forceinline__ float dnf_conv(const float* __restrict__ qkv, const float* __restrict__ conv_state,
                                          const float* __restrict__ conv_w, int t, int c, int ch, int kern,
                                          float* __restrict__ tr = nullptr) {
    const float* wc = conv_w + (size_t)c * kern;
    float acc = 0.0f;
    for (int jj = 0; jj < kern - 1; ++jj) {
        const int src = t - (kern - 1) + jj;
        const float hv = src >= 0 ? qkv[(size_t)src * ch + c] : conv_state[(size_t)(kern - 1 + src) * ch + c];
        if (tr != nullptr && jj > 0) tr[(size_t)(jj - 1) * ch] = hv;
        acc += wc[jj] * hv;
    }
    const float x = qkv[(size_t)t * ch + c];
    if (tr != nullptr) tr[(size_t)(kern - 2) * ch] = x;
    acc += wc[kern - 1] * x;
    return siluf_(acc);
}

// beta = sigmoid(b) and the decay exp(A softplus(a + dt_bias)) of one V head.
__device__ __forceinline__ void dnf_gates(float b, float al, float a_h, float dt_h, float& beta, float& decay) {
    beta = sigmoidf_(b);
    decay = expf(a_h * softplusf_(al + dt_h));
}

// In place, by one warp: x[0 .. dk) times 1 / sqrt(sum x^2 + eps), then times sc.
__device__ __forceinline__ void dnf_l2_norm(float* x, int dk, int lane, float eps, float sc) {
    float ss = 0.0f;
    for (int i = lane; i < dk; i += WARP) ss += x[i] * x[i];
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss + eps);
    __syncwarp();
    for (int i = lane; i < dk; i += WARP) x[i] = (x[i] * inv) * sc;
}

// The state rows' decay and their part of S^T k (k: the rows' k values).
__device__ __forceinline__ float dnf_decay_dot(float (&st)[DNF_ROWS], float alpha, const float* k) {
    float m = 0.0f;
#pragma unroll
    for (int q = 0; q < DNF_ROWS; ++q) {
        st[q] *= alpha;
        m += st[q] * k[q];
    }
    return m;
}

// S += k delta on the rows, and their part of S^T q.
__device__ __forceinline__ float dnf_update_dot(float (&st)[DNF_ROWS], const float* k, float delta, const float* q) {
    float out = 0.0f;
#pragma unroll
    for (int q_ = 0; q_ < DNF_ROWS; ++q_) {
        st[q_] += k[q_] * delta;
        out += st[q_] * q[q_];
    }
    return out;
}

// By one warp: 1 / rms of a V head's dv outputs (CG: read through L2, written by other blocks).
template <bool CG>
__device__ __forceinline__ float dnf_inv_rms(const float* o, int dv, int lane, float eps) {
    float ss = 0.0f;
    for (int i = lane; i < dv; i += WARP) {
        const float v = CG ? ld_cg(o + i) : o[i];
        ss += v * v;
    }
    ss = warp_sum(ss);
    return 1.0f / sqrtf(ss / (float)dv + eps);
}

__device__ __forceinline__ float dnf_gated(float o, float inv, float w, float z) { return (o * inv * w) * siluf_(z); }

// The conv window of channel c after n tokens: the last kern - 1 inputs of [conv_state | qkv],
// written over conv_state (every reader of the old window is done).
__device__ __forceinline__ void dnf_conv_window(const float* __restrict__ qkv, float* conv_state, int n, int c,
                                                int ch, int kern) {
    // In place, row jj from row n + jj > jj (n >= 1): every row is read before it is written.
    for (int jj = 0; jj < kern - 1; ++jj) {
        const int m = n + jj;  // index into [state rows | tokens]
        conv_state[(size_t)jj * ch + c] = m < kern - 1 ? conv_state[(size_t)m * ch + c] : qkv[(size_t)(m - (kern - 1)) * ch + c];
    }
}

// conv_trace row t of channel c: the window after token t.
__device__ __forceinline__ void dnf_conv_trace(const float* __restrict__ qkv, const float* __restrict__ conv_state,
                                               float* __restrict__ conv_trace, int t, int c, int ch, int kern) {
    for (int jj = 0; jj < kern - 1; ++jj) {
        const int m = t + 1 + jj;  // index into [state rows | tokens]
        conv_trace[((size_t)t * (kern - 1) + jj) * ch + c] =
            m < kern - 1 ? conv_state[(size_t)m * ch + c] : qkv[(size_t)(m - (kern - 1)) * ch + c];
    }
}

// Before the wait (`early` bit 1, conv kernel DNF_PRE_KERN wide): up to NPRE conv channels of a
// thread with their weights and their window (conv_state rows, written at least two launches
// back, as the delta state), so that after the wait only qkv is read for them. x: the channel's
// input of the last token run (the window at the end).
#define DNF_PRE_KERN 4
static_assert(DNF_PRE_KERN == 4, "dnf_conv_pre and dnf_conv_window_pre pick window rows 0..2 by hand");
template <int NPRE>
struct DnfConvRegs {
    int c[NPRE];  // the channel, or -1
    float w[NPRE][DNF_PRE_KERN], h[NPRE][DNF_PRE_KERN - 1], x[NPRE];
};

template <int NPRE>
__device__ __forceinline__ void dnf_pre_channel(DnfConvRegs<NPRE>& p, int i, int c, const float* __restrict__ conv_w,
                                                const float* __restrict__ conv_state, int ch) {
    p.c[i] = c;
    p.x[i] = 0.0f;
#pragma unroll
    for (int jj = 0; jj < DNF_PRE_KERN; ++jj) p.w[i][jj] = c >= 0 ? conv_w[(size_t)c * DNF_PRE_KERN + jj] : 0.0f;
#pragma unroll
    for (int jj = 0; jj < DNF_PRE_KERN - 1; ++jj) p.h[i][jj] = c >= 0 ? conv_state[(size_t)jj * ch + c] : 0.0f;
}

// Conv + SiLU of one channel from its window h (the inputs of tokens t - 3 .. t - 1) and its input
// x: dnf_conv's sum in dnf_conv's order; then the window slides by one (h ends as t - 2 .. t).
// tr, when not null: the window after the token, written as dnf_conv writes it.
__device__ __forceinline__ float dnf_conv_win(const float (&w)[DNF_PRE_KERN], float (&h)[DNF_PRE_KERN - 1], float x,
                                              float* __restrict__ tr, int ch) {
    float acc = 0.0f;
#pragma unroll
    for (int jj = 0; jj < DNF_PRE_KERN - 1; ++jj) {
        if (tr != nullptr && jj > 0) tr[(size_t)(jj - 1) * ch] = h[jj];
        acc += w[jj] * h[jj];
    }
    if (tr != nullptr) tr[(size_t)(DNF_PRE_KERN - 2) * ch] = x;
    acc += w[DNF_PRE_KERN - 1] * x;
    h[0] = h[1];
    h[1] = h[2];
    h[2] = x;
    return siluf_(acc);
}

// dnf_conv of channel p.c[i] at token t from the registers: its window gathered (earlier tokens'
// inputs from qkv, the carried-over state from p.h), then dnf_conv_win (the same operations in the
// same order). tr: as dnf_conv's.
template <int NPRE>
__device__ __forceinline__ float dnf_conv_pre(DnfConvRegs<NPRE>& p, int i, const float* __restrict__ qkv, int t,
                                              int ch, float* __restrict__ tr = nullptr) {
    const int c = p.c[i];
    float h[DNF_PRE_KERN - 1];
#pragma unroll
    for (int jj = 0; jj < DNF_PRE_KERN - 1; ++jj) {
        const int src = t - (DNF_PRE_KERN - 1) + jj, m = t + jj;
        h[jj] = src >= 0 ? qkv[(size_t)src * ch + c] : m == 0 ? p.h[i][0] : m == 1 ? p.h[i][1] : p.h[i][2];
    }
    p.x[i] = qkv[(size_t)t * ch + c];
    return dnf_conv_win(p.w[i], h, p.x[i], tr, ch);
}

// dnf_conv_window of channel p.c[i] after n >= 1 tokens, from the registers where it can.
template <int NPRE>
__device__ __forceinline__ void dnf_conv_window_pre(const DnfConvRegs<NPRE>& p, int i, const float* __restrict__ qkv,
                                                    float* __restrict__ conv_state, int n, int ch) {
    const int c = p.c[i];
    // The old rows come from the registers, so the rows can be written in any order.
#pragma unroll
    for (int jj = 0; jj < DNF_PRE_KERN - 1; ++jj) {
        const int m = n + jj, tok = m - (DNF_PRE_KERN - 1);  // index into [state rows | tokens]
        conv_state[(size_t)jj * ch + c] =
            m < DNF_PRE_KERN - 1 ? (m == 1 ? p.h[i][1] : p.h[i][2]) : tok == n - 1 ? p.x[i] : qkv[(size_t)tok * ch + c];
    }
}

// DNC_STAGE (default 1): dn_fused_cols_rows' conv of the preloaded channels over a chunk with a
// sliding window in registers: each token's input loaded once (DNC_STAGE_TOKENS tokens' loads of
// every channel in flight together) instead of the window's kern inputs per token, a token at a
// time, each waiting on its loads (the REDLITE_TRACE build, session 22: the prologue grew 1.4 µs
// a verify row, more than the recurrence). The same values and operations as dnf_conv_pre
// (the window holds the inputs dnf_conv_pre reads), so the same bits.
#ifndef DNC_STAGE
#define DNC_STAGE 1
#endif
#define DNC_STAGE_TOKENS 4

// dn_fused_seq(qkv, conv_state, conv_w, ba, a, dt_bias, s, z, norm_w, y, n, ch, nk, dk, dv, r, kern,
//              l2_eps, q_scale, rms_eps): the whole DeltaNet core of n tokens in one launch, from the
// projections to the gated norm: conv + SiLU (dn_conv_seq), q/k L2 norm (dn_qk_norm), beta and g
// (dn_gates), the delta rule (dn_delta_seq), RMSNorm(o) w ⊙ silu(z) (rms_norm_gated), token after
// token. qkv [n][ch] is the raw projection, ba [n][2 nv] (grouped per QK head as for dn_gates), z
// and y [n][nv][dv]; conv_state [kern-1][ch] and s [nv][dk][dv] are carried over.
// Block = QK head kh = blockIdx.x with its r = nv / nk V heads: it alone reads and writes the conv
// channels of q and k of kh and of v of those V heads, so its conv window needs no other block.
// Warp u = (hl, cc, rg) takes V head kh r + hl, state columns j = 32 cc + lane and rows
// DNF_ROWS rg .. DNF_ROWS (rg + 1) - 1 in registers (as dn_delta_seq); the column sums go over the
// rg warps in shared memory. dk must be a multiple of DNF_ROWS.
// s_trace / conv_trace (both null, or both set: the verify pass of speculative decoding) receive
// the states after every token t: s_trace[t] as s ([nv][dk][dv]), conv_trace[t] as conv_state
// ([kern-1][ch]), so a rollback to any row is a copy. early bit 0: the state rows are loaded before
// pdl_enter (see there); bit 1: also the first conv channel's weights and window, the gate
// parameters and a norm weight per thread (DnfConvRegs; kern == DNF_PRE_KERN, else ignored).
// Launch: grid = nk, block = 32 * r * ceil(dv / 32) * ceil(dk / DNF_ROWS) threads (<= DNF_MAX_THREADS),
// dynamic shared memory = (2 dk + 2 r dv + blockDim.x + 3 r) floats.
extern "C" __global__ __launch_bounds__(DNF_MAX_THREADS) void dn_fused_seq(
    const float* __restrict__ qkv, float* __restrict__ conv_state, const float* __restrict__ conv_w,
    const float* __restrict__ ba, const float* __restrict__ a, const float* __restrict__ dt_bias, float* __restrict__ s,
    const float* __restrict__ z, const float* __restrict__ norm_w, float* __restrict__ y, int n, int ch, int nk, int dk,
    int dv, int r, int kern, float l2_eps, float q_scale, float rms_eps, float* __restrict__ s_trace,
    float* __restrict__ conv_trace, int early) {
    extern __shared__ float sm[];
    const int kh = blockIdx.x, nv = nk * r;
    const int own = 2 * dk + r * dv;  // this block's conv channels: q of kh, k of kh, v of its V heads
    float* buf = sm;                   // [own]: conv output of the current token (q | k | v)
    float* os = sm + own;              // [r dv]: delta-rule output of the current token
    float* part = os + r * dv;         // [warps][32]: partial column sums
    float* gb = part + blockDim.x;     // [2 r]: beta, then exp(g), per V head
    float* invs = gb + 2 * r;          // [r]: 1 / rms of each V head's output
    const int lane = threadIdx.x % WARP, u = threadIdx.x / WARP, warps = blockDim.x / WARP;
    const int cpv = (dv + WARP - 1) / WARP, rgn = (dk + DNF_ROWS - 1) / DNF_ROWS;
    const int hl = u / (cpv * rgn), cc = (u / rgn) % cpv, rg = u % rgn;
    const int h = kh * r + hl;
    const int j = cc * WARP + lane;
    const bool col = j < dv;
    const int i0 = rg * DNF_ROWS;
    float st[DNF_ROWS];
    // The state rows: with `early`, loaded before the wait for the kernel ahead (the state was
    // last written by this layer's launch of an earlier step, or by a verify pass's rollback,
    // at least two launches back: complete, since the kernel ahead passed its own wait).
    const float* sp = s + ((size_t)h * dk + i0) * dv + (col ? j : 0);
    const int tid = threadIdx.x;
    // Channel of local index li.
#define DN_CH(li) ((li) < dk ? kh * dk + (li) : (li) < 2 * dk ? nk * dk + kh * dk + (li) - dk : 2 * nk * dk + kh * r * dv + (li) - 2 * dk)
    // early bit 1: the thread's first conv channel (weights, window), its gate parameters and its
    // first norm weight before the wait too; the same values.
    const bool pre = (early & 2) && kern == DNF_PRE_KERN;
    DnfConvRegs<1> pr;
    float pa = 0.0f, pdt = 0.0f, pnw = 0.0f;
    if (early & 1) {
#pragma unroll
        for (int q = 0; q < DNF_ROWS; ++q) st[q] = col ? sp[(size_t)q * dv] : 0.0f;
    }
    if (pre) {
        dnf_pre_channel(pr, 0, tid < own ? DN_CH(tid) : -1, conv_w, conv_state, ch);
        if (tid < r) pa = a[kh * r + tid], pdt = dt_bias[kh * r + tid];
        if (tid < r * dv) pnw = norm_w[tid % dv];
    }
    pdl_enter();  // qkv, ba and z come from the kernel ahead
    if (!(early & 1)) {
#pragma unroll
        for (int q = 0; q < DNF_ROWS; ++q) st[q] = col ? sp[(size_t)q * dv] : 0.0f;
    }
    for (int t = 0; t < n; ++t) {
        // z of the thread's first output, in flight during the conv.
        const float zt = pre && tid < r * dv ? z[(size_t)t * nv * dv + (size_t)kh * r * dv + tid] : 0.0f;
        // Conv + SiLU of this block's channels; history = [conv_state | qkv rows 0 .. t].
        for (int li = tid; li < own; li += blockDim.x) {
            buf[li] = pre && li == tid ? dnf_conv_pre(pr, 0, qkv, t, ch) : dnf_conv(qkv, conv_state, conv_w, t, DN_CH(li), ch, kern);
        }
        if (tid < r) {
            const int hh = kh * r + tid;
            const float* bat = ba + (size_t)t * 2 * nv + (size_t)kh * 2 * r;
            dnf_gates(bat[tid], bat[r + tid], pre ? pa : a[hh], pre ? pdt : dt_bias[hh], gb[tid], gb[r + tid]);
        }
        __syncthreads();
        // L2 norm of q (then times q_scale) and of k, a warp each.
        for (int vec = u; vec < 2; vec += warps) dnf_l2_norm(buf + vec * dk, dk, lane, l2_eps, vec == 0 ? q_scale : 1.0f);
        __syncthreads();
        const float* qs = buf;
        const float* ks = buf + dk;
        const float alpha = gb[r + hl];
        const float m = dnf_decay_dot(st, alpha, ks + i0);
        part[u * WARP + lane] = m;
        __syncthreads();
        const int u0 = u - rg;  // warp of row group 0 of these columns
        float mt = 0.0f;
        for (int g = 0; g < rgn; ++g) mt += part[(u0 + g) * WARP + lane];
        const float v = col ? buf[2 * dk + hl * dv + j] : 0.0f;
        const float delta = gb[hl] * (v - mt);
        const float out = dnf_update_dot(st, ks + i0, delta, qs + i0);
        __syncthreads();  // every warp has read the S^T k sums
        part[u * WARP + lane] = out;
        __syncthreads();
        if (rg == 0 && col) {
            float ot = 0.0f;
            for (int g = 0; g < rgn; ++g) ot += part[(u0 + g) * WARP + lane];
            os[hl * dv + j] = ot;
        }
        __syncthreads();
        // Gated RMSNorm per V head.
        for (int vh = u; vh < r; vh += warps) {
            const float inv = dnf_inv_rms<false>(os + vh * dv, dv, lane, rms_eps);
            if (lane == 0) invs[vh] = inv;
        }
        __syncthreads();
        for (int idx = tid; idx < r * dv; idx += blockDim.x) {
            const int vh = idx / dv, jj = idx % dv;
            const size_t at = ((size_t)t * nv + kh * r + vh) * dv + jj;
            const bool first = pre && idx == tid;
            y[at] = dnf_gated(os[idx], invs[vh], first ? pnw : norm_w[jj], first ? zt : z[at]);
        }
        if (s_trace != nullptr) {
            // The states after token t: this warp's state rows, this block's conv channels.
            if (col) {
                float* p = s_trace + (size_t)t * nv * dk * dv + ((size_t)h * dk + i0) * dv + j;
#pragma unroll
                for (int q = 0; q < DNF_ROWS; ++q, p += dv) *p = st[q];
            }
            for (int li = threadIdx.x; li < own; li += blockDim.x) {
                dnf_conv_trace(qkv, conv_state, conv_trace, t, DN_CH(li), ch, kern);
            }
        }
    }
    if (col) {
        float* p = s + ((size_t)h * dk + i0) * dv + j;
        asm volatile("" : "+l"(p));  // a fresh pointer: the load addresses are not kept live
#pragma unroll
        for (int q = 0; q < DNF_ROWS; ++q, p += dv) *p = st[q];
    }
    // The conv window ends as the last kern - 1 inputs of [conv_state | qkv].
    for (int li = tid; li < own; li += blockDim.x) {
        if (pre && li == tid) {
            dnf_conv_window_pre(pr, 0, qkv, conv_state, n, ch);
        } else {
            dnf_conv_window(qkv, conv_state, n, DN_CH(li), ch, kern);
        }
    }
#undef DN_CH
}

// dn_fused_cols(<dn_fused_seq's arguments>, o, counter): dn_fused_seq with each V head's state
// columns spread over dv / 32 blocks, so the step runs on nv dv / 32 SMs instead of nk (16 →
// 128 at full size; ncu: dn_fused_seq was its 16 SMs' instruction stream, ≈ 26 K cycles each).
// Block (kh, hl, cc) takes V head h = kh r + hl, state columns j = 32 cc + lane; warp rg holds
// rows DNF_ROWS rg .. of those columns in registers, as in dn_fused_seq, and every column's
// arithmetic is dn_fused_seq's (the shared dnf_* pieces, the S^T k and S^T q sums over the row
// warps in the same order), so every output is dn_fused_seq's bit for bit. Each block computes
// the conv, L2 norms and gates of its QK head itself (the r · dv / 32 blocks of a QK head all do
// it the same way) and the conv of its own 32 v channels. The gated norm needs a V head's dv
// outputs: the blocks write o ([n][nv][dv]), meet at a barrier of the QK head's blocks
// (grid_sync on counter[kh], every block of the group resident: 128-thread blocks), then each
// reads its head's row back through L2. After the barrier (no block still reads the old
// window), the QK head's first block writes the q/k channels' conv state; each block its v
// channels'. Traces as dn_fused_seq (q/k channels by the first block).
// early: as dn_fused_seq's (bit 1 for the thread's first DNC_PRE conv channels).
// Launch: grid = nk r (dv / 32) (dv and dk multiples of 32), block = 32 dk / DNF_ROWS threads
// (<= DNC_MAX_THREADS), dynamic shared memory = (DNC_CHUNK (2 dk + 32) + 4 blockDim.x + 2 DNC_CHUNK)
// floats (dn_cols_launch in ops/deltanet.rs); counter: nk zeroed u64s.
#define DNC_PRE 3
// dn_fused_cols_rows' tokens whose state-free parts run ahead of the recurrence (ops/deltanet.rs's
// DNC_CHUNK sizes the shared memory for it).
#define DNC_CHUNK 16
// dn_fused_cols_rows' gated norms: tokens a warp takes at once, and o values a lane holds of each
// (dv <= DNC_EPI_V * 32; wider heads take the token-at-a-time loop).
#define DNC_EPI 4
#define DNC_EPI_V 8
// The launch bound (ops/deltanet.rs checks it): at DNF_MAX_THREADS (64 registers) the kernel spilled 88
// registers' worth of loads and stores. At (256, 1) NVRTC 13.0's ptxas (the H200 machine's)
// gives it 190 registers and no local memory; with (256) alone it took 128 and spilled (STACK:104,
// 58 spill instructions, the preloaded values stored to the stack before the wait), while 13.5
// gave 168 and none: check the device's NVRTC version when reading resource usage here.
#define DNC_MAX_THREADS 256
template <bool ROWS>
__device__ __forceinline__ void dn_fused_cols_body(
    const float* __restrict__ qkv, float* __restrict__ conv_state, const float* __restrict__ conv_w,
    const float* __restrict__ ba, const float* __restrict__ a, const float* __restrict__ dt_bias, float* __restrict__ s,
    const float* __restrict__ z, const float* __restrict__ norm_w, float* __restrict__ y, int n, int ch, int nk, int dk,
    int dv, int r, int kern, float l2_eps, float q_scale, float rms_eps, float* __restrict__ s_trace,
    float* __restrict__ conv_trace, int early, float* __restrict__ o, unsigned long long* __restrict__ counter) {
    extern __shared__ float4 dnc_sm4[];  // (a name of its own: a template, not extern "C")
    float* sm = (float*)dnc_sm4;
    long long tt = trace_start(ROWS ? 24 : 12);
    const int cpv = dv / WARP, nv = nk * r;
    const int kh = blockIdx.x / (r * cpv), hl = (blockIdx.x / cpv) % r, cc = blockIdx.x % cpv;
    const int h = kh * r + hl;
    const int own = 2 * dk + WARP;     // q of kh, k of kh, the block's 32 v channels
    float* buf = sm;                   // [DNC_CHUNK][own]: conv outputs (q | k | v) of the chunk's tokens
    float* part = buf + DNC_CHUNK * own;  // [warps][32] partial column sums (prologue: see there)
    const int lane = threadIdx.x % WARP, rg = threadIdx.x / WARP, warps = blockDim.x / WARP;
    const int j = cc * WARP + lane;
    const int i0 = rg * DNF_ROWS;
    const bool lead = hl == 0 && cc == 0;  // writes the q/k channels' conv state and trace
    float st[DNF_ROWS];
    const float* sp = s + ((size_t)h * dk + i0) * dv + j;
    const int tid = threadIdx.x, bd = blockDim.x;
#define DNC_CH(li) ((li) < dk ? kh * dk + (li) : (li) < 2 * dk ? nk * dk + kh * dk + (li) - dk : 2 * nk * dk + h * dv + cc * WARP + (li) - 2 * dk)
    // early bit 1: as dn_fused_seq's, for the thread's first DNC_PRE conv channels.
    const bool pre = (early & 2) && kern == DNF_PRE_KERN;
    DnfConvRegs<DNC_PRE> pr;
    float pa = 0.0f, pdt = 0.0f, pnw = 0.0f;
    if (early & 1) {
#pragma unroll
        for (int q = 0; q < DNF_ROWS; ++q) st[q] = sp[(size_t)q * dv];
    }
    if (pre) {
#pragma unroll
        for (int i = 0; i < DNC_PRE; ++i) {
            const int li = tid + i * bd;
            dnf_pre_channel(pr, i, li < own ? DNC_CH(li) : -1, conv_w, conv_state, ch);
        }
        pa = a[h], pdt = dt_bias[h], pnw = norm_w[j];
    }
    pdl_enter();  // qkv, ba and z come from the kernel ahead
    tt = trace_phase(ROWS ? 25 : 13, tt);
    if (!(early & 1)) {
#pragma unroll
        for (int q = 0; q < DNF_ROWS; ++q) st[q] = sp[(size_t)q * dv];
    }
    // z of the warp's first gated-norm output (token rg), in flight during the token loop.
    const float zt = pre && rg < n ? z[((size_t)rg * nv + h) * dv + j] : 0.0f;
    if constexpr (ROWS) {
        // Tokens in chunks of DNC_CHUNK. What does not depend on the state (conv, gates, q/k L2
        // norms) runs for the whole chunk first, every token's loads in flight at once; then the
        // recurrence, one barrier a token: the S^T k and S^T q partial sums go through two
        // double-buffered arrays (pm, po), and row group 0 adds token t's S^T q sums after the next
        // token's barrier. The same operations per column as the token-at-a-time loop below.
        float* pm = part;             // [2][blockDim.x]
        float* po = part + 2 * bd;    // [2][blockDim.x]
        float* gbc = part + 4 * bd;   // [DNC_CHUNK][2]: beta, exp(g) of each token
#if DNC_STAGE
        // The preloaded channels' windows (DNC_STAGE), carried from chunk to chunk.
        float win[DNC_PRE][DNF_PRE_KERN - 1];
#pragma unroll
        for (int i = 0; i < DNC_PRE; ++i) {
#pragma unroll
            for (int jj = 0; jj < DNF_PRE_KERN - 1; ++jj) win[i][jj] = pr.h[i][jj];
        }
#endif
        for (int c0 = 0; c0 < n; c0 += DNC_CHUNK) {
            const int pn = min(DNC_CHUNK, n - c0);
#if DNC_STAGE
            if (pre) {
                for (int t4 = 0; t4 < pn; t4 += DNC_STAGE_TOKENS) {
                    float xv[DNC_PRE][DNC_STAGE_TOKENS];
#pragma unroll
                    for (int i = 0; i < DNC_PRE; ++i) {
#pragma unroll
                        for (int u = 0; u < DNC_STAGE_TOKENS; ++u) {
                            const int tc = t4 + u;
                            xv[i][u] = pr.c[i] >= 0 && tc < pn ? qkv[(size_t)(c0 + tc) * ch + pr.c[i]] : 0.0f;
                        }
                    }
#pragma unroll
                    for (int u = 0; u < DNC_STAGE_TOKENS; ++u) {
                        const int tc = t4 + u, t = c0 + tc;
                        if (tc >= pn) break;
                        float* trt = conv_trace == nullptr ? nullptr : conv_trace + (size_t)t * (kern - 1) * ch;
#pragma unroll
                        for (int i = 0; i < DNC_PRE; ++i) {
                            const int li = tid + i * bd;
                            if (pr.c[i] < 0) continue;
                            float* tr = trt != nullptr && (li >= 2 * dk || lead) ? trt + pr.c[i] : nullptr;
                            buf[tc * own + li] = dnf_conv_win(pr.w[i], win[i], xv[i][u], tr, ch);
                            pr.x[i] = xv[i][u];
                        }
                    }
                }
            }
#endif
            for (int tc = 0; tc < pn; ++tc) {
                const int t = c0 + tc;
                float* bt = buf + tc * own;
                // The conv trace of token t from the inputs the conv reads (q/k channels: the lead
                // block's), so the recurrence below waits for no load of it.
                float* trt = conv_trace == nullptr ? nullptr : conv_trace + (size_t)t * (kern - 1) * ch;
#define DNC_TR(li) (trt != nullptr && ((li) >= 2 * dk || lead) ? trt + DNC_CH(li) : nullptr)
                if (pre) {
#if !DNC_STAGE
#pragma unroll
                    for (int i = 0; i < DNC_PRE; ++i) {
                        const int li = tid + i * bd;
                        if (pr.c[i] >= 0) bt[li] = dnf_conv_pre(pr, i, qkv, t, ch, DNC_TR(li));
                    }
#endif
                    for (int li = tid + DNC_PRE * bd; li < own; li += bd) {
                        bt[li] = dnf_conv(qkv, conv_state, conv_w, t, DNC_CH(li), ch, kern, DNC_TR(li));
                    }
                } else {
                    for (int li = tid; li < own; li += bd) bt[li] = dnf_conv(qkv, conv_state, conv_w, t, DNC_CH(li), ch, kern, DNC_TR(li));
                }
#undef DNC_TR
            }
            for (int tc = tid; tc < pn; tc += bd) {
                const float* bat = ba + (size_t)(c0 + tc) * 2 * nv + (size_t)kh * 2 * r;
                dnf_gates(bat[hl], bat[r + hl], pre ? pa : a[h], pre ? pdt : dt_bias[h], gbc[2 * tc], gbc[2 * tc + 1]);
            }
            __syncthreads();
            for (int vec = rg; vec < 2 * pn; vec += warps) {
                dnf_l2_norm(buf + (vec >> 1) * own + (vec & 1) * dk, dk, lane, l2_eps, (vec & 1) == 0 ? q_scale : 1.0f);
            }
            __syncthreads();
            tt = trace_phase(26, tt);
            for (int tc = 0; tc < pn; ++tc) {
                const int t = c0 + tc, b = (tc & 1) * bd;
                const float* qs = buf + tc * own;
                const float* ks = qs + dk;
                pm[b + rg * WARP + lane] = dnf_decay_dot(st, gbc[2 * tc + 1], ks + i0);
                __syncthreads();  // token t's S^T k parts, token t - 1's S^T q parts are written
                if (tc > 0 && rg == 0) {
                    float ot = 0.0f;
                    for (int g = 0; g < warps; ++g) ot += po[(bd - b) + g * WARP + lane];
                    o[((size_t)(t - 1) * nv + h) * dv + j] = ot;
                }
                float mt = 0.0f;
                for (int g = 0; g < warps; ++g) mt += pm[b + g * WARP + lane];
                const float v = qs[2 * dk + lane];
                const float delta = gbc[2 * tc] * (v - mt);
                po[b + rg * WARP + lane] = dnf_update_dot(st, ks + i0, delta, qs + i0);
                if (s_trace != nullptr) {
                    float* p = s_trace + (size_t)t * nv * dk * dv + ((size_t)h * dk + i0) * dv + j;
#pragma unroll
                    for (int q = 0; q < DNF_ROWS; ++q, p += dv) *p = st[q];
                }
            }
            __syncthreads();  // the chunk's last S^T q parts; every read of buf and gbc is done
            if (rg == 0) {
                float ot = 0.0f;
                for (int g = 0; g < warps; ++g) ot += po[((pn - 1) & 1) * bd + g * WARP + lane];
                o[((size_t)(c0 + pn - 1) * nv + h) * dv + j] = ot;
            }
            tt = trace_phase(27, tt);
        }
    } else {
        float* gb = part + blockDim.x;  // beta, exp(g) of the V head
        for (int t = 0; t < n; ++t) {
            if (pre) {
                // The preloaded channels' loads all in flight at once, then the rest.
#pragma unroll
                for (int i = 0; i < DNC_PRE; ++i) {
                    if (pr.c[i] >= 0) buf[tid + i * bd] = dnf_conv_pre(pr, i, qkv, t, ch);
                }
                for (int li = tid + DNC_PRE * bd; li < own; li += bd) buf[li] = dnf_conv(qkv, conv_state, conv_w, t, DNC_CH(li), ch, kern);
            } else {
                for (int li = tid; li < own; li += bd) buf[li] = dnf_conv(qkv, conv_state, conv_w, t, DNC_CH(li), ch, kern);
            }
            if (tid == 0) {
                const float* bat = ba + (size_t)t * 2 * nv + (size_t)kh * 2 * r;
                dnf_gates(bat[hl], bat[r + hl], pre ? pa : a[h], pre ? pdt : dt_bias[h], gb[0], gb[1]);
            }
            __syncthreads();
            for (int vec = rg; vec < 2; vec += warps) dnf_l2_norm(buf + vec * dk, dk, lane, l2_eps, vec == 0 ? q_scale : 1.0f);
            __syncthreads();
            const float* qs = buf;
            const float* ks = buf + dk;
            const float m = dnf_decay_dot(st, gb[1], ks + i0);
            part[rg * WARP + lane] = m;
            __syncthreads();
            float mt = 0.0f;
            for (int g = 0; g < warps; ++g) mt += part[g * WARP + lane];
            const float v = buf[2 * dk + lane];
            const float delta = gb[0] * (v - mt);
            const float out = dnf_update_dot(st, ks + i0, delta, qs + i0);
            __syncthreads();  // every warp has read the S^T k sums
            part[rg * WARP + lane] = out;
            __syncthreads();
            if (rg == 0) {
                float ot = 0.0f;
                for (int g = 0; g < warps; ++g) ot += part[g * WARP + lane];
                o[((size_t)t * nv + h) * dv + j] = ot;
            }
            if (s_trace != nullptr) {
                float* p = s_trace + (size_t)t * nv * dk * dv + ((size_t)h * dk + i0) * dv + j;
#pragma unroll
                for (int q = 0; q < DNF_ROWS; ++q, p += dv) *p = st[q];
                for (int li = threadIdx.x; li < own; li += blockDim.x) {
                    if (li < 2 * dk && !lead) continue;
                    dnf_conv_trace(qkv, conv_state, conv_trace, t, DNC_CH(li), ch, kern);
                }
            }
        }
    }
    {
        float* p = s + ((size_t)h * dk + i0) * dv + j;
        asm volatile("" : "+l"(p));  // a fresh pointer: the load addresses are not kept live
#pragma unroll
        for (int q = 0; q < DNF_ROWS; ++q, p += dv) *p = st[q];
    }
    grid_sync(counter + kh, r * cpv);  // the QK head's o rows are written, its old window read
    if (ROWS) tt = trace_phase(28, tt);
    if (ROWS && dv <= DNC_EPI_V * WARP) {
        // The gated norms of DNC_EPI tokens a warp at once: every load (the o rows through L2, z)
        // issued before any arithmetic, then dnf_inv_rms's sums in its order.
        const float wj = pre ? pnw : norm_w[j];
        for (int t0 = rg; t0 < n; t0 += DNC_EPI * warps) {
            float ov[DNC_EPI][DNC_EPI_V], oj[DNC_EPI], zz[DNC_EPI];
#pragma unroll
            for (int u = 0; u < DNC_EPI; ++u) {
                const int t = t0 + u * warps;
                const float* orow = o + ((size_t)(t < n ? t : t0) * nv + h) * dv;
#pragma unroll
                for (int m = 0; m < DNC_EPI_V; ++m) ov[u][m] = lane + m * WARP < dv ? ld_cg(orow + lane + m * WARP) : 0.0f;
                oj[u] = ld_cg(orow + j);
                zz[u] = pre && t == rg ? zt : z[((size_t)(t < n ? t : t0) * nv + h) * dv + j];
            }
#pragma unroll
            for (int u = 0; u < DNC_EPI; ++u) {
                const int t = t0 + u * warps;
                float ss = 0.0f;
#pragma unroll
                for (int m = 0; m < DNC_EPI_V; ++m) {
                    if (lane + m * WARP < dv) ss += ov[u][m] * ov[u][m];
                }
                ss = warp_sum(ss);
                const float inv = 1.0f / sqrtf(ss / (float)dv + rms_eps);
                if (t < n) y[((size_t)t * nv + h) * dv + j] = dnf_gated(oj[u], inv, wj, zz[u]);
            }
        }
    } else {
        for (int t = rg; t < n; t += warps) {
            const float* orow = o + ((size_t)t * nv + h) * dv;
            const float inv = dnf_inv_rms<true>(orow, dv, lane, rms_eps);
            const size_t at = ((size_t)t * nv + h) * dv + j;
            const bool first = pre && t == rg;
            y[at] = dnf_gated(ld_cg(orow + j), inv, pre ? pnw : norm_w[j], first ? zt : z[at]);
        }
    }
    if (pre) {
#pragma unroll
        for (int i = 0; i < DNC_PRE; ++i) {
            if (pr.c[i] >= 0 && (tid + i * bd >= 2 * dk || lead)) dnf_conv_window_pre(pr, i, qkv, conv_state, n, ch);
        }
    }
    for (int li = tid + (pre ? DNC_PRE * bd : 0); li < own; li += bd) {
        if (li < 2 * dk && !lead) continue;
        dnf_conv_window(qkv, conv_state, n, DNC_CH(li), ch, kern);
    }
#undef DNC_CH
    trace_phase(ROWS ? 29 : 14, tt);
}

// dn_fused_cols: a decode step's (and the five-kernel prompt's fallback) token-at-a-time form;
// dn_fused_cols_rows: several tokens (verify passes, short prompts), the chunk's conv, gates, q/k
// norms and conv trace ahead of the recurrence, one barrier a token. The same outputs bit for bit.
#define DNC_ARGS                                                                                                  \
    const float *__restrict__ qkv, float *__restrict__ conv_state, const float *__restrict__ conv_w,              \
        const float *__restrict__ ba, const float *__restrict__ a, const float *__restrict__ dt_bias,             \
        float *__restrict__ s, const float *__restrict__ z, const float *__restrict__ norm_w, float *__restrict__ y, \
        int n, int ch, int nk, int dk, int dv, int r, int kern, float l2_eps, float q_scale, float rms_eps,       \
        float *__restrict__ s_trace, float *__restrict__ conv_trace, int early, float *__restrict__ o,            \
        unsigned long long *__restrict__ counter
#define DNC_PASS qkv, conv_state, conv_w, ba, a, dt_bias, s, z, norm_w, y, n, ch, nk, dk, dv, r, kern, l2_eps, q_scale, \
                 rms_eps, s_trace, conv_trace, early, o, counter
// DNC_MIN_BLOCKS (compile-time, default 1): dn_fused_cols' blocks an SM in its launch bound. 1
// gives it 190 registers (NVRTC 13.0), 48.6 K of the SM's 64 K; 2 caps it at 128 (no spills), so
// that a block fits beside the in-projection's blocks ahead of it (session 27's fused route kernel
// on 1,024-thread blocks lost 16.5 % by waiting for whole SMs). Measured on the H200 (session 27,
// three alternating rounds): 2 is 0.8 % slower (393.79 against 397.10 tok/s), so 1 stays.
#ifndef DNC_MIN_BLOCKS
#define DNC_MIN_BLOCKS 1
#endif
extern "C" __global__ __launch_bounds__(DNC_MAX_THREADS, DNC_MIN_BLOCKS) void dn_fused_cols(DNC_ARGS) {
    dn_fused_cols_body<false>(DNC_PASS);
}
extern "C" __global__ __launch_bounds__(DNC_MAX_THREADS, 1) void dn_fused_cols_rows(DNC_ARGS) {
    dn_fused_cols_body<true>(DNC_PASS);
}
#undef DNC_ARGS
#undef DNC_PASS

// dn_restore(table, s_floats, conv_floats, row): after a verify pass, every DeltaNet layer's
// recurrent and conv states from row `row` of their traces. table[4 l ..] = (s, s_trace, conv,
// conv_trace) device addresses of layer l; both state sizes multiples of 4 floats. One launch
// instead of two copies a layer. Launch: grid = (blocks, layers), block = 256.
extern "C" __global__ void dn_restore(const u64* __restrict__ table, int s_floats, int conv_floats,
                                      int row) {
    pdl_enter();
    const u64* t = table + 4 * blockIdx.y;
    float4* s = (float4*)t[0];
    const float4* st = (const float4*)t[1] + (long long)row * (s_floats / 4);
    float4* c = (float4*)t[2];
    const float4* ct = (const float4*)t[3] + (long long)row * (conv_floats / 4);
    const long long s4 = s_floats / 4, c4 = conv_floats / 4;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < s4 + c4;
         i += (long long)gridDim.x * blockDim.x) {
        if (i < s4) {
            s[i] = st[i];
        } else {
            c[i - s4] = ct[i - s4];
        }
    }
}
