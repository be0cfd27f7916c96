//! The CUDA C kernel sources, one file per family, and how they are put together.
//!
//! Every family is compiled as one translation unit after the files it builds on (`common.cu`
//! first; `dequant.cu` for anything that decodes quant blocks). At run time all families go into
//! one module ([`module_source`]); the NVRTC test also compiles each family on its own
//! ([`family_source`]) so a broken file is named by the failure.

use redlite_gguf::GgmlType;

/// `(file name, source)` of every kernel file, in concatenation order.
pub const SOURCES: &[(&str, &str)] = &[
    ("common.cu", include_str!("../kernels/common.cu")),
    ("dequant.cu", include_str!("../kernels/dequant.cu")),
    ("matvec.cu", include_str!("../kernels/matvec.cu")),
    ("moe.cu", include_str!("../kernels/moe.cu")),
    ("gemm.cu", include_str!("../kernels/gemm.cu")),
    ("norm.cu", include_str!("../kernels/norm.cu")),
    ("rope.cu", include_str!("../kernels/rope.cu")),
    ("deltanet.cu", include_str!("../kernels/deltanet.cu")),
    ("attention.cu", include_str!("../kernels/attention.cu")),
    ("sampling.cu", include_str!("../kernels/sampling.cu")),
];

/// The files each family needs before it (besides itself).
fn prerequisites(file: &str) -> &'static [&'static str] {
    match file {
        "common.cu" => &[],
        "dequant.cu" => &["common.cu"],
        "matvec.cu" => &["common.cu", "dequant.cu"],
        "moe.cu" => &["common.cu", "dequant.cu", "matvec.cu"],
        "gemm.cu" => &["common.cu", "dequant.cu", "matvec.cu"],
        "attention.cu" => &["common.cu", "rope.cu"],
        _ => &["common.cu"],
    }
}

fn source_of(file: &str) -> Option<&'static str> {
    SOURCES.iter().find(|(n, _)| *n == file).map(|(_, s)| *s)
}

fn append(out: &mut String, file: &str, src: &str) {
    // `#line` keeps NVRTC's messages pointing at the right file and line.
    out.push_str(&format!("#line 1 \"{file}\"\n"));
    out.push_str(src);
    out.push('\n');
}

/// All kernel files as one translation unit: what the backend loads.
pub fn module_source() -> String {
    let mut out = String::new();
    for (name, src) in SOURCES {
        append(&mut out, name, src);
    }
    out
}

/// One family with the files it builds on, or `None` for an unknown file name.
pub fn family_source(file: &str) -> Option<String> {
    let own = source_of(file)?;
    let mut out = String::new();
    for pre in prerequisites(file) {
        append(&mut out, pre, source_of(pre)?);
    }
    append(&mut out, file, own);
    Some(out)
}

/// Every ggml type has a kernel of each per-type family.
pub const ALL_TYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q8_0,
    GgmlType::IQ4NL,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Q8K,
    GgmlType::IQ4XS,
    GgmlType::IQ3XXS,
    GgmlType::IQ3S,
    GgmlType::IQ2XXS,
    GgmlType::IQ2XS,
    GgmlType::IQ2S,
    GgmlType::IQ1S,
    GgmlType::IQ1M,
];

/// The suffix of a type's kernels: ggml's name in lower case (`q4_k`, `iq2_xxs`).
pub fn type_suffix(ty: GgmlType) -> String {
    ty.name().to_ascii_lowercase()
}

/// The per-type kernel families (prefixes).
pub const PER_TYPE_KERNELS: &[&str] = &[
    "matvec",
    "embed",
    "embed_cat2",
    "moe_gate_up",
    "moe_down",
    "moe_gate_up_ids",
    "moe_down_ids",
    "matvec_norm3",
    "matvec_norm3_tok",
    "matvec_res",
    "matvec_res_tok",
    "moe_gate_up_tab",
    "moe_down_combine_tab",
    "gemm",
    "moe_gemm",
    "dequant_f16",
];

