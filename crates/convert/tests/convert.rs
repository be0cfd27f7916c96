//! `redlite convert` on small random-weight Hugging Face checkpoints made here: every GGUF tensor
//! is checked against the llama.cpp transforms, the layout is compared with the llama.cpp-made
//! fixture `tiny-F16.gguf`, and the oracle loads the result.

use std::collections::BTreeMap;
use std::path::Path;

use redlite_convert::{convert, ConvertOptions, OutType};
use redlite_gguf::quant::dequantize_to_vec;
use redlite_gguf::{GgmlType, GgufFile, MetaArray, MetaValue};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};

const REF: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/reference");

/// HF tensors by name: (shape, values as stored).
type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn u(cfg: &Value, k: &str) -> usize {
    cfg[k].as_u64().unwrap() as usize
}

/// Random tensors for a Qwen3-Next config; `fused` writes transformers-5 style 3-D experts.
fn random_tensors(cfg: &Value, fused: bool, mtp: bool, seed: u64) -> Tensors {
    let mut rng = Rng(seed);
    let mut t = Tensors::new();
    let mut add = |name: String, shape: Vec<usize>, scale: f32| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.next() * scale).collect();
        t.insert(name, (shape, v));
    };
    let (h, v) = (u(cfg, "hidden_size"), u(cfg, "vocab_size"));
    let (nq, nkv, hd) = (
        u(cfg, "num_attention_heads"),
        u(cfg, "num_key_value_heads"),
        u(cfg, "head_dim"),
    );
    let (nk, nv) = (
        u(cfg, "linear_num_key_heads"),
        u(cfg, "linear_num_value_heads"),
    );
    let (dk, dv) = (
        u(cfg, "linear_key_head_dim"),
        u(cfg, "linear_value_head_dim"),
    );
    let (e, ff, sff) = (
        u(cfg, "num_experts"),
        u(cfg, "moe_intermediate_size"),
        u(cfg, "shared_expert_intermediate_size"),
    );
    let kern = u(cfg, "linear_conv_kernel_dim");
    let types: Vec<String> = cfg["layer_types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap().to_string())
        .collect();
    add("model.embed_tokens.weight".into(), vec![v, h], 0.5);
    add("lm_head.weight".into(), vec![v, h], 0.1);
    add("model.norm.weight".into(), vec![h], 0.2);
    let mut layers: Vec<(String, bool)> = types
        .iter()
        .enumerate()
        .map(|(i, ty)| (format!("model.layers.{i}."), ty == "full_attention"))
        .collect();
    if mtp {
        layers.push(("mtp.layers.0.".into(), true));
        add("mtp.fc.weight".into(), vec![h, 2 * h], 0.1);
        for n in ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"] {
            add(format!("mtp.{n}.weight"), vec![h], 0.2);
        }
    }
    for (p, attn) in layers {
        // A tensor of this layer: `<p><suffix>`.
        let mut at =
            |suffix: &str, shape: Vec<usize>, scale: f32| add(format!("{p}{suffix}"), shape, scale);
        at("input_layernorm.weight", vec![h], 0.2);
        at("post_attention_layernorm.weight", vec![h], 0.2);
        if attn {
            at("self_attn.q_proj.weight", vec![2 * nq * hd, h], 0.1);
            at("self_attn.k_proj.weight", vec![nkv * hd, h], 0.1);
            at("self_attn.v_proj.weight", vec![nkv * hd, h], 0.1);
            at("self_attn.o_proj.weight", vec![h, nq * hd], 0.1);
            at("self_attn.q_norm.weight", vec![hd], 0.2);
            at("self_attn.k_norm.weight", vec![hd], 0.2);
        } else {
            let conv = 2 * nk * dk + nv * dv;
            at(
                "linear_attn.in_proj_qkvz.weight",
                vec![conv + nv * dv, h],
                0.1,
            );
            at("linear_attn.in_proj_ba.weight", vec![2 * nv, h], 0.1);
            at("linear_attn.conv1d.weight", vec![conv, 1, kern], 0.3);
            at("linear_attn.dt_bias", vec![nv], 1.0);
            at("linear_attn.A_log", vec![nv], 1.0);
            at("linear_attn.norm.weight", vec![dv], 1.0);
            at("linear_attn.out_proj.weight", vec![h, nv * dv], 0.1);
        }
        at("mlp.gate.weight", vec![e, h], 0.1);
        if fused {
            at("mlp.experts.gate_up_proj", vec![e, 2 * ff, h], 0.1);
            at("mlp.experts.down_proj", vec![e, h, ff], 0.1);
        } else {
            for x in 0..e {
                at(
                    &format!("mlp.experts.{x}.gate_proj.weight"),
                    vec![ff, h],
                    0.1,
                );
                at(&format!("mlp.experts.{x}.up_proj.weight"), vec![ff, h], 0.1);
                at(
                    &format!("mlp.experts.{x}.down_proj.weight"),
                    vec![h, ff],
                    0.1,
                );
            }
        }
        at("mlp.shared_expert.gate_proj.weight", vec![sff, h], 0.1);
        at("mlp.shared_expert.up_proj.weight", vec![sff, h], 0.1);
        at("mlp.shared_expert.down_proj.weight", vec![h, sff], 0.1);
        at("mlp.shared_expert_gate.weight", vec![1, h], 0.1);
    }
    t
}

