//! `llama_sft --export` writes what the model is ([`zero_llama::export`]):
//! the fp32 master of every trained tensor, the frozen base as its
//! checkpoint holds it, in `--export-dtype` or by default the
//! checkpoint's own dtype, tensor by tensor. Driven as `llama_sft
//! --model-dir` drives it: the weights streamed into the engine from the
//! fixture's files (`Init::Source`), stage 3 on 2 thread ranks, bf16 (its
//! default) or fp16 parameters (the `--steps 0` checks also with the
//! optimizer state and parameters offloaded to host memory), rank 0
//! writing what
//! [`SftModel::export_tensors`] reads.
//!
//! - `--steps 0`: an F32 (fixtures/llama), a BF16 (fixtures/qwen2,
//!   sharded), an F16 and a mixed F32/BF16 checkpoint (both converted
//!   here from fixtures/llama) come back bit for bit: every tensor in its
//!   own dtype with the same bytes, `config.json` naming the dtype.
//! - After bf16 training the default F32 export is the engine's master
//!   bit for bit (not the bf16 working copy, which differs), and
//!   `--export-dtype bf16` / `fp16` are the master rounded to nearest
//!   even.
//! - `--merge-lora` after bf16 training: every base tensor the adapters
//!   do not touch is the checkpoint's, byte for byte; the targeted ones
//!   are `W + s·B·A` of the checkpoint's `W` and the adapters' master, as
//!   [`merge_adapters`] computes it, bit for bit for an F32 base, rounded
//!   to nearest even for a BF16 one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use zero_testkit::temp::TempDir;

use serde_json::Value;
use zero::comm::{Communicator, ThreadGroup};
use zero::core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero::core::optim::LrSchedule;
use zero::core::{bf16, f16};
use zero::{Engine, Init, Tracer};
use zero_llama as llama;

use llama::export::{self, Target};
use llama::hf::{self, ExportSource, HfDir, HfTokenizer};
use llama::lora::LoraConfig;
use llama::train::{merge_adapters, LoraSetup, Part, SftModel};
use llama::weights::{self, Dtype, SafetensorsFile, TensorDtypes};
use llama::{tensors, Config};

/// A fixture directory.
fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Tensor name -> (dtype, raw bytes) of every tensor of a directory's
/// weights (one file, or the files of its index).
fn raw_tensors(dir: &Path) -> HashMap<String, (safetensors::Dtype, Vec<u8>)> {
    let index = dir.join(weights::INDEX_FILE);
    let files: Vec<PathBuf> = if index.is_file() {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
        let mut names: Vec<&str> = v["weight_map"]
            .as_object()
            .unwrap()
            .values()
            .map(|f| f.as_str().unwrap())
            .collect();
        names.sort();
        names.dedup();
        names.into_iter().map(|n| dir.join(n)).collect()
    } else {
        vec![dir.join(hf::WEIGHTS_FILE)]
    };
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

/// The `dtype` / `torch_dtype` values of a directory's `config.json`.
fn config_dtypes(dir: &Path) -> Vec<String> {
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    ["dtype", "torch_dtype"]
        .iter()
        .filter_map(|k| v.get(*k).map(|d| d.as_str().unwrap().to_string()))
        .collect()
}

/// A copy of fixtures/llama (F32) whose tensor `name` is stored as
/// `dtype(name)` (rounded to nearest even, `half`), with `config.json`'s
/// `dtype` set to `config`.
fn converted_llama(tag: &str, dtype: impl Fn(&str) -> Dtype, config: &str) -> TempDir {
    let src = fixture("llama");
    let t = TempDir::new(tag);
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        let name = e.file_name();
        if name != hf::WEIGHTS_FILE && !name.to_string_lossy().starts_with("golden") {
            std::fs::copy(e.path(), t.0.join(name)).unwrap();
        }
    }
    let raw = raw_tensors(&src);
    let bytes: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = {
        let f = SafetensorsFile::open(&src.join(hf::WEIGHTS_FILE)).unwrap();
        f.names()
            .into_iter()
            .map(|n| {
                let shape = f.metadata().info(&n).unwrap().shape.clone();
                let (dt, b) = &raw[&n];
                assert_eq!(*dt, safetensors::Dtype::F32, "{n}: the fixture is F32");
                let values: Vec<f32> = b
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                let d = dtype(&n);
                let out: Vec<u8> = match d {
                    Dtype::F32 => b.clone(),
                    Dtype::Bf16 => values
                        .iter()
                        .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                        .collect(),
                    Dtype::F16 => values
                        .iter()
                        .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                        .collect(),
                };
                (n, d, shape, out)
            })
            .collect()
    };
    let views = bytes.iter().map(|(n, d, shape, b)| {
        let view = safetensors::tensor::TensorView::new(d.st(), shape.clone(), b).unwrap();
        (n.as_str(), view)
    });
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), &t.0.join(hf::WEIGHTS_FILE)).unwrap();
    let p = t.0.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    v["dtype"] = config.into();
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    t
}

