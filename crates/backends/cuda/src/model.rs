//! [`CudaModel`]: the whole Qwen3-Next forward pass on one GPU.
//!
//! Weights are uploaded once in the file's quantized layout (the model crate's loader does the
//! shape checks and layout fix-ups; [`HostLoader`] only records where each weight's bytes are).
//! Hidden states, KV caches, conv and delta-rule states live on the device. A call uploads the
//! token ids and the start position, launches kernels only, and downloads the sampled token (or
//! the logits when asked for them).
//!
//! One layer, for n tokens at once, as in `redlite_model::qwen3next`. A decode step (n = 1, the
//! defaults; 508 launches on the 80B layout: 10 a DeltaNet layer, 12 an attention layer, then the
//! embedding, the final norm, the lm_head and the draw):
//!
//! ```text
//! DeltaNet:  rms_norm_q8: the q8 row of x · attn_norm and 1 / rms
//!            →  matvec_q8x_q4_k: qkv, z, ba in one launch
//!            →  dn_fused_cols: conv, q/k L2 norm, gates, delta rule, RMSNorm(o)·silu(z)
//!            →  matvec_res_q4_k: x += W_out·gated
//!            →  res_norm_router: xn = rms_norm(x, post_norm) and its q8 row, with the router's
//!               logits and the shared expert's gate logit on it
//! attention: rms_norm_q8  →  matvec_q8x_q4_k: q·gate, k, v
//!            →  attn_qk_prep (QK-norm, RoPE, KV write)  →  attn_split_gqa8xh3_h (chunks of the
//!            cache)  →  attn_merge (· sigmoid(gate))  →  matvec_res_q4_k  →  res_norm_router
//! MoE:       side stream from the start: matvec_q8x_q4_k (shared gate, up)  →  swiglu_q8
//!            →  matvec_q8x_q4_k (shared down)
//!            main: moe_gate_up_route2_q8q_iq2_xxs (the top-k in every block, the chosen
//!            experts' gate/up, SwiGLU and its q8 rows; ids kept per layer)
//!            →  (join)  moe_down_combine_tab_q8_iq2_xxs: x += Σ w·down(act) + sigmoid(g)·shared
//!            (experts found through the expert cache's per-layer table, `expert_cache.rs`)
//! ```
//!
//! Other calls take other forms of the same steps: a verify pass (a few tokens) the token-tile
//! kernels (`matvec_q8x_tok_*`, from 6 tokens `matvec_q8x_mma_q4_k` on the tensor cores,
//! `matvec_res_tok_*` (Q4_K: `matvec_res_xr_q4_k`, activations in registers) then
//! `res_norm_q8`, `matvec3_x_tok_f32` for
//! the router, `moe_router_warp`, `moe_gate_up_tok_*`, `moe_down_combine_tok_*`), each row the
//! one-token kernels' bits; a prompt the GEMMs on the tensor cores (`gemm_*`, `moe_gemm_*`) and
//! the multi-token DeltaNet and attention kernels; shapes a fused kernel does not take the
//! unfused forms (`matvec_norm3_*`, the five DeltaNet kernels). `REDLITE_CUDA_NORM_ROUTER=0`
//! runs the router, its top-k and the gate/up as one launch instead (`moe_route_gate_up_*`, a
//! grid barrier after the logits).
//!
//! then the final norm, the lm_head and `argmax` / `sample_topk`. Every position-dependent kernel
//! reads the start position from device memory, so the decode step is captured once as a CUDA
//! graph and replayed for every token (only the token id and position are copied in, and the
//! chosen id out).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{
    result as cu, sys, CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaStream, LaunchConfig,
    PushKernelArg,
};
use redlite_gguf::{GgmlType, GgufFile};
use redlite_model::weights::{LayerWeights, MixerWeights, MtpWeights, Weights};
use redlite_model::{Config, KvType, ModelError};

use crate::expert_cache::{
    device_used, moe_warps, slots_per_layer, ExpertBytes, ExpertCache, ExpertCacheSize,
    ExpertLayout, ExpertPolicy,
};
use crate::host::{HostLinear, HostLoader};
use crate::kernels::type_suffix;
use crate::mtp_queue::MtpQueue;
use crate::ops::{
    delta_seq_launch, dn_fused_launch, row_bytes, DeltaDims, RouterKernel, MATVEC_WARPS,
};
use crate::{CudaError, Gpu};

/// The ε of the L2 normalisation of DeltaNet q and k (as the model crate).
const L2_NORM_EPS: f32 = 1e-6;
/// Most rows of a speculative verify pass.
pub const MAX_VERIFY_ROWS: usize = 64;
/// Largest router top-k the router kernel handles.
const MAX_EXPERTS_USED: usize = 64;
/// Largest top-k of on-device sampling (the kernel's `SAMPLE_MAX_K`).
pub const MAX_SAMPLE_TOP_K: usize = 64;
/// Blocks per row of the greedy `argmax` (each takes a slice of the vocabulary; the last to finish
/// picks the best of their winners).
const ARGMAX_SLICES: usize = 128;
/// Largest head dimension of the attention kernels (`ATTN_MAX_HD`).
const MAX_HEAD_DIM: usize = 512;
/// Warps per block of the fused matvec kernels (`MVF_WARPS`).
pub(crate) const MVF_WARPS: usize = 8;
pub(crate) const MVF_THREADS: u32 = 32 * MVF_WARPS as u32;

/// Dynamic shared memory of `matvec_q8x_mma_q4_k` for rows `cols` wide: its 16 rows (each padded
/// by 16 bytes), their scale quads (one a block and sub-block pair, one of padding) and the tile's
/// 8 q8 rows (each padded by 16 bytes), or `None` past [`Q8X_MMA_MAX_SMEM`].
pub fn q8x_mma_smem(cols: usize) -> Option<u32> {
    let q8_row = crate::ops::q8_row_bytes(cols);
    let bytes = 16 * (cols / 256 * 144 + 16) + 16 * 16 * (cols / 64 + 1) + 8 * (q8_row + 16);
    (bytes <= Q8X_MMA_MAX_SMEM as usize).then_some(bytes as u32)
}

/// The dynamic shared memory `matvec_q8x_mma_q4_k` is opted in to (64 KiB: rows of 2,048 take
/// 49,792 bytes; three blocks an SM fit the 228 KiB of an H100 / H200).
pub const Q8X_MMA_MAX_SMEM: u32 = 64 * 1024;

/// Opts `matvec_q8x_mma_q4_k` in to [`Q8X_MMA_MAX_SMEM`] bytes of dynamic shared memory.
pub fn q8x_mma_opt_in(f: &CudaFunction) -> Result<(), CudaError> {
    f.set_attribute(
        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        Q8X_MMA_MAX_SMEM as i32,
    )
    .map_err(|e| CudaError::driver("matvec_q8x_mma_q4_k's shared memory limit", e))
}

/// `grid_sync` counters (one per kernel and grid size that uses the barrier).
const GRID_COUNTERS: usize = 16;
/// Threads of `moe_route_gate_up_q8q_iq2_xxs` (two 8-warp router groups; the gate/up's 16 warps).
const ROUTE_FUSED_THREADS: u32 = 512;
/// Largest input of `matvec_norm3_*` (its shared memory holds the normalised input).
const MVF_MAX_COLS: usize = 12 * 1024;
/// The split decode attention's buffers hold at most `max_context / ATTN_MIN_CHUNK` chunks a head
/// ([`attn_splits`]).
const ATTN_MIN_CHUNK: usize = 64;
/// Shortest chunk of the split decode attention by default (`REDLITE_CUDA_ATTN_MIN_CHUNK`), both
/// kernels: short contexts spread over more blocks (`attn_split_gqa`: 303.0 tok/s at positions
/// 8–136 against 299.6 with 64 on the H200; `attn_split`, the demo model at ≈ 1,000 positions:
/// +2.0 % decode against 64, session 21).
const ATTN_DEFAULT_MIN_CHUNK: usize = 16;
/// Default number of chunks a decode step's attention is cut into (`REDLITE_CUDA_ATTN_SPLITS`;
/// the chunks are at least [`ATTN_DEFAULT_MIN_CHUNK`] long): 128 (chunks of 256 at position
/// 32,768). On the H200 (session 10): at 32,768 chunks of 256 gave 166.4 / 162.4 tok/s, of 64
/// (512 splits) 159.2, of 1,024 79.6; at 4,096 chunks of 64 (64 splits) 230.4, of 256 165.1.
const ATTN_DEFAULT_SPLITS: usize = 128;
const ATTN_MAX_SPLITS: usize = 512;

/// Most consecutive rows per group of warps in the fused matvec kernels (`MVF_MAX_ROWS`).
pub(crate) const MVF_MAX_ROWS: usize = 4;

/// How the fused matvec kernels cut their work (`MvfSplit` in matvec.cu): each row in `parts`
/// slices (warps), each group of `parts` warps taking `rows` consecutive rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MvfSplit {
    pub parts: usize,
    pub rows: usize,
}

impl MvfSplit {
    /// The kernels' `split` argument: `parts | rows << 8`.
    pub(crate) fn arg(self) -> i32 {
        (self.parts | self.rows << 8) as i32
    }

    /// Matrix rows one block of `MVF_WARPS` warps covers.
    pub(crate) fn rows_per_block(self) -> u32 {
        (MVF_WARPS / self.parts * self.rows) as u32
    }
}

/// Rows per group of warps of `matvec_norm3` (tuning switch `REDLITE_CUDA_MVF_ROWS`, 1 to
/// `MVF_MAX_ROWS`; default 2: two rows' loads in flight per lane, the block's staging of x spread
/// over twice the rows) and of `matvec_res` (`REDLITE_CUDA_RES_ROWS`, default 1: its 2048 rows
/// give few enough blocks already).
pub(crate) fn mvf_rows_from_env(residual: bool) -> usize {
    let (var, default) = if residual {
        ("REDLITE_CUDA_RES_ROWS", 1)
    } else {
        ("REDLITE_CUDA_MVF_ROWS", 2)
    };
    env_parse(var).unwrap_or(default).clamp(1, MVF_MAX_ROWS)
}

/// Warps per row asked of the down kernels (`REDLITE_CUDA_MOE_DOWN_PARTS`, default 2).
pub(crate) fn moe_down_parts_from_env() -> usize {
    env_parse("REDLITE_CUDA_MOE_DOWN_PARTS").unwrap_or(2)
}

/// `asked` warps a row fitted to a block of `warps`: a power of two from 1 to `warps`.
pub(crate) fn fit_down_parts(asked: usize, warps: u32) -> usize {
    asked
        .clamp(1, warps as usize)
        .next_power_of_two()
        .min(warps as usize)
}

/// Rows per warp group of the one-token 8-bit kernels (`REDLITE_CUDA_Q8_ROWS`, 1 to 16, default 4).
pub(crate) fn q8_rows_from_env() -> usize {
    env_parse("REDLITE_CUDA_Q8_ROWS").unwrap_or(4).clamp(1, 16)
}

/// A tuning setting from the environment, parsed, or `None` when unset or unreadable.
pub(crate) fn env_parse<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// A comma-separated list from the environment (empty when unset).
fn env_list(name: &str) -> Vec<String> {
    std::env::var(name)
        .map(|v| {
            v.split(',')
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect()
        })
        .unwrap_or_default()
}

/// An on/off tuning switch from the environment: `0` off, `1` on, anything else the default.
pub(crate) fn env_switch(name: &str, default: bool) -> bool {
    match std::env::var(name).as_deref().map(str::trim) {
        Ok("0") => false,
        Ok("1") => true,
        _ => default,
    }
}

/// Most tokens per tile of `matvec_norm3_tok` (`MVF_MAX_TILE`).
pub(crate) const MVF_MAX_TILE: usize = 4;

/// Tokens per tile of the token-tile matvec (`matvec_norm3_tok`, `matvec_res_tok`: weights read
/// and decoded once per tile, the tile's tokens one after another in each warp) for calls of more
/// than one token: tuning switch `REDLITE_CUDA_TOKEN_TILE`, 1 (off) to `MVF_MAX_TILE`; unset (0):
/// [`AUTO_TILE_SMALL`] tokens a tile for calls of up to [`AUTO_TILE_SMALL_ROWS`] tokens, else
/// `MVF_MAX_TILE`. Outputs are bit-identical whatever the tile.
pub(crate) fn token_tile_from_env() -> usize {
    env_parse("REDLITE_CUDA_TOKEN_TILE").map_or(0, |t: usize| t.clamp(1, MVF_MAX_TILE))
}

/// The automatic tile for short calls (MTP passes, short lookup passes): two tiles of 2 run in
/// parallel where one tile of 4 runs its tokens serially. H200, session 22: the demo's MTP
/// rewrite 1.45× → 1.62× (4-row verify 1.51 → 1.34× a step, 8 rows 1.67 → 1.58×); full-size
/// 4 / 8 rows 5.84 / 9.12 ms → 5.78 / 9.18 (even), 16 rows 15.99 → 16.39 ms (tile 4 stays there).
const AUTO_TILE_SMALL: usize = 2;
const AUTO_TILE_SMALL_ROWS: usize = 8;

/// Prompts of at least this many tokens run their products through the GEMMs (`gemm.cu`: the
/// tensor-core `gemm_<type>`, `gemm_f32_simt` for f32 weights, and `moe_gemm_<type>` over the
/// routed experts grouped by expert) instead of the per-token matvecs; `REDLITE_CUDA_GEMM=0` turns
/// them off. Decode steps and speculative verify rows always take the matvecs (their rows stay
/// bit-identical to each other).
pub(crate) const GEMM_MIN_TOKENS: usize = 16;
/// The most rows of a verify pass or an MTP draft step replayed as a captured graph.
const SMALL_GRAPH_ROWS: usize = 16;
/// Verify passes of one row count before theirs is captured as a graph.
const VERIFY_GRAPH_AFTER: u32 = 3;
/// Captures of one graph tried before its launches run without one (see `CudaModel::capture`).
const CAPTURE_TRIES: usize = 3;
/// A capture invalidated from outside, as the driver returns it (from the end of the capture, or
/// from a launch inside it: [`CudaError::driver_code`]).
const INVALIDATED: sys::CUresult = sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
/// The most chained MTP drafts of one draft graph.
const MAX_GRAPH_DRAFTS: usize = 8;
/// `gemm.cu`'s tile: weight rows and tokens per block, columns per step, threads.
const GEMM_BM: usize = 64;
const GEMM_BN: usize = 64;
const GEMM_BK: usize = 32;
const GEMM_THREADS: u32 = 128;

/// Tokens a block of the activations-in-registers kernels (`matvec_res_xr_q4_k`,
/// `matvec_q8x_xr_q6_k`; `XR_TOKENS` in matvec.cu).
pub(crate) const XR_TOKENS: usize = 8;
/// Rows of a block of `matvec_res_xr_q4_k` (`XR_ROWS` in matvec.cu).
pub(crate) const RES_XR_ROWS: u32 = 8;
/// Rows of a block of `matvec_q8x_xr_q6_k`.
pub(crate) const HEAD_XR_ROWS: u32 = 16;

/// Rows a warp group of the Q4_K output projections' token tiles for a call of `n` tokens: `want`
/// (1 or 2) when set, else 2 up to 4 tokens and 1 beyond (session 29, full-size 2 / 4 / 8 / 16-row
/// verify: two rows −3.4 / −1.6 / −0.3 / +0.5 %).
pub(crate) fn res_tok_rows(want: usize, n: usize) -> usize {
    match want {
        1 | 2 => want,
        _ if n <= 4 => 2,
        _ => 1,
    }
}

/// The tile `matvec_norm3_tok` runs for `n` tokens of width `cols` (its shared memory holds the
/// tile's inputs: at most 48 KiB), or 1 (use `matvec_norm3`); `want` 0: by `n` (`token_tile_from_env`).
pub(crate) fn token_tile(want: usize, n: usize, cols: usize) -> usize {
    if n < 2 {
        return 1;
    }
    let want = match want {
        0 if n <= AUTO_TILE_SMALL_ROWS => AUTO_TILE_SMALL,
        0 => MVF_MAX_TILE,
        w => w,
    };
    want.min(n).min((48 * 1024) / (4 * cols.max(1))).max(1)
}

/// Slices of a row in the fused matvec kernels (warps per row, a power of two up to `MVF_WARPS`):
/// enough that a lane walks about `lane_iters` units of work (one warp's loop iterations: blocks
/// of the warp block decoders, groups of the group decoders, else values, 32 lanes at a time).
pub(crate) fn mvf_parts(ty: GgmlType, cols: usize, lane_iters: usize) -> usize {
    let per_iter = match ty {
        GgmlType::Q6K => 256,
        GgmlType::Q4K | GgmlType::Q8_0 => 16 * 32,
        GgmlType::IQ2XXS => 8 * 32,
        GgmlType::F32 => 4 * 32,
        _ => 32,
    };
    let iters = cols.div_ceil(per_iter);
    iters
        .div_ceil(lane_iters.max(1))
        .next_power_of_two()
        .clamp(1, MVF_WARPS)
}

/// The decode attention's `attn_split_gqa` kernel with 4 positions a warp step, for a cache of
/// `kv`: `attn_split_gqa4x` (its scores reduced transposed, one a lane: +4.5 % decode at position
/// 32,768 on the H200, session 23) unless `REDLITE_CUDA_ATTN_XR=0` (`attn_split_gqa4`); on an
/// f16 cache their `_h` forms, the XR one as `REDLITE_CUDA_ATTN_H` says: `8xh3` (the default
/// where the shape takes it, head_dim 256 with 8 query heads a KV head as the Qwen3-Next models:
/// `attn_split_gqa8xh3_h`, a KV head's query heads over two 4-warp blocks, three an SM; short
/// decode 398.60 tok/s against 393.60 with `4xp`, position 32,768 even, session 27), `4xp` (the
/// default for other shapes, `attn_split_gqa4xp_h`: the next warp step's rows loaded ahead;
/// position 32,768 349.0 tok/s against 340.7 with `4x`, session 24), `4x`
/// (`attn_split_gqa4x_h`, the same bits as `4xp`) or `8x` (`attn_split_gqa8x_h`, 8 rows loaded a
/// warp step: 347.4), or on the tensor cores (Q and P in f16) `mma` (`attn_split_mma_h`: in a
/// step even with 4xp at 32K in session 25; alone at 32K the fastest, 30.3 µs against 8xh3's
/// 32.0, session 27; two blocks an SM at 128 registers were slower, 33.8). `(heads, nkv, hd)`:
/// the model's attention shape.
fn attn_gqa4_kernel(kv: KvType, shape: (usize, usize, usize)) -> Result<String, CudaError> {
    let xr = env_switch("REDLITE_CUDA_ATTN_XR", true);
    if xr && kv == KvType::F16 {
        let (nh, nkv, hd) = shape;
        let form = std::env::var("REDLITE_CUDA_ATTN_H").unwrap_or_else(|_| {
            let takes = crate::ops::attn_split_takes("attn_split_gqa8xh3", nh, nkv, hd);
            (if takes { "8xh3" } else { "4xp" }).into()
        });
        return match form.as_str() {
            "8x" | "4xp" | "4x" | "8xh3" => Ok(format!("attn_split_gqa{form}_h")),
            "mma" => Ok("attn_split_mma_h".into()),
            other => Err(CudaError::Invalid(format!(
                "REDLITE_CUDA_ATTN_H={other} (8x, 4xp, 4x, 8xh3 or mma)"
            ))),
        };
    }
    crate::ops::kv_kernel(
        if xr {
            "attn_split_gqa4x"
        } else {
            "attn_split_gqa4"
        },
        kv,
    )
}

/// Chunks of the split decode attention for a context of `o.max_context` positions.
fn attn_splits(o: &CudaModelOptions) -> usize {
    o.max_context
        .div_ceil(ATTN_MIN_CHUNK)
        .clamp(1, ATTN_MAX_SPLITS)
}

/// `dn_fused_seq`'s launch `(threads, shared bytes)` for this model, or `None` when the shape does
/// not fit it (the DeltaNet core then runs as five kernels).
fn dn_fused(c: &Config) -> Option<(u32, u32)> {
    dn_fused_launch(DeltaDims {
        nk: c.dn_k_heads,
        nv: c.dn_v_heads,
        dk: c.dn_k_dim,
        dv: c.dn_v_dim,
    })
}

/// Sizes fixed at load time.
#[derive(Debug, Clone, Copy)]
pub struct CudaModelOptions {
    /// KV cache positions per attention layer.
    pub max_context: usize,
    /// Tokens per forward launch; longer prompts go in chunks of this many.
    pub max_batch: usize,
    /// Capture the decode step as a CUDA graph and replay it.
    pub graphs: bool,
    /// Routed experts in device memory: all, or a bounded cache (the rest read from pinned
    /// host memory, see [`crate::expert_cache`]).
    pub experts: ExpertCacheSize,
    /// Which missed experts a bounded cache promotes.
    pub expert_policy: ExpertPolicy,
    /// Rows a speculative verify pass ([`CudaModel::verify`]) may hold (0: none). Each row keeps
    /// the DeltaNet states after it (`36 × 2 MiB` at full size) for the rollback.
    pub max_verify: usize,
    /// Load the file's MTP block, when it has one, for [`CudaModel::mtp_draft`]: its layer's
    /// experts stay resident whatever `experts` says, and every trunk call then also queues its
    /// rows' hidden states for the MTP cache.
    pub mtp: bool,
    /// The KV cache's element type: f32 or f16 (half the bytes a position, and half what the
    /// decode attention streams at long contexts; the attention kernels' `_h` forms).
    pub kv_type: KvType,
}

impl Default for CudaModelOptions {
    fn default() -> Self {
        CudaModelOptions {
            max_context: 4096,
            max_batch: 256,
            graphs: true,
            experts: ExpertCacheSize::All,
            expert_policy: ExpertPolicy::Lfu,
            max_verify: 0,
            mtp: false,
            kv_type: KvType::F32,
        }
    }
}

/// On-device sampling: the engine sampler's temperature, top-k, top-p and min-p (no penalties).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuSampling {
    /// `<= 0`: greedy (arg-max).
    pub temperature: f32,
    /// 1..=[`MAX_SAMPLE_TOP_K`] when sampling.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
}

impl GpuSampling {
    pub fn greedy() -> GpuSampling {
        GpuSampling {
            temperature: 0.0,
            top_k: 1,
            top_p: 1.0,
            min_p: 0.0,
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0
    }

    /// Whether the GPU kernel can draw with these settings (else the caller samples on the host).
    pub fn supported(&self) -> bool {
        self.is_greedy() || (1..=MAX_SAMPLE_TOP_K).contains(&self.top_k)
    }
}

/// Which logits a forward call computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Head {
    /// None (an early prompt chunk).
    None,
    /// The last token's only.
    Last,
    /// Every token's.
    All,
}

/// How the tokens of one call are computed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rows {
    /// A prompt (or one decode token): causal attention over the tokens together (split over
    /// the cache for one token), the recurrent states carried to the end.
    Prompt,
    /// A verify pass: every token exactly as a one-token step at its position computes it
    /// (split attention per row), and the DeltaNet states after every row kept for a rollback.
    Steps,
}

/// A kernel argument (pointers are raw device addresses).
#[derive(Clone, Copy)]
pub(crate) enum A {
    P(u64),
    I(i32),
    F(f32),
    D(f64),
}

/// Launches `f` with `args` through `cuLaunchKernelEx`, with the programmatic-stream-serialization
/// attribute when `pdl` (the kernel waits in `pdl_enter` for the grid before it).
///
/// # Safety
/// `args` must be the kernel's parameters, in order and of its types, and every pointer among
/// them a live device buffer the kernel may access as launched.
pub(crate) unsafe fn launch_ex(
    stream: &cudarc::driver::CudaStream,
    f: &CudaFunction,
    (grid, block, shared): ((u32, u32, u32), u32, u32),
    args: &[A],
    pdl: bool,
) -> Result<(), cudarc::driver::DriverError> {
    use std::ffi::c_void;
    let mut params: Vec<*mut c_void> = args
        .iter()
        .map(|a| match a {
            A::P(v) => v as *const u64 as *mut c_void,
            A::I(v) => v as *const i32 as *mut c_void,
            A::F(v) => v as *const f32 as *mut c_void,
            A::D(v) => v as *const f64 as *mut c_void,
        })
        .collect();
    // SAFETY: an all-zero attribute value is valid (a union of plain integers).
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let cfg = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: shared,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: u32::from(pdl),
    };
    // SAFETY: the caller's contract; `params` points at values that live until the call returns
    // (the driver copies them).
    unsafe {
        sys::cuLaunchKernelEx(
            &cfg,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}

/// Device allocations, freed together when the model goes.
struct Arena {
    ctx: Arc<CudaContext>,
    ptrs: Vec<u64>,
    bytes: usize,
}

impl Arena {
    fn alloc(&mut self, bytes: usize) -> Result<u64, CudaError> {
        // SAFETY: a plain allocation in the bound context; freed once in `drop`.
        let p = unsafe { cu::malloc_sync(bytes.max(16)) }.map_err(|e| {
            CudaError::driver(
                format!(
                    "allocating {bytes} bytes (model holds {} MiB)",
                    self.bytes >> 20
                ),
                e,
            )
        })?;
        self.ptrs.push(p);
        self.bytes += bytes;
        Ok(p)
    }

    fn upload(&mut self, bytes: &[u8]) -> Result<u64, CudaError> {
        let p = self.alloc(bytes.len())?;
        // SAFETY: `p` holds `bytes.len()` bytes; the copy is synchronous.
        unsafe { cu::memcpy_htod_sync(p, bytes) }
            .map_err(|e| CudaError::driver("uploading weights", e))?;
        Ok(p)
    }

    fn upload_f32(&mut self, v: &[f32]) -> Result<u64, CudaError> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.upload(&bytes)
    }

    fn f32s(&mut self, n: usize) -> Result<u64, CudaError> {
        self.alloc(4 * n)
    }

    /// `bytes` bytes of zeros.
    fn zeros(&mut self, bytes: usize) -> Result<u64, CudaError> {
        let p = self.alloc(bytes)?;
        // SAFETY: `p` holds at least `bytes` bytes; the memset is synchronous.
        unsafe { cu::memset_d8_sync(p, 0, bytes.max(16)) }
            .map_err(|e| CudaError::driver("clearing a device buffer", e))?;
        Ok(p)
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            for &p in &self.ptrs {
                // SAFETY: each pointer came from `malloc_sync` and is freed once.
                let _ = unsafe { cu::free_sync(p) };
            }
        }
    }
}