/// The kernels that do not depend on a weight type.
pub const PLAIN_KERNELS: &[&str] = &[
    "read_sum",
    "read_sum8",
    "read_rows",
    "moe_router",
    "moe_router_warp",
    "noop_pdl",
    "rms_norm",
    "rms_norm_gated",
    "dn_restore",
    "l2_normalize",
    "add_inplace",
    "sigmoid_mul",
    "swiglu",
    "rope_neox",
    "dn_conv_step",
    "dn_gates",
    "dn_delta_step",
    "attn_decode",
    "argmax",
    "argmax_chain",
    // The device-resident model's multi-token kernels.
    "dn_conv_seq",
    "dn_qk_norm",
    "dn_delta_seq",
    "attn_qk_prep",
    "attn_causal",
    "dn_fused_seq",
    "dn_fused_cols",
    "dn_fused_cols_rows",
    "attn_split",
    "attn_split_gqa",
    "attn_split_gqa4",
    "attn_split_gqa4x",
    "attn_merge",
    "rope_table",
    "moe_combine",
    "sample_topk",
    "moe_group",
    "gemm_f32_simt",
    "matvec_norm3_q8_q4_k",
    "matvec_norm3_tok_q8_q4_k",
    "matvec_res_q8_q4_k",
    "matvec_q8x_q4_k",
    "matvec_q8x_q6_k",
    "matvec_q8x_tok_q4_k",
    "matvec_q8x_tok_q6_k",
    "matvec_q8x_mma_q4_k",
    "matvec_norm3_q8_q6_k",
    "matvec_norm3_tok_q8_q6_k",
    "swiglu_q8",
    "rms_norm_q8",
    "matvec3_x_f32",
    "matvec3_x_tok_f32",
    "res_norm_q8",
    "res_norm_router",
    "moe_gate_up_tab_q8_iq2_xxs",
    "moe_gate_up_tab_q8q_iq2_xxs",
    "moe_gate_up_route_q8q_iq2_xxs",
    "moe_gate_up_route2_q8q_iq2_xxs",
    "moe_route_gate_up_q8q_iq2_xxs",
    "moe_down_combine_tab_q8_iq2_xxs",
    "moe_gate_up_tok_q8q_iq2_xxs",
    "moe_down_combine_tok_q8_iq2_xxs",
    "matvec_res_tok2_q4_k",
    "matvec_res_xr_q4_k",
    "matvec_q8x_xr_q6_k",
    "attn_prompt",
    "attn_prompt_mma_64",
    "attn_prompt_mma_128",
    "attn_prompt_mma_256",
    // The attention kernels on an f16 KV cache.
    "attn_qk_prep_h",
    "attn_causal_h",
    "attn_prompt_h",
    "attn_prompt_mma_64_h",
    "attn_prompt_mma_128_h",
    "attn_prompt_mma_256_h",
    "attn_split_h",
    "attn_split_gqa_h",
    "attn_split_gqa4_h",
    "attn_split_gqa4x_h",
    "attn_split_gqa8x_h",
    "attn_split_gqa4xp_h",
    "attn_split_gqa8xh3_h",
    "attn_split_mma_h",
    "dn_conv_prompt",
    "dn_conv_shift",
    "swiglu_pairs",
    "moe_combine_pairs",
    "f32_to_f16",
    "dn_delta_warp_64",
    "dn_delta_warp_128",
];

/// The name of every kernel entry point in the module.
pub fn kernel_names() -> Vec<String> {
    let mut names: Vec<String> = PLAIN_KERNELS.iter().map(|s| s.to_string()).collect();
    for prefix in PER_TYPE_KERNELS {
        for &ty in ALL_TYPES {
            names.push(format!("{prefix}_{}", type_suffix(ty)));
        }
    }
    names
}

