//! The memory planner: from a memory budget (`--memory`, RAM for the CPU backend, GPU memory for
//! CUDA) and a context length, decide what is resident and how large the expert cache is.
//!
//! Everything but the routed experts must fit: the dense weights (mixers, routers, shared experts,
//! norms), the head, the embedding table (CPU only; CUDA looks rows up on the host), the KV cache
//! for `ctx` positions, the recurrent state, scratch and a runtime reserve. What remains becomes
//! the expert cache, counted in whole experts (one expert of one layer: its gate, up and down
//! slabs). When the remainder holds every expert, every expert is resident (the unbounded cache);
//! when it cannot hold one expert per layer, the plan is refused with the numbers that do not fit.

use std::fmt;

use redlite_expert_cache::{slot_bytes, PARTS};
use redlite_gguf::TensorInfo;
use redlite_model::layout::Layout;
use redlite_model::sizing::ModelSizes;
use redlite_model::{Config, KvType, LayerKind, ModelError};

/// A byte budget: a number of bytes, or the smallest budget that runs at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    Bytes(u64),
    Min,
}

impl Budget {
    /// Parses `16GiB`, `512MiB`, `1.5GB`, `4096` (bytes), `min`. Binary (`KiB`, `MiB`, `GiB`,
    /// `TiB`, also `K`, `M`, `G`, `T`) and decimal (`KB`, `MB`, `GB`, `TB`) suffixes.
    pub fn parse(s: &str) -> Result<Budget, String> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("min") {
            return Ok(Budget::Min);
        }
        parse_bytes(t).map(Budget::Bytes)
    }
}

impl fmt::Display for Budget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Budget::Bytes(b) => write!(f, "{}", human(*b)),
            Budget::Min => write!(f, "min"),
        }
    }
}

/// Bytes from `16GiB`, `512MiB`, `1.5GB`, `4096`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (examples: 16GiB, 512MiB, 4096, min)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => {
            return Err(format!(
                "'{s}': unknown unit '{other}' (use KiB, MiB, GiB, GB…)"
            ))
        }
    };
    let bytes = value * mult;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("'{s}' is out of range"));
    }
    Ok(bytes.round() as u64)
}

/// `1.50 GiB`-style rendering.
pub fn human(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", units[u])
    }
}

/// Which memory the budget is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Host RAM (the CPU backend): the embedding table is resident too.
    Cpu,
    /// GPU memory (the CUDA backend; `redlite_cuda::CudaModel` keeps the embedding table on the
    /// device too).
    Cuda,
}

impl Target {
    pub fn parse(s: &str) -> Result<Target, String> {
        match s {
            "cpu" => Ok(Target::Cpu),
            "cuda" => Ok(Target::Cuda),
            other => Err(format!(
                "unknown backend '{other}' for a plan (cpu or cuda)"
            )),
        }
    }

    /// Memory the runtime takes besides the model: binary, tokenizer, thread stacks (CPU); CUDA
    /// context, module image and the captured decode graph (CUDA: 753 MiB on an H200 with the
    /// full-size layout, cuMemGetInfo minus the model's allocations).
    pub fn reserve_bytes(self) -> u64 {
        match self {
            Target::Cpu => 64 << 20,
            Target::Cuda => 768 << 20,
        }
    }
}

/// What the planner needs to know about a model: its sizes and shape.
#[derive(Debug, Clone)]
pub struct PlanInput {
    pub sizes: ModelSizes,
    pub config: Config,
    /// The largest gate, up and down slab of one expert of any block (what sizes a cache slot).
    pub expert_parts: [u64; PARTS],
}

impl PlanInput {
    /// From an open model file.
    pub fn from_file(file: &redlite_gguf::GgufFile) -> Result<PlanInput, ModelError> {
        let config = Config::from_gguf(file)?;
        let sizes = ModelSizes::new(file, &config)?;
        let expert_parts = largest_expert_parts(file.tensors(), config.n_experts);
        Ok(PlanInput {
            sizes,
            config,
            expert_parts,
        })
    }