/// What `res_norm_router` reads of a layer's router (see `Model::norm_router`): its row split
/// and the two matrices (the router, the shared expert's gate vector).
#[derive(Clone)]
struct NormRouter {
    split: MvfSplit,
    router: DevLinear,
    gate: DevLinear,
}

/// A linear layer on the device and its matvec kernel.
#[derive(Clone)]
struct DevLinear {
    rows: usize,
    cols: usize,
    ptr: u64,
    f: CudaFunction,
    /// The weight type (names the fused kernels `matvec_norm3_<type>`, `matvec_res_<type>`).
    ty: GgmlType,
}

/// The routed experts of one layer: where they are is the expert cache's table of layer
/// `layer`; the kernels for their types.
#[derive(Clone)]
struct DevExperts {
    layer: usize,
    /// `moe_gemm_<type>` of the gate/up parts and of the down part (prompts, [`GEMM_MIN_TOKENS`]).
    gemm_gate_up_f: CudaFunction,
    gemm_down_f: CudaFunction,
    gate_up_f: CudaFunction,
    /// `moe_gate_up_tab_q8_iq2_xxs` when gate and up are IQ2_XXS (8-bit activations from `xq`).
    gate_up_q8_f: Option<CudaFunction>,
    /// `moe_gate_up_tab_q8q_iq2_xxs` and `moe_down_combine_tab_q8_iq2_xxs` when every part is
    /// IQ2_XXS (the down projection on 8-bit activations too).
    q8_down_f: Option<(CudaFunction, CudaFunction)>,
    /// Their token-tile forms for calls of several tokens (`moe_gate_up_tok_q8q_iq2_xxs`,
    /// `moe_down_combine_tok_q8_iq2_xxs`: the same bits, [`CudaModel::moe_tok`] tokens a block).
    q8_tok_f: Option<(CudaFunction, CudaFunction)>,
    down_f: CudaFunction,
    /// Warps per block of both kernels ([`moe_warps`]).
    warps: u32,
    /// The down part's type.
    down_ty: GgmlType,
}

/// Prompt GEMMs through cuBLAS: a weight matrix is decoded whole into f16 (`dequant_f16_<type>`),
/// the tokens' activations rounded to f16 (`f32_to_f16`), then one cublasGemmEx. Used for calls
/// of at least `min_tokens` tokens (`REDLITE_CUDA_CUBLAS_MIN`, default 64) on matrices of at
/// least 64 rows that fit the f16 buffers (every dense layer matrix; not the lm_head, whose
/// prompt rows are one matvec); f32 matrices (the router) go to cuBLAS as they are, in f32.
/// The main stream and the shared expert's stream each have their own handle and buffers,
/// since they run at the same time.
struct PromptBlas {
    min_tokens: usize,
    /// f32 weights (the router) through cublasGemmEx in f32 too (`REDLITE_CUDA_CUBLAS_F32=0`:
    /// `gemm_f32_simt`).
    f32: bool,
    main: BlasLane,
    side: BlasLane,
}

/// One stream's cuBLAS handle and f16 staging buffers.
struct BlasLane {
    blas: crate::blas::Blas,
    /// f16 `[w_elems]`: the decoded weight matrix.
    wh: u64,
    w_elems: usize,
    /// f16 `[x_elems]`: the activations.
    xh: u64,
    x_elems: usize,
}

impl PromptBlas {
    /// Handles and buffers for prompts of up to `max_batch` tokens, or `None` and why not (cuBLAS
    /// switched off, its library missing or failing to start, batches too small to reach
    /// `min_tokens`): the prompts then keep the own GEMM kernels. Only a failed allocation is an
    /// error.
    fn new(
        arena: &mut Arena,
        file: &GgufFile,
        c: &Config,
        opts: &CudaModelOptions,
        (main, side): (&Arc<CudaStream>, &Arc<CudaStream>),
    ) -> Result<Result<PromptBlas, String>, CudaError> {
        let min_tokens = env_parse("REDLITE_CUDA_CUBLAS_MIN")
            .unwrap_or(64)
            .max(GEMM_MIN_TOKENS);
        if !env_switch("REDLITE_CUDA_CUBLAS", true) || !env_switch("REDLITE_CUDA_GEMM", true) {
            return Ok(Err("switched off".into()));
        }
        if opts.max_batch < min_tokens {
            return Ok(Err(format!(
                "{} tokens per call, cuBLAS from {min_tokens}",
                opts.max_batch
            )));
        }
        if !crate::blas::available() {
            return Ok(Err("libcublas not found".into()));
        }
        let handles = (
            crate::blas::Blas::new(main.clone()),
            crate::blas::Blas::new(side.clone()),
        );
        let (main_blas, side_blas) = match handles {
            (Ok(m), Ok(s)) => (m, s),
            (Err(e), _) | (_, Err(e)) => return Ok(Err(e.to_string())),
        };
        // The largest dense matrix of the layers (routed experts excluded: they have their own
        // grouped kernels).
        let (mut w_elems, mut cols) = (0usize, c.hidden);
        for t in file.tensors() {
            if t.name.starts_with("blk.") && t.dims.len() == 2 && !t.name.contains("_exps") {
                w_elems = w_elems.max(t.n_elements as usize);
                cols = cols.max(t.dims[0] as usize);
            }
        }
        let sh = c.shared_ff * c.hidden;
        let b = opts.max_batch;
        let mut lane = |blas, w_elems: usize, x_elems: usize| {
            Ok::<_, CudaError>(BlasLane {
                blas,
                wh: arena.alloc(2 * w_elems)?,
                w_elems,
                xh: arena.alloc(2 * x_elems)?,
                x_elems,
            })
        };
        Ok(Ok(PromptBlas {
            min_tokens,
            f32: env_switch("REDLITE_CUDA_CUBLAS_F32", true),
            main: lane(main_blas, w_elems, b * cols)?,
            side: lane(side_blas, sh, b * c.hidden.max(c.shared_ff))?,
        }))
    }
}

/// The shared expert's own stream: forked from the model's stream after the router and joined
/// before the routed down projection, so it runs beside the routed experts (two branches of the
/// captured graph).
struct MoeSide {
    stream: Arc<CudaStream>,
    fork: CudaEvent,
    join: CudaEvent,
}

impl MoeSide {
    fn new(ctx: &Arc<CudaContext>) -> Result<MoeSide, CudaError> {
        let drv = |e| CudaError::driver("creating the shared expert's stream", e);
        Ok(MoeSide {
            stream: crate::device::new_stream(ctx).map_err(drv)?,
            fork: ctx.new_event(None).map_err(drv)?,
            join: ctx.new_event(None).map_err(drv)?,
        })
    }
}

#[derive(Clone)]
struct DevMoe {
    router: DevLinear,
    experts: DevExperts,
    sh_gate: DevLinear,
    sh_up: DevLinear,
    sh_down: DevLinear,
    /// The shared expert's gate vector as a 1-row F32 matrix.
    sh_gate_vec: DevLinear,
}

#[derive(Clone)]
enum DevMixer {
    Attention {
        wq: DevLinear,
        wk: DevLinear,
        wv: DevLinear,
        wo: DevLinear,
        q_norm: u64,
        k_norm: u64,
        /// `[max_context][kv_heads][head_dim]` each.
        kc: u64,
        vc: u64,
    },
    DeltaNet {
        qkv: DevLinear,
        z: DevLinear,
        ba: DevLinear,
        out: DevLinear,
        conv_w: u64,
        dt_bias: u64,
        a: u64,
        norm: u64,
        /// `[kernel − 1][channels]`.
        conv_state: u64,
        /// `[v_heads][k_dim][v_dim]`.
        s: u64,
        /// The states after each row of a verify pass (`[max_verify]` of each; 0 without).
        conv_trace: u64,
        s_trace: u64,
    },
}

struct DevLayer {
    attn_norm: u64,
    post_norm: u64,
    mixer: DevMixer,
    moe: DevMoe,
}

/// The MTP block on the device (`blk.N.nextn.*` and its full-attention decoder layer) and its
/// cache of slots: slot t ran `(h_t, token t+1)` at position t, h_t being the trunk's final
/// hidden state at t after the output norm (the CPU's `Model::mtp_hidden` inputs).
struct DevMtp {
    enorm: u64,
    hnorm: u64,
    /// `[hidden, 2·hidden]` of `[enorm(embed(token)) | hnorm(h)]`.
    eh_proj: DevLinear,
    layer: DevLayer,
    shared_head_norm: u64,
    /// The layer's routed experts (all resident), a cache of one layer: swapped in for
    /// `CudaModel::experts` while the MTP layer runs (its `DevExperts::layer` is 0).
    experts: ExpertCache,
    /// f32 `[queue rows][hidden]`: the queued slots' hidden states, then the waiting trunk row's
    /// (which row holds what: `queue`).
    q: u64,
    queue: MtpQueue,
    /// f32 `[max_batch][2·hidden]`: the eh_proj input.
    cat: u64,
    /// The `x` row the last head drew its draft from: a chained step's hidden input, taken
    /// through the shared-head norm by `embed_cat2` (hence the `true` beside it where passed).
    head_row: u64,
    /// Whole drafts (the queued slots, then the chained steps) as one graph, by (slots,
    /// drafts, with probabilities), and where they leave their drafts (i32
    /// `[MAX_GRAPH_DRAFTS]`) and, with probabilities, each draft's (f32 `[MAX_GRAPH_DRAFTS]`).
    draft_graphs: HashMap<(usize, usize, bool), CudaGraph>,
    drafts: u64,
    draft_probs: u64,
}

/// The kernels that do not depend on a weight type.
struct Kernels {
    rms_norm: CudaFunction,
    rms_norm_gated: CudaFunction,
    argmax_chain: CudaFunction,
    dn_restore: CudaFunction,
    swiglu: CudaFunction,
    dn_conv_seq: CudaFunction,
    dn_conv_prompt: CudaFunction,
    dn_conv_shift: CudaFunction,
    dn_qk_norm: CudaFunction,
    dn_gates: CudaFunction,
    dn_delta_seq: CudaFunction,
    dn_fused_seq: CudaFunction,
    dn_fused_cols: CudaFunction,
    dn_fused_cols_rows: CudaFunction,
    matvec_res_gated_q4_k: CudaFunction,
    attn_qk_prep: CudaFunction,
    attn_causal: CudaFunction,
    attn_prompt: CudaFunction,
    attn_split: CudaFunction,
    attn_split_gqa: CudaFunction,
    attn_split_gqa4: CudaFunction,
    attn_merge: CudaFunction,
    argmax: CudaFunction,
    sample_topk: CudaFunction,
    moe_group: CudaFunction,
    swiglu_pairs: CudaFunction,
    moe_combine_pairs: CudaFunction,
    matvec_q8x: CudaFunction,
    matvec_q8x_q6k: CudaFunction,
    matvec_q8x_tok: CudaFunction,
    matvec_q8x_tok_q6k: CudaFunction,
    matvec_q8x_xr_q6k: CudaFunction,
    matvec_q8x_mma: CudaFunction,
    swiglu_q8: CudaFunction,
    rms_norm_q8: CudaFunction,
    matvec3_x_f32: CudaFunction,
    matvec3_x_tok_f32: CudaFunction,
    res_norm_q8: CudaFunction,
    res_norm_router: CudaFunction,
    moe_gate_up_route: CudaFunction,
    moe_gate_up_route2: CudaFunction,
    /// `moe_route_gate_up_q8q_iq2_xxs` and its blocks an SM (its grid barrier needs every block
    /// resident at once: the launch checks the grid against it).
    moe_route_fused: (CudaFunction, u32),
}

/// Activation buffers for `max_batch` tokens.
struct Scratch {
    x: u64,
    xn: u64,
    // DeltaNet
    qkv: u64,
    conv: u64,
    z: u64,
    ba: u64,
    beta: u64,
    g: u64,
    o: u64,
    gated: u64,
    // attention
    qg: u64,
    kn: u64,
    vn: u64,
    q: u64,
    gate: u64,
    att: u64,
    // MoE
    rlog: u64,
    wts: u64,
    act: u64,
    sg: u64,
    su: u64,
    sa: u64,
    shared: u64,
    gl: u64,
    // head
    logits: u64,
    /// i32 `[1 + max_batch]`: the start position, then the token ids.
    input: u64,
    /// i32 `[max(1, max_verify)]`: the sampled token (the rows' greedy tokens of a verify pass).
    out: u64,
    /// f32 `[1]`: the uniform draw of the sampler.
    u: u64,
    /// u32 `[max_batch]`, zero between launches: blocks finished per token (`matvec_res_*`).
    counter: u64,
    /// u64 `[GRID_COUNTERS]`, only ever growing: `grid_sync`'s block arrivals, one counter per
    /// (kernel, grid size) (`CudaModel::grid_counter`).
    grid_counter: u64,
    /// `dn_fused_cols`' barrier counters, one per QK head (u64, only ever growing).
    dn_counter: u64,
    /// `argmax`'s slice winners (f32 value, i32 index) `[max(1, max_verify)][ARGMAX_SLICES]` and
    /// its u32 `[max(1, max_verify)]` count of finished slices per row (zero between launches).
    argmax_part: u64,
    argmax_counter: u64,
    /// `[max_batch]` q8 rows of `xn` (`q8_row_bytes(hidden)` each), written with it by
    /// `matvec_res` for the MoE's 8-bit kernels.
    xq: u64,
    /// `[max_batch]` q8 rows of the shared expert's activation `sa` (`swiglu_q8`).
    xq_sa: u64,
    /// `[max_batch · k]` q8 rows of the routed experts' activations (`q8_row_bytes(expert_ff)`
    /// each; `REDLITE_CUDA_Q8_MOE_DOWN`).
    act_q: u64,
    /// `[max_batch]` q8 rows of a mixer's normalised input and f32 `[max_batch]` its 1 / rms
    /// (`rms_norm_q8`).
    xq_in: u64,
    xq_inv: u64,
    // Prompts through the GEMMs ([`GEMM_MIN_TOKENS`]): the routed experts' (token, choice) pairs
    // grouped by expert, their gate/up rows, their down rows.
    /// i32 `[n_expert + 1]`: where each expert's pairs start in `pairs`.
    pair_off: u64,
    /// i32 `[max_batch · k]`: pair indices `t · k + j`, grouped by expert.
    pairs: u64,
    /// f32 `[max_batch · k][2 · expert_ff]`: each pair's gate then up rows.
    gu: u64,
    /// f32 `[max_batch · k][hidden]`: each pair's down rows (unweighted).
    down: u64,
    /// f32 `[max(1, max_verify)][heads][attn_splits][head_dim + 2]`: the chunks of `attn_split`.
    attn_part: u64,
    /// f32 pairs `[max_context][rope_dims / 2]`: `rope_table`'s {cos, sin} per position and pair.
    rope_cs: u64,
}

/// The captured decode step and the sampling settings it was captured with.
struct Captured {
    graph: CudaGraph,
    sampling: GpuSampling,
}