/// The `__device__` tables the host fills after loading: `(symbol, little-endian bytes)`, straight
/// from `redlite_gguf::quant::grids`.
pub fn grid_tables() -> Vec<(&'static str, Vec<u8>)> {
    use redlite_gguf::quant::grids::*;
    fn bytes64(v: &[u64]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }
    fn bytes32(v: &[u32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }
    vec![
        ("g_iq2xxs_grid", bytes64(&IQ2XXS_GRID)),
        ("g_iq2xs_grid", bytes64(&IQ2XS_GRID)),
        ("g_iq2s_grid", bytes64(&IQ2S_GRID)),
        ("g_iq3xxs_grid", bytes32(&IQ3XXS_GRID)),
        ("g_iq3s_grid", bytes32(&IQ3S_GRID)),
        ("g_iq1s_grid", bytes64(&IQ1S_GRID)),
        ("g_ksigns_iq2xs", KSIGNS_IQ2XS.to_vec()),
        (
            "g_kvalues_iq4nl",
            KVALUES_IQ4NL.iter().map(|&v| v as u8).collect(),
        ),
    ]
}

/// The kernels' run-time switches (`__constant__` ints set after the module loads), from the
/// environment: `g_knob_pre` = `REDLITE_CUDA_PRE_WEIGHTS` (default 1; 0 turns the small weight
/// prefetches into L1 before the wait off), `g_knob_topk` = `REDLITE_CUDA_TOPK_REDUX` (default 1;
/// 0: the router's top-k rounds through a shuffle butterfly, the same choices), `g_knob_sync` =
/// `REDLITE_CUDA_SYNC_RELEASE` (default 1: `grid_sync` arrives with a release atomic and no
/// sequentially consistent fences; 0: `__threadfence` on both sides),
/// `g_knob_soft` = `REDLITE_CUDA_SOFTMAX_FLAT` (default 1: the router's exps and divisions
/// without a branch per slot, the same values; 0: the branchy form), `g_knob_tkl` =
/// `REDLITE_CUDA_TOPK_LOGITS` (default 1: the router's top-k chosen on the logits and the
/// weights as exp(l - max) over the chosen only, without the softmax over every expert: the same
/// choices except where the softmax rounds two different logits to one probability, weights
/// within a few ulps; 0: the softmax, then the top-k of the probabilities).
///
/// The kernels read these as their defaults unless they are built with
/// `REDLITE_CUDA_DEFINES=KNOBS_FIXED=0` (common.cu's `KNOBS_FIXED`, default 1 since session 33:
/// the other forms' code compiled out); a knob set otherwise is reported once, with no effect.
pub fn knobs() -> Vec<(&'static str, Vec<u8>)> {
    // (symbol, environment variable, default)
    const KNOBS: [(&str, &str, bool); 5] = [
        ("g_knob_pre", "REDLITE_CUDA_PRE_WEIGHTS", true),
        ("g_knob_topk", "REDLITE_CUDA_TOPK_REDUX", true),
        ("g_knob_sync", "REDLITE_CUDA_SYNC_RELEASE", true),
        ("g_knob_soft", "REDLITE_CUDA_SOFTMAX_FLAT", true),
        ("g_knob_tkl", "REDLITE_CUDA_TOPK_LOGITS", true),
    ];
    KNOBS
        .iter()
        .map(|&(symbol, var, default)| {
            let on = std::env::var(var).map_or(default, |v| v != "0");
            if on != default && !define_values("KNOBS_FIXED").iter().any(|v| v == "0") {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    eprintln!(
                        "warning: {var} has no effect: the kernels read their run-time knobs as \
                         the defaults unless REDLITE_CUDA_DEFINES has KNOBS_FIXED=0"
                    )
                });
            }
            (symbol, (on as i32).to_le_bytes().to_vec())
        })
        .collect()
}

/// `REDLITE_CUDA_DEFINES` as (name, value) pairs, in order (see [`parse_defines`]).
pub fn env_defines() -> Vec<(String, String)> {
    parse_defines(&std::env::var("REDLITE_CUDA_DEFINES").unwrap_or_default())
}

/// `NAME=VALUE` entries separated by `,` or `;` (`bench/gpu_ab.sh` splits a configuration's
/// variables at commas, so a configuration with several defines writes `A=1;B=2`); a bare name
/// is 1; blanks around names and values are dropped, empty entries skipped.
pub fn parse_defines(defs: &str) -> Vec<(String, String)> {
    defs.split([',', ';'])
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| {
            let (name, value) = d.split_once('=').unwrap_or((d, "1"));
            (name.trim().to_string(), value.trim().to_string())
        })
        .collect()
}

