// attn_decode(q, kc, vc, scores, o, n, nkv, hd, scale): causal attention of one new token over the
// n cached positions, for query head h = blockIdx.x (GQA: KV head h / (heads / nkv)).
// q is [heads][hd]; kc and vc are [n][nkv][hd]; scores is scratch [heads][n].
// p = softmax(q.k_j * scale); o[h] = sum_j p_j v_j.
// Launch: grid = heads, block = 256 threads (a multiple of 32, >= hd is not required).
extern "C" __global__ void attn_decode(const float* __restrict__ q, const float* __restrict__ kc,
                                       const float* __restrict__ vc, float* __restrict__ scores,
                                       float* __restrict__ o, int n, int nkv, int hd, float scale) {
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