    /// From a layout, without a file (for example the full-size 80B layout).
    pub fn from_layout(layout: &Layout) -> Result<PlanInput, ModelError> {
        let config = config_of_layout(layout);
        let tensors: Vec<TensorInfo> = layout
            .tensors
            .iter()
            .map(|t| TensorInfo {
                name: t.name.clone(),
                dims: t.dims.clone(),
                ty: t.ty,
                offset: 0,
                n_elements: t.n_elems(),
                n_bytes: t.n_bytes(),
            })
            .collect();
        let sizes = ModelSizes::from_tensors(&tensors, &config)?;
        let expert_parts = largest_expert_parts(&tensors, config.n_experts);
        Ok(PlanInput {
            sizes,
            config,
            expert_parts,
        })
    }

    /// Blocks that hold routed experts (trunk layers plus the MTP block when stored).
    pub fn expert_layers(&self) -> usize {
        self.sizes.layers.len() + self.sizes.mtp.len()
    }

    /// Bytes of the largest expert of any block.
    pub fn expert_bytes(&self) -> u64 {
        self.sizes
            .layers
            .iter()
            .chain(&self.sizes.mtp)
            .map(|l| l.expert_slab_bytes)
            .max()
            .unwrap_or(0)
    }

    /// Bytes of one expert-cache slot (uniform): the largest parts plus the `O_DIRECT` alignment
    /// slack, exactly what the cache allocates per slot.
    pub fn slot_bytes(&self) -> u64 {
        slot_bytes(self.expert_parts)
    }

    /// Bytes of one GPU expert slot: the largest parts, each rounded up to 256 bytes (what
    /// `redlite_cuda::expert_cache::ExpertLayout` allocates; no file I/O into it).
    pub fn gpu_slot_bytes(&self) -> u64 {
        self.expert_parts
            .iter()
            .map(|p| p.next_multiple_of(256))
            .sum()
    }

    /// The slot size of `target`'s expert cache.
    pub fn slot_bytes_for(&self, target: Target) -> u64 {
        match target {
            Target::Cpu => self.slot_bytes(),
            Target::Cuda => self.gpu_slot_bytes(),
        }
    }

    /// Bytes of every routed expert of every block.
    pub fn all_expert_bytes(&self) -> u64 {
        self.sizes.file.expert_bytes
    }

    /// KV-cache bytes per position with `kv` entries, trunk and MTP attention.
    pub fn kv_bytes_per_position(&self, kv: KvType) -> u64 {
        self.sizes.kv_bytes_per_position(kv) + self.sizes.mtp_kv_bytes_per_position(kv)
    }

    /// Activation scratch of one forward pass of `ubatch` tokens with `ctx` positions of attention:
    /// the hidden rows and their normed copies, the widest projection outputs (DeltaNet conv
    /// channels and gate, attention q+gate), the router logits and the expert intermediates, the
    /// attention scores of one head per token, the logits of the last token, and RoPE's
    /// {cos, sin} table of every position (the CUDA backend's `rope_table`).
    pub fn scratch_bytes(&self, ctx: u64, ubatch: u64) -> u64 {
        let c = &self.config;
        let per_token = 8 * c.hidden
            + 2 * c.dn_conv_channels()
            + 2 * c.dn_value_width()
            + 2 * c.n_heads * c.head_dim
            + c.n_experts
            + 3 * c.n_experts_used * c.expert_ff
            + 3 * c.shared_ff;
        let values = ubatch * per_token as u64
            + ubatch * ctx
            + c.vocab as u64
            + ctx * (c.rope_dims / 2 * 2) as u64;
        values * 4
    }
}