/// A Qwen3-Next model resident on one GPU, with one sequence's state.
pub struct CudaModel {
    pub config: Config,
    opts: CudaModelOptions,
    gpu: Arc<Gpu>,
    stream: Arc<CudaStream>,
    k: Kernels,
    embed_f: CudaFunction,
    /// `embed_cat2_<type>`: the MTP block's embedding and its input norms in one launch.
    embed_cat2_f: CudaFunction,
    embed: u64,
    output_norm: u64,
    output: DevLinear,
    layers: Vec<DevLayer>,
    sc: Scratch,
    pos: usize,
    /// Row of the logits buffer that holds the last token's logits.
    last_row: usize,
    graph: Option<Captured>,
    /// Kernel launches so far (a captured step counts as its launches once, at capture).
    launches: u64,
    /// Launches in one decode step (measured at the first step).
    step_launches: Option<u64>,
    /// Decode steps run so far, and the one to bracket with the CUDA profiler (`profile_step`).
    decode_steps: u64,
    profile_step: Option<u64>,
    /// Verify passes run so far, and the one to bracket with the profiler
    /// (`REDLITE_CUDA_PROFILE_VERIFY=N`: the N-th pass, counted from 0).
    verify_passes: u64,
    profile_verify: Option<u64>,
    /// Graph captures invalidated from outside so far (each tried again; see `capture`).
    captures_invalidated: u64,
    /// MTP drafts run so far, and the one to bracket with the profiler, enqueued eagerly
    /// (`REDLITE_CUDA_PROFILE_DRAFT=N`: the N-th draft, counted from 0).
    mtp_drafts: u64,
    profile_draft: Option<u64>,
    /// A graphed MTP draft stops after its first draft whose probability is below this, as the
    /// CPU's `--spec-mtp-min-prob` (`REDLITE_CUDA_MTP_MIN_PROB`, default 0: every draft kept;
    /// not yet measured on a GPU). The chain's launches still run (one graph); the verify
    /// pass gets fewer rows. Eager drafts (the first after a long prompt) keep every draft.
    mtp_min_prob: f32,
    /// NVTX ranges per layer while the profiled step is enqueued (loaded with `profile_step`).
    nvtx: Option<crate::nvtx::Nvtx>,
    /// The profiled step is being enqueued.
    in_profile: bool,
    /// Work units per lane the fused matvecs aim for (`mvf_parts`; tuning switch
    /// `REDLITE_CUDA_MVF_LANE_ITERS`, default 4: 168 tok/s against 156 with 2 and 140 with 1).
    mvf_lane_iters: usize,
    /// Consecutive rows per group of warps in `matvec_norm3` and `matvec_res`
    /// (`mvf_rows_from_env`); the lm_head takes one.
    mvf_rows: usize,
    res_rows: usize,
    /// Work units per lane for the residual matvecs (`matvec_res_*`, the output projections;
    /// `REDLITE_CUDA_RES_LANE_ITERS`, default `mvf_lane_iters`): one-token and verify calls alike,
    /// so their rows keep the same bits.
    res_lane_iters: usize,
    /// Tokens per tile of the token-tile matvecs for multi-token calls (`token_tile_from_env`; 0:
    /// by the call's tokens, `token_tile`).
    token_tile: usize,
    /// Prompts may use the GEMMs (`gemm_from_env`), and whether the call being enqueued does.
    gemm: bool,
    gemm_now: bool,
    /// Prompts through the GEMMs still take `dn_fused_seq` (`REDLITE_CUDA_DN_PROMPT_FUSED=1`).
    dn_fused_prompt: bool,
    /// Prompts' delta rule by `dn_delta_warp_<dk>` (`REDLITE_CUDA_DN_WARP=0`: `dn_delta_seq`).
    dn_warp: bool,
    /// Fewest cache positions per chunk of the decode attention split (`attn_split`):
    /// `REDLITE_CUDA_ATTN_MIN_CHUNK` (a tuning switch, by default [`ATTN_DEFAULT_MIN_CHUNK`], at
    /// least 4, rounded up to a multiple of 4).
    /// Larger chunks: fewer blocks and partial results.
    attn_min_chunk: usize,
    /// Chunks of the decode attention split at most (`REDLITE_CUDA_ATTN_SPLITS`, default: SMs /
    /// KV heads with `attn_split_gqa` (one wave of its one-block-per-SM grid), else
    /// [`ATTN_DEFAULT_SPLITS`]; at most the buffers' [`attn_splits`]): long contexts get longer
    /// chunks rather than more of them.
    attn_splits: usize,
    /// Decode attention by `attn_split_gqa` (warps over positions, each scoring every query head
    /// of its KV head; the shape must fit `ops::attn_split_gqa_fits`) instead of `attn_split`
    /// (a warp per query head): `Some(P)`, P positions per warp step (`REDLITE_CUDA_ATTN_GQA=P`,
    /// 2 or 4; 0 turns it off).
    attn_gqa: Option<usize>,
    /// Blocks a KV head's query heads take in the decode attention's split kernel (2 for
    /// `attn_split_gqa8xh3_h`, else 1).
    attn_head_blocks: usize,
    /// RoPE's cosines and sines from `rope_table`'s rows (`Scratch::rope_cs`, computed once at
    /// load) instead of computed in double by every `attn_qk_prep` block
    /// (`REDLITE_CUDA_ROPE_TABLE`, default on; the same bits).
    rope_table: bool,
    /// Prompts' attention on the tensor cores (`attn_prompt_mma_<hd>`; `REDLITE_CUDA_ATTN_MMA=0`:
    /// `attn_prompt`).
    attn_mma: bool,
    /// The same for the lm_head (`REDLITE_CUDA_HEAD_LANE_ITERS`, default 8: one warp per row of
    /// the Q6_K head, which took 0.19 ms per step where the 4 of the other matrices took 0.34).
    head_lane_iters: usize,
    /// The router matvec's `(lane_iters, rows per warp)`: `REDLITE_CUDA_ROUTER_LANE_ITERS` and
    /// `REDLITE_CUDA_ROUTER_ROWS` (tuning switches; default 4 and 1: four warps a 2,048-wide
    /// row, so that the fused route kernel's 320 router groups take the 513 rows in one round,
    /// +1.0 % decode in session 19 against 1, which session 7's separate router kernel had
    /// preferred). The fused kernel and the separate matvec use the same split, so that verify
    /// rows (separate) and decode steps (fused) get the same logits.
    router_split: (usize, usize),
    /// The router kernel (`RouterKernel::for_model`: the one-warp one unless
    /// `REDLITE_CUDA_ROUTER=block`) and its function.
    router: (CudaFunction, RouterKernel),
    /// Launches with programmatic dependent launch (`pdl_enter` in common.cu): a kernel may start
    /// while the one before it in the stream finishes, its blocks prefetching their weights until
    /// the earlier grid completes. On for compute capability 9.0 and newer unless
    /// `REDLITE_CUDA_PDL=0`. Decode steps and verify rows only (not calls through the GEMMs).
    pdl: bool,
    /// Q4_K products of the fused matvecs with 8-bit activations (`matvec_norm3_q8_q4_k`:
    /// dp4a on the input quantised per 32 values; `REDLITE_CUDA_Q8=0`: f32 activations).
    q8: bool,
    /// Rows per warp group of the one-token 8-bit kernel (`REDLITE_CUDA_Q8_ROWS`, 1 to
    /// `Q8_MAX_ROWS` = 16; default 4: 32 rows a block, the input staged once for all of them; 227.95
    /// tok/s against 220.19 with 8, 205.53 with 16 and 220.70 with 2 on the H200).
    q8_rows: usize,
    /// The output projections (`matvec_res`) with 8-bit activations too (`REDLITE_CUDA_Q8_RES=1`,
    /// off by default: 217.0 against 230.3 tok/s on the H200, the staging of a 4,096-wide input
    /// per block costs more than the dp4a saves), `REDLITE_CUDA_Q8_RES_ROWS` rows per warp group.
    q8_res: bool,
    q8_res_rows: usize,
    /// The MoE block's inputs as a q8 row written once, by `matvec_res`'s last block, beside `xn`
    /// (`Scratch::xq`): the routed IQ2_XXS gate/up through `moe_gate_up_tab_q8_iq2_xxs` (dp4a,
    /// `REDLITE_CUDA_Q8_MOE`, default on) and the shared expert's Q4_K gate/up through
    /// `matvec_q8x_q4_k` (no per-block staging; `REDLITE_CUDA_XQ_SHARED`, default on), and its
    /// down rows on the q8 row `swiglu_q8` writes beside `sa`.
    q8_moe: bool,
    xq_shared: bool,
    /// Q6_K products (the lm_head) on 8-bit activations too (`matvec_q8x_q6_k`,
    /// `matvec_norm3_{,tok_}q8_q6_k`: `dp4a` on the f32 kernel's lane layout;
    /// `REDLITE_CUDA_Q8_Q6K`, on by default since session 11: 290.35 / 290.10 tok/s against
    /// 284.81 / 283.65 on the H200; fixture step KL 2.8e-5 / 4.9e-5 / 2.6e-5, in bounds).
    q8_q6k: bool,
    /// A mixer's Q4_K input projections of a one-token-at-a-time call through `rms_norm_q8` (the
    /// norm and its q8 row once per token) and `matvec_q8x_q4_k`, instead of every block of
    /// `matvec_norm3_q8_q4_k` staging them (`REDLITE_CUDA_XQ_NORM`, default on).
    xq_norm: bool,
    /// Tokens per tile of `matvec_q8x_tok_*` (the 8-bit products of a call of several tokens:
    /// `rms_norm_q8` once per token, then the weights read once per tile with the q8 rows read
    /// in place; `REDLITE_CUDA_Q8X_TILE`, 1 to 8, default 8; 1 gives the session-10 path, the
    /// staging token tiles of `matvec_norm3_tok_q8_*`).
    q8x_tile: usize,
    /// Rows per warp group of `matvec_q8x_tok_*` (`REDLITE_CUDA_Q8X_TILE_ROWS`, 1 to 16, default 2:
    /// 8 verify rows 11.61 ms against 11.64 with 1 and 11.93 with 4 on the H200; the one-token
    /// kernel takes `q8_rows`).
    q8x_tile_rows: usize,
    /// The Q4_K products of q8 rows through `matvec_q8x_mma_q4_k` (their integer sums on the
    /// tensor cores, every output the same bits) for calls of at least `REDLITE_CUDA_Q8X_MMA`
    /// tokens (0: never; default 6: full-size verify of 6 / 7 / 8 / 12 / 16 rows −1.8 / −2.6 /
    /// −4.1 / −1.9 / −4.4 % on an H100, of 5 rows −0.9 %, of 2 / 4 rows +7.5 / +3.0 %; one token
    /// −13.6 % decode; session 46).
    q8x_mma: usize,
    /// The router and the output projections of a call of several tokens through the in-place
    /// token tiles `matvec3_x_tok_f32` and `matvec_res_tok_<type>` (`REDLITE_CUDA_X_TOK`, default
    /// on; off: the staging `matvec_norm3_tok_f32` and one `matvec_res` block row per token).
    x_tok: bool,
    /// f32 products without norm weights (the router and the shared expert's gate logit) of a
    /// one-token-at-a-time call read their input in place (`matvec3_x_f32`) instead of every block
    /// staging it (`REDLITE_CUDA_X_ROUTER`, default on).
    x_router: bool,
    /// A one-token call's router top-k inside the expert gate/up kernel's blocks (each block of
    /// the token redoes it: `moe_gate_up_route_q8q_iq2_xxs`) instead of a `moe_router_warp`
    /// launch before it (`REDLITE_CUDA_ROUTE_IN_GATE_UP`, default on). On the H200: decode with
    /// every expert resident 275.5 / 275.5 tok/s against 275.4 / 276.4 (48 launches fewer, but
    /// the fused kernel takes 20.3 µs a layer against 14.5 + 7.3), with `--memory 16GiB` (experts
    /// over PCIe) 174.3 / 173.8 against 167.7 / 169.4. Verify passes keep the separate top-k
    /// (8 rows: 12.60 against 11.62 ms).
    route_in_gate_up: bool,
    /// The routed gate/up kernel with a warp's two rows walked together
    /// (`moe_gate_up_route2_q8q_iq2_xxs`, the same bits; `REDLITE_CUDA_MOE_GU_PAIR=0` the one-row
    /// form): 303.73 / 301.76 against 300.88 / 300.15 tok/s on the H200.
    moe_gu_pair: bool,
    /// One-token steps without `norm_router`: the router's logits, the top-k and the routed gate/up
    /// in one launch with a grid barrier between the logits and the top-k
    /// (`moe_route_gate_up_q8q_iq2_xxs`, the same bits; `REDLITE_CUDA_ROUTE_FUSED=0`:
    /// `matvec3_x_f32` then `moe_gate_up_route2_q8q_iq2_xxs`).
    route_fused: bool,
    /// One-token steps: the router's logits and the shared expert's gate logit computed by the
    /// output projection's next norm (`res_norm_router`: `res_norm_q8` and `matvec3_x_f32` in one
    /// launch, the router weights loaded before its wait; the same bits), then the top-k and the
    /// routed gate/up without the fused route kernel's rows and grid barrier
    /// (`moe_gate_up_route2_q8q_iq2_xxs`). Default on since session 42 (H100: decode +2.4 %,
    /// 406.62 against 397.02 tok/s; +2.3 % at 32K); `REDLITE_CUDA_NORM_ROUTER=0`: the fused route
    /// kernel (`route_fused`).
    norm_router: bool,
    /// `res_norm_router`'s direct form: the router blocks compute yn at their own columns beside
    /// their sum of squares (no staging, no barrier before the rows) and `norm_slices` more blocks
    /// write the norm's slices. Default on since session 42 (H100: decode +5.7 %, 415.49 against
    /// 393.04 tok/s over the staging form; 32K +5.1 %; the same bits);
    /// `REDLITE_CUDA_NORM_ROUTER_DIRECT=0` the staging form.
    norm_router_direct: bool,
    /// The router launch `res_norm_router` takes for the layer being enqueued (set before its
    /// mixer when `norm_router` applies, taken by [`Self::matvec_residual`]).
    next_router: Option<NormRouter>,
    /// Whether the last `matvec_residual` wrote the router's logits (`res_norm_router`).
    logits_ready: bool,
    /// (kernel, grid size) → `grid_sync` counter index, in order of first use.
    grid_counters: Vec<(&'static str, u32)>,
    /// `dn_fused_seq` loads its state rows before waiting for the kernel ahead
    /// (`REDLITE_CUDA_DN_EARLY`, default on; the same bits).
    dn_early: bool,
    /// The fused DeltaNet core as `dn_fused_cols` (a V head's state columns over dv / 32 blocks,
    /// 128 at full size, a barrier per QK head before the gated norm) instead of `dn_fused_seq`
    /// (a QK head a block: 16): its launch `(grid, threads, shared bytes)`, when the shape has one,
    /// `REDLITE_CUDA_DN_COLS` is not 0 and every block fits the GPU at once (the barrier needs a
    /// head's blocks resident together). The same bits; default on since session 17 (+6.8 %
    /// against `dn_fused_seq` on the H200 once its spills were gone; 2.4 % slower with them).
    dn_cols: Option<(u32, u32, u32)>,
    /// Calls of several tokens (verify passes, short prompts) take `dn_fused_cols_rows` (the
    /// chunk's conv, gates, q/k norms and conv trace ahead of the recurrence, one barrier a
    /// token) instead of `dn_fused_cols` (`REDLITE_CUDA_DN_ROWS`, default on; the same bits).
    dn_rows: bool,
    /// The fused DeltaNet kernels load their conv weights and windows, gate parameters and norm
    /// weights before the wait (`early` bit 1; `REDLITE_CUDA_DN_PRE`): after it only the
    /// projections (qkv, ba, z) are read; the same bits.
    dn_pre: bool,
    /// One-token steps compute the DeltaNet output gate's rows (z) on the side stream after the
    /// in-projection, beside `dn_fused_cols`, which then leaves its gated norm to the
    /// out-projection (`matvec_res_gated_q4_k`, joined after z; `REDLITE_CUDA_Z_SIDE`, default
    /// off): z leaves the in-projection's waves on the chain. The same bits.
    z_side: bool,
    /// The IQ2_XXS q8 expert kernels find expert e's parts at expert 0's + e · slot stride
    /// (`ExpertCache::direct_stride`: every expert resident) instead of loading the table entry
    /// after the ids (`REDLITE_CUDA_MOE_DIRECT`, default on: +0.8 % decode in session 14; off, and always when
    /// some experts live in host memory: the table).
    moe_direct: bool,
    /// `matvec_res`'s next norm (`xn` and its q8 row) by a kernel of its own (`res_norm_q8`)
    /// instead of its last block (`REDLITE_CUDA_RES_NORM_SPLIT=0`): 260.9 / 262.1 against 255.6 /
    /// 254.7 tok/s on the H200 (ncu: `matvec_res` 18.4 → 7.9 µs, the counting of its 512 blocks
    /// and the one-block tail gone).
    res_norm_split: bool,
    /// Timing diagnostics only: launches to leave out (`REDLITE_CUDA_SKIP`, comma-separated
    /// launch names such as `dn_fused_seq`, or `stage:name` / `stage:*` with stage `dn`, `attn`,
    /// `moe`, `shared` or `head`; `dn:z_rows` leaves the output gate's rows out of the DeltaNet
    /// in-projection launch, `dn:z_side` runs them on the side stream beside the fused kernel).
    /// The outputs are garbage; the step time shows what each stage costs on the critical path
    /// of the replayed graph (ncu times each kernel alone).
    skip: Vec<String>,
    /// Timing diagnostics only: launches replaced by `noop_pdl` with the same grid and block
    /// (`REDLITE_CUDA_NOOP`, the names as for `skip`, or `*` for all): the step time of the
    /// launches without their work.
    noop: Vec<String>,
    /// The stage the launches being enqueued belong to (for `skip`).
    stage: &'static str,
    /// Blocks per row of the greedy `argmax` (`REDLITE_CUDA_ARGMAX_SLICES`, 1 to
    /// [`ARGMAX_SLICES`], the default).
    argmax_slices: usize,
    /// Blocks per token of the one-token norms `rms_norm_q8` and `res_norm_q8` (each sums all the
    /// squares and writes a slice of the q8 row; `REDLITE_CUDA_NORM_SLICES`, 1 to 64, default
    /// [`crate::ops::NORM_SLICES`]).
    norm_slices: usize,
    /// Whether the last `matvec_residual` wrote `xq` (not when it went through a GEMM).
    xq_fresh: bool,
    /// With `q8_moe`, the IQ2_XXS down projection on 8-bit activations as well
    /// (`moe_gate_up_tab_q8q_iq2_xxs` quantises each 32 rows' activations, then
    /// `moe_down_combine_tab_q8_iq2_xxs`; `REDLITE_CUDA_Q8_MOE_DOWN=0` turns it off: on the H200
    /// 255.4 / 256.5 tok/s against 250.3 / 248.9 without, 152.0 against 145.5 at 16 GiB lfu).
    q8_moe_down: bool,
    /// Rows per warp of the decode expert gate/up kernel (`moe_gate_up_tab`):
    /// `REDLITE_CUDA_MOE_ROWS` (1 to 8, default 1: more were slower); it takes what the grid leaves.
    moe_rows: u32,
    /// Warps per row asked of `moe_down_combine_tab` (`REDLITE_CUDA_MOE_DOWN_PARTS`, default 2;
    /// [`Self::moe_down_parts`] fits it to the kernel).
    moe_down_parts: usize,
    /// Tokens a block of the IQ2_XXS routed experts' token-tile kernels in calls of several tokens
    /// (verify rows, short prompts), gate/up and down: `REDLITE_CUDA_MOE_TOK=g:d` (g 1 ..
    /// [`MOE_TOK_GU_MAX`], d 1 .. [`MOE_TOK_DOWN_MAX`]; 0: the one-token kernels on a grid of
    /// tokens; default `0:8`, see [`moe_tok_tiles`]).
    moe_tok: (usize, usize),
    /// Rows a warp group of the Q4_K output projections' token tiles (`REDLITE_CUDA_RES_TOK_ROWS`:
    /// 1, 2, or 0 for the default [`res_tok_rows`]): 2 takes `matvec_res_tok2_q4_k` (each token's
    /// activations loaded once for two rows; the same bits).
    res_tok_rows: usize,
    /// The Q4_K output projections of calls of at least `REDLITE_CUDA_RES_XR` tokens through
    /// `matvec_res_xr_q4_k` (8 rows × 8 tokens a block, each unit's activations loaded once a
    /// block into registers; the same bits as the token tiles); 0: never. Default 2 (H100,
    /// session 47, full-size verify, three alternating rounds each: 3 rows −3.9 % against the
    /// two-row tiles and 2 rows even (run 7); at 4 / 8 / 16 rows the first form −1 / −8 / −6.6 %
    /// against the tiles (run 1), this form another −3.4 / −1.5 / −1.4 % (run 4)).
    res_xr: usize,
    /// The Q6_K head (one slice a row) of calls of at least `REDLITE_CUDA_HEAD_XR` tokens through
    /// `matvec_q8x_xr_q6_k` (16 rows × 8 tokens a block, each token's q8 values loaded once for
    /// four rows; the same bits as the token tiles); 0: never. Default 2 (H100, session 47, three
    /// alternating rounds: full-size verify of 3 / 4 / 6 / 8 / 16 rows −0.6 / −0.8 / −0.8 / −1.5 /
    /// −1.8 %, 2 rows even).
    head_xr: usize,
    /// The last verify pass, `(start position, rows)`, until `keep` or another call.
    verified: Option<(usize, usize)>,
    /// The routed experts: device slots, host copies, per-layer address tables.
    experts: ExpertCache,
    /// The MTP block (`CudaModelOptions::mtp` and a file that has one).
    mtp: Option<DevMtp>,
    /// Verify passes and MTP draft steps of up to [`SMALL_GRAPH_ROWS`] rows as CUDA graphs,
    /// captured at their first use per row count (`REDLITE_CUDA_SMALL_GRAPHS`, default on;
    /// with `graphs`, and with every expert resident for verify passes).
    small_graphs: bool,
    /// By (rows, greedy argmax included); captured at the [`VERIFY_GRAPH_AFTER`]-th pass of
    /// that many rows (`verify_uses`), so that a row count seen once or twice costs no capture.
    verify_graphs: HashMap<(usize, bool), CudaGraph>,
    verify_uses: HashMap<(usize, bool), u32>,
    /// `dn_restore`'s table (per DeltaNet layer: state, its trace, conv state, its trace) and
    /// its layers, when there are verify traces and the state sizes suit it (`keep`).
    dn_restore: Option<(u64, usize)>,
    side: MoeSide,
    /// Long prompts' dense products through cuBLAS ([`PromptBlas`]; `None`: the library is not
    /// there, `REDLITE_CUDA_CUBLAS=0`, or batches too small to use it).
    blas: Option<PromptBlas>,
    /// Why `blas` is `None`.
    blas_off: Option<String>,
    // Last: frees the device memory after everything that may point into it.
    arena: Arena,
}

fn model_err(e: ModelError) -> CudaError {
    CudaError::Invalid(e.to_string())
}

fn i32_of(v: usize, what: &str) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Invalid(format!("{what} = {v} exceeds a kernel int")))
}

fn blocks(n: usize, per: u32) -> u32 {
    n.div_ceil(per as usize).max(1) as u32
}

impl CudaModel {
    /// Open a GGUF file and upload it to `gpu`.
    pub fn load(
        gpu: Arc<Gpu>,
        path: impl AsRef<Path>,
        opts: CudaModelOptions,
    ) -> Result<CudaModel, CudaError> {
        let path = path.as_ref();
        let file = GgufFile::open(path)
            .map_err(|e| CudaError::Invalid(format!("opening {}: {e}", path.display())))?;
        CudaModel::from_gguf(gpu, Arc::new(file), opts)
    }

    /// Upload an open GGUF file's model to `gpu`.
    pub fn from_gguf(
        gpu: Arc<Gpu>,
        file: Arc<GgufFile>,
        opts: CudaModelOptions,
    ) -> Result<CudaModel, CudaError> {
        let config = Config::from_gguf(&file).map_err(model_err)?;
        check_config(&config, &opts)?;
        let weights = Weights::load(&file, &config, &HostLoader).map_err(model_err)?;
        gpu.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::driver("binding the context", e))?;
        let stream = crate::device::new_stream(&gpu.ctx)
            .map_err(|e| CudaError::driver("creating the model's stream", e))?;
        let mut arena = Arena {
            ctx: gpu.ctx.clone(),
            ptrs: Vec::new(),
            bytes: 0,
        };
        let f = |name: &str| gpu.func(name).cloned();
        // An attention kernel in the form for the cache's element type.
        let fkv = |name: &str| {
            gpu.func(&crate::ops::kv_kernel(name, opts.kv_type)?)
                .cloned()
        };
        // A kernel with the blocks of `threads` an SM holds at once (for grid barriers).
        let with_blocks_per_sm =
            |name: &str, threads: u32| -> Result<(CudaFunction, u32), CudaError> {
                let k = f(name)?;
                let per_sm = k
                    .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
                    .map_err(|e| CudaError::driver("occupancy", e))?;
                Ok((k, per_sm))
            };
        // The decode attention's split kernel of 4 positions a warp step (its forms: below).
        let gqa4_name = attn_gqa4_kernel(
            opts.kv_type,
            (config.n_heads, config.n_kv_heads, config.head_dim),
        )?;
        let k = Kernels {
            rms_norm: f("rms_norm")?,
            rms_norm_gated: f("rms_norm_gated")?,
            argmax_chain: f("argmax_chain")?,
            dn_restore: f("dn_restore")?,
            swiglu: f("swiglu")?,
            dn_conv_seq: f("dn_conv_seq")?,
            dn_conv_prompt: f("dn_conv_prompt")?,
            dn_conv_shift: f("dn_conv_shift")?,
            dn_qk_norm: f("dn_qk_norm")?,
            dn_gates: f("dn_gates")?,
            dn_delta_seq: f("dn_delta_seq")?,
            dn_fused_seq: f("dn_fused_seq")?,
            dn_fused_cols: f("dn_fused_cols")?,
            dn_fused_cols_rows: f("dn_fused_cols_rows")?,
            matvec_res_gated_q4_k: f("matvec_res_gated_q4_k")?,
            attn_qk_prep: fkv("attn_qk_prep")?,
            attn_causal: fkv("attn_causal")?,
            attn_prompt: fkv("attn_prompt")?,
            attn_split: fkv("attn_split")?,
            attn_split_gqa: fkv("attn_split_gqa")?,
            attn_split_gqa4: f(&gqa4_name)?,
            attn_merge: f("attn_merge")?,
            argmax: f("argmax")?,
            sample_topk: f("sample_topk")?,
            moe_group: f("moe_group")?,
            matvec_q8x: f("matvec_q8x_q4_k")?,
            matvec_q8x_q6k: f("matvec_q8x_q6_k")?,
            matvec_q8x_tok: f("matvec_q8x_tok_q4_k")?,
            matvec_q8x_tok_q6k: f("matvec_q8x_tok_q6_k")?,
            matvec_q8x_xr_q6k: f("matvec_q8x_xr_q6_k")?,
            matvec_q8x_mma: {
                let k = f("matvec_q8x_mma_q4_k")?;
                q8x_mma_opt_in(&k)?;
                k
            },
            swiglu_q8: f("swiglu_q8")?,
            rms_norm_q8: f("rms_norm_q8")?,
            matvec3_x_f32: f("matvec3_x_f32")?,
            matvec3_x_tok_f32: f("matvec3_x_tok_f32")?,
            res_norm_q8: f("res_norm_q8")?,
            res_norm_router: f("res_norm_router")?,
            moe_gate_up_route: f("moe_gate_up_route_q8q_iq2_xxs")?,
            moe_gate_up_route2: f("moe_gate_up_route2_q8q_iq2_xxs")?,
            moe_route_fused: with_blocks_per_sm(
                "moe_route_gate_up_q8q_iq2_xxs",
                ROUTE_FUSED_THREADS,
            )?,
            swiglu_pairs: f("swiglu_pairs")?,
            moe_combine_pairs: f("moe_combine_pairs")?,
        };

        // Token embedding, straight from the file.
        let embd = file
            .tensor("token_embd.weight")
            .ok_or_else(|| CudaError::Invalid("missing tensor token_embd.weight".into()))?
            .clone();
        let embed_f = f(&format!("embed_{}", type_suffix(embd.ty)))?;
        let embed_cat2_f = f(&format!("embed_cat2_{}", type_suffix(embd.ty)))?;
        let embed = arena.upload(file.tensor_data(&embd))?;

