// Normalisations and element-wise kernels. Row kernels take one block per row (blockIdx.x);
// any block size that is a multiple of 32 works.

// noop_pdl(): waits for the kernel ahead and returns. Timing diagnostics only
// (`REDLITE_CUDA_NOOP`): it stands in for a launch with that launch's grid and block, so a step
// of such launches costs what the launches alone cost (their arguments are passed and ignored).
extern "C" __global__ void noop_pdl() { pdl_enter(); }

// rms_norm(x, w, y, n, eps): y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, rows of n values.
// Also the per-head QK-norm (rows = heads, n = head_dim, same w for every row).
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                    float* __restrict__ y, int n, float eps) {
    pdl_enter();
    __shared__ float scratch[WARP];
    const float* xr = x + (size_t)blockIdx.x * n;
    float* yr = y + (size_t)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
}

// rms_norm_gated(o, w, z, y, n, eps): the DeltaNet output norm, y = RMSNorm(o)·w ⊙ silu(z), per
// row of n values (one row per V head).
extern "C" __global__ void rms_norm_gated(const float* __restrict__ o, const float* __restrict__ w,
                                          const float* __restrict__ z, float* __restrict__ y, int n, float eps) {
    pdl_enter();
    __shared__ float scratch[WARP];
    const size_t base = (size_t)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += o[base + i] * o[base + i];
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        y[base + i] = (o[base + i] * inv * w[i]) * siluf_(z[base + i]);
    }
}

// l2_normalize(x, n, eps, scale): in place, x[r] = (x[r] * rsqrt(sum(x[r]^2) + eps)) * scale.
extern "C" __global__ void l2_normalize(float* __restrict__ x, int n, float eps, float scale) {
    pdl_enter();
    __shared__ float scratch[WARP];
    float* xr = x + (size_t)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) xr[i] = (xr[i] * inv) * scale;
}

// add_inplace(a, b, n): the residual, a += b.
extern "C" __global__ void add_inplace(float* __restrict__ a, const float* __restrict__ b, int n) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] += b[i];
}

// sigmoid_mul(a, gate, n): a *= sigmoid(gate) (the output gate of gated attention).
extern "C" __global__ void sigmoid_mul(float* __restrict__ a, const float* __restrict__ gate, int n) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] *= sigmoidf_(gate[i]);
}

// swiglu(gate, up, out, n): out = silu(gate) * up (the shared expert's activation).
extern "C" __global__ void swiglu(const float* __restrict__ gate, const float* __restrict__ up,
                                  float* __restrict__ out, int n) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = siluf_(gate[i]) * up[i];
}