/// The largest gate, up and down slab of one expert over the routed-expert tensors: experts lie
/// along the last dimension, `n_bytes / n_experts` each; a fused `gate_up` tensor is half gate,
/// half up (as the loader splits it).
fn largest_expert_parts(tensors: &[TensorInfo], n_experts: usize) -> [u64; PARTS] {
    let mut parts = [0u64; PARTS];
    for t in tensors {
        let slab = t.n_bytes / n_experts.max(1) as u64;
        let kind = t.name.split('.').find(|p| p.ends_with("_exps"));
        let (which, bytes): (&[usize], u64) = match kind {
            Some("ffn_gate_exps") => (&[0], slab),
            Some("ffn_up_exps") => (&[1], slab),
            Some("ffn_gate_up_exps") => (&[0, 1], slab / 2),
            Some("ffn_down_exps") => (&[2], slab),
            _ => continue,
        };
        for &p in which {
            parts[p] = parts[p].max(bytes);
        }
    }
    parts
}

/// The [`Config`] a file written from `layout` would have.
pub fn config_of_layout(layout: &Layout) -> Config {
    let p = &layout.params;
    let u = |v: u64| v as usize;
    Config {
        hidden: u(p.hidden),
        n_layers: u(p.n_layers),
        layer_kinds: (0..p.n_layers)
            .map(|i| {
                if p.is_attention(i) {
                    LayerKind::Attention
                } else {
                    LayerKind::DeltaNet
                }
            })
            .collect(),
        vocab: u(p.vocab),
        context_length: u(p.context_length),
        rms_eps: p.rms_eps,
        n_heads: u(p.n_heads),
        n_kv_heads: u(p.n_kv_heads),
        head_dim: u(p.head_dim),
        rope_dims: u(p.rope_dims),
        rope_theta: p.rope_theta as f64,
        conv_kernel: u(p.conv_kernel),
        dn_k_heads: u(p.dn_k_heads),
        dn_v_heads: u(p.dn_v_heads),
        dn_k_dim: u(p.dn_k_dim),
        dn_v_dim: u(p.dn_v_dim),
        n_experts: u(p.n_experts),
        n_experts_used: u(p.n_experts_used),
        expert_ff: u(p.expert_ff),
        shared_ff: u(p.shared_ff),
        nextn_layers: usize::from(p.mtp),
    }
}

/// What a plan asks for.
#[derive(Debug, Clone, Copy)]
pub struct PlanRequest {
    pub memory: Budget,
    pub ctx: u64,
    pub target: Target,
    pub kv: KvType,
    /// Tokens per forward pass for scratch (prompt chunks).
    pub ubatch: u64,
}

/// One resident item of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanRow {
    pub what: &'static str,
    pub bytes: u64,
    pub note: String,
}

/// The expert cache a plan leaves room for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertCachePlan {
    /// Every expert resident: the unbounded cache (on the CPU: read in place from the map).
    AllResident { bytes: u64 },
    /// `slots` experts in slots of `slot_bytes` each (an expert plus `O_DIRECT` alignment slack,
    /// as the cache allocates them), across `layers` blocks.
    Slots {
        slots: u64,
        slot_bytes: u64,
        layers: u64,
        experts_per_layer: u64,
    },
}

impl ExpertCachePlan {
    pub fn bytes(&self) -> u64 {
        match *self {
            ExpertCachePlan::AllResident { bytes } => bytes,
            ExpertCachePlan::Slots {
                slots, slot_bytes, ..
            } => slots * slot_bytes,
        }
    }

    /// The cache size in bytes to hand to a backend (`None` for unbounded).
    pub fn cache_bytes(&self) -> Option<u64> {
        match self {
            ExpertCachePlan::AllResident { .. } => None,
            ExpertCachePlan::Slots { .. } => Some(self.bytes()),
        }
    }
}