        let output_norm = arena.upload_f32(&weights.output_norm)?;
        let output = dev_linear(&gpu, &mut arena, &weights.output)?;
        let mut layers = Vec::with_capacity(weights.layers.len());
        for (i, w) in weights.layers.iter().enumerate() {
            layers.push(dev_layer(&gpu, &mut arena, &config, &opts, i, w)?);
        }
        let sc = scratch(&mut arena, &config, &opts)?;
        let dn_restore = dn_restore_table(&mut arena, &config, &opts, &layers)?;
        // Before the trunk's experts: a memory budget leaves them what the MTP block takes.
        let mtp = match (&weights.mtp, opts.mtp) {
            (Some(w), true) => Some(dev_mtp(&gpu, &mut arena, &config, &opts, w)?),
            _ => None,
        };
        let side = MoeSide::new(&gpu.ctx)?;
        let (blas, blas_off) =
            match PromptBlas::new(&mut arena, &file, &config, &opts, (&stream, &side.stream))? {
                Ok(b) => (Some(b), None),
                Err(why) => (None, Some(why)),
            };
        // The experts last, so that a memory budget gives them what the rest leaves.
        let experts = dev_experts(&gpu, &mut arena, &config, &opts, &weights.layers)?;
        let router_kernel = RouterKernel::for_model(config.n_experts);
        let router = (gpu.func(router_kernel.name)?.clone(), router_kernel);
        let mvf_lane_iters = env_parse("REDLITE_CUDA_MVF_LANE_ITERS").unwrap_or(4);
        let mvf_rows = mvf_rows_from_env(false);
        let pdl = gpu.info.compute_capability.0 >= 9 && env_switch("REDLITE_CUDA_PDL", true);
        // P = 4 (`attn_split_gqa4`): 303.3 tok/s against 303.0 with 2 (short), 257.3 against 254.4
        // at position 32,768 on the H200.
        let gqa_p = env_parse::<usize>("REDLITE_CUDA_ATTN_GQA").unwrap_or(4);
        let attn_gqa = (gqa_p > 0
            && crate::ops::attn_split_gqa_fits(config.n_heads, config.n_kv_heads, config.head_dim))
        .then_some(gqa_p);
        // `attn_split_gqa` runs one block per SM (242 / 255 registers a thread): as many chunks as fill
        // one wave (66 on the H200: 247.8 tok/s at position 32,768 against 233.8 with 128).
        // The gqa4 kernel: as many chunks as fill one wave of its blocks (one an SM but for
        // `attn_split_gqa8xh3_h`: two blocks a KV head, half its query heads each, three an SM).
        let (nh, nkv, hd) = (config.n_heads, config.n_kv_heads, config.head_dim);
        if attn_gqa == Some(4) && !crate::ops::attn_split_takes(&gqa4_name, nh, nkv, hd) {
            return Err(CudaError::Invalid(format!(
                "{gqa4_name} does not take head_dim {hd} with {nh} query heads over {nkv} KV heads"
            )));
        }
        let attn_head_blocks = match attn_gqa {
            Some(4) => crate::ops::attn_split_head_blocks(&gqa4_name),
            _ => 1,
        };
        let attn_default_splits = if attn_gqa == Some(4) {
            let sms = gpu.info.sm_count;
            crate::ops::attn_split_wave(&k.attn_split_gqa4, &gqa4_name, nh, nkv, sms)?.2
        } else if attn_gqa.is_some() {
            (gpu.info.sm_count / config.n_kv_heads.max(1)).max(1)
        } else {
            ATTN_DEFAULT_SPLITS
        };
        let dn_cols = crate::ops::dn_cols_launch(crate::ops::DeltaDims {
            nk: config.dn_k_heads,
            nv: config.dn_v_heads,
            dk: config.dn_k_dim,
            dv: config.dn_v_dim,
        })
        .filter(|_| env_switch("REDLITE_CUDA_DN_COLS", true))
        .filter(|&(grid, threads, shared)| {
            [&k.dn_fused_cols, &k.dn_fused_cols_rows].iter().all(|f| {
                f.occupancy_max_active_blocks_per_multiprocessor(threads, shared as usize, None)
                    .is_ok_and(|per_sm| per_sm as usize * gpu.info.sm_count >= grid as usize)
            })
        });
        let mut model = CudaModel {
            config,
            opts,
            gpu,
            stream,
            k,
            embed_f,
            embed_cat2_f,
            embed,
            output_norm,
            output,
            layers,
            sc,
            pos: 0,
            last_row: 0,
            graph: None,
            launches: 0,
            step_launches: None,
            decode_steps: 0,
            nvtx: None,
            in_profile: false,
            mvf_lane_iters,
            mvf_rows,
            res_rows: mvf_rows_from_env(true),
            res_lane_iters: env_parse("REDLITE_CUDA_RES_LANE_ITERS")
                .unwrap_or(mvf_lane_iters)
                .max(1),
            token_tile: token_tile_from_env(),
            gemm: env_switch("REDLITE_CUDA_GEMM", true),
            gemm_now: false,
            attn_mma: env_switch("REDLITE_CUDA_ATTN_MMA", true),
            attn_gqa,
            attn_head_blocks,
            rope_table: env_switch("REDLITE_CUDA_ROPE_TABLE", true),
            dn_fused_prompt: env_switch("REDLITE_CUDA_DN_PROMPT_FUSED", false),
            dn_warp: env_switch("REDLITE_CUDA_DN_WARP", true),
            attn_splits: env_parse("REDLITE_CUDA_ATTN_SPLITS")
                .unwrap_or(attn_default_splits)
                .clamp(1, ATTN_MAX_SPLITS),
            attn_min_chunk: env_parse("REDLITE_CUDA_ATTN_MIN_CHUNK")
                .unwrap_or(ATTN_DEFAULT_MIN_CHUNK)
                .max(4)
                .next_multiple_of(4),
            head_lane_iters: env_parse("REDLITE_CUDA_HEAD_LANE_ITERS").unwrap_or(8),
            router_split: (
                env_parse("REDLITE_CUDA_ROUTER_LANE_ITERS").unwrap_or(4),
                env_parse("REDLITE_CUDA_ROUTER_ROWS")
                    .unwrap_or(1)
                    .clamp(1, MVF_MAX_ROWS),
            ),
            router,
            pdl,
            q8: env_switch("REDLITE_CUDA_Q8", true),
            q8_rows: q8_rows_from_env(),
            q8_res: env_switch("REDLITE_CUDA_Q8_RES", false),
            q8_res_rows: env_parse("REDLITE_CUDA_Q8_RES_ROWS")
                .unwrap_or(2)
                .clamp(1, 16),
            q8_moe: env_switch("REDLITE_CUDA_Q8_MOE", true),
            q8_q6k: env_switch("REDLITE_CUDA_Q8_Q6K", true),
            xq_shared: env_switch("REDLITE_CUDA_XQ_SHARED", true),
            xq_norm: env_switch("REDLITE_CUDA_XQ_NORM", true),
            q8x_tile: env_parse("REDLITE_CUDA_Q8X_TILE").unwrap_or(8).clamp(1, 8),
            q8x_tile_rows: env_parse("REDLITE_CUDA_Q8X_TILE_ROWS")
                .unwrap_or(2)
                .clamp(1, 16),
            q8x_mma: env_parse("REDLITE_CUDA_Q8X_MMA").unwrap_or(6),
            x_tok: env_switch("REDLITE_CUDA_X_TOK", true),
            x_router: env_switch("REDLITE_CUDA_X_ROUTER", true),
            moe_gu_pair: env_switch("REDLITE_CUDA_MOE_GU_PAIR", true),
            route_fused: env_switch("REDLITE_CUDA_ROUTE_FUSED", true),
            norm_router: env_switch("REDLITE_CUDA_NORM_ROUTER", true),
            norm_router_direct: env_switch("REDLITE_CUDA_NORM_ROUTER_DIRECT", true),
            next_router: None,
            logits_ready: false,
            dn_early: env_switch("REDLITE_CUDA_DN_EARLY", true),
            dn_cols,
            dn_rows: env_switch("REDLITE_CUDA_DN_ROWS", true),
            dn_pre: env_switch("REDLITE_CUDA_DN_PRE", true),
            z_side: env_switch("REDLITE_CUDA_Z_SIDE", false),
            grid_counters: Vec::new(),
            moe_direct: env_switch("REDLITE_CUDA_MOE_DIRECT", true),
            route_in_gate_up: env_switch("REDLITE_CUDA_ROUTE_IN_GATE_UP", true),
            res_norm_split: env_switch("REDLITE_CUDA_RES_NORM_SPLIT", true),
            skip: env_list("REDLITE_CUDA_SKIP"),
            noop: env_list("REDLITE_CUDA_NOOP"),
            stage: "",
            norm_slices: env_parse("REDLITE_CUDA_NORM_SLICES")
                .unwrap_or(crate::ops::NORM_SLICES)
                .clamp(1, 64),
            argmax_slices: env_parse("REDLITE_CUDA_ARGMAX_SLICES")
                .unwrap_or(ARGMAX_SLICES)
                .clamp(1, ARGMAX_SLICES),
            xq_fresh: false,
            q8_moe_down: env_switch("REDLITE_CUDA_Q8_MOE_DOWN", true),
            moe_down_parts: moe_down_parts_from_env(),
            moe_tok: moe_tok_tiles(),
            res_tok_rows: env_parse("REDLITE_CUDA_RES_TOK_ROWS").unwrap_or(0).min(2),
            res_xr: env_parse("REDLITE_CUDA_RES_XR").unwrap_or(2),
            head_xr: env_parse("REDLITE_CUDA_HEAD_XR").unwrap_or(2),
            moe_rows: env_parse("REDLITE_CUDA_MOE_ROWS").unwrap_or(1).clamp(1, 8),
            verified: None,
            profile_step: env_parse("REDLITE_CUDA_PROFILE_STEP"),
            verify_passes: 0,
            captures_invalidated: 0,
            profile_verify: env_parse("REDLITE_CUDA_PROFILE_VERIFY"),
            mtp_drafts: 0,
            profile_draft: env_parse("REDLITE_CUDA_PROFILE_DRAFT"),
            mtp_min_prob: env_parse("REDLITE_CUDA_MTP_MIN_PROB").unwrap_or(0.0),
            experts,
            mtp,
            small_graphs: env_switch("REDLITE_CUDA_SMALL_GRAPHS", true),
            verify_graphs: HashMap::new(),
            verify_uses: HashMap::new(),
            dn_restore,
            side,
            blas,
            blas_off,
            arena,
        };
        model.fill_rope_table()?;
        model.reset()?;
        Ok(model)
    }

    /// `rope_table` into `Scratch::rope_cs`, once.
    fn fill_rope_table(&mut self) -> Result<(), CudaError> {
        let half = self.config.rope_dims / 2;
        if half == 0 {
            return Ok(());
        }
        let f = self.gpu.func("rope_table")?.clone();
        let args = [
            A::P(self.sc.rope_cs),
            A::I(self.opts.max_context as i32),
            A::I(self.config.rope_dims as i32),
            A::D(self.config.rope_theta),
        ];
        let grid = (self.opts.max_context as u32, half.div_ceil(32) as u32, 1);
        // SAFETY: rope_table(cs, positions, rope_dims, theta); cs holds max_context rows of half
        // pairs.
        unsafe { launch_ex(&self.stream, &f, (grid, 32, 0), &args, false) }
            .map_err(|e| CudaError::driver("launching rope_table", e))?;
        self.stream
            .synchronize()
            .map_err(|e| CudaError::driver("computing the RoPE table", e))
    }

    /// Tokens processed so far (the position of the next one).
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// The GPU the model is on.
    pub fn device_info(&self) -> &crate::DeviceInfo {
        &self.gpu.info
    }

    /// The phase sums of a `REDLITE_TRACE` build so far ([`Gpu::trace`]), after the model's stream has
    /// finished; `reset` zeroes them.
    pub fn trace(&self, reset: bool) -> Result<Vec<u64>, CudaError> {
        self.sync()?;
        self.gpu.trace(reset)
    }

    pub fn options(&self) -> &CudaModelOptions {
        &self.opts
    }

    /// How long prompts' dense products run, in words: through cuBLAS from how many tokens, or
    /// on the own kernels and why.
    pub fn prompt_gemms(&self) -> String {
        match (&self.blas, &self.blas_off) {
            (Some(b), _) => format!("prompt GEMMs through cuBLAS from {} tokens", b.min_tokens),
            (None, why) => format!(
                "prompt GEMMs on the own kernels ({})",
                why.as_deref().unwrap_or("cuBLAS off")
            ),
        }
    }

    /// Device memory the model holds (weights, caches, states, scratch), bytes.
    pub fn device_bytes(&self) -> usize {
        self.arena.bytes
    }

    /// The routed experts' cache (sizes, counters).
    pub fn expert_cache(&self) -> &ExpertCache {
        &self.experts
    }

    pub fn expert_cache_mut(&mut self) -> &mut ExpertCache {
        &mut self.experts
    }

    /// Kernel launches of one decode step (known after the first step).
    pub fn launches_per_step(&self) -> Option<u64> {
        self.step_launches
    }

    /// Kernel launches issued so far (graph replays not counted).
    /// Bracket decode step `step` (0 = the first `decode` call) with `cuProfilerStart` /
    /// `cuProfilerStop`, so `ncu --profile-from-start off` captures exactly that token's kernels
    /// (also set by the environment variable `REDLITE_CUDA_PROFILE_STEP`).
    /// NVTX ranges name each layer of that step when `libnvToolsExt` can be opened (with graphs
    /// on, kernels are enqueued only at the capture, so use no graphs to see the ranges); returns
    /// why when it cannot.
    pub fn set_profile_step(&mut self, step: Option<u64>) -> Result<(), String> {
        self.profile_step = step;
        if step.is_some() && self.nvtx.is_none() {
            self.nvtx = Some(crate::nvtx::Nvtx::load()?);
        }
        Ok(())
    }

    /// Move the sequence to position `pos` without running the tokens in between (their cache
    /// rows keep what they hold: zeros after loading, or an earlier sequence's keys and values).
    /// For timing decode at a long context without its prompt pass; the recurrent states are
    /// left as they are.
    pub fn skip_to(&mut self, pos: usize) -> Result<(), CudaError> {
        if pos >= self.opts.max_context {
            return Err(CudaError::Invalid(format!(
                "position {pos} is outside the {} positions allocated",
                self.opts.max_context
            )));
        }
        self.pos = pos;
        self.verified = None;
        Ok(())
    }

    pub fn launches(&self) -> u64 {
        self.launches
    }

    /// Graph captures that another thread's synchronisation invalidated so far (each one tried
    /// again, or its launches run without a graph).
    pub fn captures_invalidated(&self) -> u64 {
        self.captures_invalidated
    }

    /// Start a new sequence: position 0, recurrent states zeroed (KV entries are overwritten).
    pub fn reset(&mut self) -> Result<(), CudaError> {
        self.bind()?;
        for l in &self.layers {
            if let DevMixer::DeltaNet { conv_state, s, .. } = &l.mixer {
                let c = &self.config;
                let conv_bytes = 4 * (c.conv_kernel - 1) * c.dn_conv_channels();
                let s_bytes = 4 * c.dn_v_heads * c.dn_k_dim * c.dn_v_dim;
                for (p, n) in [(*conv_state, conv_bytes), (*s, s_bytes)] {
                    // SAFETY: `p` holds `n` bytes, ordered on the model's stream.
                    unsafe { cu::memset_d8_async(p, 0, n, self.stream.cu_stream()) }
                        .map_err(|e| CudaError::driver("clearing the recurrent state", e))?;
                }
            }
        }
        self.sync()?;
        self.pos = 0;
        self.verified = None;
        if let Some(m) = self.mtp.as_mut() {
            m.queue.reset();
        }
        Ok(())
    }

    /// Run `tokens` after what the sequence holds and return every token's logits.
    pub fn forward_logits(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, CudaError> {
        let vocab = self.config.vocab;
        let mut out = Vec::with_capacity(tokens.len());
        for chunk in tokens.chunks(self.opts.max_batch) {
            self.run_chunk(chunk, Head::All)?;
            let mut flat = vec![0.0f32; chunk.len() * vocab];
            self.download(&mut flat, self.sc.logits)?;
            out.extend(flat.chunks_exact(vocab).map(|r| r.to_vec()));
        }
        Ok(out)
    }

    /// Run a prompt; only the last token's logits are computed (they stay on the device, see
    /// [`CudaModel::last_logits`] and [`CudaModel::sample_last`]).
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<(), CudaError> {
        let n = tokens.len();
        let mut start = 0;
        while start < n {
            let end = (start + self.opts.max_batch).min(n);
            let head = if end == n { Head::Last } else { Head::None };
            self.run_chunk(&tokens[start..end], head)?;
            start = end;
        }
        Ok(())
    }

    /// The logits of the last token run.
    pub fn last_logits(&self) -> Result<Vec<f32>, CudaError> {
        let vocab = self.config.vocab;
        let mut row = vec![0.0f32; vocab];
        self.download(
            &mut row,
            self.sc.logits + (4 * self.last_row * vocab) as u64,
        )?;
        Ok(row)
    }

    /// Draw the next token from the last token's logits on the GPU (`u` uniform in [0, 1)).
    pub fn sample_last(&mut self, s: &GpuSampling, u: f32) -> Result<u32, CudaError> {
        self.bind()?;
        self.upload_u(u, s)?;
        let row = self.sc.logits + (4 * self.last_row * self.config.vocab) as u64;
        self.enqueue_sample(row, s)?;
        self.read_out()
    }

    /// One decode step: run `token` at the current position and draw the next one on the GPU
    /// (greedy, or top-k sampling with the uniform draw `u`). With graphs on, the step is
    /// captured at its first use (and again when the sampling settings change), then replayed.
    pub fn decode(&mut self, token: u32, s: &GpuSampling, u: f32) -> Result<u32, CudaError> {
        if !s.supported() {
            return Err(CudaError::Invalid(format!(
                "GPU sampling needs greedy decoding or top-k in 1..={MAX_SAMPLE_TOP_K} (got {})",
                s.top_k
            )));
        }
        self.bind()?;
        self.mtp_make_room(1)?;
        self.upload_input(&[token])?;
        self.upload_u(u, s)?;
        let profiled = self.profile_step == Some(self.decode_steps);
        self.decode_steps += 1;
        if profiled && self.nvtx.is_none() {
            // Ranges when the library is there; the step is profiled either way.
            self.nvtx = crate::nvtx::Nvtx::load().ok();
        }
        if profiled {
            self.profiler(true)?;
            self.in_profile = true;
        }
        if self.opts.graphs && self.graph.as_ref().is_none_or(|g| g.sampling != *s) {
            self.graph = None;
            let sampling = *s;
            let mut first = 0;
            let captured = self.capture(|m| {
                first = m.launches;
                m.enqueue_step(&sampling)
            })?;
            if let Some(graph) = captured {
                self.graph = Some(Captured { graph, sampling });
                self.step_launches = Some(self.launches - first);
            }
        }
        match &self.graph {
            Some(c) => c
                .graph
                .launch()
                .map_err(|e| CudaError::driver("replaying the decode graph", e))?,
            // Graphs off, or another thread kept invalidating the capture (the next step tries
            // again): the step's launches, run now.
            None => {
                let first = self.launches;
                self.enqueue_step(s)?;
                self.step_launches = Some(self.launches - first);
            }
        }
        if profiled {
            self.in_profile = false;
            self.profiler(false)?;
        }
        self.mtp_record(&[token], false)?;
        self.pos += 1;
        self.last_row = 0;
        self.verified = None;
        let id = self.read_out()?;
        self.experts.after_forward(&self.stream, 1)?;
        Ok(id)
    }

    /// A speculative verify pass: run `tokens` (the pending token, then the drafts) after the
    /// sequence, every row exactly as a one-token [`CudaModel::decode`] step at its position
    /// computes it (the same kernels per row; attention split over the cache per row; bit for
    /// bit), and return every row's logits. The DeltaNet states after each row are kept, so
    /// [`CudaModel::keep`] can end the sequence after any row. Needs `max_verify >= tokens.len()`.
    pub fn verify(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, CudaError> {
        self.verify_rows(tokens, false)?;
        let vocab = self.config.vocab;
        let mut flat = vec![0.0f32; tokens.len() * vocab];
        self.download(&mut flat, self.sc.logits)?;
        self.experts.after_forward(&self.stream, tokens.len())?;
        Ok(flat.chunks_exact(vocab).map(|r| r.to_vec()).collect())
    }

    /// [`CudaModel::verify`] leaving the logits on the device, for [`CudaModel::sample_row`] or
    /// [`CudaModel::row_logits`] (sampled speculative decoding: a row is drawn only once the
    /// drafts before it were accepted).
    pub fn verify_on_device(&mut self, tokens: &[u32]) -> Result<(), CudaError> {
        self.verify_rows(tokens, false)?;
        self.sync()?;
        self.experts.after_forward(&self.stream, tokens.len())
    }

    /// Row `row` of the last verify pass's logits (read back).
    pub fn row_logits(&self, row: usize) -> Result<Vec<f32>, CudaError> {
        let vocab = self.config.vocab;
        self.check_verified_row(row)?;
        let mut v = vec![0.0f32; vocab];
        self.download(&mut v, self.sc.logits + (4 * row * vocab) as u64)?;
        Ok(v)
    }

    /// Draw a token from row `row` of the last verify pass's logits on the GPU, as
    /// [`CudaModel::decode`] draws from a step's (`u` uniform in [0, 1)).
    pub fn sample_row(&mut self, row: usize, s: &GpuSampling, u: f32) -> Result<u32, CudaError> {
        self.check_verified_row(row)?;
        self.bind()?;
        self.upload_u(u, s)?;
        let at = self.sc.logits + (4 * row * self.config.vocab) as u64;
        self.enqueue_sample(at, s)?;
        self.read_out()
    }

    fn check_verified_row(&self, row: usize) -> Result<(), CudaError> {
        match self.verified {
            Some((_, n)) if row < n => Ok(()),
            _ => Err(CudaError::Invalid(format!(
                "row {row} of a verify pass: the last call was not a verify pass of more rows"
            ))),
        }
    }

    /// [`CudaModel::verify`] that returns every row's greedy token (argmax on the GPU; only the
    /// ids come back).
    pub fn verify_greedy(&mut self, tokens: &[u32]) -> Result<Vec<u32>, CudaError> {
        self.verify_rows(tokens, true)?;
        let [ids] = self.read_ids([(self.sc.out, tokens.len())], "reading the verified tokens")?;
        self.experts.after_forward(&self.stream, tokens.len())?;
        Ok(ids)
    }

    /// The forward of a verify pass (and, `greedy`, every row's argmax into `out`).
    fn verify_rows(&mut self, tokens: &[u32], greedy: bool) -> Result<(), CudaError> {
        let n = tokens.len();
        if n == 0 || n > self.opts.max_verify {
            return Err(CudaError::Invalid(format!(
                "a verify pass of {n} rows (the model was loaded for 1..={} rows)",
                self.opts.max_verify
            )));
        }
        self.bind()?;
        self.mtp_make_room(n)?;
        self.upload_input(tokens)?;
        let start = self.pos;
        let profiled = self.profile_verify == Some(self.verify_passes);
        self.verify_passes += 1;
        if profiled {
            self.profiler(true)?;
        }
        let graph = self.small_graphs
            && self.opts.graphs
            && !profiled
            && n <= SMALL_GRAPH_ROWS
            && !self.experts.bounded();
        let body = |m: &mut Self| -> Result<(), CudaError> {
            m.enqueue_forward(n, Head::All, Rows::Steps)?;
            if greedy {
                m.argmax(m.sc.logits, n)?;
            }
            Ok(())
        };
        let enqueued = if graph {
            self.verify_graph((n, greedy), body)
        } else {
            body(self)
        };
        if profiled {
            self.profiler(false)?;
        }
        enqueued?;
        self.mtp_record(tokens, true)?;
        self.pos += n;
        self.last_row = n - 1;
        self.verified = Some((start, n));
        Ok(())
    }

    /// A verify pass's launches `body` (ids and position already uploaded) for `key` = (rows,
    /// greedy): replayed from a graph once that many rows have been seen often enough.
    fn verify_graph(
        &mut self,
        key: (usize, bool),
        mut body: impl FnMut(&mut Self) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        if !self.verify_graphs.contains_key(&key) {
            let uses = self.verify_uses.entry(key).or_insert(0);
            *uses += 1;
            if *uses < VERIFY_GRAPH_AFTER {
                return body(self);
            }
            match self.capture(&mut body)? {
                Some(g) => self.verify_graphs.insert(key, g),
                None => return body(self),
            };
        }
        self.verify_graphs[&key]
            .launch()
            .map_err(|e| CudaError::driver("replaying a verify graph", e))
    }

    /// `f`'s launches captured into a graph (not run); `None` when every one of
    /// [`CAPTURE_TRIES`] captures was invalidated from outside (then nothing was enqueued or
    /// run: the caller runs `f` without a graph). A call of another thread can invalidate a
    /// capture whatever its mode (public reports name device-wide synchronisation; a read-back
    /// on another stream did not, session 50), and the capture lock covers only the captures and
    /// stream creation (session 50: `mtp_gpu`'s parallel tests, a model a thread, failed so 2
    /// runs in 5 on one H100); `f` must be safe to call again (launches only).
    fn capture(
        &mut self,
        mut f: impl FnMut(&mut Self) -> Result<(), CudaError>,
    ) -> Result<Option<CudaGraph>, CudaError> {
        for _ in 0..CAPTURE_TRIES {
            let _capturing = crate::device::capture_lock();
            self.stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| CudaError::driver("beginning a graph capture", e))?;
            let enqueued = f(self);
            let captured = self
                .stream
                .end_capture(sys::CUgraphInstantiate_flags_enum(0));
            if matches!(&captured, Err(e) if e.0 == INVALIDATED)
                || matches!(&enqueued, Err(e) if e.driver_code() == Some(INVALIDATED as u32))
            {
                self.captures_invalidated += 1;
                continue;
            }
            let captured = captured.map_err(|e| CudaError::driver("ending a graph capture", e))?;
            enqueued?;
            return captured
                .map(Some)
                .ok_or_else(|| CudaError::Invalid("a graph capture came back empty".into()));
        }
        Ok(None)
    }

    /// Keep the first `rows` rows (1..=its rows) of the last verify pass: the sequence then ends
    /// after row `rows - 1`, its state bit-identical to decoding only those tokens (the DeltaNet
    /// states copied back from that row's trace; the attention caches' later rows are
    /// overwritten before anything reads them).
    pub fn keep(&mut self, rows: usize) -> Result<(), CudaError> {
        let Some((start, n)) = self.verified.take() else {
            return Err(CudaError::Invalid(
                "keep needs a verify pass just before it".into(),
            ));
        };
        if rows == 0 || rows > n {
            return Err(CudaError::Invalid(format!(
                "keep {rows} rows of a verify pass of {n}"
            )));
        }
        if rows < n {
            self.bind()?;
            let c = &self.config;
            let s_floats = c.dn_v_heads * c.dn_k_dim * c.dn_v_dim;
            let conv_floats = (c.conv_kernel - 1) * c.dn_conv_channels();
            let row = rows - 1;
            if let Some((table, layers)) = self.dn_restore {
                // One launch for every layer's two states (ordered on the model's stream).
                let f = self.k.dn_restore.clone();
                let per = (s_floats + conv_floats) / 4;
                self.launch(
                    "dn_restore",
                    &f,
                    (blocks(per, 256).min(64), layers as u32, 1),
                    256,
                    0,
                    &[
                        A::P(table),
                        A::I(i32_of(s_floats, "state floats")?),
                        A::I(i32_of(conv_floats, "conv state floats")?),
                        A::I(i32_of(row, "row")?),
                    ],
                )?;
            } else {
                let (conv_bytes, s_bytes) = (4 * conv_floats, 4 * s_floats);
                for l in &self.layers {
                    if let DevMixer::DeltaNet {
                        conv_state,
                        s,
                        conv_trace,
                        s_trace,
                        ..
                    } = &l.mixer
                    {
                        for (dst, src, len) in [
                            (*s, *s_trace + (row * s_bytes) as u64, s_bytes),
                            (
                                *conv_state,
                                *conv_trace + (row * conv_bytes) as u64,
                                conv_bytes,
                            ),
                        ] {
                            // SAFETY: `src` is row `row` < max_verify of a trace of `len`-byte
                            // states, `dst` a state of `len` bytes; ordered on the model's stream.
                            unsafe {
                                cu::memcpy_dtod_async(dst, src, len, self.stream.cu_stream())
                            }
                            .map_err(|e| CudaError::driver("restoring a DeltaNet state", e))?;
                        }
                    }
                }
            }
        }
        self.pos = start + rows;
        self.last_row = rows - 1;
        if let Some(m) = self.mtp.as_mut() {
            // Row `rows - 1` is the last trunk row now; the rows after it leave the queue.
            m.queue.keep(rows);
        }
        Ok(())
    }

    /// Whether the MTP block is loaded ([`CudaModelOptions::mtp`] and a file that has one).
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// Up to `k` greedy MTP drafts after `pending` (the token sampled from the last trunk row,
    /// not yet run): the queued slots and `(last row, pending)` run through the MTP block in
    /// one batched pass, then the block is chained on its own output (each draft's shared-head
    /// norm and token the next slot's inputs; the chained slots are dropped afterwards). The
    /// drafts are proposals only: the verify pass decides what is kept, so they need not match
    /// the CPU's bits. Needs a trunk call since the last draft.
    pub fn mtp_draft(&mut self, pending: u32, k: usize) -> Result<Vec<u32>, CudaError> {
        let mut m = self.mtp.take().ok_or_else(|| {
            CudaError::Invalid("the model was loaded without an MTP block".into())
        })?;
        let r = self.mtp_draft_with(&mut m, pending, k);
        self.mtp = Some(m);
        r
    }

    fn mtp_draft_with(
        &mut self,
        m: &mut DevMtp,
        pending: u32,
        k: usize,
    ) -> Result<Vec<u32>, CudaError> {
        let n = self.mtp_begin(m, pending)?;
        let profiled = self.profile_draft == Some(self.mtp_drafts);
        self.mtp_drafts += 1;
        if k > 0
            && k <= MAX_GRAPH_DRAFTS
            && n <= SMALL_GRAPH_ROWS.min(self.opts.max_batch)
            && self.small_graphs
            && self.opts.graphs
            && !profiled
        {
            return self.mtp_draft_graph(m, k);
        }
        if profiled {
            self.profiler(true)?;
        }
        let d = self.mtp_flush(m, true)?;
        let mut drafts = Vec::with_capacity(k);
        if let Some(d) = d {
            drafts.push(d);
        }
        while !drafts.is_empty() && drafts.len() < k {
            let t = m.queue.slots() + drafts.len() - 1;
            let prev = drafts[drafts.len() - 1];
            self.mtp_step(m, (m.head_row, true), &[prev], t, true)?;
            drafts.push(self.read_out()?);
        }
        if profiled {
            self.profiler(false)?;
        }
        Ok(drafts)
    }

    /// [`Self::mtp_draft_with`] as one graph per (queued slots, drafts): the queued slots, the
    /// head, and each chained step after `argmax_chain` moved the last draft into the input
    /// on the device; one read of the drafts at the end.
    fn mtp_draft_graph(&mut self, m: &mut DevMtp, k: usize) -> Result<Vec<u32>, CudaError> {
        let n = self.mtp_upload_draft(m, k)?;
        let probs = self.mtp_min_prob > 0.0;
        if !m.draft_graphs.contains_key(&(n, k, probs)) {
            if let Some(g) = self.capture(|s| s.mtp_enqueue_draft(m, n, k))? {
                m.draft_graphs.insert((n, k, probs), g);
            }
        }
        match m.draft_graphs.get(&(n, k, probs)) {
            Some(g) => g
                .launch()
                .map_err(|e| CudaError::driver("replaying an MTP draft graph", e))?,
            None => self.mtp_enqueue_draft(m, n, k)?,
        }
        if !probs {
            let [drafts] = self.read_ids([(m.drafts, k)], "reading the MTP drafts")?;
            m.queue.ran();
            return Ok(drafts);
        }
        // The probabilities come back as their bits (positive floats: read_ids' clamp of
        // negative values does not touch them).
        let [mut drafts, bits] = self.read_ids(
            [(m.drafts, k), (m.draft_probs, k)],
            "reading the MTP drafts and their probabilities",
        )?;
        m.queue.ran();
        // As the CPU's drafter: the chain stops after the first draft below the threshold.
        if let Some(i) = bits
            .iter()
            .position(|&b| f32::from_bits(b) < self.mtp_min_prob)
        {
            drafts.truncate(i + 1);
        }
        Ok(drafts)
    }

    /// Token ids read back: for each `(src, n)`, `n` i32 at `src` (copies on the model's stream,
    /// one synchronization for all; negative values as 0).
    fn read_ids<const N: usize>(
        &self,
        srcs: [(u64, usize); N],
        what: &str,
    ) -> Result<[Vec<u32>; N], CudaError> {
        let mut bufs: [Vec<i32>; N] = std::array::from_fn(|i| vec![0i32; srcs[i].1]);
        for (buf, (src, _)) in bufs.iter_mut().zip(srcs) {
            // SAFETY: `src` holds at least `buf.len()` i32 (the callers' buffers); the copy is
            // complete after the synchronization below, before `buf` is read or dropped.
            unsafe { cu::memcpy_dtoh_async(buf, src, self.stream.cu_stream()) }
                .map_err(|e| CudaError::driver(what, e))?;
        }
        self.sync()?;
        Ok(bufs.map(|b| b.into_iter().map(|d| d.max(0) as u32).collect()))
    }

    /// A draft graph's input: the queued slots' position and tokens (room for `k` chained slots
    /// after them checked). Returns the queued slots.
    fn mtp_upload_draft(&mut self, m: &DevMtp, k: usize) -> Result<usize, CudaError> {
        let (n, t0) = (m.queue.queued(), m.queue.slots());
        if t0 + n + k > self.opts.max_context {
            return Err(CudaError::Invalid(format!(
                "MTP slots {t0}..{} exceed the {} positions allocated (--ctx)",
                t0 + n + k,
                self.opts.max_context
            )));
        }
        let mut input = Vec::with_capacity(n + 1);
        input.push(i32_of(t0, "position")?);
        input.extend(m.queue.tokens().iter().map(|&t| t as i32));
        // SAFETY: `input` holds 1 + max_batch i32 (the callers checked n <= max_batch).
        unsafe { cu::memcpy_htod_async(self.sc.input, &input, self.stream.cu_stream()) }
            .map_err(|e| CudaError::driver("uploading the MTP token ids", e))?;
        Ok(n)
    }

    /// A whole draft's launches: the `n` queued slots, the head, and each chained step after
    /// `argmax_chain` moved the last draft into the input; the `k` drafts land in `drafts`.
    fn mtp_enqueue_draft(&mut self, m: &mut DevMtp, n: usize, k: usize) -> Result<(), CudaError> {
        self.mtp_enqueue(m, (m.q, false), n)?;
        self.mtp_head(m, n, Some((0, n)))?;
        for j in 1..k {
            self.mtp_enqueue(m, (m.head_row, true), 1)?;
            self.mtp_head(m, 1, Some((j, 1)))?;
        }
        Ok(())
    }

    /// A draft's start: the waiting row's slot completed with `pending`; returns the queued
    /// slots.
    fn mtp_begin(&mut self, m: &mut DevMtp, pending: u32) -> Result<usize, CudaError> {
        if pending as usize >= self.config.vocab {
            return Err(CudaError::Invalid(format!(
                "token id {pending} is outside the vocabulary (size {})",
                self.config.vocab
            )));
        }
        m.queue.complete(pending).map_err(CudaError::Invalid)?;
        self.bind()?;
        Ok(m.queue.queued())
    }

    /// The probability below which a graphed MTP draft stops (after that draft; 0: never), as
    /// the CPU drafter's `--spec-mtp-min-prob` (`REDLITE_CUDA_MTP_MIN_PROB` sets it at load).
    pub fn set_mtp_min_prob(&mut self, p: f32) {
        self.mtp_min_prob = p;
    }

    /// Run the queued slots through the MTP block (chunks of at most `max_batch`), keeping the
    /// last trunk row's hidden state (when queued) as the queue's first row. `head`: the last
    /// chunk goes on through the head, and its last slot's greedy draft is returned (`None` when
    /// nothing was queued).
    fn mtp_flush(&mut self, m: &mut DevMtp, head: bool) -> Result<Option<u32>, CudaError> {
        let (n, h) = (m.queue.queued(), self.config.hidden);
        let mut c0 = 0;
        let mut draft = None;
        while c0 < n {
            let c1 = (c0 + self.opts.max_batch).min(n);
            let tokens = m.queue.tokens()[c0..c1].to_vec();
            let (hid, t) = (m.q + (4 * c0 * h) as u64, m.queue.slots() + c0);
            let with_head = head && c1 == n;
            self.mtp_step(m, (hid, false), &tokens, t, with_head)?;
            if with_head {
                draft = Some(self.read_out()?);
            }
            c0 = c1;
        }
        let (n, move_last) = m.queue.ran();
        if move_last {
            // SAFETY: rows `n` (> 0) and 0 of `q` (queue rows > n) do not overlap.
            unsafe {
                cu::memcpy_dtod_async(
                    m.q,
                    m.q + (4 * n * h) as u64,
                    4 * h,
                    self.stream.cu_stream(),
                )
            }
            .map_err(|e| CudaError::driver("moving the last MTP row", e))?;
        }
        Ok(draft)
    }

    /// Before a trunk call of `n` tokens: room in the MTP queue for its rows (the queued slots
    /// run first when there is not).
    fn mtp_make_room(&mut self, n: usize) -> Result<(), CudaError> {
        let Some(mut m) = self.mtp.take() else {
            return Ok(());
        };
        let r = if m.queue.needs_flush(n) {
            self.mtp_flush(&mut m, false).map(|_| ())
        } else {
            Ok(())
        };
        self.mtp = Some(m);
        r
    }

    /// After a trunk call of `tokens` (its rows' final hidden states in `x`): the last row's slot
    /// before the call gets its token (`tokens[0]`), each row but the last becomes a slot with
    /// the next token, the last row waits for its token. `verify`: remember where the rows start,
    /// for [`CudaModel::keep`].
    fn mtp_record(&mut self, tokens: &[u32], verify: bool) -> Result<(), CudaError> {
        let Some(mut m) = self.mtp.take() else {
            return Ok(());
        };
        let (n, h) = (tokens.len(), self.config.hidden);
        let first = m.queue.record(tokens, verify);
        let r = self.rms_norm(
            self.sc.x,
            self.output_norm,
            m.q + (4 * first * h) as u64,
            n,
            h,
        );
        self.mtp = Some(m);
        r
    }

    /// The MTP block over `tokens.len()` slots from position `t0`: slot i takes hidden row i at
    /// `hid.0` (`hid.1`: a last step's output, its shared-head norm first) and `tokens[i]`; its
    /// output (before the shared-head norm) lands in `x`. `head`: then
    /// the last slot's draft into `out` ([`Self::mtp_head`]). Eager launches: the drafts that fit
    /// a graph take [`Self::mtp_draft_graph`]; this path serves the first draft after a long
    /// prompt and the queue's flushes.
    fn mtp_step(
        &mut self,
        m: &mut DevMtp,
        hid: (u64, bool),
        tokens: &[u32],
        t0: usize,
        head: bool,
    ) -> Result<(), CudaError> {
        let n = tokens.len();
        if t0 + n > self.opts.max_context {
            return Err(CudaError::Invalid(format!(
                "MTP slots {t0}..{} exceed the {} positions allocated (--ctx)",
                t0 + n,
                self.opts.max_context
            )));
        }
        let mut input = Vec::with_capacity(n + 1);
        input.push(i32_of(t0, "position")?);
        input.extend(tokens.iter().map(|&t| t as i32));
        // SAFETY: `input` holds 1 + max_batch i32 (n <= max_batch: the callers' chunks).
        unsafe { cu::memcpy_htod_async(self.sc.input, &input, self.stream.cu_stream()) }
            .map_err(|e| CudaError::driver("uploading the MTP token ids", e))?;
        self.mtp_enqueue(m, hid, n)?;
        if head {
            self.mtp_head(m, n, None)?;
        }
        Ok(())
    }

    /// The draft of the last of `n` slots in `x` (that row kept as `head_row`, the next chained
    /// slot's input): the lm_head with the shared-head norm folded in, the greedy token into
    /// `out`. `link = Some((j, adv))` (a draft graph): also drafts[j] = the token and the next
    /// chained step's input (the position `adv` on, the token), by `argmax_chain`.
    fn mtp_head(
        &mut self,
        m: &mut DevMtp,
        n: usize,
        link: Option<(usize, usize)>,
    ) -> Result<(), CudaError> {
        let h = self.config.hidden;
        self.stage = "mtp";
        let last = self.sc.x + (4 * (n - 1) * h) as u64;
        m.head_row = last;
        let (norm, out) = (m.shared_head_norm, self.output.clone());
        self.with_split((self.head_lane_iters, 1), |s| {
            s.matvec_normed(last, Some(norm), &[(&out, s.sc.logits)], 1)
        })?;
        let probs = if self.mtp_min_prob > 0.0 {
            m.draft_probs
        } else {
            0
        };
        let chain = link.map(|(j, adv)| {
            [
                A::P(self.sc.input),
                A::P(m.drafts),
                A::I(j as i32),
                A::I(adv as i32),
                A::P(probs),
            ]
        });
        self.argmax_launch(self.sc.logits, 1, chain)
    }

    /// [`Self::mtp_step`]'s launches (the ids and position already uploaded).
    fn mtp_enqueue(
        &mut self,
        m: &mut DevMtp,
        (hid, pre): (u64, bool),
        n: usize,
    ) -> Result<(), CudaError> {
        let h = self.config.hidden;
        self.stage = "mtp";
        let (x, cat) = (self.sc.x, m.cat);
        // The embedding and both input norms in one launch.
        let f = self.embed_cat2_f.clone();
        self.launch(
            "embed_cat2",
            &f,
            (n as u32, 2, 1),
            256,
            0,
            &[
                A::P(self.embed),
                A::P(self.sc.input + 4),
                A::P(hid),
                A::P(m.enorm),
                A::P(m.hnorm),
                A::P(if pre { m.shared_head_norm } else { 0 }),
                A::P(cat),
                A::I(h as i32),
                A::F(self.config.rms_eps),
            ],
        )?;
        let rows = if n > 1 && n <= self.opts.max_verify {
            Rows::Steps
        } else {
            Rows::Prompt
        };
        self.gemm_now = self.gemm && rows == Rows::Prompt && n >= GEMM_MIN_TOKENS;
        std::mem::swap(&mut self.experts, &mut m.experts);
        let r = (|| {
            let eh = m.eh_proj.clone();
            self.matvec(&eh, cat, x, n)?;
            let l = &m.layer;
            self.stage = "attn";
            self.enqueue_attention(&l.mixer, (l.attn_norm, l.post_norm), n, rows)?;
            self.stage = "moe";
            self.enqueue_moe(&l.moe, n)
        })();
        std::mem::swap(&mut self.experts, &mut m.experts);
        self.gemm_now = false;
        r
    }

    // ----- host side of a call -----

    /// Wait for the stream, then start (`true`) or stop the CUDA profiler (`--profile-step`,
    /// `REDLITE_CUDA_PROFILE_VERIFY`).
    fn profiler(&self, start: bool) -> Result<(), CudaError> {
        self.sync()?;
        let (r, what) = if start {
            // SAFETY: no arguments; the profiler API of the bound context.
            (unsafe { sys::cuProfilerStart() }, "cuProfilerStart")
        } else {
            // SAFETY: as above.
            (unsafe { sys::cuProfilerStop() }, "cuProfilerStop")
        };
        r.result().map_err(|e| CudaError::driver(what, e))
    }

    fn bind(&self) -> Result<(), CudaError> {
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| CudaError::driver("binding the context", e))
    }

    fn sync(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(|e| CudaError::driver("synchronizing the model's stream", e))
    }

    fn download(&self, dst: &mut [f32], src: u64) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: `src` addresses at least `dst.len()` floats of a live buffer; synchronized below.
        unsafe { cu::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| CudaError::driver("device-to-host copy", e))?;
        self.sync()
    }

    fn read_out(&self) -> Result<u32, CudaError> {
        let [id] = self.read_ids([(self.sc.out, 1)], "reading the sampled token")?;
        Ok(id[0])
    }

    /// Check `tokens` and copy `[pos, ids...]` to the device.
    fn upload_input(&mut self, tokens: &[u32]) -> Result<(), CudaError> {
        let c = &self.config;
        if self.pos + tokens.len() > self.opts.max_context {
            return Err(CudaError::Invalid(format!(
                "context full: {} + {} tokens exceed the {} positions allocated (--ctx)",
                self.pos,
                tokens.len(),
                self.opts.max_context
            )));
        }
        let mut input = Vec::with_capacity(tokens.len() + 1);
        input.push(i32_of(self.pos, "position")?);
        for &t in tokens {
            if t as usize >= c.vocab {
                return Err(CudaError::Invalid(format!(
                    "token id {t} is outside the vocabulary (size {})",
                    c.vocab
                )));
            }
            input.push(t as i32);
        }
        // SAFETY: `input` holds 1 + max_batch i32 (checked by the callers); pageable memory is
        // staged before the call returns.
        unsafe { cu::memcpy_htod_async(self.sc.input, &input, self.stream.cu_stream()) }
            .map_err(|e| CudaError::driver("uploading the token ids", e))
    }

    fn upload_u(&mut self, u: f32, s: &GpuSampling) -> Result<(), CudaError> {
        if s.is_greedy() {
            return Ok(());
        }
        let v = [u.clamp(0.0, 1.0 - f32::EPSILON)];
        // SAFETY: `u` holds one f32.
        unsafe { cu::memcpy_htod_async(self.sc.u, &v, self.stream.cu_stream()) }
            .map_err(|e| CudaError::driver("uploading the sampler draw", e))
    }

    fn run_chunk(&mut self, tokens: &[u32], head: Head) -> Result<(), CudaError> {
        if tokens.is_empty() {
            return Ok(());
        }
        self.bind()?;
        self.mtp_make_room(tokens.len())?;
        self.upload_input(tokens)?;
        self.enqueue_forward(tokens.len(), head, Rows::Prompt)?;
        self.mtp_record(tokens, false)?;
        self.pos += tokens.len();
        self.verified = None;
        self.last_row = if head == Head::All {
            tokens.len() - 1
        } else {
            0
        };
        self.sync()?;
        self.experts.after_forward(&self.stream, tokens.len())
    }

    // ----- kernels only from here: nothing below touches the host (capturable) -----

    fn launch(
        &mut self,
        what: &str,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        args: &[A],
    ) -> Result<(), CudaError> {
        if self.skipped(what) {
            return Ok(());
        }
        let noop;
        let f = if Self::listed(&self.noop, self.stage, what) {
            noop = self.gpu.func("noop_pdl")?.clone();
            &noop
        } else {
            f
        };
        // Decode steps and verify rows only: on prompts the GEMMs' many-wave grids lost by it
        // (4,096 tokens 10,985 → 9,728 tok/s on the H200).
        if self.pdl && !self.gemm_now {
            return self.launch_pdl(what, f, grid, block, shared, args);
        }
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                A::P(v) => b.arg(v),
                A::I(v) => b.arg(v),
                A::F(v) => b.arg(v),
                A::D(v) => b.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (block, 1, 1),
            shared_mem_bytes: shared,
        };
        // SAFETY: every kernel's arguments are listed in its declared order with its types
        // (pointers as u64 device addresses of live buffers sized for `max_batch` tokens).
        unsafe { b.launch(cfg) }.map_err(|e| CudaError::driver(what, e))?;
        self.launches += 1;
        Ok(())
    }

    /// Whether `REDLITE_CUDA_SKIP` leaves this launch out (timing diagnostics).
    fn skipped(&self, what: &str) -> bool {
        Self::listed(&self.skip, self.stage, what)
    }

    /// Whether launch `what` of `stage` is in a `REDLITE_CUDA_SKIP`-style list (`*`: all).
    fn listed(list: &[String], stage: &str, what: &str) -> bool {
        list.iter().any(|s| match s.split_once(':') {
            Some((st, name)) => st == stage && (name == "*" || name == what),
            None => s == what || s == "*",
        })
    }

    /// The `grid_sync` counter for launches of `kernel` with `blocks` blocks (its barrier target
    /// assumes every launch on a counter has the same grid), or `None` when all are taken.
    fn grid_counter(&mut self, kernel: &'static str, blocks: u32) -> Option<u64> {
        let key = (kernel, blocks);
        let i = match self.grid_counters.iter().position(|k| *k == key) {
            Some(i) => i,
            None if self.grid_counters.len() < GRID_COUNTERS => {
                self.grid_counters.push(key);
                self.grid_counters.len() - 1
            }
            None => return None,
        };
        Some(self.sc.grid_counter + 8 * i as u64)
    }

    /// Whether a grid of `blocks` can be resident at once at `per_sm` blocks an SM.
    fn all_resident(&self, blocks: u32, per_sm: u32) -> bool {
        (per_sm as usize) * self.gpu.info.sm_count >= blocks as usize
    }

    /// [`Self::launch`] through `cuLaunchKernelEx` with the programmatic-stream-serialization
    /// attribute (the kernel waits in `pdl_enter` for the grid before it).
    fn launch_pdl(
        &mut self,
        what: &str,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        args: &[A],
    ) -> Result<(), CudaError> {
        // SAFETY: as in `launch`: the arguments are the kernel's, in order and of its types.
        unsafe { launch_ex(&self.stream, f, (grid, block, shared), args, true) }
            .map_err(|e| CudaError::driver(what, e))?;
        self.launches += 1;
        Ok(())
    }

    /// `y[t] = W · x[t]` for `n` rows.
    fn matvec(&mut self, w: &DevLinear, x: u64, y: u64, n: usize) -> Result<(), CudaError> {
        if self.gemm_fits(w) {
            return self.gemm(w, x, y, n, false);
        }
        let args = [
            A::P(w.ptr),
            A::P(x),
            A::P(y),
            A::I(w.rows as i32),
            A::I(w.cols as i32),
        ];
        let f = w.f.clone();
        self.launch(
            "matvec",
            &f,
            (blocks(w.rows, MATVEC_WARPS), n as u32, 1),
            32 * MATVEC_WARPS,
            0,
            &args,
        )
    }

    /// `y_m[t] = W_m · rms_norm(x[t], nw)` (with `nw`; without, `W_m · x[t]`) for matrices that
    /// read the same input (all of width `cols`): one `matvec_norm3_<type>` launch per run of up
    /// to three of one type, each block normalising `x[t]` itself. Wider inputs than its shared
    /// memory holds go through `rms_norm` into `xn` and plain matvecs.
    fn matvec_normed(
        &mut self,
        x: u64,
        nw: Option<u64>,
        mats: &[(&DevLinear, u64)],
        n: usize,
    ) -> Result<(), CudaError> {
        if self.gemm_now {
            let (big, rest): (Vec<_>, Vec<_>) = mats.iter().partition(|(w, _)| self.gemm_fits(w));
            if let Some((w0, _)) = big.first() {
                // Normalise once into xn (free at a mixer's input; the MoE passes xn itself
                // without norm weights), then one GEMM per matrix.
                let input = match nw {
                    Some(nw) => {
                        let xn = self.sc.xn;
                        self.rms_norm(x, nw, xn, n, w0.cols)?;
                        xn
                    }
                    None => x,
                };
                for (w, y) in &big {
                    self.gemm(w, input, *y, n, false)?;
                }
                return self.matvec_normed_fused(x, nw, &rest, n);
            }
        }
        self.matvec_normed_fused(x, nw, mats, n)
    }

    /// [`Self::matvec_normed`] through the fused matvec kernels.
    fn matvec_normed_fused(
        &mut self,
        x: u64,
        nw: Option<u64>,
        mats: &[(&DevLinear, u64)],
        n: usize,
    ) -> Result<(), CudaError> {
        let Some(cols) = mats.first().map(|(w, _)| w.cols) else {
            return Ok(());
        };
        if cols > MVF_MAX_COLS || mats.iter().any(|(w, _)| w.cols != cols) {
            let input = match nw {
                Some(nw) => {
                    let xn = self.sc.xn;
                    self.rms_norm(x, nw, xn, n, cols)?;
                    xn
                }
                None => x,
            };
            for (w, y) in mats {
                self.matvec(w, input, *y, n)?;
            }
            return Ok(());
        }
        let nw = nw.unwrap_or(0);
        let mut normed_q8 = false;
        let mut i = 0;
        while i < mats.len() {
            let ty = mats[i].0.ty;
            let mut group = vec![mats[i]];
            while group.len() < 3
                && i + group.len() < mats.len()
                && mats[i + group.len()].0.ty == ty
            {
                group.push(mats[i + group.len()]);
            }
            i += group.len();
            // Several tokens: the token-tile kernel when it is on (weights read once per tile).
            let tile = token_tile(self.token_tile, n, cols);
            let q8 = self.q8_fits(ty, cols);
            if q8 && (tile == 1 || self.q8x_tile > 1) && nw != 0 && self.xq_norm {
                // The norm and its q8 row once per token, then the rows without staging.
                let (xq, invs) = (self.sc.xq_in, self.sc.xq_inv);
                if !normed_q8 {
                    let f = self.k.rms_norm_q8.clone();
                    self.launch(
                        "rms_norm_q8",
                        &f,
                        (self.norm_slices as u32, n as u32, 1),
                        MVF_THREADS,
                        0,
                        &[
                            A::P(x),
                            A::P(nw),
                            A::F(self.config.rms_eps),
                            A::I(cols as i32),
                            A::P(xq),
                            A::P(invs),
                        ],
                    )?;
                    normed_q8 = true;
                }
                self.matvec_q8x((xq, invs), &group, n)?;
                continue;
            }
            if ty == GgmlType::F32 && (tile == 1 || self.x_tok) && nw == 0 && self.x_router {
                // x read in place; several tokens (a verify pass) in tiles, the same bits.
                let split = MvfSplit {
                    parts: mvf_parts(ty, cols, self.mvf_lane_iters),
                    rows: if tile > 1 { 1 } else { self.mvf_rows },
                };
                let f = if tile > 1 {
                    self.k.matvec3_x_tok_f32.clone()
                } else {
                    self.k.matvec3_x_f32.clone()
                };
                let mut args = vec![
                    A::P(x),
                    A::I(cols as i32),
                    A::I(split.arg() | (tile << 16) as i32),
                ];
                if tile > 1 {
                    args.push(A::I(n as i32));
                }
                let grid_x = push_mats3(&mut args, &group, split.rows_per_block());
                self.launch(
                    "matvec3_x",
                    &f,
                    (grid_x, n.div_ceil(tile) as u32, 1),
                    MVF_THREADS,
                    0,
                    &args,
                )?;
                continue;
            }
            let kernel = match (tile > 1, q8) {
                (true, false) => "matvec_norm3_tok",
                (false, false) => "matvec_norm3",
                (true, true) => "matvec_norm3_tok_q8",
                (false, true) => "matvec_norm3_q8",
            };
            let f = self
                .gpu
                .func(&format!("{kernel}_{}", type_suffix(ty)))?
                .clone();
            let split = MvfSplit {
                parts: mvf_parts(ty, cols, self.mvf_lane_iters),
                rows: match (tile > 1, q8) {
                    (true, _) => 1,
                    (false, true) => self.q8_rows,
                    (false, false) => self.mvf_rows,
                },
            };
            let shared = if q8 {
                tile * crate::ops::q8_row_bytes(cols)
            } else {
                4 * tile * cols
            };
            let rows_per_block = split.rows_per_block();
            let mut args = vec![
                A::P(x),
                A::P(nw),
                A::F(self.config.rms_eps),
                A::I(cols as i32),
                A::I(split.arg() | (tile << 16) as i32),
            ];
            if tile > 1 {
                args.push(A::I(n as i32));
            }
            let grid_x = push_mats3(&mut args, &group, rows_per_block);
            self.launch(
                "matvec_norm3",
                &f,
                (grid_x, n.div_ceil(tile) as u32, 1),
                MVF_THREADS,
                shared as u32,
                &args,
            )?;
        }
        Ok(())
    }

    /// Warps per row of `moe_down_combine_tab` (`REDLITE_CUDA_MOE_DOWN_PARTS`: 1, 2, 4 … up to the
    /// block's warps; default 2: 232.0 / 232.2 tok/s against 224.1 / 224.2 with 1 and 232.2 / 231.3
    /// with 4 on the H200; group-decoded expert types only, others take 1).
    fn moe_down_parts(&self, e: &DevExperts) -> usize {
        let grouped = matches!(e.down_ty, GgmlType::IQ2XXS | GgmlType::Q4K | GgmlType::Q8_0);
        if !grouped || !self.config.hidden.is_multiple_of(e.warps as usize) {
            return 1;
        }
        fit_down_parts(self.moe_down_parts, e.warps)
    }

    /// Whether the fused matvec of a `ty` matrix `cols` wide takes 8-bit activations.
    fn q8_fits(&self, ty: GgmlType, cols: usize) -> bool {
        let ty_ok = ty == GgmlType::Q4K || (self.q8_q6k && ty == GgmlType::Q6K);
        self.q8 && ty_ok && cols.is_multiple_of(256)
    }

    /// `y_m[t] = W_m · xq[t]` for up to three Q4_K matrices of one width on the q8 rows a
    /// producer wrote (`matvec_q8x_q4_k`: the rows of `matvec_norm3_q8_q4_k` without its staging).
    /// `invs` (0: none) scales token t's outputs by `invs[t]` (the 1 / rms of [`Self::rms_norm_q8`]).
    fn matvec_q8x(
        &mut self,
        (xq, invs): (u64, u64),
        mats: &[(&DevLinear, u64)],
        n: usize,
    ) -> Result<(), CudaError> {
        let (cols, ty) = (mats[0].0.cols, mats[0].0.ty);
        if ty == GgmlType::Q4K && self.q8x_mma != 0 && n >= self.q8x_mma {
            if let Some(smem) = q8x_mma_smem(cols) {
                return self.matvec_q8x_mma((xq, invs), mats, n, smem);
            }
        }
        // Several tokens: the weights once per tile (`matvec_q8x_tok_*`, the same bits).
        let tile = if n > 1 { self.q8x_tile.min(n) } else { 1 };
        let split = MvfSplit {
            parts: mvf_parts(ty, cols, self.mvf_lane_iters),
            rows: if tile > 1 {
                self.q8x_tile_rows
            } else {
                self.q8_rows
            },
        };
        let mut args = vec![
            A::P(xq),
            A::P(invs),
            A::I(cols as i32),
            A::I(split.arg() | (tile << 16) as i32),
        ];
        if tile > 1 {
            args.push(A::I(n as i32));
        }
        // The Q6_K head of a verify pass in one slice a row: its q8 values in registers
        // (`matvec_q8x_xr_q6_k`, 16 rows × 8 tokens a block; the same bits).
        if ty == GgmlType::Q6K
            && tile > 1
            && self.head_xr != 0
            && n >= self.head_xr
            && split.parts == 1
        {
            let grid_x = push_mats3(&mut args, mats, HEAD_XR_ROWS);
            let f = self.k.matvec_q8x_xr_q6k.clone();
            return self.launch(
                "matvec_q8x",
                &f,
                (grid_x, n.div_ceil(XR_TOKENS) as u32, 1),
                MVF_THREADS,
                0,
                &args,
            );
        }
        let grid_x = push_mats3(&mut args, mats, split.rows_per_block());
        let f = match (ty == GgmlType::Q6K, tile > 1) {
            (true, false) => self.k.matvec_q8x_q6k.clone(),
            (false, false) => self.k.matvec_q8x.clone(),
            (true, true) => self.k.matvec_q8x_tok_q6k.clone(),
            (false, true) => self.k.matvec_q8x_tok.clone(),
        };
        self.launch(
            "matvec_q8x",
            &f,
            (grid_x, n.div_ceil(tile) as u32, 1),
            MVF_THREADS,
            0,
            &args,
        )
    }

    /// [`Self::matvec_q8x`] through `matvec_q8x_mma_q4_k`: 16 rows × 8 tokens a block, the
    /// one-token kernel's slices (`parts`) and sums emulated, so the same bits.
    fn matvec_q8x_mma(
        &mut self,
        (xq, invs): (u64, u64),
        mats: &[(&DevLinear, u64)],
        n: usize,
        smem: u32,
    ) -> Result<(), CudaError> {
        let (cols, ty) = (mats[0].0.cols, mats[0].0.ty);
        let parts = mvf_parts(ty, cols, self.mvf_lane_iters);
        let mut args = vec![
            A::P(xq),
            A::P(invs),
            A::I(cols as i32),
            A::I(parts as i32),
            A::I(n as i32),
        ];
        let grid_x = push_mats3(&mut args, mats, 16);
        let f = self.k.matvec_q8x_mma.clone();
        self.launch(
            "matvec_q8x",
            &f,
            (grid_x, n.div_ceil(8) as u32, 1),
            MVF_THREADS,
            smem,
            &args,
        )
    }

    /// The mixer's output projection with the residual and the next norm folded in:
    /// `x[t] += W · a[t]`, then `xn[t] = rms_norm(x[t], post_norm)` (by the last block per token).
    fn matvec_residual(
        &mut self,
        w: &DevLinear,
        a: u64,
        post_norm: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        self.matvec_residual_in(w, ResInput::Rows(a), post_norm, n)
    }

    /// [`Self::matvec_residual`] on rows `a` or (one token, Q4_K, f32 activations) on the
    /// DeltaNet gated norm the kernel forms itself from the mixer's o and z
    /// (`matvec_res_gated_q4_k`).
    fn matvec_residual_in(
        &mut self,
        w: &DevLinear,
        input: ResInput,
        post_norm: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        let a = match input {
            ResInput::Rows(a) => a,
            ResInput::Gated { .. }
                if n == 1 && w.ty == GgmlType::Q4K && !self.q8_res && !self.gemm_now =>
            {
                0
            }
            ResInput::Gated { .. } => {
                return Err(CudaError::Invalid(format!(
                    "the gated out-projection takes one decode token of a Q4_K matrix with f32 activations, not {n} of {}",
                    w.ty.name()
                )))
            }
        };
        let (x, xn, counter) = (self.sc.x, self.sc.xn, self.sc.counter);
        self.xq_fresh = false;
        self.logits_ready = false;
        let router = self.next_router.take();
        if self.gemm_fits(w) {
            self.gemm(w, a, x, n, true)?;
            return self.rms_norm(x, post_norm, xn, n, self.config.hidden);
        }
        let xq = self.next_xq();
        self.xq_fresh = xq != 0;
        let q8 = self.q8_res && w.ty == GgmlType::Q4K && self.q8_fits(w.ty, w.cols);
        let name = if q8 {
            "matvec_res_q8_q4_k".to_string()
        } else {
            format!("matvec_res_{}", type_suffix(w.ty))
        };
        let f = self.gpu.func(&name)?.clone();
        let split = MvfSplit {
            parts: mvf_parts(w.ty, w.cols, self.res_lane_iters),
            rows: if q8 { self.q8_res_rows } else { self.res_rows },
        };
        // The next norm in the last block, or (null norm weights there) by `res_norm_q8` after.
        let split_norm = self.res_norm_split;
        let nw_in_kernel = if split_norm { 0 } else { post_norm };
        let shared = if q8 {
            crate::ops::q8_row_bytes(w.cols) as u32
        } else {
            0
        };
        let tile = token_tile(self.token_tile, n, w.cols);
        if self.x_tok && tile > 1 && split_norm && !q8 {
            // Several tokens (a verify pass): the weights once per tile, the same bits; Q4_K
            // with `res_tok_rows` 2: two rows a warp group sharing each token's activation loads.
            let xr = w.ty == GgmlType::Q4K && self.res_xr != 0 && n >= self.res_xr;
            let two = !xr && res_tok_rows(self.res_tok_rows, n) == 2 && w.ty == GgmlType::Q4K;
            let name = if xr {
                "matvec_res_xr_q4_k".to_string()
            } else if two {
                "matvec_res_tok2_q4_k".to_string()
            } else {
                format!("matvec_res_tok_{}", type_suffix(w.ty))
            };
            let f = self.gpu.func(&name)?.clone();
            let split = MvfSplit {
                parts: split.parts,
                rows: if two { 2 } else { 1 },
            };
            let grid = if xr {
                (blocks(w.rows, RES_XR_ROWS), n.div_ceil(XR_TOKENS) as u32, 1)
            } else {
                (
                    blocks(w.rows, split.rows_per_block()),
                    n.div_ceil(tile) as u32,
                    1,
                )
            };
            self.launch(
                "matvec_res_tok",
                &f,
                grid,
                MVF_THREADS,
                0,
                &[
                    A::P(w.ptr),
                    A::P(a),
                    A::P(x),
                    A::I(w.rows as i32),
                    A::I(w.cols as i32),
                    A::I(split.arg() | (tile << 16) as i32),
                    A::I(n as i32),
                ],
            )?;
        } else {
            // One token's gated norm formed in the kernel (o, z and the norm weights in place of
            // the rows), or the rows.
            let mut args = vec![A::P(w.ptr)];
            let (f, tokens, shared) = match input {
                ResInput::Gated { o, z, norm, .. } => {
                    args.extend([A::P(o), A::P(z), A::P(norm)]);
                    (self.k.matvec_res_gated_q4_k.clone(), 1, 4 * w.cols as u32)
                }
                ResInput::Rows(a) => {
                    args.push(A::P(a));
                    (f, n as u32, shared)
                }
            };
            args.extend([
                A::P(x),
                A::I(w.rows as i32),
                A::I(w.cols as i32),
                A::I(split.arg()),
                A::P(nw_in_kernel),
                A::P(xn),
                A::P(counter),
                A::F(self.config.rms_eps),
                A::P(xq),
            ]);
            if let ResInput::Gated { dv, .. } = input {
                args.extend([A::I(dv as i32), A::F(self.config.rms_eps)]);
            }
            self.launch(
                "matvec_res",
                &f,
                (blocks(w.rows, split.rows_per_block()), tokens, 1),
                MVF_THREADS,
                shared,
                &args,
            )?;
        }
        if !split_norm {
            return Ok(());
        }
        // res_norm_q8's arguments, the first of res_norm_router's.
        let norm_args = [
            A::P(x),
            A::I(w.rows as i32),
            A::P(post_norm),
            A::P(xn),
            A::F(self.config.rms_eps),
            A::P(xq),
        ];
        if let Some(r) = router.filter(|_| n == 1 && xq != 0) {
            // The next norm and the router's logits on it in one launch (`norm_router`).
            let f = self.k.res_norm_router.clone();
            let slices = self.norm_slices;
            let early = if self.norm_router_direct { 2 } else { 1 };
            let mut args = norm_args.to_vec();
            args.extend([A::I(slices as i32), A::I(r.split.arg()), A::I(early)]);
            let (rlog, gl) = (self.sc.rlog, self.sc.gl);
            let grid_x = push_mats3(
                &mut args,
                &[(&r.router, rlog), (&r.gate, gl)],
                r.split.rows_per_block(),
            );
            self.launch(
                "res_norm_router",
                &f,
                (
                    crate::ops::res_norm_router_blocks(grid_x, slices as u32, early),
                    1,
                    1,
                ),
                MVF_THREADS,
                4 * w.rows as u32,
                &args,
            )?;
            self.logits_ready = true;
            return Ok(());
        }
        let f = self.k.res_norm_q8.clone();
        self.launch(
            "res_norm_q8",
            &f,
            (self.norm_slices as u32, n as u32, 1),
            MVF_THREADS,
            0,
            &norm_args,
        )
    }

    /// Where the output projection's next norm also writes its q8 row: `sc.xq` when an 8-bit MoE
    /// kernel will read it, else null.
    fn next_xq(&self) -> u64 {
        if (self.q8_moe || self.xq_shared) && self.config.hidden.is_multiple_of(32) {
            self.sc.xq
        } else {
            0
        }
    }

    /// Whether `w` goes through [`Self::gemm`] in the call being enqueued.
    fn gemm_fits(&self, w: &DevLinear) -> bool {
        self.gemm_now && w.cols.is_multiple_of(GEMM_BK)
    }

    /// `y[t] (+)= W · x[t]` for the `n` tokens of a prompt on the tensor cores (`gemm_<type>`).
    fn gemm(
        &mut self,
        w: &DevLinear,
        x: u64,
        y: u64,
        n: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        if self.gemm_blas(w, x, y, n, accumulate)? {
            return Ok(());
        }
        // f32 weights (the router: its logits pick the experts) keep f32 inputs.
        let (name, threads) = match w.ty {
            GgmlType::F32 => ("gemm_f32_simt".to_string(), 256),
            ty => (format!("gemm_{}", type_suffix(ty)), GEMM_THREADS),
        };
        let f = self.gpu.func(&name)?.clone();
        self.launch(
            "gemm",
            &f,
            (
                w.rows.div_ceil(GEMM_BM) as u32,
                n.div_ceil(GEMM_BN) as u32,
                1,
            ),
            threads,
            0,
            &[
                A::P(w.ptr),
                A::P(x),
                A::P(y),
                A::I(w.rows as i32),
                A::I(w.cols as i32),
                A::I(n as i32),
                A::I(accumulate as i32),
            ],
        )
    }

    /// [`Self::gemm`] through cuBLAS ([`PromptBlas`]) when it applies; `false` when it does not
    /// (nothing enqueued).
    fn gemm_blas(
        &mut self,
        w: &DevLinear,
        x: u64,
        y: u64,
        n: usize,
        accumulate: bool,
    ) -> Result<bool, CudaError> {
        let side = Arc::ptr_eq(&self.stream, &self.side.stream);
        let Some(pb) = &self.blas else {
            return Ok(false);
        };
        let lane = if side { &pb.side } else { &pb.main };
        let (rows, cols) = (w.rows, w.cols);
        if w.ty == GgmlType::F32 {
            // f32 weights (the router) straight from their buffer, f32 inputs.
            if !pb.f32 || n < pb.min_tokens || rows < 64 {
                return Ok(false);
            }
            lane.blas
                .gemm_f32((w.ptr, x, y), (rows, cols, n), accumulate)?;
            self.launches += 1;
            return Ok(true);
        }
        if n < pb.min_tokens || rows < 64 || rows * cols > lane.w_elems || n * cols > lane.x_elems {
            return Ok(false);
        }
        let (wh, xh) = (lane.wh, lane.xh);
        let f = self
            .gpu
            .func(&format!("dequant_f16_{}", type_suffix(w.ty)))?
            .clone();
        let groups = rows * cols / 16;
        self.launch(
            "dequant_f16",
            &f,
            (blocks(groups, 256), 1, 1),
            256,
            0,
            &[A::P(w.ptr), A::P(wh), A::I(rows as i32), A::I(cols as i32)],
        )?;
        let f = self.gpu.func("f32_to_f16")?.clone();
        let len4 = n * cols / 4;
        self.launch(
            "f32_to_f16",
            &f,
            (blocks(len4, 256), 1, 1),
            256,
            0,
            &[A::P(x), A::P(xh), A::I(i32_of(len4, "activations")?)],
        )?;
        let pb = self.blas.as_ref().expect("checked above");
        let lane = if side { &pb.side } else { &pb.main };
        lane.blas
            .gemm_f16((wh, xh, y), (rows, cols, n), accumulate)?;
        self.launches += 1;
        Ok(true)
    }

    fn rms_norm(&mut self, x: u64, w: u64, y: u64, rows: usize, n: usize) -> Result<(), CudaError> {
        let f = self.k.rms_norm.clone();
        let eps = self.config.rms_eps;
        self.launch(
            "rms_norm",
            &f,
            (rows as u32, 1, 1),
            256,
            0,
            &[A::P(x), A::P(w), A::P(y), A::I(n as i32), A::F(eps)],
        )
    }

    fn elementwise(&mut self, f: &CudaFunction, args: &[A], len: usize) -> Result<(), CudaError> {
        let mut all = args.to_vec();
        all.push(A::I(len as i32));
        self.launch("element-wise", f, (blocks(len, 256), 1, 1), 256, 0, &all)
    }

    /// Embedding, every layer, final norm and the lm_head for `n` tokens whose ids and start
    /// position are already in `input`.
    fn enqueue_forward(&mut self, n: usize, head: Head, rows: Rows) -> Result<(), CudaError> {
        self.gemm_now = self.gemm && rows == Rows::Prompt && n >= GEMM_MIN_TOKENS;
        let r = self.enqueue_forward_rows(n, head, rows);
        self.gemm_now = false;
        r
    }

    fn enqueue_forward_rows(&mut self, n: usize, head: Head, rows: Rows) -> Result<(), CudaError> {
        let h = self.config.hidden;
        let x = self.sc.x;
        self.embedding(n)?;
        for i in 0..self.layers.len() {
            self.enqueue_layer(i, n, rows)?;
        }
        match head {
            Head::None => Ok(()),
            Head::Last => {
                let last = x + (4 * (n - 1) * h) as u64;
                self.lm_head(last, 1)
            }
            Head::All => self.lm_head(x, n),
        }
    }

    /// The embedding rows of the `n` token ids in `input` into `x`.
    fn embedding(&mut self, n: usize) -> Result<(), CudaError> {
        let f = self.embed_f.clone();
        self.launch(
            "embedding",
            &f,
            (n as u32, 1, 1),
            256,
            0,
            &[
                A::P(self.embed),
                A::P(self.sc.input + 4),
                A::P(self.sc.x),
                A::I(self.config.hidden as i32),
            ],
        )
    }

    /// Final norm and lm_head of `n` rows of `x` into the logits, with its own row split
    /// (`head_lane_iters`).
    fn lm_head(&mut self, x: u64, n: usize) -> Result<(), CudaError> {
        let out = self.output.clone();
        // A prompt's last row alone (Head::Last) takes the matvec, not a 1-token GEMM (ncu: 1.2
        // ms for the Q6_K head against 0.26).
        let gemm = self.gemm_now;
        self.gemm_now = gemm && n >= GEMM_MIN_TOKENS;
        self.stage = "head";
        let r = self.with_split((self.head_lane_iters, 1), |m| {
            m.matvec_normed(x, Some(m.output_norm), &[(&out, m.sc.logits)], n)
        });
        self.gemm_now = gemm;
        r
    }

    /// `f` with the fused matvecs' row split set to `(lane_iters, rows per warp)`, then the
    /// split restored.
    fn with_split<R>(
        &mut self,
        (iters, rows): (usize, usize),
        f: impl FnOnce(&mut Self) -> R,
    ) -> R {
        let iters = std::mem::replace(&mut self.mvf_lane_iters, iters);
        let rows = std::mem::replace(&mut self.mvf_rows, rows);
        let r = f(self);
        self.mvf_lane_iters = iters;
        self.mvf_rows = rows;
        r
    }

    /// One decode step (the captured part): forward of one token, then the draw into `out`.
    fn enqueue_step(&mut self, s: &GpuSampling) -> Result<(), CudaError> {
        self.enqueue_forward(1, Head::Last, Rows::Prompt)?;
        self.enqueue_sample(self.sc.logits, s)
    }

    /// Each of `rows` rows of logits at `logits`: its greedy token into `out` (`argmax`, the row
    /// cut into [`ARGMAX_SLICES`] blocks: one block took 61 µs of a 4 ms step for 151,936 logits).
    fn argmax(&mut self, logits: u64, rows: usize) -> Result<(), CudaError> {
        self.argmax_launch(logits, rows, None)
    }

    /// `argmax` of `rows` rows into `out`, or with `chain` (`argmax_chain`'s further arguments:
    /// input, drafts, j, adv, probs) the one-row `argmax_chain` of an MTP draft graph.
    fn argmax_launch(
        &mut self,
        logits: u64,
        rows: usize,
        chain: Option<[A; 5]>,
    ) -> Result<(), CudaError> {
        let (name, f) = match chain {
            Some(_) => ("argmax_chain", self.k.argmax_chain.clone()),
            None => ("argmax", self.k.argmax.clone()),
        };
        let mut args = vec![
            A::P(logits),
            A::I(self.config.vocab as i32),
            A::P(self.sc.out),
            A::P(self.sc.argmax_part),
            A::P(self.sc.argmax_counter),
        ];
        args.extend(chain.into_iter().flatten());
        self.launch(
            name,
            &f,
            (self.argmax_slices as u32, rows as u32, 1),
            256,
            0,
            &args,
        )
    }

    fn enqueue_sample(&mut self, row: u64, s: &GpuSampling) -> Result<(), CudaError> {
        let vocab = self.config.vocab as i32;
        if s.is_greedy() {
            return self.argmax(row, 1);
        }
        if !s.supported() || s.top_k > self.config.vocab {
            return Err(CudaError::Invalid(format!(
                "GPU sampling: top-k {} not in 1..={MAX_SAMPLE_TOP_K}",
                s.top_k
            )));
        }
        let top_p = if s.top_p > 0.0 && s.top_p <= 1.0 {
            s.top_p
        } else {
            1.0
        };
        let min_p = if s.min_p.is_nan() {
            0.0
        } else {
            s.min_p.clamp(0.0, 1.0)
        };
        let f = self.k.sample_topk.clone();
        self.launch(
            "sample_topk",
            &f,
            (1, 1, 1),
            1024,
            0,
            &[
                A::P(row),
                A::I(vocab),
                A::I(s.top_k as i32),
                A::F(1.0 / s.temperature),
                A::F(top_p),
                A::F(min_p),
                A::P(self.sc.u),
                A::P(self.sc.out),
            ],
        )
    }

    /// One layer: the mixer reads `rms_norm(x, attn_norm)` (normalised inside its projection
    /// kernel), adds its output to `x` in its output projection, whose last block also writes
    /// `xn = rms_norm(x, post_norm)` for the MoE.
    fn enqueue_layer(&mut self, i: usize, n: usize, rows: Rows) -> Result<(), CudaError> {
        let norms = (self.layers[i].attn_norm, self.layers[i].post_norm);
        // A clone of the layer's handles (addresses and kernel handles), so `self` stays free.
        let mixer = self.layers[i].mixer.clone();
        if let Some(nv) = self.nvtx.as_ref().filter(|_| self.in_profile) {
            let kind = match &mixer {
                DevMixer::Attention { .. } => "attention",
                DevMixer::DeltaNet { .. } => "deltanet",
            };
            nv.push(&format!("layer {i}"));
            nv.push(&format!("layer {i} {kind}"));
        }
        self.next_router = self.norm_router_for(&self.layers[i].moe, n);
        match &mixer {
            DevMixer::Attention { .. } => {
                self.stage = "attn";
                self.enqueue_attention(&mixer, norms, n, rows)?
            }
            DevMixer::DeltaNet { .. } => {
                self.stage = "dn";
                self.enqueue_delta_net(&mixer, norms, n, rows)?
            }
        }
        self.stage = "moe";
        if let Some(nv) = self.nvtx.as_ref().filter(|_| self.in_profile) {
            nv.pop();
        }
        let moe = self.layers[i].moe.clone();
        let nvtx = self.nvtx.as_ref().filter(|_| self.in_profile);
        if let Some(nv) = nvtx {
            nv.push(&format!("layer {i} moe"));
        }
        let r = self.enqueue_moe(&moe, n);
        if let Some(nv) = self.nvtx.as_ref().filter(|_| self.in_profile) {
            nv.pop();
            nv.pop();
        }
        r
    }

    fn enqueue_attention(
        &mut self,
        m: &DevMixer,
        (attn_norm, post_norm): (u64, u64),
        n: usize,
        rows: Rows,
    ) -> Result<(), CudaError> {
        let DevMixer::Attention {
            wq,
            wk,
            wv,
            wo,
            q_norm,
            k_norm,
            kc,
            vc,
        } = m
        else {
            return Ok(());
        };
        let c = &self.config;
        let (nh, nkv, hd, rd) = (c.n_heads, c.n_kv_heads, c.head_dim, c.rope_dims);
        let (theta, eps) = (c.rope_theta, c.rms_eps);
        let scale = 1.0 / (hd as f32).sqrt();
        let sc = &self.sc;
        let (x, qg, kn, vn, q, gate, att, part) = (
            sc.x,
            sc.qg,
            sc.kn,
            sc.vn,
            sc.q,
            sc.gate,
            sc.att,
            sc.attn_part,
        );
        let pos = sc.input;
        let rope_cs = if self.rope_table { sc.rope_cs } else { 0 };
        self.matvec_normed(x, Some(attn_norm), &[(wq, qg), (wk, kn), (wv, vn)], n)?;
        let f = self.k.attn_qk_prep.clone();
        self.launch(
            "attn_qk_prep",
            &f,
            ((nh + nkv) as u32, n as u32, 1),
            128,
            0,
            &[
                A::P(qg),
                A::P(kn),
                A::P(vn),
                A::P(q),
                A::P(gate),
                A::P(*kc),
                A::P(*vc),
                A::P(*q_norm),
                A::P(*k_norm),
                A::P(pos),
                A::I(nh as i32),
                A::I(nkv as i32),
                A::I(hd as i32),
                A::I(rd as i32),
                A::D(theta),
                A::F(eps),
                A::P(rope_cs),
            ],
        )?;
        if n == 1 || rows == Rows::Steps {
            // Decode (each row at its own position): the cache split into chunks
            // (flash-decoding), then the chunks merged and the output gate applied.
            let splits = attn_splits(&self.opts).min(self.attn_splits);
            let f = match self.attn_gqa {
                Some(4) => self.k.attn_split_gqa4.clone(),
                Some(_) => self.k.attn_split_gqa.clone(),
                None => self.k.attn_split.clone(),
            };
            let (gx, block) = crate::ops::attn_split_block(nh, nkv, self.attn_head_blocks);
            self.launch(
                "attn_split",
                &f,
                (gx, splits as u32, n as u32),
                block,
                0,
                &[
                    A::P(q),
                    A::P(*kc),
                    A::P(*vc),
                    A::P(part),
                    A::P(pos),
                    A::I(nh as i32),
                    A::I(nkv as i32),
                    A::I(hd as i32),
                    A::F(scale),
                    A::I(self.attn_min_chunk as i32),
                ],
            )?;
            let f = self.k.attn_merge.clone();
            self.launch(
                "attn_merge",
                &f,
                (nh as u32, hd.div_ceil(32) as u32, n as u32),
                256,
                0,
                &[
                    A::P(part),
                    A::P(gate),
                    A::P(att),
                    A::P(pos),
                    A::I(splits as i32),
                    A::I(hd as i32),
                    A::I(self.attn_min_chunk as i32),
                ],
            )?;
        } else if self.gemm_now && crate::ops::attn_prompt_fits(nh, nkv, hd) {
            // A prompt: a GQA group of query rows per block, K/V staged once for all of them; on
            // the tensor cores (flash-attention form, head_dim 64/128/256) unless switched off.
            // The two kernels take the same arguments but for head_dim (the tensor-core one has
            // it in its name).
            let mut args = vec![
                A::P(q),
                A::P(*kc),
                A::P(*vc),
                A::P(gate),
                A::P(att),
                A::P(pos),
                A::I(n as i32),
                A::I(nh as i32),
                A::I(nkv as i32),
                A::F(scale),
            ];
            let (name, f, (grid, block, shared)) =
                match crate::ops::attn_prompt_mma(nh, nkv, hd).filter(|_| self.attn_mma) {
                    Some(launch) => {
                        let (name, grid, block, shared) = launch(n);
                        let name = crate::ops::kv_kernel(name, self.opts.kv_type)?;
                        let f = self.gpu.func(&name)?.clone();
                        (name, f, (grid, block, shared))
                    }
                    None => {
                        args.insert(9, A::I(hd as i32));
                        (
                            "attn_prompt".to_string(),
                            self.k.attn_prompt.clone(),
                            crate::ops::attn_prompt_launch(n, nh, nkv, hd),
                        )
                    }
                };
            self.launch(&name, &f, grid, block, shared, &args)?;
        } else {
            let f = self.k.attn_causal.clone();
            self.launch(
                "attn_causal",
                &f,
                (nh as u32, n as u32, 1),
                128,
                0,
                &[
                    A::P(q),
                    A::P(*kc),
                    A::P(*vc),
                    A::P(gate),
                    A::P(att),
                    A::P(pos),
                    A::I(nkv as i32),
                    A::I(hd as i32),
                    A::F(scale),
                ],
            )?;
        }
        self.matvec_residual(wo, att, post_norm, n)
    }

    fn enqueue_delta_net(
        &mut self,
        m: &DevMixer,
        (attn_norm, post_norm): (u64, u64),
        n: usize,
        rows: Rows,
    ) -> Result<(), CudaError> {
        let DevMixer::DeltaNet {
            qkv,
            z,
            ba,
            out,
            conv_w,
            dt_bias,
            a,
            norm,
            conv_state,
            s,
            conv_trace,
            s_trace,
        } = m
        else {
            return Ok(());
        };
        // The states after every row, for a verify pass.
        let (s_tr, conv_tr) = match rows {
            Rows::Steps => (*s_trace, *conv_trace),
            Rows::Prompt => (0, 0),
        };
        let c = &self.config;
        let (nk, nv, dk, dv) = (c.dn_k_heads, c.dn_v_heads, c.dn_k_dim, c.dn_v_dim);
        let (ch, kern, eps) = (c.dn_conv_channels(), c.conv_kernel, c.rms_eps);
        let q_scale = 1.0 / (dk as f32).sqrt();
        let sc = &self.sc;
        let (x, qkv_b, conv, z_b, ba_b, beta, g, o, gated) = (
            sc.x, sc.qkv, sc.conv, sc.z, sc.ba, sc.beta, sc.g, sc.o, sc.gated,
        );
        // Prompts through the GEMMs take the five-kernel form: its delta rule runs nv × dv/32
        // blocks (the fused kernel nk), each one token after another.
        let fused = dn_fused(c).filter(|_| !self.gemm_now || self.dn_fused_prompt);
        // One-token steps, z on the side stream: the output gate's rows after the in-projection
        // (on the q8 row of x its norm wrote), joined before the out-projection, so that they
        // run beside the fused kernel's recurrence instead of in the in-projection's waves.
        // `REDLITE_CUDA_Z_SIDE`: the fused kernel leaves its gated norm to the out-projection
        // (`matvec_res_gated_q4_k`, the same bits). `REDLITE_CUDA_SKIP=dn:z_side` (timing
        // diagnostics only): the fused kernel keeps its gated norm and reads z before it is
        // written (garbage outputs).
        let one = n == 1
            && fused.is_some()
            && self.dn_cols.is_some()
            && !self.gemm_now
            && self.xq_norm
            && self.q8_fits(z.ty, z.cols);
        let gated_after = self.z_side
            && one
            && out.ty == GgmlType::Q4K
            && !self.q8_res
            && self.res_norm_split
            && out.cols == nv * dv
            && 4 * out.cols <= 48 * 1024;
        let z_side = (self.skipped("z_side") && one) || gated_after;
        if self.skipped("z_rows") {
            // Timing diagnostics only (`REDLITE_CUDA_SKIP=dn:z_rows`): the in-projection launch
            // without the output gate's rows, which only the gated norm at the mixer's end reads.
            self.matvec_normed(x, Some(attn_norm), &[(qkv, qkv_b), (ba, ba_b)], n)?;
        } else if z_side {
            self.matvec_normed(x, Some(attn_norm), &[(qkv, qkv_b), (ba, ba_b)], n)?;
            let drv = |e| CudaError::driver("forking the output gate's stream", e);
            self.side.fork.record(&self.stream).map_err(drv)?;
            self.side.stream.wait(&self.side.fork).map_err(drv)?;
            // A plain launch: the z blocks start once the in-projection has ended, not beside its
            // second wave (a programmatic edge would let them start at its trigger).
            let main = std::mem::replace(&mut self.stream, self.side.stream.clone());
            let pdl = std::mem::replace(&mut self.pdl, false);
            let done = self.matvec_q8x((self.sc.xq_in, self.sc.xq_inv), &[(z, z_b)], n);
            self.pdl = pdl;
            self.stream = main;
            done?;
            self.side.join.record(&self.side.stream).map_err(drv)?;
        } else {
            self.matvec_normed(x, Some(attn_norm), &[(qkv, qkv_b), (z, z_b), (ba, ba_b)], n)?;
        }
        if let Some((threads, shared)) = fused {
            // Conv, q/k norm, gates, delta rule and gated norm in one launch.
            let r = nv / nk;
            let cols = self.dn_cols;
            let (name, f, grid, threads, shared) = match cols {
                Some((grid, threads, shared)) if n > 1 && self.dn_rows => (
                    "dn_fused_cols_rows",
                    self.k.dn_fused_cols_rows.clone(),
                    grid,
                    threads,
                    shared,
                ),
                Some((grid, threads, shared)) => (
                    "dn_fused_cols",
                    self.k.dn_fused_cols.clone(),
                    grid,
                    threads,
                    shared,
                ),
                None => (
                    "dn_fused_seq",
                    self.k.dn_fused_seq.clone(),
                    nk as u32,
                    threads,
                    shared,
                ),
            };
            let mut args = vec![
                A::P(qkv_b),
                A::P(*conv_state),
                A::P(*conv_w),
                A::P(ba_b),
                A::P(*a),
                A::P(*dt_bias),
                A::P(*s),
                A::P(z_b),
                A::P(*norm),
                A::P(gated),
                A::I(n as i32),
                A::I(ch as i32),
                A::I(nk as i32),
                A::I(dk as i32),
                A::I(dv as i32),
                A::I(r as i32),
                A::I(kern as i32),
                A::F(L2_NORM_EPS),
                A::F(q_scale),
                A::F(eps),
                A::P(s_tr),
                A::P(conv_tr),
                A::I(self.dn_early as i32 | (self.dn_pre as i32) << 1 | (gated_after as i32) << 2),
            ];
            if cols.is_some() {
                // The gated norm's rows and the per-QK-head barrier counters.
                args.extend([A::P(self.sc.o), A::P(self.sc.dn_counter)]);
            }
            self.launch(name, &f, (grid, 1, 1), threads, shared, &args)?;
            if z_side {
                let drv = |e| CudaError::driver("joining the output gate's stream", e);
                self.stream.wait(&self.side.join).map_err(drv)?;
            }
            if gated_after {
                let input = ResInput::Gated {
                    o: self.sc.o,
                    z: z_b,
                    norm: *norm,
                    dv,
                };
                return self.matvec_residual_in(out, input, post_norm, n);
            }
            return self.matvec_residual(out, gated, post_norm, n);
        }
        // The conv: one thread per channel over the tokens (the state updated in place), or for a
        // prompt by (channel, 32-token tile) blocks and then the state shift.
        let (f, name, tiles) = if self.gemm_now {
            (
                self.k.dn_conv_prompt.clone(),
                "dn_conv_prompt",
                n.div_ceil(32),
            )
        } else {
            (self.k.dn_conv_seq.clone(), "dn_conv_seq", 1)
        };
        self.launch(
            name,
            &f,
            (blocks(ch, 128), tiles as u32, 1),
            128,
            0,
            &[
                A::P(qkv_b),
                A::P(*conv_state),
                A::P(*conv_w),
                A::P(conv),
                A::I(n as i32),
                A::I(ch as i32),
                A::I(kern as i32),
            ],
        )?;
        if self.gemm_now {
            let f = self.k.dn_conv_shift.clone();
            self.launch(
                "dn_conv_shift",
                &f,
                (blocks(ch, 128), 1, 1),
                128,
                0,
                &[
                    A::P(qkv_b),
                    A::P(*conv_state),
                    A::I(n as i32),
                    A::I(ch as i32),
                    A::I(kern as i32),
                ],
            )?;
        }
        let f = self.k.dn_qk_norm.clone();
        self.launch(
            "dn_qk_norm",
            &f,
            ((2 * nk) as u32, n as u32, 1),
            128,
            0,
            &[
                A::P(conv),
                A::I(ch as i32),
                A::I(nk as i32),
                A::I(dk as i32),
                A::F(L2_NORM_EPS),
                A::F(q_scale),
            ],
        )?;
        let f = self.k.dn_gates.clone();
        self.launch(
            "dn_gates",
            &f,
            (blocks(nv, 64), n as u32, 1),
            64,
            0,
            &[
                A::P(ba_b),
                A::P(*a),
                A::P(*dt_bias),
                A::P(beta),
                A::P(g),
                A::I(nv as i32),
                A::I((nv / nk) as i32),
            ],
        )?;
        // Prompts: the barrier-free form when the shape has one (`REDLITE_CUDA_DN_WARP=0`: not).
        // Same arguments, but dn_delta_warp_<dk> has dk in its name.
        let warp =
            crate::ops::delta_warp_launch(nv, dk, dv).filter(|_| self.gemm_now && self.dn_warp);
        let mut args = vec![
            A::P(conv),
            A::P(beta),
            A::P(g),
            A::P(*s),
            A::P(o),
            A::I(n as i32),
            A::I(ch as i32),
            A::I(nk as i32),
        ];
        let (what, f, (grid, block, shared)) = match warp {
            Some((name, grid)) => (
                "dn_delta_warp",
                self.gpu.func(&name)?.clone(),
                (grid, 128, 0),
            ),
            None => {
                args.push(A::I(dk as i32));
                let f = self.k.dn_delta_seq.clone();
                ("dn_delta_seq", f, delta_seq_launch(nv, dk, dv))
            }
        };
        args.push(A::I(dv as i32));
        self.launch(what, &f, grid, block, shared, &args)?;
        let f = self.k.rms_norm_gated.clone();
        self.launch(
            "rms_norm_gated",
            &f,
            ((n * nv) as u32, 1, 1),
            128,
            0,
            &[
                A::P(o),
                A::P(*norm),
                A::P(z_b),
                A::P(gated),
                A::I(dv as i32),
                A::F(eps),
            ],
        )?;
        self.matvec_residual(out, gated, post_norm, n)
    }

    /// The router launch of `res_norm_router` for a layer's MoE when `norm_router` applies to
    /// this call: the top-k in the gate/up kernel ([`Self::top_k_in_gate_up`], the conditions
    /// `enqueue_moe` checks too) with the paired gate/up rows, and an F32 router and shared-expert
    /// gate of the hidden width.
    fn norm_router_for(&self, m: &DevMoe, n: usize) -> Option<NormRouter> {
        let c = &self.config;
        let (h, ne) = (c.hidden, c.n_experts);
        let applies = self.norm_router
            && !self.gemm_now
            && self.top_k_in_gate_up(&m.experts, n)
            && self.moe_gu_pair
            && self.x_router
            && h.is_multiple_of(32)
            && h <= MVF_MAX_COLS
            && m.router.ty == GgmlType::F32
            && m.sh_gate_vec.ty == GgmlType::F32
            && m.router.cols == h
            && m.sh_gate_vec.cols == h
            && m.router.rows == ne;
        applies.then(|| NormRouter {
            split: MvfSplit {
                parts: mvf_parts(GgmlType::F32, h, self.router_split.0),
                rows: self.router_split.1,
            },
            router: m.router.clone(),
            gate: m.sh_gate_vec.clone(),
        })
    }

    /// Whether a call of `n` tokens may take its top-k inside the gate/up kernel's blocks
    /// (`moe_gate_up_route*_q8q_iq2_xxs`): one token, IQ2_XXS experts on 8-bit activations with
    /// their q8 down kernel, the warp router's limits (k ≤ 32, at most 512 experts). The
    /// conditions `enqueue_moe` and `norm_router_for` share; each adds its own.
    fn top_k_in_gate_up(&self, e: &DevExperts, n: usize) -> bool {
        let c = &self.config;
        self.route_in_gate_up
            && n == 1
            && self.q8_moe
            && self.q8_moe_down
            && e.q8_down_f.is_some()
            && c.expert_ff.is_multiple_of(32)
            && self.router.1.name == "moe_router_warp"
            && c.n_experts_used <= 32
            && c.n_experts <= 32 * 16
    }

    fn enqueue_moe(&mut self, m: &DevMoe, n: usize) -> Result<(), CudaError> {
        // The logits already written by `res_norm_router` (this layer's `matvec_residual`).
        let logits_ready = std::mem::take(&mut self.logits_ready);
        let c = &self.config;
        let (h, ne, k, ff) = (c.hidden, c.n_experts, c.n_experts_used, c.expert_ff);
        let sc = &self.sc;
        let (x, xn, rlog, wts, act) = (sc.x, sc.xn, sc.rlog, sc.wts, sc.act);
        let (shared, gl) = (sc.shared, sc.gl);
        let e = &m.experts;
        // Each layer's ids stay until the call ends: the expert cache reads them afterwards.
        let (ids, tab) = (self.experts.ids(e.layer, n), self.experts.table(e.layer));
        // Expert e's parts at the table's first entries + e · dstride (every expert resident), or
        // 0: through the table.
        let dstride = if self.moe_direct {
            self.experts.direct_stride().unwrap_or(0)
        } else {
            0
        };
        // The shared expert reads only xn: on the side stream from the start, beside the router,
        // the top-k and the routed gate/up.
        let drv = |e| CudaError::driver("forking the shared expert's stream", e);
        self.side.fork.record(&self.stream).map_err(drv)?;
        self.side.stream.wait(&self.side.fork).map_err(drv)?;
        let main = std::mem::replace(&mut self.stream, self.side.stream.clone());
        self.stage = "shared";
        let shared_done = self.enqueue_shared_expert(m, n);
        self.stage = "moe";
        self.stream = main;
        shared_done?;
        self.side.join.record(&self.side.stream).map_err(drv)?;
        // Router logits and the shared expert's gate logit (both rows of xn) in one launch, with
        // its own row split (`router_split`: 512 rows of 2048 f32 fill only part of the GPU at
        // the matrices' split), then the top-k.
        // IQ2_XXS gate, up and down all on 8-bit activations (the default), or IQ2_XXS gate/up on
        // the q8 row of xn when matvec_res wrote it, or f32 activations.
        let q8_down = e
            .q8_down_f
            .clone()
            .filter(|_| self.q8_moe && self.q8_moe_down && self.xq_fresh && ff.is_multiple_of(32));
        let routed_gemm =
            self.gemm_now && ne <= 1024 && h.is_multiple_of(GEMM_BK) && ff.is_multiple_of(GEMM_BK);
        // A one-token call's top-k inside the gate/up kernel's blocks
        // (`moe_gate_up_route_q8q_iq2_xxs`).
        let route_in_gate_up = self.top_k_in_gate_up(e, n) && q8_down.is_some() && !routed_gemm;
        // The router, its top-k and the gate/up in one launch (grid barrier): every block of it
        // resident at once; the router's rows with matvec3_x_f32's split (its bits).
        let route_fused = Some(self.k.moe_route_fused.clone())
            .filter(|(_, per_sm)| {
                self.all_resident(((ff / 32) * k) as u32, *per_sm)
                    && ROUTE_FUSED_THREADS == crate::ops::q8q_threads()
            })
            .filter(|_| {
                route_in_gate_up
                    && !logits_ready
                    && self.route_fused
                    && self.moe_gu_pair
                    && self.x_router
                    && m.router.ty == GgmlType::F32
                    && m.sh_gate_vec.ty == GgmlType::F32
                    && m.router.cols == h
                    && m.sh_gate_vec.cols == h
                    && m.router.rows == ne
                    && h <= MVF_MAX_COLS
                    && self.router_split.1 == 1
            });
        let route_fused = route_fused.filter(|_| q8_down.is_some()).map(|(f, _)| f);
        // The fused route kernel computes the logits itself (below, with the gate/up); a
        // one-token call's top-k runs inside the gate/up kernel's blocks.
        if route_fused.is_none() {
            if !logits_ready {
                self.with_split(self.router_split, |s| {
                    s.matvec_normed(xn, None, &[(&m.router, rlog), (&m.sh_gate_vec, gl)], n)
                })?;
            }
            if !route_in_gate_up {
                let (f, rk) = self.router.clone();
                self.launch(
                    rk.name,
                    &f,
                    (n as u32, 1, 1),
                    rk.threads,
                    rk.shared,
                    &[
                        A::P(rlog),
                        A::I(ne as i32),
                        A::I(k as i32),
                        A::P(ids),
                        A::P(wts),
                    ],
                )?;
            }
        }
        if routed_gemm {
            return self.enqueue_routed_gemm(e, n, (ids, tab), drv);
        }
        // The q8 IQ2_XXS kernels' table: with IQ2_NIB the layer's nibble copy (the other
        // kernels keep the experts' own).
        let (q8_tab, q8_dstride) = match self.experts.nib_table(e.layer) {
            Some((t, sb)) => (t, if dstride != 0 { sb } else { 0 }),
            None => (tab, dstride),
        };
        let q8_down_on = q8_down.is_some();
        // The routed gate/up kernels' arguments after the logits (after the router's, for the
        // fused kernel): n_expert, the table, ids, weights, xq, act, its q8 rows, sizes, dstride.
        let routed_tail = [
            A::I(ne as i32),
            A::P(q8_tab),
            A::P(ids),
            A::P(wts),
            A::P(self.sc.xq),
            A::P(act),
            A::P(self.sc.act_q),
            A::I(ff as i32),
            A::I(h as i32),
            A::I(k as i32),
            A::P(q8_dstride),
        ];
        let (down_f, down_act) = match q8_down {
            Some((_, dn_f)) if route_fused.is_some() => {
                let act_q = self.sc.act_q;
                let f = route_fused.clone().expect("checked above");
                let grid = ((ff / 32) * k) as u32;
                let counter = self
                    .grid_counter("moe_route_gate_up", grid)
                    .ok_or_else(|| CudaError::Invalid("out of grid_sync counters".into()))?;
                self.launch(
                    "moe_route_gate_up_q8q",
                    &f,
                    (grid, 1, 1),
                    ROUTE_FUSED_THREADS,
                    0,
                    &[
                        A::P(xn),
                        A::I(h as i32),
                        A::I(mvf_parts(GgmlType::F32, h, self.router_split.0) as i32),
                        A::P(m.router.ptr),
                        A::P(rlog),
                        A::I(ne as i32),
                        A::P(m.sh_gate_vec.ptr),
                        A::P(gl),
                        A::I(m.sh_gate_vec.rows as i32),
                    ]
                    .into_iter()
                    .chain(routed_tail)
                    .chain([A::P(counter)])
                    .collect::<Vec<_>>(),
                )?;
                (dn_f, act_q)
            }
            Some((_, dn_f)) if route_in_gate_up => {
                let act_q = self.sc.act_q;
                let f = if self.moe_gu_pair {
                    self.k.moe_gate_up_route2.clone()
                } else {
                    self.k.moe_gate_up_route.clone()
                };
                self.launch(
                    "moe_gate_up_route_q8q",
                    &f,
                    ((ff / 32) as u32, k as u32, n as u32),
                    crate::ops::q8q_threads(),
                    0,
                    &[A::P(rlog)]
                        .into_iter()
                        .chain(routed_tail)
                        .collect::<Vec<_>>(),
                )?;
                (dn_f, act_q)
            }
            Some((gu_f, dn_f)) => {
                let act_q = self.sc.act_q;
                let mut args = vec![
                    A::P(q8_tab),
                    A::P(ids),
                    A::P(self.sc.xq),
                    A::P(act),
                    A::P(act_q),
                    A::I(ff as i32),
                    A::I(h as i32),
                    A::I(k as i32),
                    A::P(q8_dstride),
                ];
                let tok = e.q8_tok_f.as_ref().filter(|_| n > 1 && self.moe_tok.0 > 0);
                let (name, f, z, threads) = match tok {
                    Some((f, _)) => (
                        "moe_gate_up_tok_q8q",
                        f.clone(),
                        push_token_tile(&mut args, n, self.moe_tok.0),
                        crate::ops::q8q_tok_threads(),
                    ),
                    None => (
                        "moe_gate_up_tab_q8q",
                        gu_f,
                        n,
                        crate::ops::q8q_threads_for(n),
                    ),
                };
                self.launch(
                    name,
                    &f,
                    ((ff / 32) as u32, k as u32, z as u32),
                    threads,
                    0,
                    &args,
                )?;
                (dn_f, act_q)
            }
            None => {
                let (gate_up_f, input, gu_tab) = match &e.gate_up_q8_f {
                    Some(f) if self.q8_moe && self.xq_fresh => (f.clone(), self.sc.xq, q8_tab),
                    _ => (e.gate_up_f.clone(), xn, tab),
                };
                self.launch(
                    "moe_gate_up_tab",
                    &gate_up_f,
                    (blocks(ff, e.warps * self.moe_rows), k as u32, n as u32),
                    32 * e.warps,
                    0,
                    &[
                        A::P(gu_tab),
                        A::P(ids),
                        A::P(input),
                        A::P(act),
                        A::I(ff as i32),
                        A::I(h as i32),
                        A::I(k as i32),
                    ],
                )?;
                (e.down_f.clone(), act)
            }
        };
        self.stream.wait(&self.side.join).map_err(drv)?;
        // x += sum of the weighted routed experts + sigmoid(g) · shared, in one launch (the q8
        // kernel takes `dstride` too).
        let mut args = vec![
            A::P(if q8_down_on { q8_tab } else { tab }),
            A::P(ids),
            A::P(wts),
            A::P(down_act),
            A::P(x),
            A::P(shared),
            A::P(gl),
            A::I(h as i32),
            A::I(ff as i32),
            A::I(k as i32),
            A::P(q8_dstride),
        ];
        if !q8_down_on {
            args.truncate(10);
        }
        let tok = e
            .q8_tok_f
            .as_ref()
            .filter(|_| q8_down_on && n > 1 && self.moe_tok.1 > 0);
        let (name, f, y) = match tok {
            Some((_, f)) => (
                "moe_down_combine_tok",
                f.clone(),
                push_token_tile(&mut args, n, self.moe_tok.1),
            ),
            None => ("moe_down_combine_tab", down_f, n),
        };
        self.launch(
            name,
            &f,
            (blocks(h * self.moe_down_parts(e), e.warps), y as u32, 1),
            32 * e.warps,
            0,
            &args,
        )?;
        Ok(())
    }

    /// The routed experts of a prompt's `n` tokens on the tensor cores, after the router: the
    /// (token, choice) pairs grouped by expert, one `moe_gemm` over every expert's gate and up
    /// rows, SwiGLU, one over the down rows, then `x += Σ weight · down + sigmoid(g) · shared` per
    /// token (once the shared expert's stream has joined).
    fn enqueue_routed_gemm(
        &mut self,
        e: &DevExperts,
        n: usize,
        (ids, tab): (u64, u64),
        drv: impl Fn(cudarc::driver::DriverError) -> CudaError,
    ) -> Result<(), CudaError> {
        let c = &self.config;
        let (h, ne, k, ff) = (c.hidden, c.n_experts, c.n_experts_used, c.expert_ff);
        let sc = &self.sc;
        let (x, xn, wts, act, shared, gl) = (sc.x, sc.xn, sc.wts, sc.act, sc.shared, sc.gl);
        let (off, pairs, gu, down) = (sc.pair_off, sc.pairs, sc.gu, sc.down);
        let f = self.k.moe_group.clone();
        self.launch(
            "moe_group",
            &f,
            (1, 1, 1),
            1024,
            0,
            &[
                A::P(ids),
                A::I((n * k) as i32),
                A::I(ne as i32),
                A::P(off),
                A::P(pairs),
            ],
        )?;
        // gate and up: parts 0 and 1 of every expert, rows into gu[p][0 .. 2 ff).
        self.launch(
            "moe_gemm gate/up",
            &e.gemm_gate_up_f,
            ((2 * ff.div_ceil(GEMM_BM)) as u32, ne as u32, 1),
            GEMM_THREADS,
            0,
            &[
                A::P(tab),
                A::I(0),
                A::I(2),
                A::P(off),
                A::P(pairs),
                A::P(xn),
                A::I(k as i32),
                A::P(gu),
                A::I(ff as i32),
                A::I(h as i32),
                A::I((2 * ff) as i32),
            ],
        )?;
        let f = self.k.swiglu_pairs.clone();
        self.elementwise(&f, &[A::P(gu), A::P(act), A::I(ff as i32)], n * k * ff)?;
        self.launch(
            "moe_gemm down",
            &e.gemm_down_f,
            (h.div_ceil(GEMM_BM) as u32, ne as u32, 1),
            GEMM_THREADS,
            0,
            &[
                A::P(tab),
                A::I(2),
                A::I(1),
                A::P(off),
                A::P(pairs),
                A::P(act),
                A::I(1),
                A::P(down),
                A::I(h as i32),
                A::I(ff as i32),
                A::I(h as i32),
            ],
        )?;
        self.stream.wait(&self.side.join).map_err(drv)?;
        let f = self.k.moe_combine_pairs.clone();
        self.launch(
            "moe_combine_pairs",
            &f,
            (blocks(h, 256), n as u32, 1),
            256,
            0,
            &[
                A::P(x),
                A::P(down),
                A::P(wts),
                A::P(shared),
                A::P(gl),
                A::I(h as i32),
                A::I(k as i32),
            ],
        )
    }

    /// The shared expert of `n` tokens into `shared` (on whatever stream `self.stream` is).
    fn enqueue_shared_expert(&mut self, m: &DevMoe, n: usize) -> Result<(), CudaError> {
        let sff = self.config.shared_ff;
        let sc = &self.sc;
        let (xn, xq, sg, su, sa, shared) = (sc.xn, sc.xq, sc.sg, sc.su, sc.sa, sc.shared);
        // Gate and up rows read the same xn: one launch when they share a type (on the q8 row
        // of xn matvec_res wrote, when there is one and they are Q4_K).
        let xq_fits = self.xq_shared
            && self.xq_fresh
            && m.sh_gate.ty == m.sh_up.ty
            && m.sh_gate.cols == m.sh_up.cols
            && self.q8_fits(m.sh_gate.ty, m.sh_gate.cols);
        if xq_fits {
            self.matvec_q8x((xq, 0), &[(&m.sh_gate, sg), (&m.sh_up, su)], n)?;
        } else {
            self.matvec_normed(xn, None, &[(&m.sh_gate, sg), (&m.sh_up, su)], n)?;
        }
        if self.xq_shared
            && !self.gemm_now
            && sff.is_multiple_of(32)
            && self.q8_fits(m.sh_down.ty, m.sh_down.cols)
        {
            // The activation quantised where it is made, then the down rows on it (no staging;
            // not for prompts through the GEMMs: this reads the weights once per token).
            let xq_sa = self.sc.xq_sa;
            let f = self.k.swiglu_q8.clone();
            self.launch(
                "swiglu_q8",
                &f,
                (blocks(sff, 256), n as u32, 1),
                256,
                0,
                &[A::P(sg), A::P(su), A::P(sa), A::P(xq_sa), A::I(sff as i32)],
            )?;
            return self.matvec_q8x((xq_sa, 0), &[(&m.sh_down, shared)], n);
        }
        let f = self.k.swiglu.clone();
        self.elementwise(&f, &[A::P(sg), A::P(su), A::P(sa)], n * sff)?;
        if self.q8_fits(m.sh_down.ty, m.sh_down.cols) {
            // One matrix through the fused kernel (no norm weights): the 8-bit form.
            return self.matvec_normed(sa, None, &[(&m.sh_down, shared)], n);
        }
        self.matvec(&m.sh_down, sa, shared, n)
    }
}