/// Writes config.json, the tensors (split over two safetensors files, as `dtype`) and the
/// fixture's small BPE tokenizer; returns the tensors with the values as stored.
fn write_checkpoint(dir: &Path, cfg: &Value, mut t: Tensors, dtype: Dtype) -> Tensors {
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(cfg).unwrap(),
    )
    .unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(format!("{REF}/models/small_bpe/{f}"), dir.join(f)).unwrap();
    }
    let mut bufs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, (shape, vals)) in t.iter_mut() {
        let bytes: Vec<u8> = match dtype {
            Dtype::BF16 => {
                for x in vals.iter_mut() {
                    *x = half::bf16::from_f32(*x).to_f32();
                }
                vals.iter()
                    .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                    .collect()
            }
            _ => vals.iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        bufs.push((name.clone(), shape.clone(), bytes));
    }
    let half_n = bufs.len() / 2;
    for (i, part) in [&bufs[..half_n], &bufs[half_n..]].iter().enumerate() {
        let views: Vec<(String, TensorView)> = part
            .iter()
            .map(|(n, s, b)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap()))
            .collect();
        let bytes = safetensors::serialize(views, None).unwrap();
        std::fs::write(
            dir.join(format!("model-0000{}-of-00002.safetensors", i + 1)),
            bytes,
        )
        .unwrap();
    }
    t
}

fn tiny_config() -> Value {
    let text = std::fs::read_to_string(format!("{REF}/models/hf_config.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn read(f: &GgufFile, name: &str) -> Vec<f32> {
    let t = f.tensor(name).unwrap_or_else(|| panic!("missing {name}"));
    dequantize_to_vec(t.ty, f.tensor_data(t)).unwrap()
}

fn hf<'a>(t: &'a Tensors, name: &str) -> &'a [f32] {
    &t.get(name).unwrap_or_else(|| panic!("missing HF {name}")).1
}