/// How a run keeps its state.
#[derive(Clone, Copy, Debug)]
struct Mode {
    precision: Precision,
    /// The optimizer state and the parameters offloaded to host memory.
    offload: bool,
}

/// bf16 or fp16 parameters, nothing offloaded.
fn plain(precision: Precision) -> Mode {
    Mode {
        precision,
        offload: false,
    }
}

/// The engine config of a `llama_sft` run: stage 3, `mode`, a constant
/// learning rate large enough to move the weights in a step.
fn engine_config(mode: Mode, micro: usize) -> ResolvedConfig {
    let mut c = ResolvedConfig::simple(3, 2, micro);
    c.precision = mode.precision;
    if mode.offload {
        c.zero.offload_optimizer.device = OffloadDevice::Cpu;
        c.zero.offload_param.device = OffloadDevice::Cpu;
    }
    c.optimizer.lr = 1e-2;
    c.optimizer.weight_decay = 0.0;
    c.scheduler = LrSchedule::Constant { lr: 1e-2 };
    c
}

/// What one rank of a run returns: every tensor's fp32 master (trainable
/// ones) and working copy, by name, and the adapters' master.
#[derive(Default)]
struct Seen {
    master: HashMap<String, Vec<f32>>,
    params: HashMap<String, Vec<f32>>,
    adapters: Vec<Vec<f32>>,
}