impl Drop for CudaModel {
    fn drop(&mut self) {
        // The graph and the stream go before the memory they use (the arena is the last field).
        self.graph = None;
        let _ = self.bind();
        let _ = self.sync();
    }
}

/// The `(w, y, rows)` arguments of up to three matrices for the fused matvec kernels (absent
/// ones as nulls and 0 rows), appended to `args`; returns the blocks they take at `rpb` rows a
/// block.
fn push_mats3(args: &mut Vec<A>, mats: &[(&DevLinear, u64)], rpb: u32) -> u32 {
    let mut grid_x = 0;
    for m in 0..3 {
        match mats.get(m) {
            Some((w, y)) => {
                args.extend([A::P(w.ptr), A::P(*y), A::I(w.rows as i32)]);
                grid_x += blocks(w.rows, rpb);
            }
            None => args.extend([A::P(0), A::P(0), A::I(0)]),
        }
    }
    grid_x
}

/// The shapes the kernels handle.
fn check_config(c: &Config, o: &CudaModelOptions) -> Result<(), CudaError> {
    let bad = |m: String| Err(CudaError::Invalid(m));
    if o.max_batch == 0 || o.max_batch > 65_535 || o.max_context == 0 {
        return bad(format!(
            "max batch {} (1..=65535) and max context {} (> 0)",
            o.max_batch, o.max_context
        ));
    }
    i32_of(o.max_context, "max context")?;
    if o.max_verify > o.max_batch.min(MAX_VERIFY_ROWS) {
        return bad(format!(
            "{} verify rows (at most the max batch {} and {MAX_VERIFY_ROWS})",
            o.max_verify, o.max_batch
        ));
    }
    if o.max_verify > 0 && dn_fused(c).is_none() {
        return bad(
            "speculative verify on the GPU needs the fused DeltaNet kernel, which does not take this shape"
                .into(),
        );
    }
    if c.n_experts_used == 0 || c.n_experts_used > MAX_EXPERTS_USED.min(c.n_experts) {
        return bad(format!(
            "{} experts used of {} (the router kernel takes up to {MAX_EXPERTS_USED})",
            c.n_experts_used, c.n_experts
        ));
    }
    if !c.head_dim.is_multiple_of(32) || c.head_dim > MAX_HEAD_DIM || c.rope_dims > c.head_dim {
        return bad(format!(
            "head dim {} (a multiple of 32, at most {MAX_HEAD_DIM}), rope dims {}",
            c.head_dim, c.rope_dims
        ));
    }
    crate::ops::kv_kernel("", o.kv_type)?;
    if c.n_kv_heads == 0 || !c.n_heads.is_multiple_of(c.n_kv_heads) {
        return bad(format!(
            "{} heads over {} KV heads",
            c.n_heads, c.n_kv_heads
        ));
    }
    if c.conv_kernel == 0 || c.conv_kernel > 8 || c.dn_k_dim > 1024 || c.dn_k_heads == 0 {
        return bad(format!(
            "DeltaNet conv kernel {} (1..=8), k dim {} (<= 1024)",
            c.conv_kernel, c.dn_k_dim
        ));
    }
    if !c.dn_v_heads.is_multiple_of(c.dn_k_heads) {
        return bad(format!(
            "{} V heads over {} QK heads",
            c.dn_v_heads, c.dn_k_heads
        ));
    }
    Ok(())
}