/// Checks every GGUF tensor of a converted F32 file against the transforms, exactly.
fn check_transforms(f: &GgufFile, t: &Tensors, cfg: &Value, mtp: bool) {
    let (h, _v) = (u(cfg, "hidden_size"), u(cfg, "vocab_size"));
    let (nk, nv) = (
        u(cfg, "linear_num_key_heads"),
        u(cfg, "linear_num_value_heads"),
    );
    let (dk, dv) = (
        u(cfg, "linear_key_head_dim"),
        u(cfg, "linear_value_head_dim"),
    );
    let (e, ff) = (u(cfg, "num_experts"), u(cfg, "moe_intermediate_size"));
    let n_layer = u(cfg, "num_hidden_layers");
    let plus1 = |x: &[f32]| x.iter().map(|v| v + 1.0).collect::<Vec<f32>>();
    assert_eq!(
        read(f, "token_embd.weight"),
        hf(t, "model.embed_tokens.weight")
    );
    assert_eq!(read(f, "output.weight"), hf(t, "lm_head.weight"));
    assert_eq!(
        read(f, "output_norm.weight"),
        plus1(hf(t, "model.norm.weight"))
    );
    let mut blocks: Vec<(String, String, bool)> = (0..n_layer)
        .map(|i| {
            let attn = cfg["layer_types"][i] == "full_attention";
            (format!("model.layers.{i}."), format!("blk.{i}."), attn)
        })
        .collect();
    if mtp {
        blocks.push(("mtp.layers.0.".into(), format!("blk.{n_layer}."), true));
        let b = format!("blk.{n_layer}.nextn.");
        assert_eq!(
            read(f, &format!("{b}eh_proj.weight")),
            hf(t, "mtp.fc.weight")
        );
        assert_eq!(
            read(f, &format!("{b}enorm.weight")),
            plus1(hf(t, "mtp.pre_fc_norm_embedding.weight"))
        );
        assert_eq!(
            read(f, &format!("{b}hnorm.weight")),
            plus1(hf(t, "mtp.pre_fc_norm_hidden.weight"))
        );
        assert_eq!(
            read(f, &format!("{b}shared_head_norm.weight")),
            plus1(hf(t, "mtp.norm.weight"))
        );
        assert_eq!(
            f.tensor(&format!("{b}eh_proj.weight")).unwrap().dims,
            vec![2 * h as u64, h as u64]
        );
    }
    for (p, b, attn) in &blocks {
        let g = |n: &str| read(f, &format!("{b}{n}"));
        let s = |n: &str| hf(t, &format!("{p}{n}")).to_vec();
        assert_eq!(g("attn_norm.weight"), plus1(&s("input_layernorm.weight")));
        assert_eq!(
            g("post_attention_norm.weight"),
            plus1(&s("post_attention_layernorm.weight"))
        );
        if *attn {
            assert_eq!(g("attn_q.weight"), s("self_attn.q_proj.weight"));
            assert_eq!(g("attn_k.weight"), s("self_attn.k_proj.weight"));
            assert_eq!(g("attn_v.weight"), s("self_attn.v_proj.weight"));
            assert_eq!(g("attn_output.weight"), s("self_attn.o_proj.weight"));
            assert_eq!(
                g("attn_q_norm.weight"),
                plus1(&s("self_attn.q_norm.weight"))
            );
            assert_eq!(
                g("attn_k_norm.weight"),
                plus1(&s("self_attn.k_norm.weight"))
            );
        } else {
            // Un-grouping by head index: group g holds [q_g | k_g | v of heads g*r.. | z of heads g*r..].
            let qkvz = s("linear_attn.in_proj_qkvz.weight");
            let r = nv / nk;
            let group = 2 * dk + 2 * r * dv;
            let row = |i: usize| &qkvz[i * h..(i + 1) * h];
            let mut want_qkv = Vec::new();
            for gi in 0..nk {
                for i in 0..dk {
                    want_qkv.extend_from_slice(row(gi * group + i));
                }
            }
            for gi in 0..nk {
                for i in 0..dk {
                    want_qkv.extend_from_slice(row(gi * group + dk + i));
                }
            }
            let mut want_z = Vec::new();
            for head in 0..nv {
                let (gi, j) = (head / r, head % r);
                for i in 0..dv {
                    want_qkv.extend_from_slice(row(gi * group + 2 * dk + j * dv + i));
                    want_z.extend_from_slice(row(gi * group + 2 * dk + r * dv + j * dv + i));
                }
            }
            // want_qkv got v interleaved with nothing else: v rows were appended in head order.
            assert_eq!(g("attn_qkv.weight"), want_qkv);
            assert_eq!(g("attn_gate.weight"), want_z);
            assert_eq!(g("ssm_ba.weight"), s("linear_attn.in_proj_ba.weight"));
            assert_eq!(g("ssm_conv1d.weight"), s("linear_attn.conv1d.weight"));
            assert_eq!(g("ssm_dt.bias"), s("linear_attn.dt_bias"));
            let a: Vec<f32> = s("linear_attn.A_log").iter().map(|x| -x.exp()).collect();
            assert_eq!(g("ssm_a"), a);
            assert_eq!(
                g("ssm_norm.weight"),
                s("linear_attn.norm.weight"),
                "no +1 on the DeltaNet norm"
            );
            assert_eq!(g("ssm_out.weight"), s("linear_attn.out_proj.weight"));
        }
        assert_eq!(g("ffn_gate_inp.weight"), s("mlp.gate.weight"));
        assert_eq!(
            g("ffn_gate_inp_shexp.weight"),
            s("mlp.shared_expert_gate.weight")
        );
        assert_eq!(
            f.tensor(&format!("{b}ffn_gate_inp_shexp.weight"))
                .unwrap()
                .dims,
            vec![h as u64, 1]
        );
        assert_eq!(
            g("ffn_gate_shexp.weight"),
            s("mlp.shared_expert.gate_proj.weight")
        );
        assert_eq!(
            g("ffn_up_shexp.weight"),
            s("mlp.shared_expert.up_proj.weight")
        );
        assert_eq!(
            g("ffn_down_shexp.weight"),
            s("mlp.shared_expert.down_proj.weight")
        );
        let (gate, up, down) = (
            g("ffn_gate_exps.weight"),
            g("ffn_up_exps.weight"),
            g("ffn_down_exps.weight"),
        );
        for x in 0..e {
            let slab = ff * h;
            let (want_gate, want_up, want_down) =
                if t.contains_key(&format!("{p}mlp.experts.gate_up_proj")) {
                    let gu = s("mlp.experts.gate_up_proj");
                    let d = s("mlp.experts.down_proj");
                    let base = x * 2 * slab;
                    (
                        gu[base..base + slab].to_vec(),
                        gu[base + slab..base + 2 * slab].to_vec(),
                        d[x * slab..(x + 1) * slab].to_vec(),
                    )
                } else {
                    (
                        s(&format!("mlp.experts.{x}.gate_proj.weight")),
                        s(&format!("mlp.experts.{x}.up_proj.weight")),
                        s(&format!("mlp.experts.{x}.down_proj.weight")),
                    )
                };
            assert_eq!(
                &gate[x * slab..(x + 1) * slab],
                &want_gate[..],
                "{b} gate expert {x}"
            );
            assert_eq!(
                &up[x * slab..(x + 1) * slab],
                &want_up[..],
                "{b} up expert {x}"
            );
            assert_eq!(
                &down[x * slab..(x + 1) * slab],
                &want_down[..],
                "{b} down expert {x}"
            );
        }
        assert_eq!(
            f.tensor(&format!("{b}ffn_down_exps.weight")).unwrap().dims,
            vec![ff as u64, h as u64, e as u64]
        );
    }
}