/// One run as `llama_sft --model-dir dir` does it, on 2 thread ranks:
/// the weights streamed from their files, `steps` optimizer steps on a
/// few samples of the addition task through the model's chat template,
/// then one export per entry of `exports` (the path and `--export-dtype`),
/// as `llama_sft` writes it. Returns rank 0's [`Seen`] after training.
fn run(
    dir: &Path,
    mode: Mode,
    lora: Option<LoraConfig>,
    steps: usize,
    exports: &[(PathBuf, Option<Dtype>)],
) -> Seen {
    let probe = HfDir::open(dir).unwrap();
    let tok = HfTokenizer::load(dir, probe.hf.eos_token_ids.first().copied()).unwrap();
    let micro = 2;
    let samples: Vec<llama::data::Sample> = (0..2 * micro as u64)
        .map(|n| {
            tok.sample(
                &format!("{}=", 300 + n),
                "",
                &llama::data::answer_for(300 + n),
            )
            .unwrap()
        })
        .collect();
    let seq = llama::data::max_len(&samples);
    let runs =
        ThreadGroup::run(2, |comm| -> zero::Result<Seen> {
            let rank = comm.rank();
            let m = HfDir::open(dir).unwrap();
            let checkpoint = TensorDtypes::of_files(&m.weights);
            let mut cfg = m.hf.config;
            cfg.max_seq = seq;
            let init: Vec<Init> = m
                .weights
                .iter()
                .map(|f| Init::Source(Arc::new(f.clone())))
                .collect();
            let setup = lora.clone().map(|cfg| LoraSetup {
                cfg,
                seed: 5,
                adapters: None,
            });
            let mut b = Engine::builder(engine_config(mode, micro), comm).seed(1);
            let model = SftModel::register_from(&mut b, cfg, Some(init), setup, 1, false)?;
            let mut e = b.build()?;
            let mine: Vec<&llama::data::Sample> =
                samples[micro * rank..micro * (rank + 1)].iter().collect();
            let (tokens, targets) =
                llama::data::make_batch_with_pad(&mine, seq, tok.pad_id()).unwrap();
            for _ in 0..steps {
                let t = Tracer::disabled();
                match mode.precision {
                    Precision::Bf16 => model
                        .train_micro_batch::<bf16, _>(&mut e, &tokens, &targets, micro, seq, &t)?,
                    Precision::Fp16 => model
                        .train_micro_batch::<f16, _>(&mut e, &tokens, &targets, micro, seq, &t)?,
                    Precision::Fp32 => model
                        .train_micro_batch::<f32, _>(&mut e, &tokens, &targets, micro, seq, &t)?,
                };
                e.step()?;
            }
            let mut seen = Seen::default();
            for part in Part::all(&cfg) {
                let u = match part {
                    Part::Embed => model.embed,
                    Part::Layer(l) => model.layers[l],
                    Part::Head => model.head,
                };
                let st = e.unit_state(u)?;
                let lay = e.layout(u)?.clone();
                for t in &tensors(&cfg)[part.range(&cfg)] {
                    let tl = lay.tensor(&t.name).unwrap();
                    if tl.trainable {
                        seen.master
                            .insert(t.name.clone(), st.master[tl.range()].to_vec());
                        seen.params
                            .insert(t.name.clone(), st.params[tl.range()].to_vec());
                    }
                }
            }
            seen.adapters = model.snapshot_adapters(&mut e)?;
            for (path, asked) in exports {
                let dtypes = export::choose(*asked, Some(checkpoint.clone()));
                let mut out_cfg = cfg;
                out_cfg.max_seq = m.hf.config.max_seq;
                let target = Target {
                    path,
                    source: Some(ExportSource {
                        dir: &m.dir,
                        hf: &m.hf,
                    }),
                    bos_eos: (None, None),
                };
                export::write(
                    target,
                    &out_cfg,
                    &dtypes,
                    &mut |part| {
                        model
                            .export_tensors(&mut e, part)
                            .map_err(|e| e.to_string())
                    },
                    rank == 0,
                )
                .map_err(|what| zero::Error::Usage { rank, what })?;
            }
            Ok(seen)
        })
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect::<Vec<_>>();
    runs.into_iter().next().unwrap()
}

/// Every tensor of `out` is `src`'s: the same dtype, the same bytes.
fn assert_same_tensors(what: &str, src: &Path, out: &Path) {
    let (a, b) = (raw_tensors(src), raw_tensors(out));
    assert_eq!(a.len(), b.len(), "{what}: tensor count");
    for (n, (dt, bytes)) in &a {
        let (dt2, bytes2) = b
            .get(n)
            .unwrap_or_else(|| panic!("{what}: {n} not exported"));
        assert_eq!(dt, dt2, "{what}: {n} dtype");
        assert!(bytes == bytes2, "{what}: {n} differs");
    }
}