fn matvec_kernel(gpu: &Gpu, ty: GgmlType) -> Result<CudaFunction, CudaError> {
    gpu.func(&format!("matvec_{}", type_suffix(ty))).cloned()
}

/// Upload one linear layer.
fn dev_linear(gpu: &Gpu, arena: &mut Arena, w: &HostLinear) -> Result<DevLinear, CudaError> {
    let rb = row_bytes(w.ty, w.cols)?;
    let bytes = w.bytes();
    if bytes.len() != w.rows * rb {
        return Err(CudaError::Invalid(format!(
            "{}: {} bytes for {} rows of {} {} values",
            w.name,
            bytes.len(),
            w.rows,
            w.cols,
            w.ty.name()
        )));
    }
    Ok(DevLinear {
        rows: w.rows,
        cols: w.cols,
        ptr: arena.upload(bytes)?,
        f: matvec_kernel(gpu, w.ty)?,
        ty: w.ty,
    })
}

/// A small f32 vector as a 1-row F32 matrix (the shared expert's gate).
fn dev_row(gpu: &Gpu, arena: &mut Arena, v: &[f32]) -> Result<DevLinear, CudaError> {
    Ok(DevLinear {
        rows: 1,
        cols: v.len(),
        ptr: arena.upload_f32(v)?,
        f: matvec_kernel(gpu, GgmlType::F32)?,
        ty: GgmlType::F32,
    })
}

