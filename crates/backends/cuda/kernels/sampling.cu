// argmax(x, n, out): per row (blockIdx.x) of n logits, the index of the largest value, lowest
// index on ties (greedy decoding on the lm_head output). NaN never wins.
// Launch: grid = rows, block = any multiple of 32.
extern "C" __global__ void argmax(const float* __restrict__ x, int n, int* __restrict__ out) {
    __shared__ float sv[WARP];
    __shared__ int si[WARP];
    const float* r = x + (size_t)blockIdx.x * n;
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = r[i];
        if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
    }
    for (int o = WARP / 2; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP, nw = blockDim.x / WARP;
    if (lane == 0) { sv[wid] = bv; si[wid] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        bv = sv[0];
        bi = si[0];
        for (int w = 1; w < nw; ++w) {
            if (sv[w] > bv || (sv[w] == bv && si[w] < bi)) { bv = sv[w]; bi = si[w]; }
        }
        out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
    }
}
