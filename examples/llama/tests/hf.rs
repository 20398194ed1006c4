//! Hugging Face directories against `transformers` (the fixtures and their
//! golden numbers come from `tests/fixtures/make_golden.py`; no PyTorch is
//! needed here): forward logits, the shifted causal-LM loss and every
//! parameter gradient of a Qwen2 (q/k/v biases, tied embeddings, BF16,
//! sharded) and a Llama (untied, vocabulary 263, GQA with one KV head,
//! rope_theta 5e5, rms_norm_eps 1e-5, F32); the tokenizer and chat template
//! against `apply_chat_template`; an export that gives back the input
//! tensors bit for bit; and every bad input named before training.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use zero_testkit::temp::TempDir;

use llama::hf::{self, ExportSource, HfModel, HfTokenizer};
use llama::weights::{self, SafetensorsFile};
use llama::{ops, tensors, Config, Model};
use serde_json::Value;
use zero_llama as llama;

/// A fixture directory.
fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A copy of fixture `name` (its model and tokenizer files) in a fresh
/// temp directory.
fn copy_of(name: &str) -> TempDir {
    let t = TempDir::new(&format!("llama-hf-{name}"));
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), t.0.join(e.file_name())).unwrap();
    }
    t
}

/// Edits `config.json` of `dir` with `f`.
fn edit_config(dir: &TempDir, f: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let p = dir.0.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// What `make_golden.py` computed for a fixture.
struct Golden {
    ids: Vec<Vec<u32>>,
    labels: Vec<Vec<i64>>,
    loss: f64,
    chat: Value,
    /// `logits` and `grad.<name>`, F32.
    tensors: HashMap<String, Vec<f32>>,
}

fn golden(name: &str) -> Golden {
    let dir = fixture(name);
    let j: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let rows = |k: &str| -> Vec<Vec<i64>> {
        j[k].as_array()
            .unwrap()
            .iter()
            .map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_i64().unwrap())
                    .collect()
            })
            .collect()
    };
    let mut f = SafetensorsFile::open(&dir.join("golden.safetensors")).unwrap();
    let mut tensors = HashMap::new();
    for n in f.names() {
        let shape = f.metadata().info(&n).unwrap().shape.clone();
        tensors.insert(n.clone(), f.read(&n, &shape).unwrap());
    }
    Golden {
        ids: rows("input_ids")
            .into_iter()
            .map(|r| r.into_iter().map(|x| x as u32).collect())
            .collect(),
        labels: rows("labels"),
        loss: j["loss"].as_f64().unwrap(),
        chat: j["chat"].clone(),
        tensors,
    }
}

/// `max |a - b|` and the index where it is.
fn max_err(a: &[f32], b: &[f32]) -> (f32, usize) {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .enumerate()
        .fold((0f32, 0), |m, (i, e)| if e > m.0 { (e, i) } else { m })
}

