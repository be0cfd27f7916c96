// Quantized matrix-vector products and the embedding lookup, one kernel per type.
//
// matvec_<type>(w, x, y, rows, cols): y[t][r] = W[r] . x[t] for t < gridDim.y (the batch);
// W is `rows` rows of `cols / QK` blocks in the file's layout, x and y are f32 row-major.
// One warp per output row: lane i takes elements i, i + 32, ... (neighbouring lanes read
// neighbouring bytes), accumulates in f32 and the warp sums at the end.
// Launch: block = 32 * warps threads, grid = (ceil(rows / warps), n).

template <typename T>
__device__ __forceinline__ float row_dot(const u8* __restrict__ wr, const float* __restrict__ x, int cols, int lane) {
    float acc = 0.0f;
    for (int k = lane; k < cols; k += WARP) {
        acc += T::dq(wr + (size_t)(k / T::QK) * T::BB, k % T::QK) * x[k];
    }
    return warp_sum(acc);
}

template <typename T>
__device__ __forceinline__ size_t row_bytes(int cols) {
    return (size_t)(cols / T::QK) * T::BB;
}

template <typename T>
__device__ __forceinline__ void matvec_body(const u8* __restrict__ w, const float* __restrict__ x,
                                            float* __restrict__ y, int rows, int cols) {
    const int warps = blockDim.x / WARP;
    const int row = blockIdx.x * warps + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    const int t = blockIdx.y;
    if (row >= rows) return;  // whole warps leave together
    const float acc = row_dot<T>(w + (size_t)row * row_bytes<T>(cols), x + (size_t)t * cols, cols, lane);
    if (lane == 0) y[(size_t)t * rows + row] = acc;
}

// embed_<type>(table, ids, out, cols): out[t] = dequantized row ids[t] of the table.
// Launch: grid = n ids, block = any multiple of 32.
template <typename T>
__device__ __forceinline__ void embed_body(const u8* __restrict__ table, const int* __restrict__ ids,
                                           float* __restrict__ out, int cols) {
    const int t = blockIdx.x;
    const u8* row = table + (size_t)ids[t] * row_bytes<T>(cols);
    for (int k = threadIdx.x; k < cols; k += blockDim.x) {
        out[(size_t)t * cols + k] = T::dq(row + (size_t)(k / T::QK) * T::BB, k % T::QK);
    }
}

#define MATVEC_KERNELS(name, T)                                                                      \
    extern "C" __global__ void matvec_##name(const u8* w, const float* x, float* y, int rows, int cols) { \
        matvec_body<T>(w, x, y, rows, cols);                                                         \
    }                                                                                                \
    extern "C" __global__ void embed_##name(const u8* table, const int* ids, float* out, int cols) { \
        embed_body<T>(table, ids, out, cols);                                                        \
    }

FOR_EACH_TYPE(MATVEC_KERNELS)
