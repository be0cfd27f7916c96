//! The mixture of experts (`moe.cu`): the router kernels, the routed experts' gate/up, SwiGLU and
//! down in each form (per-layer table, slots, ids, token tiles) and the combine.

use super::*;

/// Threads of the block-wide router kernel `moe_router` per token.
pub const ROUTER_THREADS: u32 = 256;
/// Threads per block of `moe_gate_up_tab_q8q_iq2_xxs` (32 rows a block): `REDLITE_CUDA_Q8Q_WARPS`
/// warps (8, 16 or 32; default 16: two rows a warp, two blocks an SM: 283.1 / 283.2 tok/s on the
/// H200 against 279.0 / 279.2 with 32 warps, one block an SM, and 276.9 with 8).
pub fn q8q_threads() -> u32 {
    32 * warps_from_env("REDLITE_CUDA_Q8Q_WARPS", &[8, 16, 32], 16)
}

/// Threads per block of `moe_gate_up_tab_q8q_iq2_xxs` in a call of `n` tokens: past
/// [`Q8Q_FEW_TOKENS`] (the verify's 8- and 16-row passes) `REDLITE_CUDA_Q8Q_TOK_WARPS` warps (4, 8
/// or 16; default 8: four blocks an SM; session 30 on the H200, 8 / 16 rows −2.3 / −2.1 % against
/// 16 warps, while every q8 kernel at 8 warps cost 2 rows 2.3 %), else [`q8q_threads`]. The same
/// bits whatever the warps.
pub fn q8q_threads_for(n: usize) -> u32 {
    if n > Q8Q_FEW_TOKENS {
        32 * warps_from_env("REDLITE_CUDA_Q8Q_TOK_WARPS", &[4, 8, 16], 8)
    } else {
        q8q_threads()
    }
}

/// Threads per block of `moe_gate_up_tok_q8q_iq2_xxs`: [`q8q_threads`], at most 512 (its launch
/// bound; `REDLITE_CUDA_Q8Q_WARPS=32` failed its launch with "invalid argument" in session 30).
pub fn q8q_tok_threads() -> u32 {
    q8q_threads().min(512)
}

/// Calls of up to this many tokens take [`q8q_threads`] in `moe_gate_up_tab_q8q_iq2_xxs`.
pub const Q8Q_FEW_TOKENS: usize = 4;

/// Most experts the one-warp router kernel `moe_router_warp` takes (its `32 * ROUTER_VPL`).
pub const ROUTER_WARP_MAX_EXPERTS: usize = 512;
/// `moe_router_warp`'s block for its block-wide top-k: a thread an expert up to 512.
const ROUTER_PAR_THREADS: u32 = 512;

/// Which router kernel runs and how it is launched (per token: one block of `threads`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterKernel {
    pub name: &'static str,
    pub threads: u32,
    /// Dynamic shared memory, bytes.
    pub shared: u32,
}

impl RouterKernel {
    /// The block-wide kernel: softmax and k rounds of a block argmax (any expert count).
    pub fn block(n_expert: usize) -> RouterKernel {
        RouterKernel {
            name: "moe_router",
            threads: ROUTER_THREADS,
            shared: (4 * n_expert) as u32,
        }
    }

    /// The one-warp kernel (probabilities in registers, no barrier per round), or `None` when
    /// `n_expert` is above what it holds. Launched with 512 threads, it takes the block-wide
    /// top-k (moe.cu's `TOPK_PAR`: the same outputs; session 34) where that applies, warp 0's
    /// rounds otherwise; `REDLITE_CUDA_ROUTER_PAR=0` launches one warp (the rounds always).
    pub fn warp(n_expert: usize) -> Option<RouterKernel> {
        let par = crate::model::env_switch("REDLITE_CUDA_ROUTER_PAR", true);
        (n_expert <= ROUTER_WARP_MAX_EXPERTS).then_some(RouterKernel {
            name: "moe_router_warp",
            threads: if par { ROUTER_PAR_THREADS } else { 32 },
            shared: 0,
        })
    }

    /// What the model runs: the one-warp kernel where it applies, unless
    /// `REDLITE_CUDA_ROUTER=block` asks for the block-wide one (for A/B measurements).
    pub fn for_model(n_expert: usize) -> RouterKernel {
        let block = std::env::var("REDLITE_CUDA_ROUTER").is_ok_and(|v| v == "block");
        match RouterKernel::warp(n_expert) {
            Some(w) if !block => w,
            _ => RouterKernel::block(n_expert),
        }
    }
}
/// `swiglu_q8` on `n` tokens of `len` values: `(silu(gate) · up, its q8 rows)`.
pub fn swiglu_q8(
    gpu: &Gpu,
    gate: &[f32],
    up: &[f32],
    len: usize,
) -> Result<(Vec<f32>, Vec<u8>), CudaError> {
    let n = check_rows(gate.len(), len, "swiglu_q8 gate")?;
    if up.len() != gate.len() || !len.is_multiple_of(32) {
        return Err(CudaError::Invalid("swiglu_q8: sizes".into()));
    }
    let (g, u) = (upload(gpu, gate)?, upload(gpu, up)?);
    let mut out = alloc_poisoned::<f32>(gpu, n * len)?;
    let mut xq = alloc_poisoned::<u8>(gpu, n * q8_row_bytes(len))?;
    let li = i32_arg(len, "len")?;
    launch!(
        gpu,
        gpu.func("swiglu_q8")?,
        "swiglu_q8",
        cfg((blocks(len, 256), n as u32, 1), 256, 0),
        [&g, &u, &mut out, &mut xq, &li]
    )?;
    Ok((download(gpu, &out)?, download(gpu, &xq)?))
}

