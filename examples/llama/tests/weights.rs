//! `zero_llama::weights`: safetensors round trips (F32 bit-exact, BF16
//! rounded), foreign files (F16, extra tensors), and every error path.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use llama::weights::{self, Dtype};
use llama::{init_params, tensors, Config};
use safetensors::tensor::TensorView;
use zero_llama as llama;

/// Smaller than `Config::tiny()`: every test writes and reads a whole model.
fn cfg() -> Config {
    Config {
        vocab: 32,
        dim: 16,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        hidden: 24,
        max_seq: 16,
        ..Config::tiny()
    }
}

/// A unique path under the temp dir, removed (with its `.tmp`) on drop.
struct TempPath(PathBuf);

impl TempPath {
    fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let name = format!(
            "zero-llama-weights-{}-{n}-{tag}.safetensors",
            std::process::id()
        );
        TempPath(std::env::temp_dir().join(name))
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        let mut tmp = self.0.clone().into_os_string();
        tmp.push(".tmp");
        let _ = std::fs::remove_file(tmp);
    }
}

/// Writes `(name, dtype, shape, bytes)` with the safetensors crate directly.
fn write_raw(path: &Path, entries: &[(String, safetensors::Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(&str, TensorView<'_>)> = entries
        .iter()
        .map(|(n, dt, shape, bytes)| {
            (
                n.as_str(),
                TensorView::new(*dt, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// The model's tensors as F32 entries for [`write_raw`].
fn f32_entries(
    c: &Config,
    params: &[Vec<f32>],
) -> Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> {
    tensors(c)
        .into_iter()
        .zip(params)
        .map(|(t, p)| {
            let bytes = p.iter().flat_map(|x| x.to_le_bytes()).collect();
            (t.name, safetensors::Dtype::F32, t.shape, bytes)
        })
        .collect()
}

fn load_err(path: &Path, c: &Config) -> String {
    match weights::load(path, c) {
        Ok(_) => panic!("loading {} should fail", path.display()),
        Err(e) => e,
    }
}

#[test]
fn f32_round_trip_is_bit_exact() {
    let c = cfg();
    let params = init_params(&c, 7);
    let p = TempPath::new("f32");
    weights::save(&p.0, &c, &params, Dtype::F32).unwrap();
    let (back, ignored) = weights::load_with_report(&p.0, &c).unwrap();
    assert!(ignored.is_empty(), "{ignored:?}");
    assert_eq!(back.len(), params.len());
    for (a, b) in params.iter().zip(&back) {
        let (a, b): (Vec<u32>, Vec<u32>) = (
            a.iter().map(|x| x.to_bits()).collect(),
            b.iter().map(|x| x.to_bits()).collect(),
        );
        assert_eq!(a, b);
    }
    let mut tmp = p.0.clone().into_os_string();
    tmp.push(".tmp");
    assert!(
        !Path::new(&tmp).exists(),
        "the .tmp file must be renamed away"
    );
}

#[test]
fn saved_file_has_hf_names_and_format_metadata() {
    let c = cfg();
    let params = init_params(&c, 1);
    let p = TempPath::new("meta");
    // Slices work as well as Vecs.
    let slices: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
    weights::save(&p.0, &c, &slices, Dtype::Bf16).unwrap();
    let bytes = std::fs::read(&p.0).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let want = HashMap::from([("format".to_string(), "pt".to_string())]);
    assert_eq!(meta.metadata().as_ref(), Some(&want));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for t in tensors(&c) {
        let v = st.tensor(&t.name).unwrap();
        assert_eq!(v.shape(), t.shape.as_slice(), "{}", t.name);
        assert_eq!(v.dtype(), safetensors::Dtype::BF16, "{}", t.name);
    }
    assert_eq!(st.len(), tensors(&c).len());
}

#[test]
fn bf16_round_trip_equals_rounded_values() {
    let c = cfg();
    let params = init_params(&c, 3);
    let p = TempPath::new("bf16");
    weights::save(&p.0, &c, &params, Dtype::Bf16).unwrap();
    let back = weights::load(&p.0, &c).unwrap();
    for (a, b) in params.iter().zip(&back) {
        let rounded: Vec<f32> = a
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect();
        assert_eq!(&rounded, b);
    }
    // The rounding did something (the test is not vacuous).
    assert_ne!(params[0], back[0]);
}

#[test]
fn save_overwrites_an_existing_file() {
    let c = cfg();
    let p = TempPath::new("overwrite");
    weights::save(&p.0, &c, &init_params(&c, 1), Dtype::F32).unwrap();
    let second = init_params(&c, 2);
    weights::save(&p.0, &c, &second, Dtype::F32).unwrap();
    assert_eq!(weights::load(&p.0, &c).unwrap(), second);
}

#[test]
fn f16_file_with_extra_tensor_loads_and_reports_it() {
    let c = cfg();
    let params = init_params(&c, 5);
    let mut entries: Vec<_> = tensors(&c)
        .into_iter()
        .zip(&params)
        .map(|(t, p)| {
            let bytes = p
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect();
            (t.name, safetensors::Dtype::F16, t.shape, bytes)
        })
        .collect();
    let extra = "model.layers.0.self_attn.rotary_emb.inv_freq".to_string();
    let half_hd = c.head_dim() / 2;
    entries.push((
        extra.clone(),
        safetensors::Dtype::F32,
        vec![half_hd],
        vec![0u8; 4 * half_hd],
    ));
    let p = TempPath::new("f16");
    write_raw(&p.0, &entries);
    let (back, ignored) = weights::load_with_report(&p.0, &c).unwrap();
    assert_eq!(ignored, vec![extra]);
    for (a, b) in params.iter().zip(&back) {
        let rounded: Vec<f32> = a.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect();
        assert_eq!(&rounded, b);
    }
}

#[test]
fn missing_file_names_the_path() {
    let p = TempPath::new("missing");
    let e = load_err(&p.0, &cfg());
    assert!(e.contains(&p.0.display().to_string()), "{e}");
    assert!(e.contains("cannot open"), "{e}");
}

#[test]
fn garbage_is_not_a_safetensors_file() {
    let c = cfg();
    for (tag, bytes) in [
        ("text", b"this is certainly not a safetensors file".to_vec()),
        ("short", b"abc".to_vec()),
        ("badjson", {
            let mut v = 10u64.to_le_bytes().to_vec();
            v.extend_from_slice(b"{not json}");
            v
        }),
    ] {
        let p = TempPath::new(tag);
        std::fs::write(&p.0, bytes).unwrap();
        let e = load_err(&p.0, &c);
        assert!(e.contains(&p.0.display().to_string()), "{e}");
        assert!(e.contains("not a safetensors file"), "{tag}: {e}");
    }
}

#[test]
fn missing_tensor_is_named() {
    let c = cfg();
    let mut entries = f32_entries(&c, &init_params(&c, 1));
    let gone = "model.layers.1.mlp.up_proj.weight";
    entries.retain(|e| e.0 != gone);
    let p = TempPath::new("missing-tensor");
    write_raw(&p.0, &entries);
    let e = load_err(&p.0, &c);
    assert!(e.contains(gone) && e.contains("not found"), "{e}");
}

#[test]
fn missing_lm_head_hints_at_tied_embeddings() {
    let c = cfg();
    let mut entries = f32_entries(&c, &init_params(&c, 1));
    entries.retain(|e| e.0 != "lm_head.weight");
    let p = TempPath::new("tied");
    write_raw(&p.0, &entries);
    let e = load_err(&p.0, &c);
    assert!(e.contains("lm_head.weight") && e.contains("tie"), "{e}");
}

#[test]
fn fewer_layers_than_the_config_is_explained() {
    let c = cfg();
    let small = Config { n_layers: 1, ..c };
    let p = TempPath::new("layers");
    weights::save(&p.0, &small, &init_params(&small, 1), Dtype::F32).unwrap();
    let e = load_err(&p.0, &c);
    assert!(e.contains("model.layers.1."), "{e}");
    assert!(
        e.contains("file has 1 layers") && e.contains("n_layers = 2"),
        "{e}"
    );
}

#[test]
fn wrong_shape_names_tensor_and_both_shapes() {
    let c = cfg();
    let bigger = Config { vocab: 40, ..c };
    let p = TempPath::new("shape");
    weights::save(&p.0, &bigger, &init_params(&bigger, 1), Dtype::F32).unwrap();
    let e = load_err(&p.0, &c);
    assert!(e.contains("model.embed_tokens.weight"), "{e}");
    assert!(e.contains("[40, 16]") && e.contains("[32, 16]"), "{e}");
    assert!(e.contains("vocab: file 40, config 32"), "{e}");

    let wider = Config { hidden: 20, ..c };
    weights::save(&p.0, &wider, &init_params(&wider, 1), Dtype::F32).unwrap();
    let e = load_err(&p.0, &c);
    assert!(e.contains("model.layers.0.mlp.gate_proj.weight"), "{e}");
    assert!(e.contains("hidden: file 20, config 24"), "{e}");
}

#[test]
fn truncated_file_is_reported() {
    let c = cfg();
    let p = TempPath::new("trunc");
    weights::save(&p.0, &c, &init_params(&c, 1), Dtype::F32).unwrap();
    let len = std::fs::metadata(&p.0).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&p.0).unwrap();
    f.set_len(len - 100).unwrap();
    drop(f);
    let e = load_err(&p.0, &c);
    assert!(e.contains(&p.0.display().to_string()), "{e}");
    assert!(e.contains("truncated"), "{e}");

    // Cut inside the header.
    let f = std::fs::OpenOptions::new().write(true).open(&p.0).unwrap();
    f.set_len(20).unwrap();
    drop(f);
    let e = load_err(&p.0, &c);
    assert!(e.contains("truncated"), "{e}");
}

#[test]
fn unsupported_dtype_is_named() {
    let c = cfg();
    let mut entries = f32_entries(&c, &init_params(&c, 1));
    let victim = &mut entries[3];
    victim.1 = safetensors::Dtype::I32;
    let name = victim.0.clone();
    let p = TempPath::new("i32");
    write_raw(&p.0, &entries);
    let e = load_err(&p.0, &c);
    assert!(e.contains(&name) && e.contains("I32"), "{e}");
}

#[test]
fn save_rejects_wrong_lengths() {
    let c = cfg();
    let p = TempPath::new("badlen");
    let mut params = init_params(&c, 1);
    params[2].pop();
    let e = weights::save(&p.0, &c, &params, Dtype::F32).unwrap_err();
    assert!(e.contains(&tensors(&c)[2].name), "{e}");
    assert!(!p.0.exists());
    params.pop();
    let e = weights::save(&p.0, &c, &params, Dtype::F32).unwrap_err();
    assert!(e.contains("parameter tensors"), "{e}");
}

/// A tensor the model does not use (a bias of a Qwen2 file read as plain
/// Llama) is an error of `load` that names it and hints at the config; a
/// derived buffer (`rotary_emb.inv_freq`) is not.
#[test]
fn unused_tensor_is_an_error_naming_it() {
    let c = cfg();
    let mut entries = f32_entries(&c, &init_params(&c, 3));
    let kd = c.n_kv_heads * c.head_dim();
    let inv_freq = "model.layers.0.self_attn.rotary_emb.inv_freq".to_string();
    entries.push((
        inv_freq,
        safetensors::Dtype::F32,
        vec![c.head_dim() / 2],
        vec![0u8; 4 * c.head_dim() / 2],
    ));
    let p = TempPath::new("inv-freq");
    write_raw(&p.0, &entries);
    assert_eq!(weights::load(&p.0, &c).unwrap().len(), tensors(&c).len());

    let bias = "model.layers.1.self_attn.k_proj.bias".to_string();
    entries.push((bias, safetensors::Dtype::F32, vec![kd], vec![0u8; 4 * kd]));
    let p = TempPath::new("unused");
    write_raw(&p.0, &entries);
    let e = load_err(&p.0, &c);
    assert!(
        e.contains("`model.layers.1.self_attn.k_proj.bias` is not used") && e.contains("bias"),
        "{e}"
    );
}

/// Qwen2's tensor list (q/k/v biases, no `lm_head.weight`) round-trips
/// bit for bit; a file without the biases names the first missing one.
#[test]
fn biases_and_tied_embeddings_round_trip() {
    let c = Config {
        qkv_bias: true,
        tie_embeddings: true,
        ..cfg()
    };
    let params = init_params(&c, 4);
    let p = TempPath::new("qwen");
    weights::save(&p.0, &c, &params, Dtype::F32).unwrap();
    assert_eq!(weights::load(&p.0, &c).unwrap(), params);

    let plain = Config {
        tie_embeddings: true,
        ..cfg()
    };
    let p = TempPath::new("no-bias");
    weights::save(&p.0, &plain, &init_params(&plain, 4), Dtype::F32).unwrap();
    let e = load_err(&p.0, &c);
    assert!(
        e.contains("`model.layers.0.self_attn.q_proj.bias` not found (and 5 more)"),
        "{e}"
    );
}

/// `save_sharded` splits at the size limit in tensor order and writes the
/// index `transformers` reads; under the limit it writes one file.
#[test]
fn sharded_save_writes_an_index() {
    let c = cfg();
    let params = init_params(&c, 6);
    let dir = std::env::temp_dir().join(format!("zero-llama-shards-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let one = weights::save_sharded(&dir, &c, &params, Dtype::Bf16, u64::MAX).unwrap();
    assert_eq!(one, vec!["model.safetensors".to_string()]);
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();

    let names = weights::save_sharded(&dir, &c, &params, Dtype::F32, 4096).unwrap();
    assert!(names.len() > 3, "{names:?}");
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(weights::INDEX_FILE)).unwrap())
            .unwrap();
    let total: usize = tensors(&c).iter().map(|t| 4 * t.numel()).sum();
    assert_eq!(index["metadata"]["total_size"], total);
    let n = names.len() - 1;
    for t in tensors(&c) {
        let file = index["weight_map"][&t.name].as_str().unwrap();
        assert!(file.ends_with(&format!("-of-{n:05}.safetensors")), "{file}");
        let mut f = weights::SafetensorsFile::open(&dir.join(file)).unwrap();
        assert!(
            std::fs::metadata(dir.join(file)).unwrap().len() < 4096 + 1024 || f.names().len() == 1,
            "{file} is over the limit with several tensors"
        );
        let i = tensors(&c).iter().position(|x| x.name == t.name).unwrap();
        assert_eq!(f.read(&t.name, &t.shape).unwrap(), params[i]);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