impl Plan {
    /// The expert-cache size to give a backend.
    pub fn cache_size(&self) -> redlite_expert_cache::CacheSize {
        match self.experts.cache_bytes() {
            None => redlite_expert_cache::CacheSize::Unbounded,
            Some(b) => redlite_expert_cache::CacheSize::Bytes(b),
        }
    }
}

/// A feasible plan.
#[derive(Debug, Clone)]
pub struct Plan {
    pub request: PlanRequest,
    /// The budget in bytes (for `min`, the smallest that works).
    pub budget: u64,
    /// Everything but the expert cache.
    pub rows: Vec<PlanRow>,
    pub experts: ExpertCachePlan,
    /// Bytes of every routed expert (what full residency takes).
    pub all_expert_bytes: u64,
    /// Experts per block in the file.
    pub experts_per_layer_file: u64,
}

impl Plan {
    pub fn fixed_bytes(&self) -> u64 {
        self.rows.iter().map(|r| r.bytes).sum()
    }

    pub fn total_bytes(&self) -> u64 {
        self.fixed_bytes() + self.experts.bytes()
    }
}

/// A plan that does not fit: every row, what it needs and what the budget holds.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}", render_refusal(self))]
pub struct PlanRefused {
    pub budget: u64,
    pub rows: Vec<PlanRow>,
    /// The smallest expert cache (one expert per block).
    pub min_experts: PlanRow,
}

impl PlanRefused {
    pub fn needed(&self) -> u64 {
        self.rows.iter().map(|r| r.bytes).sum::<u64>() + self.min_experts.bytes
    }
}

fn render_refusal(r: &PlanRefused) -> String {
    let mut s = format!(
        "the plan does not fit: {} needed, {} available ({} short)\n",
        human(r.needed()),
        human(r.budget),
        human(r.needed().saturating_sub(r.budget))
    );
    for row in r.rows.iter().chain(std::iter::once(&r.min_experts)) {
        s.push_str(&format!(
            "  {:<22} {:>12}  {}\n",
            row.what,
            human(row.bytes),
            row.note
        ));
    }
    s.push_str(&format!("  {:<22} {:>12}", "budget", human(r.budget)));
    s
}