/// The device buffers of one token's routed experts through the per-layer table kernels: the
/// table (`tab[3e + p]`: part p (gate, up, down) of expert e), ids `0..k`, the weights, the
/// output (zeros), a zero shared-expert output and gate logit, and the sizes as kernel arguments.
struct TabCall {
    tab: CudaSlice<u64>,
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    out: CudaSlice<f32>,
    shared: CudaSlice<f32>,
    gl: CudaSlice<f32>,
    ff: i32,
    hidden: i32,
    k: i32,
}

fn tab_call(
    gpu: &Gpu,
    set: &ExpertSet,
    weights: &[f32],
    (hidden, ff): (usize, usize),
) -> Result<TabCall, CudaError> {
    let k = weights.len();
    let tab: Vec<u64> = (0..k)
        .flat_map(|e| [set.gate[e], set.up[e], set.down[e]].map(|b| device_address(gpu, b)))
        .collect();
    let ids: Vec<i32> = (0..k as i32).collect();
    Ok(TabCall {
        tab: upload(gpu, &tab)?,
        ids: upload(gpu, &ids)?,
        weights: upload(gpu, weights)?,
        out: upload(gpu, &vec![0.0f32; hidden])?,
        shared: upload(gpu, &vec![0.0f32; hidden])?,
        gl: upload(gpu, &[0.0f32])?,
        ff: i32_arg(ff, "ff")?,
        hidden: i32_arg(hidden, "hidden")?,
        k: i32_arg(k, "k")?,
    })
}

/// A down kernel of the per-layer table form (`moe_down_combine_tab_*`) on the activations `act`
/// (f32 values or q8 rows) of the call `c`, `grid_x` blocks of [`crate::expert_cache::moe_warps`]
/// warps, one token.
fn down_tab_launch<T: DeviceRepr>(
    gpu: &Gpu,
    name: &str,
    c: &mut TabCall,
    act: &CudaSlice<T>,
    grid_x: u32,
) -> Result<(), CudaError> {
    let warps = crate::expert_cache::moe_warps();
    launch!(
        gpu,
        gpu.func(name)?,
        name,
        cfg((grid_x, 1, 1), 32 * warps, 0),
        [&c.tab, &c.ids, &c.weights, act, &mut c.out, &c.shared, &c.gl, &c.hidden, &c.ff, &c.k]
    )
}

/// What [`moe_experts_q8_down`] returns: `Σ weight · down(act)`, the f32 activations `[k][ff]`
/// and their q8 rows.
pub type ExpertsQ8 = (Vec<f32>, Vec<f32>, Vec<u8>);

/// The routed experts of one token with every part IQ2_XXS, all on 8-bit activations:
/// `moe_gate_up_tab_q8q_iq2_xxs` on the q8 row `xq` (writing the activations and their q8
/// rows), then `moe_down_combine_tab_q8_iq2_xxs` on those rows.
pub fn moe_experts_q8_down(
    gpu: &Gpu,
    set: &ExpertSet,
    weights: &[f32],
    xq: &[u8],
    (hidden, ff): (usize, usize),
) -> Result<ExpertsQ8, CudaError> {
    let k = weights.len();
    if set.gate_up_ty != GgmlType::IQ2XXS
        || set.down_ty != GgmlType::IQ2XXS
        || set.gate.len() != k
        || xq.len() != q8_row_bytes(hidden)
        || !ff.is_multiple_of(32)
    {
        return Err(CudaError::Invalid(
            "experts (q8 down): IQ2_XXS parts and one q8 row".into(),
        ));
    }
    let mut c = tab_call(gpu, set, weights, (hidden, ff))?;
    let x_d = upload(gpu, xq)?;
    let mut act = alloc_poisoned::<f32>(gpu, k * ff)?;
    let mut actq = alloc_poisoned::<u8>(gpu, k * q8_row_bytes(ff))?;
    launch!(
        gpu,
        gpu.func("moe_gate_up_tab_q8q_iq2_xxs")?,
        "moe_gate_up_tab_q8q_iq2_xxs",
        cfg(((ff / 32) as u32, k as u32, 1), q8q_threads(), 0),
        [&c.tab, &c.ids, &x_d, &mut act, &mut actq, &c.ff, &c.hidden, &c.k, &0u64]
    )?;
    // Two warps per row, as the model runs it.
    down_q8_launch(gpu, &mut c, &actq, (hidden, 1), 0)?;
    Ok((
        download(gpu, &c.out)?,
        download(gpu, &act)?,
        download(gpu, &actq)?,
    ))
}