/// The values `REDLITE_CUDA_DEFINES` gives `name` (a bare name is 1), in order.
fn define_values(name: &str) -> Vec<String> {
    env_defines()
        .into_iter()
        .filter_map(|(n, v)| (n == name).then_some(v))
        .collect()
}

/// Whether `REDLITE_CUDA_DEFINES` defines `name` to something other than 0 (a bare name is 1).
pub fn define_on(name: &str) -> bool {
    define_values(name).iter().any(|v| v != "0")
}

/// Whether the kernels are built with their phase stamps (`REDLITE_CUDA_DEFINES` names
/// `REDLITE_TRACE`): they add their phases' clock cycles to `g_trace` (read back with
/// `Gpu::trace`).
pub fn trace_on() -> bool {
    define_on("REDLITE_TRACE")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The entry points a kernel source defines by name (`extern "C" __global__ [bounds] void
    /// NAME(`), skipping the macro-made ones (`NAME` with `##`: the per-type families).
    fn defined_entry_points(src: &str) -> Vec<String> {
        const MARK: &str = "extern \"C\" __global__";
        let mut names = Vec::new();
        for (at, _) in src.match_indices(MARK) {
            let mut rest = src[at + MARK.len()..].trim_start();
            loop {
                if let Some(r) = rest.strip_prefix("void") {
                    rest = r.trim_start();
                } else if let Some((_, r)) = rest
                    .strip_prefix("__launch_bounds__")
                    .and_then(|r| r.split_once(')'))
                {
                    // The bounds' arguments (no parentheses inside them in these sources).
                    rest = r.trim_start();
                } else {
                    break;
                }
            }
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '#')
                .collect();
            if !name.is_empty() && !name.contains('#') {
                names.push(name);
            }
        }
        names
    }

    /// Every kernel a source file defines by name is in [`kernel_names`], the list the module is
    /// loaded by: a kernel left out compiles but is missing at run time ("no kernel named …"),
    /// which only a GPU run would show (session 51 lost a device run to it).
    #[test]
    fn every_defined_kernel_is_loaded() {
        let listed = kernel_names();
        let mut count = 0;
        for (file, src) in SOURCES {
            for name in defined_entry_points(src) {
                count += 1;
                assert!(
                    listed.contains(&name),
                    "{file} defines kernel {name}, missing from kernels.rs's lists"
                );
            }
        }
        assert!(
            count >= 80,
            "only {count} kernels found by name: the parser is off"
        );
    }

    #[test]
    fn defines_split_at_commas_and_semicolons() {
        let p = |s: &str| parse_defines(s);
        assert_eq!(
            p("A=1, B ;C = x;;"),
            vec![
                ("A".to_string(), "1".to_string()),
                ("B".to_string(), "1".to_string()),
                ("C".to_string(), "x".to_string())
            ]
        );
        assert!(p("").is_empty());
    }

    /// moe.cu's `iq2_negmask_alu` (the IQ2_XXS sign masks computed): the same arithmetic in u32
    /// gives, for every 7-bit code, the mask of the `ksigns_iq2xs` table (0xFF in byte j where
    /// bit j of the sign byte is set).
    #[test]
    fn iq2_sign_mask_formula_matches_the_ksigns_table() {
        for code in 0u32..128 {
            let sg = code | ((code.count_ones() & 1) << 7);
            let spread =
                |n: u32| (((n.wrapping_mul(0x1020_4080)) & 0x8080_8080) >> 7).wrapping_mul(255);
            let alu = ((spread(sg >> 4) as u64) << 32) | spread(sg & 15) as u64;
            let table = redlite_gguf::quant::grids::KSIGNS_IQ2XS[code as usize];
            let want = (0..8).fold(0u64, |m, j| {
                m | if (table >> j) & 1 == 1 {
                    0xFFu64 << (8 * j)
                } else {
                    0
                }
            });
            assert_eq!(alu, want, "code {code}");
        }
    }

    /// `prmt_sign_bytes` (PRMT with selector 0xBA98): byte j is 0xFF where the top bit of x's
    /// byte j is set, else 0.
    fn replicate(x: u32) -> u32 {
        (0..4).fold(0u32, |r, j| {
            r | (((x >> (8 * j + 7)) & 1) * (0xFF << (8 * j)))
        })
    }

    /// moe.cu's `iq2_signed_bytes` (`IQ2_SIGNED_DP4A`): the multiply, PRMT's sign-replicating
    /// selectors and `(g ^ m) + (m & 0x01010101)` give every grid word with each byte negated
    /// where the `ksigns_iq2xs` sign byte says, for all 256 entries and 128 sign codes.
    #[test]
    fn iq2_signed_grid_bytes_match_the_tables() {
        let signed = |g: u32, n: u32| {
            let m = replicate(n.wrapping_mul(0x1020_4080));
            (g ^ m).wrapping_add(m & 0x0101_0101)
        };
        for code in 0u32..128 {
            let sg = code | ((code.count_ones() & 1) << 7);
            let table = redlite_gguf::quant::grids::KSIGNS_IQ2XS[code as usize];
            for &g in redlite_gguf::quant::grids::IQ2XXS_GRID.iter() {
                let got = [signed(g as u32, sg & 15), signed((g >> 32) as u32, sg >> 4)];
                for j in 0..8 {
                    let byte = ((got[j / 4] >> (8 * (j % 4))) & 0xFF) as u8 as i8;
                    let mag = ((g >> (8 * j)) & 0xFF) as i8;
                    let want = if (table >> j) & 1 == 1 { -mag } else { mag };
                    assert_eq!(byte, want, "code {code}, grid {g:#018x}, byte {j}");
                }
            }
        }
    }

    /// moe.cu's `IQ2_NEGSUM` form: the masks `prmt((code & 15) · 0x10204080)` and
    /// `prmt((code >> 4) · 0x10204080 + popc(code) << 31)` give, byte by byte, (g ^ m) - m equal to
    /// the grid byte negated where the `ksigns_iq2xs` sign byte says (so dp4a(g ^ m, q) -
    /// dp4a(m, q) is Σ s g q exactly), for all 256 entries and 128 sign codes.
    #[test]
    fn iq2_negsum_masks_give_the_signed_grid() {
        for code in 0u32..128 {
            let mlo = replicate((code & 15).wrapping_mul(0x1020_4080));
            let mhi = replicate(
                (code >> 4)
                    .wrapping_mul(0x1020_4080)
                    .wrapping_add(code.count_ones() << 31),
            );
            let table = redlite_gguf::quant::grids::KSIGNS_IQ2XS[code as usize];
            for &g in redlite_gguf::quant::grids::IQ2XXS_GRID.iter() {
                let halves = [(g as u32, mlo), ((g >> 32) as u32, mhi)];
                for j in 0..8 {
                    let (h, m) = halves[j / 4];
                    let byte = |w: u32| ((w >> (8 * (j % 4))) & 0xFF) as u8 as i8 as i32;
                    let got = byte(h ^ m) - byte(m);
                    let mag = ((g >> (8 * j)) & 0xFF) as i32;
                    let want = if (table >> j) & 1 == 1 { -mag } else { mag };
                    assert_eq!(got, want, "code {code}, grid {g:#018x}, byte {j}");
                }
            }
        }
    }

    #[test]
    fn every_per_type_kernel_is_instantiated_in_the_source() {
        let src = module_source();
        // The X-macro list must name every type the backend dispatches to.
        for &ty in ALL_TYPES {
            let needle = format!("X({}, ", type_suffix(ty));
            assert!(src.contains(&needle), "FOR_EACH_TYPE lacks {}", ty.name());
        }
        for k in PLAIN_KERNELS {
            assert!(
                src.contains(&format!("void {k}(")),
                "kernel {k} missing from the sources"
            );
        }
        assert_eq!(ALL_TYPES.len(), redlite_gguf::TYPE_TRAITS.len());
    }

    /// The reverse of the check above: every `__global__` entry point the sources define (plain,
    /// or `<prefix>_##name` inside a per-type macro) is listed, so the loader resolves it.
    #[test]
    fn every_kernel_in_the_sources_is_listed() {
        let src = module_source();
        let names = kernel_names();
        for part in src.split("__global__").skip(1) {
            // `void NAME(` possibly after `__launch_bounds__(...)` and line continuations.
            let Some(at) = part.find("void ") else {
                continue;
            };
            let mut rest = part[at + 5..].trim_start_matches(['\\', ' ', '\n']);
            if let Some(bounds) = rest.strip_prefix("__launch_bounds__(") {
                rest = bounds[bounds.find(')').map_or(0, |i| i + 1)..]
                    .trim_start_matches(['\\', ' ', '\n']);
            }
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '#')
                .collect();
            match name.strip_suffix("_##name") {
                Some(prefix) => assert!(
                    PER_TYPE_KERNELS.contains(&prefix),
                    "per-type kernel family {prefix} is not in PER_TYPE_KERNELS"
                ),
                None => assert!(
                    names.contains(&name),
                    "kernel {name} is not in PLAIN_KERNELS"
                ),
            }
        }
    }

    /// The braced body that follows `from` (the first `{` after the parameter list that starts
    /// at the first `(`), or `None` if the braces do not close.
    fn braced_body(from: &str) -> Option<&str> {
        let open_paren = from.find('(')?;
        let mut depth = 0usize;
        let mut close_paren = None;
        for (i, c) in from[open_paren..].char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        close_paren = Some(open_paren + i);
                        break;
                    }
                }
                _ => {}
            }
        }
        let start = close_paren? + from[close_paren?..].find('{')?;
        let mut depth = 0usize;
        for (i, c) in from[start..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some(&from[start..start + i + 1]);
                    }
                }
                _ => {}
            }
        }
        None
    }

    /// Programmatic dependent launch is only safe if every kernel waits for the grid before it
    /// (`pdl_enter()`, common.cu) before touching activations: each `__global__` body calls it,
    /// directly or through the `*_body` function it forwards to.
    #[test]
    fn every_kernel_reaches_pdl_enter() {
        let src = module_source();
        let body_of = |name: &str| {
            let at = src.find(&format!("void {name}("))?;
            braced_body(&src[at..])
        };
        let mut kernels = 0;
        for (at, _) in src.match_indices("__global__") {
            let body = braced_body(&src[at..]).expect("a kernel body");
            let head: String = src[at..].chars().take(120).collect();
            let reaches = body.contains("pdl_enter();")
                || body
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .filter(|w| w.ends_with("_body"))
                    .any(|f| body_of(f).is_some_and(|b| b.contains("pdl_enter();")));
            assert!(reaches, "kernel without pdl_enter(): {head}");
            kernels += 1;
        }
        assert!(kernels > 40, "only {kernels} kernels found");
    }

    #[test]
    fn families_resolve() {
        for (name, _) in SOURCES {
            let src = family_source(name).expect("known family");
            assert!(src.starts_with("#line 1 \"common.cu\""));
        }
        assert!(family_source("nope.cu").is_none());
    }

    #[test]
    fn every_knob_is_a_constant_int_of_the_source() {
        let src = module_source();
        for (name, bytes) in knobs() {
            assert_eq!(bytes.len(), 4, "{name}");
            assert!(
                src.contains(&format!("__constant__ int {name};")),
                "knob {name} is not declared"
            );
        }
    }

    #[test]
    fn grid_tables_have_the_declared_sizes() {
        let sizes: Vec<(&str, usize)> = grid_tables().iter().map(|(n, b)| (*n, b.len())).collect();
        assert_eq!(
            sizes,
            vec![
                ("g_iq2xxs_grid", 256 * 8),
                ("g_iq2xs_grid", 512 * 8),
                ("g_iq2s_grid", 1024 * 8),
                ("g_iq3xxs_grid", 256 * 4),
                ("g_iq3s_grid", 512 * 4),
                ("g_iq1s_grid", 2048 * 8),
                ("g_ksigns_iq2xs", 128),
                ("g_kvalues_iq4nl", 16),
            ]
        );
    }
}