/// Decides residency for `input` under `req`.
pub fn plan(input: &PlanInput, req: PlanRequest) -> Result<Plan, PlanRefused> {
    let s = &input.sizes;
    let mut rows = Vec::new();
    rows.push(PlanRow {
        what: "dense weights",
        bytes: s.decode.dense + s.mtp.iter().map(|m| m.dense_bytes).sum::<u64>(),
        note: format!(
            "mixers, routers, shared experts, norms of {} layers{}",
            s.layers.len(),
            if s.mtp.is_empty() { "" } else { " + MTP" }
        ),
    });
    let tied = s.head_is_tied();
    rows.push(PlanRow {
        what: "head",
        bytes: s.head_bytes(),
        note: if tied {
            "output = token_embd (tied)".into()
        } else {
            "output.weight".into()
        },
    });
    let embd = if tied { 0 } else { s.token_embd_bytes };
    rows.push(PlanRow {
        what: "embeddings",
        bytes: embd,
        note: match (req.target, tied) {
            (_, true) => "shared with the head".into(),
            (Target::Cuda, false) => "token_embd.weight (rows gathered on the GPU)".into(),
            (Target::Cpu, false) => "token_embd.weight".into(),
        },
    });
    let kv_per_pos = input.kv_bytes_per_position(req.kv);
    rows.push(PlanRow {
        what: "KV cache",
        bytes: kv_per_pos * req.ctx,
        note: format!(
            "{} positions × {} ({})",
            req.ctx,
            human(kv_per_pos),
            req.kv.name()
        ),
    });
    rows.push(PlanRow {
        what: "recurrent state",
        bytes: s.recurrent_state_bytes_f32(),
        note: "conv history + delta-rule state, f32".into(),
    });
    rows.push(PlanRow {
        what: "scratch",
        bytes: input.scratch_bytes(req.ctx, req.ubatch),
        note: format!("activations of {} tokens, logits", req.ubatch),
    });
    rows.push(PlanRow {
        what: "runtime reserve",
        bytes: req.target.reserve_bytes(),
        note: match req.target {
            Target::Cpu => "binary, tokenizer, thread stacks".into(),
            Target::Cuda => "CUDA context, modules, workspaces".into(),
        },
    });
    let fixed: u64 = rows.iter().map(|r| r.bytes).sum();
    let slot = input.slot_bytes_for(req.target);
    let layers = input.expert_layers() as u64;
    let all = input.all_expert_bytes();
    let min_cache = slot * layers;
    let budget = match req.memory {
        Budget::Bytes(b) => b,
        Budget::Min => fixed + min_cache,
    };
    let per_layer_file = input.config.n_experts as u64;
    let remainder = budget.saturating_sub(fixed);
    if budget < fixed + min_cache {
        return Err(PlanRefused {
            budget,
            rows,
            min_experts: PlanRow {
                what: "expert cache (min)",
                bytes: min_cache,
                note: format!("1 expert × {layers} layers × {} slots", human(slot)),
            },
        });
    }
    let experts = if remainder >= all {
        ExpertCachePlan::AllResident { bytes: all }
    } else {
        let slots = remainder / slot.max(1);
        ExpertCachePlan::Slots {
            slots,
            slot_bytes: slot,
            layers,
            experts_per_layer: slots / layers.max(1),
        }
    };
    Ok(Plan {
        request: req,
        budget,
        rows,
        experts,
        all_expert_bytes: all,
        experts_per_layer_file: per_layer_file,
    })
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.request;
        writeln!(
            f,
            "plan for {} of {} memory, context {} ({} KV)",
            human(self.budget),
            match r.target {
                Target::Cpu => "host",
                Target::Cuda => "GPU",
            },
            r.ctx,
            r.kv.name()
        )?;
        for row in &self.rows {
            writeln!(
                f,
                "  {:<22} {:>12}  {}",
                row.what,
                human(row.bytes),
                row.note
            )?;
        }
        match self.experts {
            ExpertCachePlan::AllResident { bytes } => writeln!(
                f,
                "  {:<22} {:>12}  all experts resident ({} per layer)",
                "expert cache",
                human(bytes),
                self.experts_per_layer_file
            )?,
            ExpertCachePlan::Slots {
                slots,
                slot_bytes,
                layers,
                experts_per_layer,
            } => writeln!(
                f,
                "  {:<22} {:>12}  {slots} experts in slots of {} ≈ {experts_per_layer} of {} per layer × {layers} layers ({:.1}% of the experts, {})",
                "expert cache",
                human(slots * slot_bytes),
                human(slot_bytes),
                self.experts_per_layer_file,
                100.0 * slots as f64 / (layers * self.experts_per_layer_file).max(1) as f64,
                human(self.all_expert_bytes)
            )?,
        }
        write!(
            f,
            "  {:<22} {:>12}  of {}",
            "total",
            human(self.total_bytes()),
            human(self.budget)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(Budget::parse("16GiB"), Ok(Budget::Bytes(16 << 30)));
        assert_eq!(Budget::parse("512MiB"), Ok(Budget::Bytes(512 << 20)));
        assert_eq!(Budget::parse("512M"), Ok(Budget::Bytes(512 << 20)));
        assert_eq!(Budget::parse("1.5GB"), Ok(Budget::Bytes(1_500_000_000)));
        assert_eq!(Budget::parse("4096"), Ok(Budget::Bytes(4096)));
        assert_eq!(Budget::parse("min"), Ok(Budget::Min));
        assert_eq!(Budget::parse("MIN"), Ok(Budget::Min));
        assert!(Budget::parse("lots").is_err());
        assert!(Budget::parse("12 parsecs").is_err());
        assert!(Budget::parse("-1GiB").is_err());
    }
}