/// `--steps 0 --export` with default flags gives back an F32, a BF16
/// (sharded), an F16 and a mixed F32/BF16 checkpoint bit for bit, whether
/// the run's parameters are bf16 or fp16, to a directory and to a
/// `.safetensors` file; `config.json` names the dtype (F32 for the mix).
#[test]
fn steps_0_gives_back_every_checkpoint_bit_for_bit() {
    let f16 = converted_llama("f16", |_| Dtype::F16, "float16");
    let mixed = converted_llama(
        "mixed",
        |n| {
            if n.ends_with("norm.weight") {
                Dtype::F32
            } else {
                Dtype::Bf16
            }
        },
        "bfloat16",
    );
    let (llama, qwen2) = (fixture("llama"), fixture("qwen2"));
    let cases: [(&str, &Path, &str); 4] = [
        ("F32", &llama, "float32"),
        ("BF16", &qwen2, "bfloat16"),
        ("F16", &f16.0, "float16"),
        ("F32/BF16", &mixed.0, "float32"),
    ];
    for (what, src, torch) in cases {
        for mode in [
            plain(Precision::Bf16),
            plain(Precision::Fp16),
            Mode {
                precision: Precision::Bf16,
                offload: true,
            },
        ] {
            let out = TempDir::new("steps0");
            let dir = out.0.join("hf");
            let file = out.0.join("w.safetensors");
            run(
                src,
                mode,
                None,
                0,
                &[(dir.clone(), None), (file.clone(), None)],
            );
            let what = format!("{what} under {mode:?}");
            assert_same_tensors(&what, src, &dir);
            for d in config_dtypes(&dir) {
                assert_eq!(d, torch, "{what}: config.json");
            }
            // The weights file alone: the same tensors.
            let single = TempDir::new("single");
            std::fs::copy(&file, single.0.join(hf::WEIGHTS_FILE)).unwrap();
            assert_same_tensors(&format!("{what} (file)"), src, &single.0);
        }
    }
    // The F32 checkpoint's file is transformers' byte for byte.
    let out = TempDir::new("llama-bytes");
    run(
        &fixture("llama"),
        plain(Precision::Bf16),
        None,
        0,
        &[(out.0.clone(), None)],
    );
    assert!(
        std::fs::read(fixture("llama").join(hf::WEIGHTS_FILE)).unwrap()
            == std::fs::read(out.0.join(hf::WEIGHTS_FILE)).unwrap(),
        "the export of fixtures/llama is not its model.safetensors"
    );
}

/// Tensor `name` of a directory's weights as f32 (from F32, BF16 or F16).
fn read_tensor(
    dir: &Path,
    name: &str,
    raw: &HashMap<String, (safetensors::Dtype, Vec<u8>)>,
) -> Vec<f32> {
    let (dt, b) = raw
        .get(name)
        .unwrap_or_else(|| panic!("{}: no {name}", dir.display()));
    match dt {
        safetensors::Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        safetensors::Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        safetensors::Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        d => panic!("{name}: {d:?}"),
    }
}

/// After bf16 training, the default export of an F32 checkpoint is the
/// engine's fp32 master bit for bit, not the bf16 working copy;
/// `--export-dtype bf16` and `fp16` are the master rounded to nearest
/// even, and `config.json` says so.
#[test]
fn bf16_training_exports_the_master() {
    let out = TempDir::new("trained");
    let (f32_dir, bf16_dir, f16_dir) = (out.0.join("f32"), out.0.join("bf16"), out.0.join("f16"));
    let seen = run(
        &fixture("llama"),
        plain(Precision::Bf16),
        None,
        3,
        &[
            (f32_dir.clone(), None),
            (bf16_dir.clone(), Some(Dtype::Bf16)),
            (f16_dir.clone(), Some(Dtype::F16)),
        ],
    );
    let src = fixture("llama");
    let cfg = HfDir::open(&src).unwrap().hf.config;
    let names: Vec<String> = tensors(&cfg).into_iter().map(|t| t.name).collect();
    assert_eq!(seen.master.len(), names.len(), "every tensor trains");
    // The master is not the working copy: an export of the latter (what
    // llama_sft wrote before) would fail the checks below.
    let moved = names
        .iter()
        .filter(|n| seen.master[*n] != seen.params[*n])
        .count();
    assert!(moved > names.len() / 2, "{moved} masters differ from bf16");
    let original = raw_tensors(&src);
    let (a, b, c) = (
        raw_tensors(&f32_dir),
        raw_tensors(&bf16_dir),
        raw_tensors(&f16_dir),
    );
    let mut trained = 0;
    for n in &names {
        let master = &seen.master[n];
        assert_eq!(a[n].0, safetensors::Dtype::F32, "{n}");
        let got = read_tensor(&f32_dir, n, &a);
        assert!(
            got.iter()
                .zip(master)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "{n}: the F32 export is not the master"
        );
        trained += usize::from(got != read_tensor(&src, n, &original));
        assert_eq!(b[n].0, safetensors::Dtype::BF16, "{n}");
        let rne: Vec<u8> = master
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect();
        assert!(b[n].1 == rne, "{n}: BF16 is not the master rounded");
        assert_eq!(c[n].0, safetensors::Dtype::F16, "{n}");
        let rne: Vec<u8> = master
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect();
        assert!(c[n].1 == rne, "{n}: F16 is not the master rounded");
    }
    assert!(trained > names.len() / 2, "only {trained} tensors trained");
    for (dir, torch) in [
        (&f32_dir, "float32"),
        (&bf16_dir, "bfloat16"),
        (&f16_dir, "float16"),
    ] {
        assert_eq!(config_dtypes(dir), [torch], "{}", dir.display());
    }
}