fn opts(ty: OutType) -> ConvertOptions {
    ConvertOptions {
        out_type: ty,
        name: Some("test".into()),
        ..ConvertOptions::default()
    }
}

/// Per-expert BF16 checkpoint with MTP → F32 GGUF: every tensor matches the transforms exactly,
/// and the oracle loads the file (with its MTP block) and computes finite logits.
#[test]
fn per_expert_bf16_checkpoint_to_f32_matches_transforms() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let t = write_checkpoint(
        dir.path(),
        &cfg,
        random_tensors(&cfg, false, true, 7),
        Dtype::BF16,
    );
    let out = dir.path().join("out.gguf");
    let r = convert(dir.path(), &out, &opts(OutType::F32)).unwrap();
    assert_eq!(r.nextn_layers, 1);
    assert_eq!(r.block_count, 5);
    let f = GgufFile::open(&out).unwrap();
    assert!(f.tensors().iter().all(|t| t.ty == GgmlType::F32));
    check_transforms(&f, &t, &cfg, true);
    assert_eq!(f.get_u32("qwen3next.nextn_predict_layers").unwrap(), 1);

    let model = redlite_model::Model::load(&out).unwrap();
    assert!(model.has_mtp());
    let mut st = model.new_state();
    let logits = model
        .forward(&mut st, &[1, 2, 3], redlite_model::Mode::Step)
        .unwrap();
    assert_eq!(logits.len(), 3);
    assert!(logits.iter().flatten().all(|x| x.is_finite()));
}

/// transformers-5 fused experts (gate_up_proj / down_proj) → Q8_0: the same transforms, the small
/// tensors in F32, the matrices Q8_0 within half a quantization step; `--no-mtp` drops the block.
#[test]
fn fused_experts_to_q8_0() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let t = write_checkpoint(
        dir.path(),
        &cfg,
        random_tensors(&cfg, true, true, 11),
        Dtype::F32,
    );
    let f32_path = dir.path().join("f32.gguf");
    convert(dir.path(), &f32_path, &opts(OutType::F32)).unwrap();
    let f32_file = GgufFile::open(&f32_path).unwrap();
    check_transforms(&f32_file, &t, &cfg, true);

    let q_path = dir.path().join("q8.gguf");
    let no_mtp = ConvertOptions {
        include_mtp: false,
        ..opts(OutType::Q8_0)
    };
    let r = convert(dir.path(), &q_path, &no_mtp).unwrap();
    assert_eq!((r.block_count, r.nextn_layers), (4, 0));
    let q = GgufFile::open(&q_path).unwrap();
    assert!(q.get("qwen3next.nextn_predict_layers").is_none());
    assert!(q.tensors().iter().all(|t| !t.name.starts_with("blk.4.")));
    assert_eq!(q.get_u32("general.file_type").unwrap(), 7);
    for ti in q.tensors() {
        let small = ti.dims.len() == 1
            || ti.name.ends_with("norm.weight")
            || ti.name.contains("ffn_gate_inp")
            || ti.name.contains("ssm_conv1d")
            || !ti.name.ends_with(".weight");
        let want = if small { GgmlType::F32 } else { GgmlType::Q8_0 };
        assert_eq!(ti.ty, want, "{}", ti.name);
        let exact = read(&f32_file, &ti.name);
        let got = read(&q, &ti.name);
        for (bq, be) in got.chunks(32).zip(exact.chunks(32)) {
            let amax = be.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (a, b) in bq.iter().zip(be) {
                assert!(
                    (a - b).abs() <= amax / 127.0 * 0.5 + amax * 1e-3 + 1e-7,
                    "{}: {a} vs {b}",
                    ti.name
                );
            }
        }
    }
}

