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

// dn_conv_seq(x, state, w, y, n, ch, kern): the causal depthwise conv over n tokens, x and y
// [n][ch]; channel c = thread keeps its window in registers. y[t][c] = silu(sum_j w[c][j] *
// history[t + j][c]) over [state (kern-1 rows, oldest first) | x]; the state ends as the last kern-1
// inputs. kern <= DN_MAX_KERN. Launch: ceil(ch / block) blocks.
extern "C" __global__ void dn_conv_seq(const float* __restrict__ x, float* __restrict__ state,
                                       const float* __restrict__ w, float* __restrict__ y, int n, int ch,
                                       int kern) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= ch) return;
    float wc[DN_MAX_KERN], hist[DN_MAX_KERN];
#pragma unroll
    for (int j = 0; j < DN_MAX_KERN; ++j) {
        wc[j] = j < kern ? w[(size_t)c * kern + j] : 0.0f;
        hist[j] = j < kern - 1 ? state[(size_t)j * ch + c] : 0.0f;
    }
    for (int t = 0; t < n; ++t) {
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
#pragma unroll
    for (int j = 0; j < DN_MAX_KERN - 1; ++j) {
        if (j < kern - 1) state[(size_t)j * ch + c] = hist[j];
    }
}

// dn_qk_norm(qkv, ch, nk, dk, eps, q_scale): in place on the conv output [n][ch] (ch starts with
// q of the nk QK heads, then k): row r = blockIdx.x of token t = blockIdx.y (r < nk: q head r,
// else k head r - nk) becomes x * rsqrt(sum x^2 + eps), q rows then times q_scale.
// Launch: grid = (2 nk, n), block = any multiple of 32.
extern "C" __global__ void dn_qk_norm(float* __restrict__ qkv, int ch, int nk, int dk, float eps, float q_scale) {
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
extern "C" __global__ void dn_delta_seq(const float* __restrict__ qkv, const float* __restrict__ beta,
                                        const float* __restrict__ g, float* __restrict__ s,
                                        float* __restrict__ o, int n, int ch, int nk, int dk, int dv) {
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
    for (int t = 0; t < n; ++t) {
        const float* row = qkv + (size_t)t * ch;
        __syncthreads();  // the previous token's q, k and partial sums are no longer read
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            qs[i] = row[kh * dk + i];
            ks[i] = row[nk * dk + kh * dk + i];
        }
        __syncthreads();
        const float alpha = expf(g[(size_t)t * nv + h]);
        float m = 0.0f;
#pragma unroll
        for (int r = 0; r < DN_ROWS; ++r) {
            if (i0 + r < dk) {
                st[r] *= alpha;
                m += st[r] * ks[i0 + r];
            }
        }
        part[w * WARP + lane] = m;
        __syncthreads();
        float mt = 0.0f;
        for (int ww = 0; ww < warps; ++ww) mt += part[ww * WARP + lane];
        const float v = col ? row[2 * nk * dk + h * dv + j] : 0.0f;
        const float delta = beta[(size_t)t * nv + h] * (v - mt);
        float out = 0.0f;
#pragma unroll
        for (int r = 0; r < DN_ROWS; ++r) {
            if (i0 + r < dk) {
                st[r] += ks[i0 + r] * delta;
                out += st[r] * qs[i0 + r];
            }
        }
        __syncthreads();  // every warp has read the S^T k sums
        part[w * WARP + lane] = out;
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