/// When the experts (each `len` bytes) sit in one mapped file at a fixed stride of at least `len`
/// (the slabs of one 3-D tensor, or the gate or up halves of a fused one): the file, the byte
/// range covering all of them and the stride.
pub fn expert_span<'a>(
    ws: &[&'a HostLinear],
    len: usize,
) -> Option<(&'a Arc<GgufFile>, std::ops::Range<usize>, usize)> {
    let (file, r0) = ws.first()?.file_range()?;
    let stride = match ws.get(1) {
        Some(w) => w.file_range()?.1.start.checked_sub(r0.start)?,
        None => len,
    };
    if stride < len {
        return None;
    }
    let regular = ws.iter().enumerate().all(|(e, w)| {
        w.file_range().is_some_and(|(f, r)| {
            Arc::ptr_eq(f, file) && r.start == r0.start + e * stride && r.len() == len
        })
    });
    regular.then(|| {
        (
            file,
            r0.start..r0.start + (ws.len() - 1) * stride + len,
            stride,
        )
    })
}

/// The routed experts of every layer into the expert cache (all resident, or the slots
/// `opts.experts` leaves room for, the rest in pinned host memory). Every layer's experts must
/// share one type and shape per part (gate and up alike).
fn dev_experts(
    gpu: &Gpu,
    arena: &mut Arena,
    c: &Config,
    opts: &CudaModelOptions,
    layers: &[LayerWeights<HostLoader>],
) -> Result<ExpertCache, CudaError> {
    let part_len =
        |w: &HostLinear| -> Result<usize, CudaError> { Ok(row_bytes(w.ty, w.cols)? * w.rows) };
    let mut experts: ExpertBytes<'_> = Vec::with_capacity(layers.len());
    let mut layouts = Vec::with_capacity(layers.len());
    let mut nib_layers = Vec::with_capacity(layers.len());
    for w in layers {
        let first = w
            .moe
            .experts
            .first()
            .ok_or_else(|| CudaError::Invalid("a MoE layer without routed experts".into()))?;
        let (g0, d0) = (&first.gate, &first.down);
        let mut layer = Vec::with_capacity(w.moe.experts.len());
        for e in &w.moe.experts {
            for (p, like) in [(&e.gate, g0), (&e.up, g0), (&e.down, d0)] {
                if p.ty != like.ty || p.rows != like.rows || p.cols != like.cols {
                    return Err(CudaError::Invalid(format!(
                        "{}: the routed experts of a layer differ in type or shape ({} {}x{} vs {} {}x{} of {}); the GPU expert kernels take one type per part and layer",
                        p.name,
                        p.ty.name(),
                        p.rows,
                        p.cols,
                        like.ty.name(),
                        like.rows,
                        like.cols,
                        like.name
                    )));
                }
            }
            layer.push([e.gate.bytes(), e.up.bytes(), e.down.bytes()]);
        }
        experts.push(layer);
        layouts.push(ExpertLayout::new(part_len(g0)?, part_len(d0)?));
        nib_layers.push((g0.ty == GgmlType::IQ2XXS, d0.ty == GgmlType::IQ2XXS));
    }
    let stride = layouts.iter().map(|l| l.slot_bytes).max().unwrap_or(0);
    let used = match opts.experts {
        ExpertCacheSize::Budget(_) => device_used()?,
        _ => 0,
    };
    let per_layer = slots_per_layer(opts.experts, experts.len(), c.n_experts, stride, used)?;
    let mut alloc = |n: usize| arena.alloc(n);
    let mut cache = ExpertCache::new(
        &gpu.ctx,
        &mut alloc,
        &experts,
        layouts,
        c.n_experts_used,
        opts.max_batch,
        per_layer,
        opts.expert_policy,
    )?;
    // IQ2_NIB: the q8 IQ2_XXS expert kernels read the experts' nibble copy.
    if crate::iq2_nib::enabled() {
        cache.add_nibble_copy(&mut alloc, &experts, &nib_layers)?;
    }
    Ok(cache)
}

