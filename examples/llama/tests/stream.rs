//! Weights streamed from safetensors files (`weights::open`,
//! `hf::HfDir::open`): every range of a [`TensorFile`] reads the values
//! `weights::load` / `HfModel::open` give, bit for bit, in F32, BF16 and
//! F16; an engine built from the files (`Init::Source`) holds the state of
//! one built from the values, with and without LoRA; a file cut short
//! after the check is an error of `build` naming the file and the tensor.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use zero_testkit::temp::TempDir;

use zero::comm::ThreadGroup;
use zero::core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero::{Engine, Init, TensorSource, UnitState};
use zero_llama::hf::{HfDir, HfModel};
use zero_llama::lora::LoraConfig;
use zero_llama::train::{LoraSetup, SftModel};
use zero_llama::weights::{self, Dtype, TensorFile};
use zero_llama::{tensors, Config};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every tensor of `files` read in uneven ranges (a first element alone,
/// then ranges of 7, 1000 and 600 000 elements: across BF16's 2^19-element
/// chunks) equals `want`, bit for bit.
fn assert_ranges_read(files: &[TensorFile], want: &[Vec<f32>]) {
    assert_eq!(files.len(), want.len());
    for (f, w) in files.iter().zip(want) {
        assert_eq!(f.numel(), w.len(), "{}", f.name());
        let mut got = vec![f32::NAN; w.len()];
        let mut at = 0;
        for len in [1, 7, 1000, 600_000].into_iter().cycle() {
            if at == w.len() {
                break;
            }
            let end = (at + len).min(w.len());
            TensorSource::read(f, at..end, &mut got[at..end]).unwrap();
            at = end;
        }
        assert_eq!(bits(&got), bits(w), "tensor `{}`", f.name());
    }
}

/// The fixtures (BF16 in three shards with tied embeddings and q/k/v
/// biases; F32 in one file), and a model saved as F16, F32 and BF16 with
/// a tensor larger than a conversion chunk: ranges of the streamed
/// tensors are the loaded values.
#[test]
fn ranges_of_streamed_tensors_are_the_loaded_values() {
    for name in ["qwen2", "llama"] {
        let m = HfModel::open(&fixture(name)).unwrap();
        let d = HfDir::open(&fixture(name)).unwrap();
        assert_eq!(d.dtype, m.dtype, "{name}");
        assert_ranges_read(&d.weights, &m.params);
    }
    let cfg = Config {
        vocab: 2000,
        dim: 320,
        ..Config::tiny()
    };
    let params: Vec<Vec<f32>> = tensors(&cfg)
        .iter()
        .enumerate()
        .map(|(t, info)| {
            (0..info.numel())
                .map(|i| ((i * 31 + t * 7) % 1013) as f32 * 1.7e-3 - 0.8)
                .collect()
        })
        .collect();
    assert!(params[0].len() > 1 << 19, "the embedding spans two chunks");
    let dir = TempDir::new("dtypes");
    for dtype in [Dtype::F16, Dtype::F32, Dtype::Bf16] {
        let path = dir.0.join(format!("{}.safetensors", dtype.torch_name()));
        weights::save(&path, &cfg, &params, dtype).unwrap();
        let files = weights::open(&path, &cfg).unwrap();
        assert!(files.iter().all(|f| f.dtype() == dtype));
        assert_ranges_read(&files, &weights::load(&path, &cfg).unwrap());
    }
}

/// Every unit's parameters and master, bit for bit.
fn assert_same_states(a: &[UnitState], b: &[UnitState], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (u, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(bits(&x.params), bits(&y.params), "{what}: unit {u} params");
        assert_eq!(bits(&x.master), bits(&y.master), "{what}: unit {u} master");
    }
}

/// The engine's state, on 2 ranks, after building the model of `cfg`
/// from `init` (values or sources) with LoRA when `lora`: rank 0's view.
fn built(
    c: &ResolvedConfig,
    cfg: Config,
    init: Vec<Init>,
    lora: Option<LoraSetup>,
) -> zero::Result<Vec<UnitState>> {
    let mut out = ThreadGroup::run(2, |comm| -> zero::Result<Vec<UnitState>> {
        let mut b = Engine::builder(c.clone(), comm).seed(3);
        SftModel::register_from(&mut b, cfg, Some(init.clone()), lora.clone(), 1, false)?;
        let mut e = b.build()?;
        e.unit_ids().into_iter().map(|u| e.unit_state(u)).collect()
    })
    .unwrap();
    let rank1 = out.pop().unwrap();
    let rank0 = out.pop().unwrap();
    assert_eq!(rank0.is_ok(), rank1.is_ok(), "the ranks agree");
    rank0
}

/// `config` for 2 ranks at `stage`, bf16, with both offloads on nvme at
/// stage 3 (ZeRO-Infinity) under `dir`.
fn engine_config(stage: u8, dir: &Path) -> ResolvedConfig {
    let mut c = ResolvedConfig::simple(stage, 2, 1);
    c.precision = Precision::Bf16;
    if stage == 3 {
        let z = &mut c.zero;
        z.sub_group_size = 5000;
        z.offload_optimizer.device = OffloadDevice::Nvme;
        z.offload_optimizer.nvme_path = Some(dir.join("opt"));
        z.offload_param.device = OffloadDevice::Nvme;
        z.offload_param.nvme_path = Some(dir.join("param"));
        z.offload_param.buffer_size = 1 << 16;
        z.offload_param.max_in_cpu = 0;
        z.aio.block_size = 4096;
    }
    c
}

/// The Qwen2 fixture (BF16 shards, tied embeddings, q/k/v biases) built
/// from its files and from its values, stages 2 and 3 (both offloads on
/// nvme), with and without LoRA (the base frozen): the same parameters and
/// master, bit for bit.
#[test]
fn an_engine_built_from_the_files_holds_the_loaded_values() {
    let dir = TempDir::new("engine");
    let m = HfModel::open(&fixture("qwen2")).unwrap();
    let d = HfDir::open(&fixture("qwen2")).unwrap();
    let values: Vec<Init> = m
        .params
        .iter()
        .map(|v| Init::Values(v.as_slice().into()))
        .collect();
    let sources: Vec<Init> = d
        .weights
        .iter()
        .map(|f| Init::Source(Arc::new(f.clone())))
        .collect();
    let lora = LoraSetup {
        cfg: LoraConfig::new(2, 4.0, 0.0, &["q_proj", "v_proj"]).unwrap(),
        seed: 5,
        adapters: None,
    };
    for stage in [2, 3] {
        for lora in [None, Some(lora.clone())] {
            let what = format!("stage {stage}, LoRA {}", lora.is_some());
            let c = engine_config(stage, &dir.0);
            let want = built(&c, m.hf.config, values.clone(), lora.clone()).unwrap();
            let got = built(&c, m.hf.config, sources.clone(), lora).unwrap();
            assert_same_states(&want, &got, &what);
        }
    }
}

/// A weights file cut short after it was checked: the build fails on
/// both ranks with an error naming the file and the tensor it could not
/// read.
#[test]
fn a_file_cut_short_after_the_check_fails_the_build() {
    let dir = TempDir::new("cut");
    let cfg = Config::tiny();
    let params: Vec<Vec<f32>> = tensors(&cfg)
        .iter()
        .map(|t| vec![0.25; t.numel()])
        .collect();
    let path = dir.0.join("model.safetensors");
    weights::save(&path, &cfg, &params, Dtype::Bf16).unwrap();
    let files = weights::open(&path, &cfg).unwrap();
    // The tensor whose bytes end the file.
    let last = files
        .iter()
        .max_by_key(|f| f.bytes().end)
        .unwrap()
        .name()
        .to_string();
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 64)
        .unwrap();
    let init: Vec<Init> = files
        .into_iter()
        .map(|f| Init::Source(Arc::new(f)))
        .collect();
    let err = built(&engine_config(3, &dir.0), cfg, init, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&path.display().to_string()) && err.contains(&format!("tensor `{last}`")),
        "{err}"
    );
    assert!(err.contains("cannot read elements"), "{err}");
}
