// Gated DeltaNet, one decode step (the recurrent form). The pieces, in order:
//   dn_conv_step   causal depthwise conv over [state | new input], SiLU, state shifted
//   l2_normalize   (norm.cu) q and k per QK head, q also scaled by 1/sqrt(dk)
//   dn_gates       beta = sigmoid(b), g = A * softplus(a + dt_bias) per V head
//   dn_delta_step  S <- exp(g) S; m = S^T k; S += k (beta (v - m))^T; o = S^T q
//   rms_norm_gated (norm.cu) RMSNorm(o) w * silu(z)

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
extern "C" __global__ void dn_gates(const float* __restrict__ ba, const float* __restrict__ a,
                                    const float* __restrict__ dt_bias, float* __restrict__ beta,
                                    float* __restrict__ g, int nv, int r) {
    const int h = blockIdx.x * blockDim.x + threadIdx.x;
    if (h >= nv) return;
    const int grp = h / r, j = h % r;
    beta[h] = sigmoidf_(ba[grp * 2 * r + j]);
    g[h] = a[h] * softplusf_(ba[grp * 2 * r + r + j] + dt_bias[h]);
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