/// `dn_restore`'s table of the DeltaNet layers' states and traces (`None` without verify traces,
/// DeltaNet layers, or state sizes in whole float4s).
fn dn_restore_table(
    arena: &mut Arena,
    c: &Config,
    o: &CudaModelOptions,
    layers: &[DevLayer],
) -> Result<Option<(u64, usize)>, CudaError> {
    let s_floats = c.dn_v_heads * c.dn_k_dim * c.dn_v_dim;
    let conv_floats = (c.conv_kernel - 1) * c.dn_conv_channels();
    if o.max_verify == 0 || !s_floats.is_multiple_of(4) || !conv_floats.is_multiple_of(4) {
        return Ok(None);
    }
    let mut t: Vec<u8> = Vec::new();
    let mut n = 0;
    for l in layers {
        if let DevMixer::DeltaNet {
            conv_state,
            s,
            conv_trace,
            s_trace,
            ..
        } = &l.mixer
        {
            for p in [*s, *s_trace, *conv_state, *conv_trace] {
                t.extend_from_slice(&p.to_le_bytes());
            }
            n += 1;
        }
    }
    if n == 0 {
        return Ok(None);
    }
    Ok(Some((arena.upload(&t)?, n)))
}

/// The MTP block: its decoder layer (own attention cache, experts in a resident cache of their
/// own), norms, eh_proj, and the slot queue's buffers.
fn dev_mtp(
    gpu: &Gpu,
    arena: &mut Arena,
    c: &Config,
    o: &CudaModelOptions,
    w: &MtpWeights<HostLoader>,
) -> Result<DevMtp, CudaError> {
    let h = c.hidden;
    if w.eh_proj.rows != h || w.eh_proj.cols != 2 * h {
        return Err(CudaError::Invalid(format!(
            "{}: {}x{}, the MTP block needs {h}x{}",
            w.eh_proj.name,
            w.eh_proj.rows,
            w.eh_proj.cols,
            2 * h
        )));
    }
    let layer = dev_layer(gpu, arena, c, o, 0, &w.layer)?;
    let resident = CudaModelOptions {
        experts: ExpertCacheSize::All,
        ..*o
    };
    let experts = dev_experts(gpu, arena, c, &resident, std::slice::from_ref(&w.layer))?;
    let q_rows = o.max_batch.max(o.max_verify) + 2;
    Ok(DevMtp {
        enorm: arena.upload_f32(&w.enorm)?,
        hnorm: arena.upload_f32(&w.hnorm)?,
        eh_proj: dev_linear(gpu, arena, &w.eh_proj)?,
        layer,
        shared_head_norm: arena.upload_f32(&w.shared_head_norm)?,
        experts,
        q: arena.f32s(q_rows * h)?,
        queue: MtpQueue::new(q_rows),
        cat: arena.f32s(o.max_batch * 2 * h)?,
        head_row: 0,
        draft_graphs: HashMap::new(),
        drafts: arena.zeros(4 * MAX_GRAPH_DRAFTS)?,
        draft_probs: arena.zeros(4 * MAX_GRAPH_DRAFTS)?,
    })
}

fn dev_layer(
    gpu: &Gpu,
    arena: &mut Arena,
    c: &Config,
    o: &CudaModelOptions,
    layer: usize,
    w: &LayerWeights<HostLoader>,
) -> Result<DevLayer, CudaError> {
    // Per-row copies of a state for the verify pass, when there is one.
    let trace = |arena: &mut Arena, n: usize| -> Result<u64, CudaError> {
        if o.max_verify == 0 {
            Ok(0)
        } else {
            arena.f32s(o.max_verify * n)
        }
    };
    let mixer = match &w.mixer {
        MixerWeights::Attention(a) => {
            // Bytes of each cache: [max_context][kv_heads][head_dim] of the KV type.
            let kv = o
                .kv_type
                .bytes_for((o.max_context * c.n_kv_heads * c.head_dim) as u64)
                as usize;
            DevMixer::Attention {
                wq: dev_linear(gpu, arena, &a.wq)?,
                wk: dev_linear(gpu, arena, &a.wk)?,
                wv: dev_linear(gpu, arena, &a.wv)?,
                wo: dev_linear(gpu, arena, &a.wo)?,
                q_norm: arena.upload_f32(&a.q_norm)?,
                k_norm: arena.upload_f32(&a.k_norm)?,
                kc: arena.zeros(kv)?,
                vc: arena.zeros(kv)?,
            }
        }
        MixerWeights::DeltaNet(d) => DevMixer::DeltaNet {
            qkv: dev_linear(gpu, arena, &d.qkv)?,
            z: dev_linear(gpu, arena, &d.z)?,
            ba: dev_linear(gpu, arena, &d.ba)?,
            out: dev_linear(gpu, arena, &d.out)?,
            conv_w: arena.upload_f32(&d.conv)?,
            dt_bias: arena.upload_f32(&d.dt_bias)?,
            a: arena.upload_f32(&d.a)?,
            norm: arena.upload_f32(&d.norm)?,
            conv_state: arena.f32s((c.conv_kernel - 1) * c.dn_conv_channels())?,
            s: arena.f32s(c.dn_v_heads * c.dn_k_dim * c.dn_v_dim)?,
            conv_trace: trace(arena, (c.conv_kernel - 1) * c.dn_conv_channels())?,
            s_trace: trace(arena, c.dn_v_heads * c.dn_k_dim * c.dn_v_dim)?,
        },
    };
    let m = &w.moe;
    let expert = m
        .experts
        .first()
        .ok_or_else(|| CudaError::Invalid("a MoE layer without experts".into()))?;
    if expert.gate.ty != expert.up.ty {
        return Err(CudaError::Invalid(format!(
            "{} and {}: gate and up experts differ in type",
            expert.gate.name, expert.up.name
        )));
    }
    let experts = DevExperts {
        layer,
        gate_up_f: gpu
            .func(&format!("moe_gate_up_tab_{}", type_suffix(expert.gate.ty)))?
            .clone(),
        gate_up_q8_f: match expert.gate.ty {
            GgmlType::IQ2XXS => Some(gpu.func("moe_gate_up_tab_q8_iq2_xxs")?.clone()),
            _ => None,
        },
        q8_down_f: match (expert.gate.ty, expert.down.ty) {
            (GgmlType::IQ2XXS, GgmlType::IQ2XXS) => Some((
                gpu.func("moe_gate_up_tab_q8q_iq2_xxs")?.clone(),
                gpu.func("moe_down_combine_tab_q8_iq2_xxs")?.clone(),
            )),
            _ => None,
        },
        q8_tok_f: match (expert.gate.ty, expert.down.ty) {
            (GgmlType::IQ2XXS, GgmlType::IQ2XXS) => Some((
                gpu.func("moe_gate_up_tok_q8q_iq2_xxs")?.clone(),
                gpu.func("moe_down_combine_tok_q8_iq2_xxs")?.clone(),
            )),
            _ => None,
        },
        down_f: gpu
            .func(&format!(
                "moe_down_combine_tab_{}",
                type_suffix(expert.down.ty)
            ))?
            .clone(),
        warps: moe_warps(),
        down_ty: expert.down.ty,
        gemm_gate_up_f: gpu
            .func(&format!("moe_gemm_{}", type_suffix(expert.gate.ty)))?
            .clone(),
        gemm_down_f: gpu
            .func(&format!("moe_gemm_{}", type_suffix(expert.down.ty)))?
            .clone(),
    };
    Ok(DevLayer {
        attn_norm: arena.upload_f32(&w.attn_norm)?,
        post_norm: arena.upload_f32(&w.post_attention_norm)?,
        mixer,
        moe: DevMoe {
            router: dev_linear(gpu, arena, &m.router)?,
            experts,
            sh_gate: dev_linear(gpu, arena, &m.shared.gate)?,
            sh_up: dev_linear(gpu, arena, &m.shared.up)?,
            sh_down: dev_linear(gpu, arena, &m.shared.down)?,
            sh_gate_vec: dev_row(gpu, arena, &m.shared_gate)?,
        },
    })
}

/// Activation buffers for `max_batch` tokens.
fn scratch(arena: &mut Arena, c: &Config, o: &CudaModelOptions) -> Result<Scratch, CudaError> {
    let b = o.max_batch;
    let (h, ch, vw, nv) = (
        c.hidden,
        c.dn_conv_channels(),
        c.dn_value_width(),
        c.dn_v_heads,
    );
    let (qw, kvw) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    let (ne, k, ff, sff) = (c.n_experts, c.n_experts_used, c.expert_ff, c.shared_ff);
    let mut f = |n: usize| arena.f32s(b * n);
    Ok(Scratch {
        x: f(h)?,
        xn: f(h)?,
        qkv: f(ch)?,
        conv: f(ch)?,
        z: f(vw)?,
        ba: f(2 * nv)?,
        beta: f(nv)?,
        g: f(nv)?,
        o: f(vw)?,
        gated: f(vw)?,
        qg: f(2 * qw)?,
        kn: f(kvw)?,
        vn: f(kvw)?,
        q: f(qw)?,
        gate: f(qw)?,
        att: f(qw)?,
        rlog: f(ne)?,
        wts: f(k)?,
        act: f(k * ff)?,
        sg: f(sff)?,
        su: f(sff)?,
        sa: f(sff)?,
        shared: f(h)?,
        gl: f(1)?,
        logits: f(c.vocab)?,
        input: arena.alloc(4 * (b + 1))?,
        out: arena.alloc(4 * o.max_verify.max(1))?,
        u: arena.alloc(4)?,
        counter: arena.zeros(4 * b)?,
        grid_counter: arena.zeros(8 * GRID_COUNTERS)?,
        dn_counter: arena.zeros(8 * c.dn_k_heads.max(1))?,
        argmax_part: arena.alloc(8 * ARGMAX_SLICES * o.max_verify.max(1))?,
        argmax_counter: arena.zeros(4 * o.max_verify.max(1))?,
        xq: arena.alloc(b * crate::ops::q8_row_bytes(h))?,
        xq_sa: arena.alloc(b * crate::ops::q8_row_bytes(sff))?,
        act_q: arena.alloc(b * k * crate::ops::q8_row_bytes(ff))?,
        xq_in: arena.alloc(b * crate::ops::q8_row_bytes(MVF_MAX_COLS))?,
        pair_off: arena.alloc(4 * (ne + 1))?,
        pairs: arena.alloc(4 * b * k)?,
        gu: arena.f32s(b * k * 2 * ff)?,
        down: arena.f32s(b * k * h)?,
        attn_part: arena
            .f32s(o.max_verify.max(1) * c.n_heads * attn_splits(o) * (c.head_dim + 2))?,
        xq_inv: arena.f32s(b)?,
        rope_cs: arena.alloc(8 * o.max_context * (c.rope_dims / 2).max(1))?,
    })
}

/// What an output projection reads: activation rows, or the DeltaNet gated norm it forms itself
/// from the mixer's o and z (device addresses; `dv` values a V head).
#[derive(Debug, Clone, Copy)]
enum ResInput {
    Rows(u64),
    Gated {
        o: u64,
        z: u64,
        norm: u64,
        dv: usize,
    },
}

/// The most tokens a block of `moe_gate_up_tok_q8q_iq2_xxs` takes (the kernel's `GU_TOK_MAX`).
pub const MOE_TOK_GU_MAX: usize = 4;
/// The most tokens a block of `moe_down_combine_tok_q8_iq2_xxs` takes (its `DOWN_TOK_MAX`).
pub const MOE_TOK_DOWN_MAX: usize = 8;

/// A token-tile kernel's last two arguments for a call of `n` tokens with `tile` of them a block
/// (`n`, the tile clamped to `n`); returns the grid's extent over the tokens.
fn push_token_tile(args: &mut Vec<A>, n: usize, tile: usize) -> usize {
    let tile = tile.clamp(1, n.max(1));
    args.extend([A::I(n as i32), A::I(tile as i32)]);
    n.div_ceil(tile)
}

/// [`CudaModel::moe_tok`] from `REDLITE_CUDA_MOE_TOK` (`g:d`, `g,d` or one number for both;
/// default `0:8`: the down kernel's token tiles only. Session 28 on the H200: the full-size
/// 8-row verify 8.64 against 8.82 ms, 16 rows 14.91 against 15.29, 2 and 4 rows even; the
/// gate/up tiles lost at 2 and 4 rows and gained less than the down's at 8).
fn moe_tok_tiles() -> (usize, usize) {
    let Ok(v) = std::env::var("REDLITE_CUDA_MOE_TOK") else {
        return (0, MOE_TOK_DOWN_MAX);
    };
    let mut it = v
        .split([',', ':'])
        .map(|p| p.trim().parse::<usize>().unwrap_or(0));
    let g = it.next().unwrap_or(0);
    let d = it.next().unwrap_or(g);
    (g.min(MOE_TOK_GU_MAX), d.min(MOE_TOK_DOWN_MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_projection_tile_rows_by_call_length() {
        // Default: two rows a warp group up to 4 tokens; a setting of 1 or 2 holds for any length.
        assert_eq!(res_tok_rows(0, 2), 2);
        assert_eq!(res_tok_rows(0, 4), 2);
        assert_eq!(res_tok_rows(0, 5), 1);
        assert_eq!(res_tok_rows(0, 16), 1);
        assert_eq!(res_tok_rows(1, 2), 1);
        assert_eq!(res_tok_rows(2, 16), 2);
    }

    #[test]
    fn token_tiles_by_call_length() {
        // One token: no tile. Automatic: 2 up to 8 tokens, then 4; never more than the tokens or
        // than 48 KiB of f32 inputs.
        assert_eq!(token_tile(0, 1, 2048), 1);
        assert_eq!(token_tile(0, 4, 2048), 2);
        assert_eq!(token_tile(0, 8, 2048), 2);
        assert_eq!(token_tile(0, 9, 2048), 4);
        assert_eq!(token_tile(0, 64, 2048), 4);
        assert_eq!(token_tile(0, 3, 8192), 1);
        // A fixed tile (`REDLITE_CUDA_TOKEN_TILE`) whatever the length.
        assert_eq!(token_tile(4, 4, 2048), 4);
        assert_eq!(token_tile(4, 3, 2048), 3);
        assert_eq!(token_tile(1, 16, 2048), 1);
    }

    /// The integer value of `#define NAME value` in matvec.cu.
    fn matvec_define(name: &str) -> usize {
        let src = crate::kernels::SOURCES
            .iter()
            .find(|(f, _)| *f == "matvec.cu")
            .expect("matvec.cu is a kernel source")
            .1;
        let line = src
            .lines()
            .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("matvec.cu defines {name}"));
        line.trim().parse().expect("an integer define")
    }

    #[test]
    fn activations_in_registers_grids_match_the_kernels() {
        // The host sizes these kernels' grids: its block shapes must be the kernels'.
        assert_eq!(RES_XR_ROWS as usize, matvec_define("XR_ROWS"));
        assert_eq!(XR_TOKENS, matvec_define("XR_TOKENS"));
        let warps = matvec_define("MVF_WARPS");
        assert_eq!(HEAD_XR_ROWS as usize, warps / 2 * matvec_define("XQ_ROWS"));
    }

    #[test]
    fn tensor_core_products_shared_memory() {
        // 16 padded Q4_K rows, their scale quads, 8 padded q8 rows (ncu saw 12.93 KB at 512).
        assert_eq!(q8x_mma_smem(2048), Some(49_792));
        assert_eq!(q8x_mma_smem(512), Some(12_928));
        assert_eq!(q8x_mma_smem(4096), None);
    }

    /// `matvec_q8x_mma_q4_k`'s order of additions, here on the host: `warp_sum`'s butterfly (lane
    /// 0's value after v_L += v_{L^o} for o = 16 … 1) equals a binary counter over the lanes in
    /// bit-reversed order, cut into 8 runs of 4 leaves whose roots a second counter adds
    /// (`q8x_mma_push`), bit for bit, where a sequential sum does not.
    #[test]
    fn bit_reversed_counter_is_the_warp_butterfly() {
        fn push(stk: &mut [f32], v: &mut f32, i: usize) {
            for (b, s) in stk.iter_mut().enumerate() {
                if (i >> b) & 1 == 1 {
                    *v += *s; // left subtree + right (an f32 addition commutes)
                } else {
                    *s = *v;
                    return;
                }
            }
        }
        fn counter(leaves: impl Iterator<Item = f32>, levels: usize) -> f32 {
            let mut stk = vec![0.0f32; levels];
            let mut v = 0.0;
            for (i, leaf) in leaves.enumerate() {
                v = leaf;
                push(&mut stk, &mut v, i);
            }
            v
        }
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Values over many binades, so that the order of additions shows in the bits.
            let m = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            m * 2f32.powi((state % 24) as i32 - 12)
        };
        let mut sequential_differs = false;
        for _ in 0..2000 {
            let lanes: Vec<f32> = (0..32).map(|_| next()).collect();
            let mut v = lanes.clone();
            for o in [16, 8, 4, 2, 1] {
                v = (0..32).map(|l| v[l] + v[l ^ o]).collect();
            }
            let rev = |i: usize| (i as u32).reverse_bits() as usize >> 27;
            let roots: Vec<f32> = (0..8)
                .map(|run| counter((0..4).map(|i| lanes[rev(run * 4 + i)]), 2))
                .collect();
            let tree = counter(roots.into_iter(), 3);
            assert_eq!(tree.to_bits(), v[0].to_bits());
            sequential_differs |= lanes.iter().sum::<f32>().to_bits() != v[0].to_bits();
        }
        assert!(sequential_differs);
    }
}