/// `moe_down_combine_tab_q8_iq2_xxs` on the q8 activation rows `actq` of the call `c` (`n`
/// tokens, one a grid row), two warps per row as the model runs it, the parts through the table
/// (`dstride` 0) or at the table's first entries + id · `dstride`.
fn down_q8_launch(
    gpu: &Gpu,
    c: &mut TabCall,
    actq: &CudaSlice<u8>,
    (hidden, n): (usize, usize),
    dstride: u64,
) -> Result<(), CudaError> {
    let warps = crate::expert_cache::moe_warps();
    let name = "moe_down_combine_tab_q8_iq2_xxs";
    launch!(
        gpu,
        gpu.func(name)?,
        name,
        cfg((blocks(hidden * 2, warps), n as u32, 1), 32 * warps, 0),
        [
            &c.tab, &c.ids, &c.weights, actq, &mut c.out, &c.shared, &c.gl, &c.hidden, &c.ff, &c.k,
            &dstride
        ]
    )
}

/// What [`moe_gate_up_route_q8q`] returns: expert ids and weights `[k]`, the activations
/// `[k][ff]` and their q8 rows.
pub type RoutedGateUp = (Vec<i32>, Vec<f32>, Vec<f32>, Vec<u8>);

/// `moe_gate_up_route_q8q_iq2_xxs` (with `pair`: `moe_gate_up_route2_q8q_iq2_xxs`, a warp's two
/// rows together) on one token: the top-`k` of the router `logits` (`n_expert` of them; the chosen
/// ids must be those of `set`'s experts, `0..k`) and the gate/up rows of each choice on the q8 row
/// `xq`.
pub fn moe_gate_up_route_q8q(
    gpu: &Gpu,
    pair: bool,
    set: &ExpertSet,
    logits: &[f32],
    xq: &[u8],
    (hidden, ff): (usize, usize),
) -> Result<RoutedGateUp, CudaError> {
    let k = set.gate.len();
    let ne = logits.len();
    if set.gate_up_ty != GgmlType::IQ2XXS
        || k == 0
        || k > 32
        || ne < k
        || ne > ROUTER_WARP_MAX_EXPERTS
        || xq.len() != q8_row_bytes(hidden)
        || !ff.is_multiple_of(32)
    {
        return Err(CudaError::Invalid("routed gate/up: sizes".into()));
    }
    let c = tab_call(gpu, set, &vec![0.0; k], (hidden, ff))?;
    let (l_d, x_d) = (upload(gpu, logits)?, upload(gpu, xq)?);
    let mut ids = alloc_poisoned::<i32>(gpu, k)?;
    let mut wts = alloc_poisoned::<f32>(gpu, k)?;
    let mut act = alloc_poisoned::<f32>(gpu, k * ff)?;
    let mut actq = alloc_poisoned::<u8>(gpu, k * q8_row_bytes(ff))?;
    let nei = i32_arg(ne, "experts")?;
    let name = if pair {
        "moe_gate_up_route2_q8q_iq2_xxs"
    } else {
        "moe_gate_up_route_q8q_iq2_xxs"
    };
    launch!(
        gpu,
        gpu.func(name)?,
        name,
        cfg(((ff / 32) as u32, k as u32, 1), q8q_threads(), 0),
        [
            &l_d, &nei, &c.tab, &mut ids, &mut wts, &x_d, &mut act, &mut actq, &c.ff, &c.hidden,
            &c.k, &0u64
        ]
    )?;
    Ok((
        download(gpu, &ids)?,
        download(gpu, &wts)?,
        download(gpu, &act)?,
        download(gpu, &actq)?,
    ))
}

/// What [`moe_route_down_q8_slots`] returns: `Σ weight · down(act)`, the activations `[k][ff]`
/// and their q8 rows.
pub type RoutedSlots = (Vec<f32>, Vec<f32>, Vec<u8>);