/// `--merge-lora` after bf16 training of adapters, the default export:
/// every base tensor the adapters do not touch is the checkpoint's, byte
/// for byte (the engine holds it as bf16); the targeted ones are the
/// checkpoint's `W` plus `s·B·A` of the adapters' master, as
/// [`merge_adapters`] computes it in f32: bit for bit for an F32 base
/// (fixtures/llama), rounded to nearest even for a BF16 one
/// (fixtures/qwen2: biases, tied embeddings).
#[test]
fn merged_lora_export_is_the_checkpoint_plus_the_adapters() {
    for (name, dtype) in [
        ("llama", safetensors::Dtype::F32),
        ("qwen2", safetensors::Dtype::BF16),
    ] {
        let src = fixture(name);
        let lc = LoraConfig::new(4, 8.0, 0.0, &["q_proj", "v_proj"]).unwrap();
        let out = TempDir::new("merged");
        let seen = run(
            &src,
            plain(Precision::Bf16),
            Some(lc.clone()),
            3,
            &[(out.0.clone(), None)],
        );
        assert!(seen.master.is_empty(), "{name}: the base is frozen");
        let cfg: Config = HfDir::open(&src).unwrap().hf.config;
        let original = raw_tensors(&src);
        let names: Vec<String> = tensors(&cfg).into_iter().map(|t| t.name).collect();
        let mut expect: Vec<Vec<f32>> = names
            .iter()
            .map(|n| read_tensor(&src, n, &original))
            .collect();
        let base = expect.clone();
        merge_adapters(&cfg, &lc, &mut expect, &seen.adapters);
        let got = raw_tensors(&out.0);
        let mut merged = 0;
        for (i, n) in names.iter().enumerate() {
            assert_eq!(got[n].0, dtype, "{name}: {n}");
            if expect[i] == base[i] {
                assert!(
                    got[n].1 == original[n].1,
                    "{name}: {n}: not the checkpoint's bytes"
                );
                continue;
            }
            merged += 1;
            let want: Vec<u8> = if dtype == safetensors::Dtype::F32 {
                expect[i].iter().flat_map(|x| x.to_le_bytes()).collect()
            } else {
                expect[i]
                    .iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                    .collect()
            };
            assert!(
                got[n].1 == want,
                "{name}: {n}: not the checkpoint's base with the adapters merged"
            );
        }
        assert_eq!(
            merged,
            2 * cfg.n_layers,
            "{name}: q_proj and v_proj of every layer"
        );
        if dtype == safetensors::Dtype::F32 {
            // The bf16 copy the engine trained with is not the base: an
            // export of it would fail above.
            let q = &base[cfg.layer_range(0).start];
            let rounded: Vec<f32> = q
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect();
            assert_ne!(&rounded, q, "{name}: the base is bf16 already");
        }
    }
}