fn meta_of(f: &GgufFile) -> BTreeMap<String, MetaValue> {
    f.metadata().iter().cloned().collect()
}

/// The converter's output for a checkpoint with the fixture's config and tokenizer has the same
/// tensor names, dims and types, and the same metadata, as llama.cpp's `tiny-F16.gguf`.
#[test]
fn layout_matches_llama_cpp_fixture() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    write_checkpoint(
        dir.path(),
        &cfg,
        random_tensors(&cfg, false, true, 3),
        Dtype::F32,
    );
    let out = dir.path().join("f16.gguf");
    convert(dir.path(), &out, &opts(OutType::F16)).unwrap();
    let ours = GgufFile::open(&out).unwrap();
    let fixture = GgufFile::open(format!("{REF}/models/tiny-F16.gguf")).unwrap();
    let layout = |f: &GgufFile| -> BTreeMap<String, (Vec<u64>, GgmlType)> {
        f.tensors()
            .iter()
            .map(|t| (t.name.clone(), (t.dims.clone(), t.ty)))
            .collect()
    };
    assert_eq!(layout(&ours), layout(&fixture));
    let (mo, mf) = (meta_of(&ours), meta_of(&fixture));
    let skip = ["general.name", "general.size_label"];
    let keys = |m: &BTreeMap<String, MetaValue>| -> Vec<String> {
        m.keys()
            .filter(|k| !skip.contains(&k.as_str()))
            .cloned()
            .collect()
    };
    assert_eq!(keys(&mo), keys(&mf));
    for k in keys(&mf) {
        assert_eq!(mo[&k], mf[&k], "metadata {k}");
    }
    // Spot check: the token list is the tokenizer's, padded with [PAD…] entries.
    let Some(MetaValue::Array(MetaArray::String(tokens))) = mo.get("tokenizer.ggml.tokens") else {
        panic!("no token list")
    };
    assert_eq!(tokens.len(), 4160);
    assert_eq!(tokens[4159], "[PAD4159]");
}

/// A checkpoint tensor that no GGUF tensor uses, or a missing one, is an error with the name.
#[test]
fn unknown_or_missing_tensors_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let mut t = random_tensors(&cfg, false, false, 5);
    t.insert(
        "model.layers.0.extra.weight".into(),
        (vec![2], vec![0.0, 1.0]),
    );
    write_checkpoint(dir.path(), &cfg, t.clone(), Dtype::F32);
    let err = convert(dir.path(), &dir.path().join("x.gguf"), &opts(OutType::F16)).unwrap_err();
    assert!(
        err.to_string().contains("model.layers.0.extra.weight"),
        "{err}"
    );

    let dir2 = tempfile::tempdir().unwrap();
    t.remove("model.layers.0.extra.weight");
    t.remove("model.layers.3.self_attn.k_norm.weight");
    write_checkpoint(dir2.path(), &cfg, t, Dtype::F32);
    let err = convert(
        dir2.path(),
        &dir2.path().join("x.gguf"),
        &opts(OutType::F16),
    )
    .unwrap_err();
    assert!(err.to_string().contains("k_norm"), "{err}");

    let bad_cfg = json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama"});
    std::fs::write(dir2.path().join("config.json"), bad_cfg.to_string()).unwrap();
    let err = convert(
        dir2.path(),
        &dir2.path().join("x.gguf"),
        &opts(OutType::F16),
    )
    .unwrap_err();
    assert!(err.to_string().contains("not a Qwen3-Next"), "{err}");
}