/// The routed experts of one token as the model runs them with every expert resident: the
/// experts' parts packed into slots of one buffer (the expert cache's layout, [`ExpertLayout`]),
/// a table pointing into them, then `moe_gate_up_route2_q8q_iq2_xxs` (top-`k` of `logits`) and
/// `moe_down_combine_tab_q8_iq2_xxs`, the parts found through the table (`dstride` 0) or at its
/// first entries + id · slot stride (`direct`). `parts[p][e]`: part p (gate, up, down) of expert
/// e, IQ2_XXS, `logits.len()` experts.
///
/// [`ExpertLayout`]: crate::expert_cache::ExpertLayout
pub fn moe_route_down_q8_slots(
    gpu: &Gpu,
    parts: [&[Vec<u8>]; 3],
    logits: &[f32],
    k: usize,
    xq: &[u8],
    (hidden, ff): (usize, usize),
    direct: bool,
) -> Result<RoutedSlots, CudaError> {
    let ne = logits.len();
    if parts.iter().any(|p| p.len() != ne)
        || k == 0
        || k > 32
        || ne < k
        || ne > ROUTER_WARP_MAX_EXPERTS
        || xq.len() != q8_row_bytes(hidden)
        || !ff.is_multiple_of(32)
    {
        return Err(CudaError::Invalid("routed experts in slots: sizes".into()));
    }
    let (_slots, tab, sb) = expert_slots(gpu, parts)?;
    let mut c = TabCall {
        tab,
        ids: alloc_poisoned::<i32>(gpu, k)?,
        weights: alloc_poisoned::<f32>(gpu, k)?,
        out: upload(gpu, &vec![0.0f32; hidden])?,
        shared: upload(gpu, &vec![0.0f32; hidden])?,
        gl: upload(gpu, &[0.0f32])?,
        ff: i32_arg(ff, "ff")?,
        hidden: i32_arg(hidden, "hidden")?,
        k: i32_arg(k, "k")?,
    };
    let (l_d, x_d) = (upload(gpu, logits)?, upload(gpu, xq)?);
    let mut act = alloc_poisoned::<f32>(gpu, k * ff)?;
    let mut actq = alloc_poisoned::<u8>(gpu, k * q8_row_bytes(ff))?;
    let nei = i32_arg(ne, "experts")?;
    let dstride = if direct { sb as u64 } else { 0 };
    let name = "moe_gate_up_route2_q8q_iq2_xxs";
    launch!(
        gpu,
        gpu.func(name)?,
        name,
        cfg(((ff / 32) as u32, k as u32, 1), q8q_threads(), 0),
        [
            &l_d,
            &nei,
            &c.tab,
            &mut c.ids,
            &mut c.weights,
            &x_d,
            &mut act,
            &mut actq,
            &c.ff,
            &c.hidden,
            &c.k,
            &dstride
        ]
    )?;
    down_q8_launch(gpu, &mut c, &actq, (hidden, 1), dstride)?;
    Ok((
        download(gpu, &c.out)?,
        download(gpu, &act)?,
        download(gpu, &actq)?,
    ))
}

/// The routed experts of `n` tokens (`ids` and `weights`: `[n][k]`, ids into `parts`' experts;
/// `xq`: the tokens' q8 rows) with every part IQ2_XXS, as a call of several tokens runs them:
/// `tiles = (0, 0)`: the one-token kernels on a grid of tokens (`moe_gate_up_tab_q8q_iq2_xxs`,
/// `moe_down_combine_tab_q8_iq2_xxs`); `(g, d)`: their token-tile forms
/// (`moe_gate_up_tok_q8q_iq2_xxs`, `moe_down_combine_tok_q8_iq2_xxs`) with g and d tokens a block.
/// The parts through the table, or (`direct`) at its first entries + id · slot stride. Returns
/// `(x + Σ weight · down, activations [n][k][ff], their q8 rows)` for `x` = the index pattern
/// written first (so that a missed row shows).
#[allow(clippy::too_many_arguments)]
pub fn moe_experts_q8_tokens(
    gpu: &Gpu,
    parts: [&[Vec<u8>]; 3],
    ids: &[i32],
    weights: &[f32],
    xq: &[u8],
    (hidden, ff): (usize, usize),
    tiles: (usize, usize),
    direct: bool,
) -> Result<RoutedSlots, CudaError> {
    let ne = parts[0].len();
    let n = xq.len() / q8_row_bytes(hidden).max(1);
    let k = ids.len().checked_div(n).unwrap_or(0);
    if parts.iter().any(|p| p.len() != ne)
        || n == 0
        || k == 0
        || ids.len() != n * k
        || weights.len() != n * k
        || xq.len() != n * q8_row_bytes(hidden)
        || ids.iter().any(|&i| i < 0 || i as usize >= ne)
        || !ff.is_multiple_of(32)
        || tiles.0 > crate::model::MOE_TOK_GU_MAX
        || tiles.1 > crate::model::MOE_TOK_DOWN_MAX
    {
        return Err(CudaError::Invalid(
            "routed experts of several tokens: sizes".into(),
        ));
    }
    let (_slots, tab, sb) = expert_slots(gpu, parts)?;
    let start: Vec<f32> = (0..n * hidden).map(|i| (i % 7) as f32 * 0.25).collect();
    let mut c = TabCall {
        tab,
        ids: upload(gpu, ids)?,
        weights: upload(gpu, weights)?,
        out: upload(gpu, &start)?,
        shared: upload(gpu, &vec![0.5f32; n * hidden])?,
        gl: upload(gpu, &vec![0.25f32; n])?,
        ff: i32_arg(ff, "ff")?,
        hidden: i32_arg(hidden, "hidden")?,
        k: i32_arg(k, "k")?,
    };
    let x_d = upload(gpu, xq)?;
    let mut act = alloc_poisoned::<f32>(gpu, n * k * ff)?;
    let mut actq = alloc_poisoned::<u8>(gpu, n * k * q8_row_bytes(ff))?;
    let dstride = if direct { sb as u64 } else { 0 };
    let ni = i32_arg(n, "tokens")?;
    if tiles.0 == 0 {
        let name = "moe_gate_up_tab_q8q_iq2_xxs";
        launch!(
            gpu,
            gpu.func(name)?,
            name,
            cfg(
                ((ff / 32) as u32, k as u32, n as u32),
                q8q_threads_for(n),
                0
            ),
            [&c.tab, &c.ids, &x_d, &mut act, &mut actq, &c.ff, &c.hidden, &c.k, &dstride]
        )?;
    } else {
        let name = "moe_gate_up_tok_q8q_iq2_xxs";
        let tile = i32_arg(tiles.0, "tile")?;
        launch!(
            gpu,
            gpu.func(name)?,
            name,
            cfg(
                ((ff / 32) as u32, k as u32, n.div_ceil(tiles.0) as u32),
                q8q_tok_threads(),
                0
            ),
            [
                &c.tab, &c.ids, &x_d, &mut act, &mut actq, &c.ff, &c.hidden, &c.k, &dstride, &ni,
                &tile
            ]
        )?;
    }
    // Two warps per row, as the model runs it.
    if tiles.1 == 0 {
        down_q8_launch(gpu, &mut c, &actq, (hidden, n), dstride)?;
    } else {
        let warps = crate::expert_cache::moe_warps();
        let grid_x = blocks(hidden * 2, warps);
        let name = "moe_down_combine_tok_q8_iq2_xxs";
        let tile = i32_arg(tiles.1, "tile")?;
        launch!(
            gpu,
            gpu.func(name)?,
            name,
            cfg((grid_x, n.div_ceil(tiles.1) as u32, 1), 32 * warps, 0),
            [
                &c.tab, &c.ids, &c.weights, &actq, &mut c.out, &c.shared, &c.gl, &c.hidden, &c.ff,
                &c.k, &dstride, &ni, &tile
            ]
        )?;
    }
    Ok((
        download(gpu, &c.out)?,
        download(gpu, &act)?,
        download(gpu, &actq)?,
    ))
}

