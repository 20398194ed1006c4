//! LoRA adapters (`zero_llama::lora`): PEFT's initialisation leaves the
//! output unchanged, the backward pass matches central differences (with
//! and without dropout, plain and rsLoRA scale), merging gives the
//! adapted layer's output, configs and PEFT's files round-trip, and bad
//! settings are errors naming them.

use zero_llama::lora::{self, LoraCache, LoraConfig, LoraDims};
use zero_llama::ops::linear_forward;
use zero_llama::XorShift;

fn randv(rng: &mut XorShift, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| scale * rng.normal()).collect()
}

fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

const DIMS: LoraDims = LoraDims {
    rows: 6,
    d_in: 10,
    d_out: 7,
    r: 3,
    scale: 16.0 / 3.0,
};

fn adapter_out(x: &[f32], a: &[f32], b: &[f32], mask: Option<Vec<f32>>, d: LoraDims) -> Vec<f32> {
    let mut y = vec![0.0; d.rows * d.d_out];
    lora::forward(x, a, b, &mut y, mask, d, 1);
    y
}

#[test]
fn a_fresh_adapter_leaves_the_output_unchanged() {
    let mut rng = XorShift::new(1);
    let d = DIMS;
    let x = randv(&mut rng, d.rows * d.d_in, 1.0);
    let w = randv(&mut rng, d.d_out * d.d_in, 0.1);
    let a = lora::init_a(&mut rng, d.r, d.d_in);
    let bound = 1.0 / (d.d_in as f32).sqrt();
    assert!(a.iter().all(|v| v.abs() <= bound));
    assert!(
        a.iter().any(|v| v.abs() > bound / 2.0),
        "A is not all small"
    );
    let b = vec![0.0; d.d_out * d.r];
    let base = linear_forward(&x, &w, d.rows, d.d_in, d.d_out, 1);
    let mut y = base.clone();
    lora::forward(&x, &a, &b, &mut y, None, d, 1);
    assert_eq!(
        y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        base.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

/// Central differences of `L = <adapter(x), proj>` in each of A, B and x
/// against the analytic gradients. The adapter is linear in each, so the
/// differences are exact up to rounding.
fn check_gradients(d: LoraDims, p: f32, seed: u64) {
    let mut rng = XorShift::new(seed);
    let x = randv(&mut rng, d.rows * d.d_in, 1.0);
    let a = randv(&mut rng, d.r * d.d_in, 0.3);
    let b = randv(&mut rng, d.d_out * d.r, 0.3);
    let proj = randv(&mut rng, d.rows * d.d_out, 1.0);
    let mask = lora::dropout_mask(x.len(), p, seed ^ 77);
    assert_eq!(mask.is_some(), p > 0.0);
    let mut y = vec![0.0; d.rows * d.d_out];
    let cache: LoraCache = lora::forward(&x, &a, &b, &mut y, mask.clone(), d, 1);
    let (mut da, mut db) = (vec![0.0; a.len()], vec![0.0; b.len()]);
    // dx accumulates: start from a non-zero base gradient.
    let base_dx = randv(&mut rng, x.len(), 1.0);
    let mut dx = base_dx.clone();
    lora::backward(&proj, &x, &a, &b, &cache, &mut da, &mut db, &mut dx, d, 1);
    let dx: Vec<f32> = dx.iter().zip(&base_dx).map(|(g, b)| g - b).collect();

    let loss =
        |x: &[f32], a: &[f32], b: &[f32]| dot64(&adapter_out(x, a, b, mask.clone(), d), &proj);
    let h = 1e-2f32;
    let compare = |name: &str, analytic: &[f32], eval: &dyn Fn(usize, f32) -> f64| {
        for (i, &g) in analytic.iter().enumerate() {
            let num = (eval(i, h) - eval(i, -h)) / (2.0 * h as f64);
            let err = (num - g as f64).abs();
            assert!(
                err <= 1e-3 * (1.0 + num.abs()),
                "{name}[{i}]: analytic {g}, numeric {num} (p = {p}, scale = {})",
                d.scale
            );
        }
    };
    let shifted = |v: &[f32], i: usize, dv: f32| {
        let mut v = v.to_vec();
        v[i] += dv;
        v
    };
    compare("dA", &da, &|i, dv| loss(&x, &shifted(&a, i, dv), &b));
    compare("dB", &db, &|i, dv| loss(&x, &a, &shifted(&b, i, dv)));
    compare("dx", &dx, &|i, dv| loss(&shifted(&x, i, dv), &a, &b));
}

#[test]
fn gradients_match_central_differences() {
    check_gradients(DIMS, 0.0, 3);
    check_gradients(DIMS, 0.3, 4);
    let cfg = LoraConfig {
        use_rslora: true,
        ..LoraConfig::new(4, 8.0, 0.1, &["q_proj"]).unwrap()
    };
    assert_eq!(cfg.scale(), 4.0);
    check_gradients(
        LoraDims {
            r: 4,
            scale: cfg.scale(),
            ..DIMS
        },
        cfg.dropout,
        5,
    );
}

#[test]
fn dropout_masks_are_seeded_and_inverted() {
    let m = lora::dropout_mask(10_000, 0.25, 9).unwrap();
    assert_eq!(Some(&m), lora::dropout_mask(10_000, 0.25, 9).as_ref());
    assert_ne!(Some(&m), lora::dropout_mask(10_000, 0.25, 10).as_ref());
    let dropped = m.iter().filter(|&&k| k == 0.0).count();
    assert!(
        (2_200..2_800).contains(&dropped),
        "{dropped} of 10000 dropped at p = 0.25"
    );
    assert!(m.iter().all(|&k| k == 0.0 || k == 1.0 / 0.75));
    assert!(lora::dropout_mask(10, 0.0, 1).is_none());
}

#[test]
fn merging_gives_the_adapted_output() {
    let mut rng = XorShift::new(6);
    let d = DIMS;
    let x = randv(&mut rng, d.rows * d.d_in, 1.0);
    let w = randv(&mut rng, d.d_out * d.d_in, 0.1);
    let a = randv(&mut rng, d.r * d.d_in, 0.3);
    let b = randv(&mut rng, d.d_out * d.r, 0.3);
    let mut y = linear_forward(&x, &w, d.rows, d.d_in, d.d_out, 1);
    lora::forward(&x, &a, &b, &mut y, None, d, 1);
    let mut merged = w.clone();
    lora::merge(&mut merged, &a, &b, d.d_in, d.d_out, d.r, d.scale);
    let ym = linear_forward(&x, &merged, d.rows, d.d_in, d.d_out, 1);
    for (i, (p, q)) in y.iter().zip(&ym).enumerate() {
        assert!(
            (p - q).abs() <= 1e-4 * (1.0 + p.abs()),
            "[{i}]: {p} vs merged {q}"
        );
    }
}

#[test]
fn bad_settings_are_errors_naming_them() {
    let err = |r, alpha, p, t: &[&str]| LoraConfig::new(r, alpha, p, t).unwrap_err();
    assert!(err(0, 16.0, 0.0, &["q_proj"]).contains("rank r"));
    assert!(err(8, f32::NAN, 0.0, &["q_proj"]).contains("lora_alpha"));
    assert!(err(8, 16.0, 1.0, &["q_proj"]).contains("lora_dropout"));
    assert!(err(8, 16.0, 0.0, &[]).contains("no target modules"));
    let e = err(8, 16.0, 0.0, &["q_proj", "qkv_proj"]);
    assert!(e.contains("\"qkv_proj\"") && e.contains("gate_proj"), "{e}");
}

#[test]
fn peft_files_round_trip() {
    // Targets are kept in block order whatever order they were given in.
    let cfg = LoraConfig::new(8, 16.0, 0.05, &["v_proj", "q_proj", "down_proj"]).unwrap();
    assert_eq!(cfg.targets, ["q_proj", "v_proj", "down_proj"]);
    assert!(cfg.targets("v_proj") && !cfg.targets("k_proj"));
    let json = cfg.peft_config("Qwen/Qwen2.5-14B-Instruct");
    assert_eq!(json["peft_type"], "LORA");
    assert_eq!(json["r"], 8);
    assert_eq!(json["target_modules"][2], "down_proj");
    assert_eq!(LoraConfig::from_peft_config(&json).unwrap(), cfg);

    assert_eq!(
        lora::peft_name(3, "q_proj", false).unwrap(),
        "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"
    );
    assert_eq!(
        lora::peft_name(0, "down_proj", true).unwrap(),
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
    );
    assert!(lora::peft_name(0, "lm_head", false).is_none());

    let with = |k: &str, v: serde_json::Value| {
        let mut j = json.clone();
        j[k] = v;
        LoraConfig::from_peft_config(&j).unwrap_err()
    };
    assert!(with("use_dora", true.into()).contains("use_dora"));
    assert!(with("rank_pattern", serde_json::json!({"q_proj": 4})).contains("rank_pattern"));
    assert!(with("target_modules", "all-linear".into()).contains("regular expression"));
    assert!(with("target_modules", serde_json::json!(["c_attn"])).contains("\"c_attn\""));
    assert!(with("peft_type", "IA3".into()).contains("peft_type"));
    assert!(with("modules_to_save", serde_json::json!(["lm_head"])).contains("modules_to_save"));
}

#[test]
fn trainable_elements_follow_peft_for_qwen2_5_14b() {
    // Qwen2.5-14B: hidden 5120, 40 heads and 8 kv heads of 128, intermediate 13824.
    let shape = |m: &str| match m {
        "q_proj" | "o_proj" => (5120, 5120),
        "k_proj" | "v_proj" => (5120, 1024),
        "gate_proj" | "up_proj" => (5120, 13824),
        "down_proj" => (13824, 5120),
        other => panic!("{other}"),
    };
    let all: Vec<&str> = lora::TARGETS.iter().map(|t| t.0).collect();
    let cfg = LoraConfig::new(8, 16.0, 0.05, &all).unwrap();
    // Per layer: r (in + out) per target; 48 layers.
    assert_eq!(48 * cfg.block_params(shape), 34_406_400);
}

/// `save_adapter` writes PEFT's layout and `load_adapter` reads it back bit
/// for bit; a wrong shape, a missing tensor, an extra tensor and a missing
/// file are errors naming them.
#[test]
fn adapter_directories_round_trip_and_bad_ones_are_named() {
    let cfg = zero_llama::Config {
        qkv_bias: true,
        ..zero_llama::Config::tiny()
    };
    let lc = LoraConfig::new(3, 6.0, 0.05, &["q_proj", "down_proj", "k_proj"]).unwrap();
    let mut rng = XorShift::new(4);
    let infos = lora::all_lora_tensors(&cfg, &lc);
    assert_eq!(infos.len(), 2 * 3 * cfg.n_layers);
    let values: Vec<Vec<f32>> = infos
        .iter()
        .map(|t| randv(&mut rng, t.numel(), 0.5))
        .collect();
    let dir = std::env::temp_dir().join(format!("zero-llama-adapter-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let files = lora::save_adapter(&dir, &cfg, &lc, &values, "base/").unwrap();
    assert_eq!(files, [lora::ADAPTER_CONFIG, lora::ADAPTER_WEIGHTS]);
    let (back, got) = lora::load_adapter(&dir, &cfg).unwrap();
    assert_eq!(back, lc);
    for (a, b) in values.iter().zip(&got) {
        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
    let text = std::fs::read_to_string(dir.join(lora::ADAPTER_CONFIG)).unwrap();
    assert!(text.contains("\"lora_dropout\": 0.05"), "{text}");
    // Another model: wrong shapes, missing layers, extra layers.
    let err = |c: zero_llama::Config| lora::load_adapter(&dir, &c).unwrap_err();
    let e = err(zero_llama::Config {
        dim: 32,
        n_heads: 2,
        n_kv_heads: 1,
        ..cfg
    });
    assert!(
        e.contains("layers.0.self_attn.q_proj.lora_A.weight") && e.contains("[3, 64]"),
        "{e}"
    );
    let e = err(zero_llama::Config { n_layers: 3, ..cfg });
    assert!(e.contains("layers.2.") && e.contains("not found"), "{e}");
    let e = err(zero_llama::Config { n_layers: 1, ..cfg });
    assert!(
        e.contains("layers.1.") && e.contains("not an adapter of this model"),
        "{e}"
    );
    std::fs::remove_file(dir.join(lora::ADAPTER_WEIGHTS)).unwrap();
    let e = err(cfg);
    assert!(e.contains(lora::ADAPTER_WEIGHTS), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