fn max_abs(a: &[f32]) -> f32 {
    a.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// Our loss, logits and gradients of `params` on the golden batch of `g`
/// (transformers shifts: position t predicts label t + 1).
fn run_golden(cfg: Config, params: &[Vec<f32>], g: &Golden) -> (f32, Vec<f32>, Vec<Vec<f32>>) {
    let (batch, seq) = (g.ids.len(), g.ids[0].len());
    let tokens: Vec<u32> = g.ids.concat();
    let targets: Vec<i32> = g
        .labels
        .iter()
        .flat_map(|row| (0..seq).map(move |t| if t + 1 < seq { row[t + 1] as i32 } else { -100 }))
        .collect();
    let model = Model::new(cfg, 1);
    let refs: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
    let (loss, cache) = model.forward(&refs, &tokens, &targets, batch, seq);
    let logits = ops::linear_forward(
        &cache.xn,
        refs[cfg.head_index()],
        batch * seq,
        cfg.dim,
        cfg.vocab,
        1,
    );
    let grads = model.backward(&refs, &cache);
    (loss, logits, grads)
}

/// Our forward and backward on the fixture's tokens against transformers':
/// logits within 1e-5 of the largest logit, the loss within 1e-6
/// relative, every gradient within 2e-5 of its tensor's largest element
/// (fp32 arithmetic in a different order; the errors seen are printed).
fn matches_transformers(name: &str, expect: impl Fn(&Config)) {
    let m = HfModel::open(&fixture(name)).unwrap_or_else(|e| panic!("{e}"));
    let cfg = m.hf.config;
    expect(&cfg);
    let g = golden(name);
    let (loss, logits, grads) = run_golden(cfg, &m.params, &g);
    let want = &g.tensors["logits"];
    let (err, at) = max_err(&logits, want);
    let scale = max_abs(want);
    eprintln!("{name}: logits max |err| {err:.3e} (max |logit| {scale:.3}), at {at}");
    assert!(
        err <= 1e-5 * scale,
        "{name}: logit {at}: {} vs {}",
        logits[at],
        want[at]
    );
    let rel = ((f64::from(loss) - g.loss) / g.loss).abs();
    eprintln!(
        "{name}: loss {loss} vs transformers {} (rel err {rel:.2e})",
        g.loss
    );
    assert!(rel < 1e-6, "{name}: loss {loss} vs {}", g.loss);

    let infos = tensors(&cfg);
    assert_eq!(
        infos.len(),
        g.tensors.len() - 1,
        "{name}: one golden gradient per tensor"
    );
    assert_grads(name, &infos, &grads, &g.tensors);
}

/// Every gradient of `infos` within 2e-5 of its golden tensor's largest
/// element (`grad.<name>` of `want`); prints the worst.
fn assert_grads(
    name: &str,
    infos: &[llama::TensorInfo],
    grads: &[Vec<f32>],
    want: &HashMap<String, Vec<f32>>,
) {
    let mut worst = (0f32, String::new());
    for (t, gr) in infos.iter().zip(grads) {
        let want = want
            .get(&format!("grad.{}", t.name))
            .unwrap_or_else(|| panic!("{name}: no golden gradient for {}", t.name));
        let (err, at) = max_err(gr, want);
        let scale = max_abs(want);
        assert!(scale > 0.0, "{name}: {}: zero gradient", t.name);
        let rel = err / scale;
        assert!(
            rel <= 2e-5,
            "{name}: gradient of {} element {at}: {} vs {} (max |g| {scale})",
            t.name,
            gr[at],
            want[at]
        );
        if rel > worst.0 {
            worst = (rel, t.name.clone());
        }
    }
    eprintln!(
        "{name}: gradients: worst max |err| / max |g| {:.3e} ({})",
        worst.0, worst.1
    );
}

#[test]
fn qwen2_matches_transformers() {
    matches_transformers("qwen2", |c| {
        assert!(c.qkv_bias && c.tie_embeddings);
        assert_eq!((c.vocab, c.n_kv_heads, c.rope_theta), (300, 2, 1e6));
        assert_eq!(c.norm_eps, 1e-6);
    });
}

#[test]
fn llama_matches_transformers() {
    matches_transformers("llama", |c| {
        assert!(!c.qkv_bias && !c.tie_embeddings);
        assert_eq!((c.vocab, c.n_kv_heads, c.rope_theta), (263, 1, 5e5));
        assert_eq!(c.norm_eps, 1e-5);
    });
}

/// A real vocabulary (32768), tied embeddings, BF16, and `pad_token_id` =
/// `eos_token_id` = the end-of-turn token, which the batch holds as an
/// input: loss, logits and gradients within `matches_transformers`'
/// tolerances (the log-sum-exp over 32768 logits of std ~3 is where an
/// f32 running sum lost precision), and the padding row's gradient, which
/// transformers' `padding_idx` leaves to the LM head alone.
#[test]
fn bigvocab_with_padding_matches_transformers() {
    let name = "llama_bigvocab";
    matches_transformers(name, |c| {
        assert!(!c.qkv_bias && c.tie_embeddings);
        assert_eq!((c.vocab, c.n_kv_heads, c.pad_id), (32768, 2, Some(2)));
    });
    let m = HfModel::open(&fixture(name)).unwrap();
    let g = golden(name);
    let pad = m.hf.config.pad_id.unwrap();
    assert_eq!(m.hf.eos_token_ids, vec![pad], "pad = end of turn");
    let inputs = g.ids.concat().iter().filter(|&&t| t == pad).count();
    assert!(
        inputs >= 4,
        "the batch holds the padding token {inputs} times"
    );
    // The padding row within the tolerance of the whole tensor's check; the
    // row with its input lookups counted (no padding_idx) far outside it.
    let want = &g.tensors["grad.model.embed_tokens.weight"];
    let dim = m.hf.config.dim;
    let rows = (pad as usize * dim)..((pad as usize + 1) * dim);
    let tol = 2e-5 * max_abs(want);
    let row_err = |cfg: Config| {
        let (_, _, grads) = run_golden(cfg, &m.params, &g);
        max_err(&grads[0][rows.clone()], &want[rows.clone()]).0
    };
    let with = row_err(m.hf.config);
    let without = row_err(Config {
        pad_id: None,
        ..m.hf.config
    });
    eprintln!(
        "{name}: padding row max |err| {with:.3e}; counting its lookups {without:.3e} \
         (tolerance {tol:.3e}, max |row| {:.3e})",
        max_abs(&want[rows.clone()])
    );
    assert!(with <= tol, "{with} > {tol}");
    assert!(without > 100.0 * tol, "{without}: the lookups do not show");
}

/// The tokenizer and chat template give `apply_chat_template`'s ids: the
/// prompt with the generation prompt, and prompt ++ answer the whole
/// conversation (answer ending in EOS); decoding the answer gives the text.
#[test]
fn chat_template_matches_transformers() {
    for name in ["qwen2", "llama"] {
        let m = HfModel::open(&fixture(name)).unwrap();
        let t = HfTokenizer::load(&fixture(name), m.hf.eos_token_ids.first().copied())
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(t.has_chat_template());
        let chat = golden(name).chat;
        let ids = |k: &str| -> Vec<u32> {
            chat[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        let (user, answer) = (
            chat["user"].as_str().unwrap(),
            chat["assistant"].as_str().unwrap(),
        );
        assert_eq!(
            t.eos_id() as u64,
            chat["eos_token_id"].as_u64().unwrap(),
            "{name}"
        );
        let s = t.sample(user, "", answer).unwrap();
        assert_eq!(s.prompt, ids("prompt_ids"), "{name}: prompt");
        assert_eq!(t.prompt(user, "").unwrap(), s.prompt, "{name}");
        let full: Vec<u32> = s.prompt.iter().chain(&s.answer).copied().collect();
        assert_eq!(full, ids("full_ids"), "{name}: conversation");
        assert!(s.answer.contains(&t.eos_id()), "{name}");
        assert_eq!(t.decode(&s.answer), answer, "{name}");
        assert_eq!(s.number, Some(1807));
        assert!(t.max_id() < m.hf.config.vocab as u32, "{name}");
    }
}

/// Tensor name -> raw bytes of every tensor of a directory's weights.
fn raw_tensors(dir: &Path) -> HashMap<String, (safetensors::Dtype, Vec<u8>)> {
    let mut files = Vec::new();
    let index = dir.join(weights::INDEX_FILE);
    if index.is_file() {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
        let mut names: Vec<&str> = v["weight_map"]
            .as_object()
            .unwrap()
            .values()
            .map(|f| f.as_str().unwrap())
            .collect();
        names.sort();
        names.dedup();
        files.extend(names.into_iter().map(|n| dir.join(n)));
    } else {
        files.push(dir.join(hf::WEIGHTS_FILE));
    }
    let mut out = HashMap::new();
    for p in files {
        let mut f = SafetensorsFile::open(&p).unwrap();
        for n in f.names() {
            let dt = f.dtype(&n).unwrap();
            out.insert(n.clone(), (dt, f.raw_bytes(&n).unwrap()));
        }
    }
    out
}

/// A loaded directory exported in its own dtype gives back every tensor
/// bit for bit (sharded again for the Qwen2), its config (dtype included)
/// and its tokenizer files; the export loads as the same model.
#[test]
fn export_gives_back_the_input_bit_for_bit() {
    for (name, shard) in [("qwen2", 20_000u64), ("llama", hf::DEFAULT_SHARD_BYTES)] {
        let src = fixture(name);
        let m = HfModel::open(&src).unwrap();
        let out = TempDir::new("export");
        let files = hf::export(
            &out.0,
            &m.hf.config,
            &m.params,
            m.dtype,
            Some(ExportSource {
                dir: &src,
                hf: &m.hf,
            }),
            (None, None),
            shard,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        for f in [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "chat_template.jinja",
        ] {
            assert!(files.iter().any(|x| x == f), "{name}: {f} not in {files:?}");
        }
        assert_eq!(
            out.0.join(weights::INDEX_FILE).is_file(),
            name == "qwen2",
            "{name}: sharded only above the size"
        );
        if name == "llama" {
            // One file, as transformers' `save_pretrained` wrote it (names
            // sorted, `{"format": "pt"}`): the same bytes.
            assert!(
                std::fs::read(src.join(hf::WEIGHTS_FILE)).unwrap()
                    == std::fs::read(out.0.join(hf::WEIGHTS_FILE)).unwrap(),
                "{name}: {} is not transformers' file",
                hf::WEIGHTS_FILE
            );
        }
        let (a, b) = (raw_tensors(&src), raw_tensors(&out.0));
        assert_eq!(a.len(), b.len(), "{name}: tensor count");
        for (n, (dt, bytes)) in &a {
            let (dt2, bytes2) = &b[n];
            assert_eq!(dt, dt2, "{name}: {n} dtype");
            assert!(bytes == bytes2, "{name}: {n} differs");
        }
        for f in [
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "generation_config.json",
        ] {
            assert_eq!(
                std::fs::read(src.join(f)).unwrap(),
                std::fs::read(out.0.join(f)).unwrap(),
                "{name}: {f}"
            );
        }
        let back = HfModel::open(&out.0).unwrap();
        assert_eq!(back.hf.config, m.hf.config);
        assert_eq!(back.dtype, m.dtype);
        assert_eq!(back.params, m.params);
        assert_eq!(back.hf.raw, m.hf.raw, "{name}: config.json kept as it was");
    }
}

/// A model made here (no source directory) exports a config that reads
/// back as the same `Config`, with BOS/EOS in both JSON files.
#[test]
fn export_without_a_source_writes_a_config() {
    let cfg = Config {
        vocab: 261,
        max_seq: 48,
        qkv_bias: true,
        tie_embeddings: true,
        norm_eps: 1e-5,
        pad_id: Some(257),
        ..Config::tiny()
    };
    let params = llama::init_params(&cfg, 3);
    let out = TempDir::new("made");
    hf::export(
        &out.0,
        &cfg,
        &params,
        weights::Dtype::Bf16,
        None,
        (Some(256), Some(257)),
        hf::DEFAULT_SHARD_BYTES,
    )
    .unwrap();
    let back = HfModel::open(&out.0).unwrap();
    assert_eq!(back.hf.config, cfg);
    assert_eq!(back.hf.model_type, hf::ModelType::Qwen2);
    assert_eq!(back.dtype, weights::Dtype::Bf16);
    assert_eq!(
        (back.hf.bos_token_id, back.hf.eos_token_ids.clone()),
        (Some(256), vec![257])
    );
    let gen: Value = serde_json::from_str(
        &std::fs::read_to_string(out.0.join("generation_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        (gen["bos_token_id"].as_u64(), gen["eos_token_id"].as_u64()),
        (Some(256), Some(257))
    );
}

fn open_err(dir: &Path) -> String {
    match HfModel::open(dir) {
        Ok(_) => panic!("{} should not load", dir.display()),
        Err(e) => e,
    }
}

/// Every config key that the model cannot honour is an error naming the
/// file and the key.
#[test]
fn bad_configs_are_named() {
    type Edit = fn(&mut serde_json::Map<String, Value>);
    let cases: &[(&str, Edit, &str)] = &[
        (
            "model_type",
            |c| {
                c.insert("model_type".into(), "mistral".into());
            },
            "`mistral` is not supported",
        ),
        (
            "model_type",
            |c| {
                c.remove("model_type");
            },
            "missing",
        ),
        (
            "rope_scaling",
            |c| {
                c.insert(
                    "rope_scaling".into(),
                    serde_json::json!({"rope_type": "linear", "factor": 2.0}),
                );
            },
            "not supported",
        ),
        (
            "rope_parameters",
            |c| {
                c.insert(
                    "rope_parameters".into(),
                    serde_json::json!({"rope_type": "yarn", "rope_theta": 1e4}),
                );
            },
            "\"default\"",
        ),
        (
            "head_dim",
            |c| {
                c.insert("head_dim".into(), 16.into());
            },
            "differs from hidden_size / num_attention_heads = 8",
        ),
        (
            "num_key_value_heads",
            |c| {
                c.insert("num_key_value_heads".into(), 3.into());
            },
            "does not divide",
        ),
        (
            "hidden_size",
            |c| {
                c.remove("hidden_size");
            },
            "missing",
        ),
        (
            "vocab_size",
            |c| {
                c.insert("vocab_size".into(), (-3).into());
            },
            "not a whole number",
        ),
        (
            "attention_bias",
            |c| {
                c.insert("attention_bias".into(), true.into());
            },
            "o_proj",
        ),
        (
            "hidden_act",
            |c| {
                c.insert("hidden_act".into(), "gelu".into());
            },
            "silu only",
        ),
        (
            "pad_token_id",
            |c| {
                c.insert("pad_token_id".into(), 263.into());
            },
            "263 is not a token id below vocab_size 263",
        ),
        (
            "layer_types",
            |c| {
                c.insert(
                    "layer_types".into(),
                    serde_json::json!(["full_attention", "sliding_attention"]),
                );
            },
            "full_attention",
        ),
    ];
    for (key, edit, says) in cases {
        let d = copy_of("llama");
        edit_config(&d, edit);
        let e = open_err(&d.0);
        assert!(
            e.contains("config.json") && e.contains(&format!("`{key}`")) && e.contains(says),
            "{key}: {e}"
        );
    }
    let d = copy_of("qwen2");
    edit_config(&d, |c| {
        c.insert("use_sliding_window".into(), true.into());
    });
    assert!(open_err(&d.0).contains("`use_sliding_window`"));
}

/// Weights that do not fit the config, and broken shards: each error names
/// the file and the tensor (or the missing file).
#[test]
fn bad_weights_are_named() {
    // A missing tensor: the config asks for a layer more.
    let d = copy_of("llama");
    edit_config(&d, |c| {
        c.insert("num_hidden_layers".into(), 3.into());
    });
    let e = open_err(&d.0);
    assert!(
        e.contains("model.safetensors")
            && e.contains("`model.layers.2.self_attn.q_proj.weight` not found"),
        "{e}"
    );
    // A wrong shape.
    let d = copy_of("llama");
    edit_config(&d, |c| {
        c.insert("intermediate_size".into(), 50.into());
    });
    let e = open_err(&d.0);
    assert!(
        e.contains("`model.layers.0.mlp.gate_proj.weight` has shape [48, 32], but the config expects [50, 32]"),
        "{e}"
    );
    // An unused tensor: lm_head.weight of an untied model read as tied.
    let d = copy_of("llama");
    edit_config(&d, |c| {
        c.insert("tie_word_embeddings".into(), true.into());
    });
    let e = open_err(&d.0);
    assert!(
        e.contains("`lm_head.weight` is not used") && e.contains("tie_word_embeddings"),
        "{e}"
    );
    // Qwen2 weights read as Llama: the biases are unused.
    let d = copy_of("qwen2");
    edit_config(&d, |c| {
        c.insert("model_type".into(), "llama".into());
    });
    let e = open_err(&d.0);
    assert!(
        e.contains("_proj.bias` is not used") && e.contains("(and 5 more)"),
        "{e}"
    );
    // A tied model whose file lacks biases? A Llama read as Qwen2.
    let d = copy_of("llama");
    edit_config(&d, |c| {
        c.insert("model_type".into(), "qwen2".into());
    });
    let e = open_err(&d.0);
    assert!(
        e.contains("`model.layers.0.self_attn.q_proj.bias` not found"),
        "{e}"
    );
    // The index names a file that is not there.
    let d = copy_of("qwen2");
    std::fs::remove_file(d.0.join("model-00002-of-00003.safetensors")).unwrap();
    let e = open_err(&d.0);
    assert!(
        e.contains(weights::INDEX_FILE)
            && e.contains("names model-00002-of-00003.safetensors")
            && e.contains("missing"),
        "{e}"
    );
    // No weights at all.
    let d = copy_of("llama");
    std::fs::remove_file(d.0.join("model.safetensors")).unwrap();
    assert!(open_err(&d.0).contains("no model.safetensors"));
    // Not a directory.
    assert!(open_err(&fixture("nope")).contains("not a directory"));
}

/// A missing or unreadable tokenizer, and a special token it lacks, are
/// errors naming the file.
#[test]
fn bad_tokenizers_are_named() {
    let err = |d: &Path| match HfTokenizer::load(d, None) {
        Ok(_) => panic!("{} should not load", d.display()),
        Err(e) => e,
    };
    let d = copy_of("llama");
    std::fs::remove_file(d.0.join("tokenizer.json")).unwrap();
    let e = err(&d.0);
    assert!(e.contains("tokenizer.json: missing"), "{e}");
    std::fs::write(d.0.join("tokenizer.json"), "{ not json").unwrap();
    let e = err(&d.0);
    assert!(
        e.contains("tokenizer.json: cannot load the tokenizer"),
        "{e}"
    );
    let d = copy_of("llama");
    let tc = d.0.join("tokenizer_config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&tc).unwrap()).unwrap();
    v["eos_token"] = "<|no such token|>".into();
    std::fs::write(&tc, v.to_string()).unwrap();
    let e = err(&d.0);
    assert!(
        e.contains("`eos_token` \"<|no such token|>\" is not a token"),
        "{e}"
    );
    let d = copy_of("llama");
    std::fs::write(
        d.0.join("chat_template.jinja"),
        "{{ raise_exception('no chat') }}",
    )
    .unwrap();
    let e = err(&d.0);
    assert!(e.contains("chat template") && e.contains("no chat"), "{e}");
}

/// The Llama fixture (F32) under the engine, as `llama_sft --model-dir`
/// drives it: samples from its tokenizer and chat template, stage 3 on 2
/// thread ranks, fp32; the loss falls, and the trained weights exported
/// and read back are the engine's snapshot bit for bit, in the source's
/// layout and dtype.
#[test]
fn fixture_trains_under_the_engine_and_exports() {
    use zero::comm::{Communicator, ThreadGroup};
    use zero::core::config::{Precision, ResolvedConfig};
    use zero::core::optim::LrSchedule;
    use zero::{Engine, Tracer};

    let src = fixture("llama");
    let m = HfModel::open(&src).unwrap();
    let tok = HfTokenizer::load(&src, None).unwrap();
    let samples: Vec<llama::data::Sample> = (0..8u64)
        .map(|n| {
            tok.sample(
                &format!("{}=", 100 + n),
                "",
                &llama::data::answer_for(100 + n),
            )
            .unwrap()
        })
        .collect();
    let seq = llama::data::max_len(&samples);
    let mut cfg = m.hf.config;
    cfg.max_seq = seq;
    let out = TempDir::new("trained");
    let runs = ThreadGroup::run(2, |comm| -> zero::Result<(Vec<f32>, Vec<Vec<f32>>)> {
        let rank = comm.rank();
        let mut c = ResolvedConfig::simple(3, 2, 4);
        c.precision = Precision::Fp32;
        c.optimizer.lr = 1e-2;
        c.optimizer.weight_decay = 0.0;
        c.scheduler = LrSchedule::Constant { lr: 1e-2 };
        let mut b = Engine::builder(c, comm).seed(1);
        let model =
            llama::train::SftModel::register(&mut b, cfg, Some(m.params.clone()), 1, false)?;
        let mut e = b.build()?;
        let mine: Vec<&llama::data::Sample> = samples[4 * rank..4 * rank + 4].iter().collect();
        let (tokens, targets) = llama::data::make_batch_with_pad(&mine, seq, tok.pad_id()).unwrap();
        let mut losses = Vec::new();
        for _ in 0..6 {
            let st = model.train_micro_batch::<f32, _>(
                &mut e,
                &tokens,
                &targets,
                4,
                seq,
                &Tracer::disabled(),
            )?;
            losses.push(st.loss);
            e.step()?;
        }
        Ok((losses, model.snapshot(&mut e)?))
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap())
    .collect::<Vec<_>>();
    let (losses, snapshot) = &runs[0];
    assert!(
        losses[5] < 0.7 * losses[0],
        "the loss does not fall: {losses:?}"
    );
    assert_eq!(snapshot, &runs[1].1, "ranks agree");
    assert_ne!(snapshot, &m.params, "training changed the weights");
    hf::export(
        &out.0,
        &m.hf.config,
        snapshot,
        m.dtype,
        Some(ExportSource {
            dir: &src,
            hf: &m.hf,
        }),
        (None, None),
        hf::DEFAULT_SHARD_BYTES,
    )
    .unwrap();
    let back = HfModel::open(&out.0).unwrap();
    assert_eq!(&back.params, snapshot);
    assert_eq!(back.hf.config, m.hf.config, "max_position_embeddings kept");
}

/// `strftime_now` (Llama 3.2's templates call it) formats UTC dates; an
/// unsupported directive is an error naming it, also from a template.
#[test]
fn strftime_now_formats_dates() {
    use llama::hf::tokenizer::strftime_utc;
    // 2024-07-26 13:05:09 UTC, a Friday, day 208 of a leap year.
    let t = 1_721_999_109;
    assert_eq!(strftime_utc("%d %b %Y", t).unwrap(), "26 Jul 2024");
    assert_eq!(
        strftime_utc("%A %B %e %y %m %H:%M:%S %j %%", t).unwrap(),
        "Friday July 26 24 07 13:05:09 208 %"
    );
    assert_eq!(strftime_utc("%d %b %Y", 0).unwrap(), "01 Jan 1970");
    assert_eq!(
        strftime_utc("%Y-%m-%d %a", 951_782_400).unwrap(),
        "2000-02-29 Tue"
    );
    assert!(strftime_utc("%Q", t).unwrap_err().contains("`%Q`"));

    let d = copy_of("llama");
    std::fs::write(
        d.0.join("chat_template.jinja"),
        "{{ bos_token }}Today {{ strftime_now('%Y') }}: {{ messages[0].content | trim }}",
    )
    .unwrap();
    let t = HfTokenizer::load(&d.0, None).unwrap();
    let text = t.render(" 5= ", None).unwrap();
    let year: u32 = text["<|begin_of_text|>Today ".len()..][..4]
        .parse()
        .unwrap();
    assert!(year >= 2024 && text.ends_with(": 5="), "{text}");
    std::fs::write(d.0.join("chat_template.jinja"), "{{ strftime_now('%Q') }}").unwrap();
    assert!(HfTokenizer::load(&d.0, None)
        .err()
        .unwrap()
        .contains("`%Q` is not supported"));
}

/// transformers 4's layout of the same model: `rope_theta` at the top,
/// `rope_scaling: null`, `torch_dtype`, and the chat template inside
/// `tokenizer_config.json` (no `chat_template.jinja`): the same model and
/// the same chat ids.
#[test]
fn transformers_4_layout_reads_the_same() {
    let d = copy_of("llama");
    edit_config(&d, |c| {
        let theta = c.remove("rope_parameters").unwrap()["rope_theta"].clone();
        c.insert("rope_theta".into(), theta);
        c.insert("rope_scaling".into(), Value::Null);
        let dtype = c.remove("dtype").unwrap();
        c.insert("torch_dtype".into(), dtype);
    });
    let template = std::fs::read_to_string(d.0.join("chat_template.jinja")).unwrap();
    std::fs::remove_file(d.0.join("chat_template.jinja")).unwrap();
    let tc = d.0.join("tokenizer_config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&tc).unwrap()).unwrap();
    v["chat_template"] = template.into();
    std::fs::write(&tc, v.to_string()).unwrap();

    let (a, b) = (
        HfModel::open(&fixture("llama")).unwrap(),
        HfModel::open(&d.0).unwrap(),
    );
    assert_eq!(a.hf.config, b.hf.config);
    assert_eq!(a.hf.dtype, b.hf.dtype);
    let t = HfTokenizer::load(&d.0, None).unwrap();
    let s = t
        .sample("1807=", "", "王大丫丫的回答是--->1800 + 7")
        .unwrap();
    let full: Vec<u32> = s.prompt.iter().chain(&s.answer).copied().collect();
    let want: Vec<u32> = golden("llama").chat["full_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(full, want);
}

/// Without a chat template the prompt is the text with the tokenizer's
/// special tokens (the Llama fixture's BOS) and the answer the output and
/// EOS; without any EOS (no `eos_token`, no `eos_token_id`) the tokenizer
/// is refused, since generation would not stop.
#[test]
fn no_chat_template_and_no_eos() {
    let d = copy_of("llama");
    std::fs::remove_file(d.0.join("chat_template.jinja")).unwrap();
    let t = HfTokenizer::load(&d.0, None).unwrap();
    assert!(!t.has_chat_template());
    let s = t.sample("17=", "", "王大丫丫的回答是--->10 + 7").unwrap();
    let bos = t.encode("", true).unwrap();
    assert_eq!(bos.len(), 1, "the fixture's post-processor adds one BOS");
    assert_eq!(s.prompt[0], bos[0]);
    assert_eq!(t.decode(&s.prompt), "17=");
    assert_eq!(s.answer.last(), Some(&t.eos_id()));
    assert_eq!(t.decode(&s.answer), "王大丫丫的回答是--->10 + 7");
    // Without a template there is no way to render several turns.
    use llama::chat::{Message, Role};
    let turns = [
        Message::new(Role::System, "S"),
        Message::new(Role::User, "17="),
    ];
    let e = t.sample_messages(&turns, "x").unwrap_err();
    assert!(
        e.contains("no chat template") && e.contains("system, user"),
        "{e}"
    );
    assert!(t.prompt_messages(&turns).is_err());

    let tc = d.0.join("tokenizer_config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&tc).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("eos_token");
    std::fs::write(&tc, v.to_string()).unwrap();
    let e = HfTokenizer::load(&d.0, None).err().unwrap();
    assert!(
        e.contains("no `eos_token`") && e.contains("eos_token_id"),
        "{e}"
    );
    // The model config's eos_token_id stands in.
    assert_eq!(HfTokenizer::load(&d.0, Some(1)).unwrap().eos_id(), 1);
}

/// LoRA against PEFT (`tests/fixtures/make_golden_lora.py`): the Qwen2
/// fixture plus the adapter PEFT saved (rank 4, alpha 8, all seven target
/// modules, random non-zero A and B), read with `lora::load_adapter`: the
/// logits within 1e-5 of the largest logit, the loss within 1e-6
/// relative, and every adapter gradient within 2e-5 of its tensor's
/// largest element (fp32 in a different order; the errors seen are
/// printed).
#[test]
fn lora_matches_peft() {
    use llama::lora;
    let m = HfModel::open(&fixture("qwen2")).unwrap_or_else(|e| panic!("{e}"));
    let cfg = m.hf.config;
    let (lc, adapters) =
        lora::load_adapter(&fixture("qwen2_lora"), &cfg).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((lc.r, lc.alpha, lc.dropout), (4, 8.0, 0.0));
    assert_eq!(lc.targets.len(), 7, "{:?}", lc.targets);
    let g = golden("qwen2");
    let dir = fixture("qwen2_lora");
    let mut f = SafetensorsFile::open(&dir.join("golden.safetensors")).unwrap();
    let mut want = HashMap::new();
    for n in f.names() {
        let shape = f.metadata().info(&n).unwrap().shape.clone();
        want.insert(n.clone(), f.read(&n, &shape).unwrap());
    }
    let j: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let peft_loss = j["loss"].as_f64().unwrap();
    let (batch, seq) = (g.ids.len(), g.ids[0].len());
    let tokens: Vec<u32> = g.ids.concat();
    let targets: Vec<i32> = g
        .labels
        .iter()
        .flat_map(|row| (0..seq).map(move |t| if t + 1 < seq { row[t + 1] as i32 } else { -100 }))
        .collect();
    let model = Model::with_lora(cfg, lc.clone(), 1);
    let mut params = m.params.clone();
    params.extend(adapters);
    let refs: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
    let (loss, cache) = model.forward(&refs, &tokens, &targets, batch, seq);
    let logits = ops::linear_forward(
        &cache.xn,
        refs[cfg.head_index()],
        batch * seq,
        cfg.dim,
        cfg.vocab,
        1,
    );
    let (err, at) = max_err(&logits, &want["logits"]);
    let scale = max_abs(&want["logits"]);
    eprintln!("lora: logits max |err| {err:.3e} (max |logit| {scale:.3}), at {at}");
    assert!(
        err <= 1e-5 * scale,
        "lora: logit {at}: {} vs {}",
        logits[at],
        want["logits"][at]
    );
    // The adapter matters: the base's logits are far from PEFT's.
    assert!(
        max_err(&logits, &g.tensors["logits"]).0 > 1e3 * err.max(1e-7),
        "the adapter does not change the logits"
    );
    let rel = ((f64::from(loss) - peft_loss) / peft_loss).abs();
    eprintln!("lora: loss {loss} vs PEFT {peft_loss} (rel err {rel:.2e})");
    assert!(rel < 1e-6, "lora: loss {loss} vs {peft_loss}");
    let grads = model.backward(&refs, &cache);
    let infos = lora::all_lora_tensors(&cfg, &lc);
    assert_eq!(
        infos.len(),
        want.len() - 1,
        "one golden gradient per adapter matrix"
    );
    assert_grads("lora", &infos, &grads[cfg.tensor_count()..], &want);
}

/// A multi-turn conversation in the Qwen2 fixture's ChatML template: one
/// sample per assistant turn, each the template's rendering of the history
/// with the generation prompt, then exactly the tokens the template adds
/// for the turn; the last sample is the whole conversation's tokens.
#[test]
fn multi_turn_messages_train_every_assistant_turn() {
    use llama::chat::{parse_examples, samples, Need, Template};
    let t = HfTokenizer::load(&fixture("qwen2"), None).unwrap();
    let ex = parse_examples(
        r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}"#,
        "chat.jsonl",
        Need::Answers,
    )
    .unwrap();
    let s = samples(&t, &ex).unwrap();
    assert_eq!(s.len(), 2);
    let full = t
        .encode(&t.render_messages(&ex[0].messages, false).unwrap(), false)
        .unwrap();
    let last: Vec<u32> = s[1].prompt.iter().chain(&s[1].answer).copied().collect();
    assert_eq!(last, full, "the last turn's sample is the conversation");
    assert!(
        full.starts_with(&s[0].prompt),
        "the first turn's prompt opens it"
    );
    assert!(s[0].prompt.len() < s[1].prompt.len());
    assert_eq!(t.decode(&s[0].answer), "hello");
    assert_eq!(t.decode(&s[1].answer), "4");
    assert_eq!(s[1].answer.iter().filter(|&&i| i == t.eos_id()).count(), 1);
    let system = t.render_messages(&ex[0].messages[..2], true).unwrap();
    assert!(
        system.starts_with("<|im_start|>system\nBe brief."),
        "{system}"
    );
    assert_eq!(Template::prompt(&t, ex[0].prompt()).unwrap(), s[1].prompt);
    // One user turn: the same sample as the Alpaca path.
    let one = parse_examples(
        r#"[{"prompt": "1807=", "completion": "x"}]"#,
        "f",
        Need::Answers,
    )
    .unwrap();
    assert_eq!(
        samples(&t, &one).unwrap()[0],
        t.sample("1807=", "", "x").unwrap()
    );
}

/// The validation loss (forward only, part by part, batches as long as
/// their longest sample, the head on answer rows only) is the model's
/// mean loss over the same answer tokens.
#[test]
fn answer_loss_is_the_models_loss_on_the_answers() {
    use llama::train::FullParams;
    let src = fixture("llama");
    let m = HfModel::open(&src).unwrap();
    let tok = HfTokenizer::load(&src, None).unwrap();
    let samples: Vec<llama::data::Sample> = ["1=", "23=", "456=", "7890=", "12="]
        .iter()
        .map(|p| tok.sample(p, "", "some answer text").unwrap())
        .collect();
    let seq = llama::data::max_len(&samples);
    let mut cfg = m.hf.config;
    cfg.max_seq = seq;
    let all: Vec<&llama::data::Sample> = samples.iter().collect();
    let (tokens, targets) = llama::data::make_batch_with_pad(&all, seq, tok.pad_id()).unwrap();
    let model = Model::new(cfg, 1);
    let refs: Vec<&[f32]> = m.params.iter().map(Vec::as_slice).collect();
    let (want, _) = model.forward(&refs, &tokens, &targets, all.len(), seq);
    let count = targets.iter().filter(|&&t| t >= 0).count();
    // Batches of 2 (the last of 1), then a batch past the end (empty).
    let (sum, n) = llama::eval::answer_loss(
        &cfg,
        &model.block,
        &mut FullParams {
            cfg: &cfg,
            params: &m.params,
        },
        &all,
        4,
        2,
        tok.pad_id(),
        1,
    )
    .unwrap();
    assert_eq!(n, count);
    let got = sum / n as f64;
    assert!(
        (got - f64::from(want)).abs() < 1e-5 * f64::from(want),
        "{got} vs {want}"
    );
}