/// Experts `parts[p][e]` (part p: gate, up, down) packed into the slots of one device buffer (the
/// expert cache's layout) and the table of their parts' addresses: `(slots, table, slot bytes)`.
fn expert_slots(
    gpu: &Gpu,
    parts: [&[Vec<u8>]; 3],
) -> Result<(CudaSlice<u8>, CudaSlice<u64>, usize), CudaError> {
    let ne = parts[0].len();
    let layout = crate::expert_cache::ExpertLayout::new(parts[0][0].len(), parts[2][0].len());
    let sb = layout.slot_bytes;
    let mut host = vec![0u8; ne * sb];
    for e in 0..ne {
        let slot = &mut host[e * sb..(e + 1) * sb];
        slot[..layout.gate_bytes].copy_from_slice(&parts[0][e]);
        slot[layout.up_off..layout.up_off + layout.gate_bytes].copy_from_slice(&parts[1][e]);
        slot[layout.down_off..layout.down_off + layout.down_bytes].copy_from_slice(&parts[2][e]);
    }
    let slots = upload(gpu, &host)?;
    let base = device_address(gpu, &slots);
    let offs = [0, layout.up_off as u64, layout.down_off as u64];
    let tab: Vec<u64> = (0..ne)
        .flat_map(|e| offs.map(|o| base + (e * sb) as u64 + o))
        .collect();
    Ok((slots, upload(gpu, &tab)?, sb))
}

/// What [`moe_route_gate_up_slots`] returns: the router's logits, the shared expert's gate
/// logit, the chosen ids and weights, the activations `[k][ff]` and their q8 rows.
pub type RouteGateUp = (Vec<f32>, Vec<f32>, Vec<i32>, Vec<f32>, Vec<f32>, Vec<u8>);

/// How [`moe_route_gate_up_slots`] launches the router and the routed gate/up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteForm {
    /// `matvec3_x_f32`, then `moe_gate_up_route2_q8q_iq2_xxs`.
    Separate,
    /// `moe_route_gate_up_q8q_iq2_xxs` (a grid barrier after the logits).
    Fused,
}

/// A one-token router and routed gate/up as the model runs them with every expert resident
/// (experts in slots, direct addresses): the f32 `router` `[ne][hidden]` and `gate_vec`
/// `[hidden]` on `xn` (the model's router split), the top-`k` of the logits, the gate/up rows on
/// `xq`, launched as `form` says.
#[allow(clippy::too_many_arguments)]
pub fn moe_route_gate_up_slots(
    gpu: &Gpu,
    parts: [&[Vec<u8>]; 3],
    router: &[f32],
    gate_vec: &[f32],
    (xn, xq): (&[f32], &[u8]),
    k: usize,
    (hidden, ff): (usize, usize),
    form: RouteForm,
) -> Result<RouteGateUp, CudaError> {
    let ne = parts[0].len();
    if parts.iter().any(|p| p.len() != ne)
        || k == 0
        || k > 32
        || ne < k
        || ne > ROUTER_WARP_MAX_EXPERTS
        || router.len() != ne * hidden
        || gate_vec.len() != hidden
        || xn.len() != hidden
        || xq.len() != q8_row_bytes(hidden)
        || !ff.is_multiple_of(32)
        || q8q_threads() != 512
    {
        return Err(CudaError::Invalid(
            "routed gate/up with its router: sizes".into(),
        ));
    }
    let (_slots, tab, sb) = expert_slots(gpu, parts)?;
    let bytes = |v: &[f32]| v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
    let (w0, w1) = (upload(gpu, &bytes(router))?, upload(gpu, &bytes(gate_vec))?);
    let (xn_d, xq_d) = (upload(gpu, xn)?, upload(gpu, xq)?);
    let mut rlog = alloc_poisoned::<f32>(gpu, ne)?;
    let mut gl = alloc_poisoned::<f32>(gpu, 1)?;
    let mut ids = alloc_poisoned::<i32>(gpu, k)?;
    let mut wts = alloc_poisoned::<f32>(gpu, k)?;
    let mut act = alloc_poisoned::<f32>(gpu, k * ff)?;
    let mut actq = alloc_poisoned::<u8>(gpu, k * q8_row_bytes(ff))?;
    let parts_n = crate::model::mvf_parts(GgmlType::F32, hidden, 1);
    let (ci, pi, nei, one) = (
        i32_arg(hidden, "hidden")?,
        i32_arg(parts_n, "parts")?,
        i32_arg(ne, "experts")?,
        1i32,
    );
    let (ffi, ki, dstride) = (i32_arg(ff, "ff")?, i32_arg(k, "k")?, sb as u64);
    if form != RouteForm::Separate {
        let (name, grid) = ("moe_route_gate_up_q8q_iq2_xxs", ((ff / 32) * k) as u32);
        let mut counter = upload(gpu, &[0u64])?;
        let f = gpu.func(name)?;
        let mut b = gpu.stream.launch_builder(f);
        b.arg(&xn_d)
            .arg(&ci)
            .arg(&pi)
            .arg(&w0)
            .arg(&mut rlog)
            .arg(&nei)
            .arg(&w1)
            .arg(&mut gl)
            .arg(&one)
            .arg(&nei)
            .arg(&tab)
            .arg(&mut ids)
            .arg(&mut wts)
            .arg(&xq_d)
            .arg(&mut act)
            .arg(&mut actq)
            .arg(&ffi)
            .arg(&ci)
            .arg(&ki)
            .arg(&dstride)
            .arg(&mut counter);
        drv(name, unsafe { b.launch(cfg((grid, 1, 1), 512, 0)) })?;
    } else {
        let split = MvfSplit {
            parts: parts_n,
            rows: 1,
        };
        let (p, zero, zi) = (split.arg(), 0u64, 0i32);
        let rows_grid = blocks(ne, split.rows_per_block()) + blocks(1, split.rows_per_block());
        launch!(
            gpu,
            gpu.func("matvec3_x_f32")?,
            "matvec3_x_f32",
            cfg((rows_grid, 1, 1), 256, 0),
            [&xn_d, &ci, &p, &w0, &mut rlog, &nei, &w1, &mut gl, &one, &zero, &zero, &zi]
        )?;
        launch!(
            gpu,
            gpu.func("moe_gate_up_route2_q8q_iq2_xxs")?,
            "moe_gate_up_route2_q8q_iq2_xxs",
            cfg(((ff / 32) as u32, k as u32, 1), 512, 0),
            [
                &rlog, &nei, &tab, &mut ids, &mut wts, &xq_d, &mut act, &mut actq, &ffi, &ci, &ki,
                &dstride
            ]
        )?;
    }
    Ok((
        download(gpu, &rlog)?,
        download(gpu, &gl)?,
        download(gpu, &ids)?,
        download(gpu, &wts)?,
        download(gpu, &act)?,
        download(gpu, &actq)?,
    ))
}

/// The routed experts of one token as the model runs them on a q8 row of `x` (`xq`,
/// [`q8_row`]): `moe_gate_up_tab_q8_iq2_xxs` (IQ2_XXS gate and up), then
/// `moe_down_combine_tab_<down type>`; returns `Σ weight · down(act)`.
pub fn moe_experts_q8(
    gpu: &Gpu,
    set: &ExpertSet,
    weights: &[f32],
    xq: &[u8],
    (hidden, ff): (usize, usize),
) -> Result<Vec<f32>, CudaError> {
    let k = weights.len();
    if set.gate_up_ty != GgmlType::IQ2XXS || set.gate.len() != k || xq.len() != q8_row_bytes(hidden)
    {
        return Err(CudaError::Invalid(
            "experts (q8): IQ2_XXS gate/up and one q8 row".into(),
        ));
    }
    experts_tab_run(
        gpu,
        set,
        weights,
        xq,
        "moe_gate_up_tab_q8_iq2_xxs",
        (hidden, ff),
    )
}

/// Router of `tokens` tokens: softmax, top-k, renormalised weights, ascending expert ids, by
/// the kernel `kernel` (see [`RouterKernel`]).
pub fn moe_router(
    gpu: &Gpu,
    kernel: RouterKernel,
    logits: &[f32],
    n_expert: usize,
    k: usize,
) -> Result<(Vec<i32>, Vec<f32>), CudaError> {
    if k == 0 || k > 64 || k > n_expert || !logits.len().is_multiple_of(n_expert) {
        return Err(CudaError::Invalid(format!(
            "router: k = {k} of {n_expert} experts, {} logits",
            logits.len()
        )));
    }
    let tokens = logits.len() / n_expert;
    let f = gpu.func(kernel.name)?;
    let l = upload(gpu, logits)?;
    let mut idx = alloc_poisoned::<i32>(gpu, tokens * k)?;
    let mut w = alloc_poisoned::<f32>(gpu, tokens * k)?;
    let (ne, kk) = (i32_arg(n_expert, "experts")?, i32_arg(k, "k")?);
    launch!(
        gpu,
        f,
        "moe_router",
        cfg((tokens as u32, 1, 1), kernel.threads, kernel.shared),
        [&l, &ne, &kk, &mut idx, &mut w]
    )?;
    Ok((download(gpu, &idx)?, download(gpu, &w)?))
}

/// Device addresses and types of the chosen experts' weights.
pub struct ExpertSet<'a> {
    pub gate_up_ty: GgmlType,
    pub down_ty: GgmlType,
    pub gate: Vec<&'a CudaSlice<u8>>,
    pub up: Vec<&'a CudaSlice<u8>>,
    pub down: Vec<&'a CudaSlice<u8>>,
}

/// `Σ_e weight_e · down_e(silu(gate_e·x) ⊙ up_e·x)` over the chosen experts, summed in order.
pub fn moe_experts(
    gpu: &Gpu,
    set: &ExpertSet,
    weights: &[f32],
    x: &[f32],
    ff: usize,
) -> Result<Vec<f32>, CudaError> {
    let k = weights.len();
    let hidden = x.len();
    if set.gate.len() != k || set.up.len() != k || set.down.len() != k || k == 0 {
        return Err(CudaError::Invalid(format!(
            "experts: {k} weights for {} experts",
            set.gate.len()
        )));
    }
    let ptrs =
        |v: &[&CudaSlice<u8>]| -> Vec<u64> { v.iter().map(|s| device_address(gpu, s)).collect() };
    let gate_p = upload(gpu, &ptrs(&set.gate))?;
    let up_p = upload(gpu, &ptrs(&set.up))?;
    let down_p = upload(gpu, &ptrs(&set.down))?;
    let x_d = upload(gpu, x)?;
    let w_d = upload(gpu, weights)?;
    let mut act = alloc_poisoned::<f32>(gpu, k * ff)?;
    let mut out = alloc_poisoned::<f32>(gpu, hidden)?;
    let (ffi, hi, ki) = (
        i32_arg(ff, "ff")?,
        i32_arg(hidden, "hidden")?,
        i32_arg(k, "k")?,
    );
    let gu = format!("moe_gate_up_{}", type_suffix(set.gate_up_ty));
    launch!(
        gpu,
        gpu.func(&gu)?,
        &gu,
        cfg(
            (blocks(ff, MATVEC_WARPS), k as u32, 1),
            32 * MATVEC_WARPS,
            0
        ),
        [&gate_p, &up_p, &x_d, &mut act, &ffi, &hi]
    )?;
    let dn = format!("moe_down_{}", type_suffix(set.down_ty));
    launch!(
        gpu,
        gpu.func(&dn)?,
        &dn,
        cfg((blocks(hidden, MATVEC_WARPS), 1, 1), 32 * MATVEC_WARPS, 0),
        [&down_p, &act, &w_d, &mut out, &hi, &ffi, &ki]
    )?;
    download(gpu, &out)
}

/// The same sum through the device-resident model's kernels (`moe_gate_up_tab_<type>`, then
/// `moe_down_combine_tab_<type>` with a zero residual, a zero shared expert and its gate 0):
/// the chosen experts as the entries 0..k of a per-layer table of part addresses, as the GPU
/// expert cache builds it; warps per block as the model runs them.
pub fn moe_experts_tab(
    gpu: &Gpu,
    set: &ExpertSet,
    weights: &[f32],
    x: &[f32],
    ff: usize,
) -> Result<Vec<f32>, CudaError> {
    let k = weights.len();
    let hidden = x.len();
    if set.gate.len() != k || set.up.len() != k || set.down.len() != k || k == 0 {
        return Err(CudaError::Invalid(format!(
            "experts (table): {k} weights for {} experts",
            set.gate.len()
        )));
    }
    let gu = format!("moe_gate_up_tab_{}", type_suffix(set.gate_up_ty));
    experts_tab_run(gpu, set, weights, x, &gu, (hidden, ff))
}

/// The gate/up kernel `gu` on the input `x` (f32 values or a q8 row), then
/// `moe_down_combine_tab_<down type>`: `Σ weight · down(act)` of one token.
fn experts_tab_run<T: cudarc::driver::DeviceRepr>(
    gpu: &Gpu,
    set: &ExpertSet,
    weights: &[f32],
    x: &[T],
    gu: &str,
    (hidden, ff): (usize, usize),
) -> Result<Vec<f32>, CudaError> {
    let k = weights.len();
    let mut c = tab_call(gpu, set, weights, (hidden, ff))?;
    let x_d = upload(gpu, x)?;
    let mut act = alloc_poisoned::<f32>(gpu, k * ff)?;
    let warps = crate::expert_cache::moe_warps();
    launch!(
        gpu,
        gpu.func(gu)?,
        gu,
        cfg((blocks(ff, warps), k as u32, 1), 32 * warps, 0),
        [&c.tab, &c.ids, &x_d, &mut act, &c.ff, &c.hidden, &c.k]
    )?;
    let dn = format!("moe_down_combine_tab_{}", type_suffix(set.down_ty));
    down_tab_launch(gpu, &dn, &mut c, &act, blocks(hidden, warps))?;
    download(gpu, &c.out)
}

/// Whole expert tensors (`n_exp` experts of type `ty`, one after another) for the id kernels.
pub struct ExpertTensors<'a> {
    pub ty: GgmlType,
    pub gate: &'a [u8],
    pub up: &'a [u8],
    pub down: &'a [u8],
    pub n_exp: usize,
}

/// The routed experts of `n` tokens with the choice as device data: `ids`, `weights` `[n][k]`,
/// `x [n][hidden]`; returns `[n][hidden]`.
#[allow(clippy::too_many_arguments)]
pub fn moe_experts_ids(
    gpu: &Gpu,
    t: &ExpertTensors,
    ids: &[i32],
    weights: &[f32],
    x: &[f32],
    hidden: usize,
    ff: usize,
    k: usize,
) -> Result<Vec<f32>, CudaError> {
    let n = check_rows(x.len(), hidden, "moe_experts_ids x")?;
    let gu_bytes = row_bytes(t.ty, hidden)? * ff;
    let dn_bytes = row_bytes(t.ty, ff)? * hidden;
    if ids.len() != n * k
        || weights.len() != n * k
        || t.gate.len() != t.n_exp * gu_bytes
        || t.up.len() != t.gate.len()
        || t.down.len() != t.n_exp * dn_bytes
        || ids.iter().any(|&i| i < 0 || i as usize >= t.n_exp)
    {
        return Err(CudaError::Invalid("moe_experts_ids: sizes or ids".into()));
    }
    let (gd, ud, dd) = (
        upload(gpu, t.gate)?,
        upload(gpu, t.up)?,
        upload(gpu, t.down)?,
    );
    let (idd, wd, xd) = (upload(gpu, ids)?, upload(gpu, weights)?, upload(gpu, x)?);
    let mut act = alloc_poisoned::<f32>(gpu, n * k * ff)?;
    let mut out = alloc_poisoned::<f32>(gpu, n * hidden)?;
    let (ffi, hi, ki) = (
        i32_arg(ff, "ff")?,
        i32_arg(hidden, "hidden")?,
        i32_arg(k, "k")?,
    );
    let (gus, dns) = (gu_bytes as u64, dn_bytes as u64);
    let gu = format!("moe_gate_up_ids_{}", type_suffix(t.ty));
    launch!(
        gpu,
        gpu.func(&gu)?,
        &gu,
        cfg(
            (blocks(ff, MATVEC_WARPS), k as u32, n as u32),
            32 * MATVEC_WARPS,
            0
        ),
        [&gd, &ud, &gus, &idd, &xd, &mut act, &ffi, &hi, &ki]
    )?;
    let dn = format!("moe_down_ids_{}", type_suffix(t.ty));
    launch!(
        gpu,
        gpu.func(&dn)?,
        &dn,
        cfg(
            (blocks(hidden, MATVEC_WARPS), n as u32, 1),
            32 * MATVEC_WARPS,
            0
        ),
        [&dd, &dns, &idd, &wd, &act, &mut out, &hi, &ffi, &ki]
    )?;
    download(gpu, &out)
}

/// `x + routed + sigmoid(gate_logit[t]) · shared` per token (`[n][hidden]`, `gate_logit [n]`).
pub fn moe_combine(
    gpu: &Gpu,
    x: &[f32],
    routed: &[f32],
    shared: &[f32],
    gate_logit: &[f32],
) -> Result<Vec<f32>, CudaError> {
    let n = gate_logit.len();
    let hidden = check_rows(x.len(), n.max(1), "moe_combine")?;
    if routed.len() != x.len() || shared.len() != x.len() || n == 0 {
        return Err(CudaError::Invalid("moe_combine: sizes".into()));
    }
    let mut xd = upload(gpu, x)?;
    let (rd, sd, gd) = (
        upload(gpu, routed)?,
        upload(gpu, shared)?,
        upload(gpu, gate_logit)?,
    );
    let hi = i32_arg(hidden, "hidden")?;
    launch!(
        gpu,
        gpu.func("moe_combine")?,
        "moe_combine",
        cfg((blocks(hidden, 256), n as u32, 1), 256, 0),
        [&mut xd, &rd, &sd, &gd, &hi]
    )?;
    download(gpu, &xd)
}
