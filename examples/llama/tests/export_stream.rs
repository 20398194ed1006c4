//! `llama_sft --export` streams from the engine: every rank reads the
//! model one unit at a time ([`SftModel::part_tensors`], LoRA folded in)
//! in the same order, and rank 0 writes each unit as it comes
//! ([`weights::save_from`], [`hf::export_from`]). The files are byte for
//! byte those of the whole-model path it replaced: the model read whole
//! ([`SftModel::snapshot`], the adapters folded in by [`merge_adapters`]),
//! written by the `safetensors` crate's `serialize_to_file` (the writer
//! the export used before, kept here as the reference) and sharded as
//! `save_sharded` did. Checked at stages 0 and 3 with 2 thread ranks,
//! with and without LoRA, as BF16 and F32, to a `.safetensors` file and
//! to a Hugging Face directory (one file, and shards that split units).

use std::collections::HashMap;
use std::path::Path;
use zero_testkit::temp::TempDir;

use zero::comm::{Communicator, ThreadGroup};
use zero::core::config::{Precision, ResolvedConfig};
use zero::core::{bf16, Element};
use zero::Engine;
use zero_llama as llama;

use llama::data;
use llama::hf::{self, Export};
use llama::lora::LoraConfig;
use llama::train::{merge_adapters, LoraSetup, SftModel};
use llama::weights::{self, Dtype};
use llama::{tensors, Config};

/// The reference: tensors `which` of `params` (in [`tensors`] order)
/// written as `weights::save` wrote them before it streamed, with
/// `safetensors::serialize_to_file` (which orders them itself).
fn reference_file(path: &Path, cfg: &Config, params: &[Vec<f32>], which: &[usize], dtype: Dtype) {
    let infos = tensors(cfg);
    let bytes: Vec<Vec<u8>> = which
        .iter()
        .map(|&i| match dtype {
            Dtype::F32 => params[i].iter().flat_map(|x| x.to_le_bytes()).collect(),
            Dtype::Bf16 => params[i]
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
            Dtype::F16 => params[i]
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
        })
        .collect();
    let views = which.iter().zip(&bytes).map(|(&i, b)| {
        let view =
            safetensors::tensor::TensorView::new(dtype.st(), infos[i].shape.clone(), b).unwrap();
        (infos[i].name.as_str(), view)
    });
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), path).unwrap();
}

/// The reference of a directory's weights: `save_sharded` as it was
/// (split in tensor order at `max` bytes, each file by
/// [`reference_file`], the index).
fn reference_sharded(dir: &Path, cfg: &Config, params: &[Vec<f32>], dtype: Dtype, max: u64) {
    let infos = tensors(cfg);
    let bytes = |i: usize| (infos[i].numel() * dtype.size()) as u64;
    let total: u64 = (0..infos.len()).map(bytes).sum();
    if total <= max {
        let all: Vec<usize> = (0..infos.len()).collect();
        reference_file(&dir.join("model.safetensors"), cfg, params, &all, dtype);
        return;
    }
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0u64;
    for i in 0..infos.len() {
        let last = shards.last_mut().unwrap();
        if !last.is_empty() && size + bytes(i) > max {
            shards.push(vec![i]);
            size = bytes(i);
        } else {
            last.push(i);
            size += bytes(i);
        }
    }
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (k, shard) in shards.iter().enumerate() {
        let name = format!("model-{:05}-of-{n:05}.safetensors", k + 1);
        reference_file(&dir.join(&name), cfg, params, shard, dtype);
        for &i in shard {
            weight_map.insert(infos[i].name.clone(), name.clone().into());
        }
    }
    let index = serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": weight_map,
    });
    std::fs::write(
        dir.join(weights::INDEX_FILE),
        serde_json::to_string_pretty(&index).unwrap(),
    )
    .unwrap();
}

/// Every file of `dir` by name, with its bytes.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

/// Asserts that `a` and `b` hold the same files, byte for byte.
fn same_files(a: &Path, b: &Path, what: &str) {
    let (fa, fb) = (files(a), files(b));
    let names = |f: &[(String, Vec<u8>)]| f.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
    assert_eq!(names(&fa), names(&fb), "{what}: the files");
    for ((n, x), (_, y)) in fa.iter().zip(&fb) {
        assert!(x == y, "{what}: {n} differs");
    }
}

/// The shard size of the sharded directories: a few blocks per file, so
/// that files split blocks.
const SHARD: u64 = 150_000;

/// Samples per rank in the one micro-batch.
const MICRO: usize = 2;

/// The exports of one run.
const OUTPUTS: [(&str, Dtype, u64); 5] = [
    ("file-bf16.safetensors", Dtype::Bf16, 0),
    ("file-f32.safetensors", Dtype::F32, 0),
    ("hf-bf16", Dtype::Bf16, hf::DEFAULT_SHARD_BYTES),
    ("hf-f32-sharded", Dtype::F32, SHARD),
    ("hf-bf16-sharded", Dtype::Bf16, SHARD),
];

/// Every tensor's values, in [`tensors`] order.
type Params = Vec<Vec<f32>>;

/// One rank: one optimizer step (so that the weights and adapters are
/// trained ones), then every export of [`OUTPUTS`] into `dir`, streamed
/// (rank 0 writes); returns the model as the old path read it, without
/// and with the adapters merged.
fn export_rank<T: Element, C: Communicator>(
    comm: C,
    cfg: &ResolvedConfig,
    model_cfg: Config,
    lora: Option<LoraSetup>,
    dir: &Path,
) -> zero::Result<(Params, Params)> {
    let rank = comm.rank();
    let task = data::addition_task(3);
    let seq = data::max_len(&task.train);
    let mut b = Engine::builder(cfg.clone(), comm).seed(7);
    let model = SftModel::register_lora(&mut b, model_cfg, None, lora.clone(), 1, false)?;
    let mut e = b.build()?;
    let micro = MICRO;
    let samples: Vec<&data::Sample> = task.train[rank * micro..(rank + 1) * micro]
        .iter()
        .collect();
    let (tokens, targets) = data::make_batch(&samples, seq).unwrap();
    model.train_micro_batch::<T, C>(
        &mut e,
        &tokens,
        &targets,
        micro,
        seq,
        &zero::Tracer::disabled(),
    )?;
    e.step()?;
    // The export reads parameters alone, or with the master: those of
    // the full state, without the moments.
    for u in e.unit_ids() {
        let params = e.unit_params(u)?;
        let full = e.unit_state(u)?;
        assert_eq!(params, full.params, "unit {u:?}");
        let master = e.unit_master(u)?;
        assert_eq!(master.params, full.params, "unit {u:?}");
        assert_eq!(master.master, full.master, "unit {u:?}");
        assert!(master.m.is_empty() && master.v.is_empty(), "unit {u:?}");
    }

    let usage = |what: String| zero::Error::Usage { rank, what };
    for (name, dtype, shard) in OUTPUTS {
        let mut fetch = |part| model.part_tensors(&mut e, part).map_err(|e| e.to_string());
        let path = dir.join(name);
        if shard == 0 {
            weights::save_from(&path, &model_cfg, dtype, &mut fetch, rank == 0).map_err(usage)?;
        } else {
            let out = Export {
                dtypes: dtype.into(),
                source: None,
                bos_eos: (Some(data::BOS), Some(data::EOS)),
                max_shard_bytes: shard,
            };
            let written =
                hf::export_from(&path, &model_cfg, &mut fetch, out, rank == 0).map_err(usage)?;
            assert_eq!(written.is_empty(), rank != 0, "rank {rank}: {written:?}");
        }
    }
    // The old path: the whole model read at once, the adapters merged.
    let base = model.snapshot(&mut e)?;
    let mut whole = base.clone();
    if let Some(l) = &lora {
        let adapters = model.snapshot_adapters(&mut e)?;
        merge_adapters(&model_cfg, &l.cfg, &mut whole, &adapters);
    }
    Ok((base, whole))
}

#[test]
fn streamed_exports_are_the_whole_model_exports_byte_for_byte() {
    let task = data::addition_task(3);
    let seq = data::max_len(&task.train);
    // 12 blocks, so that names sort blocks 10 and 11 between 1 and 2.
    let plain = Config {
        vocab: data::VOCAB,
        n_layers: 12,
        max_seq: seq + 8,
        ..Config::tiny()
    };
    let biased_tied = Config {
        qkv_bias: true,
        tie_embeddings: true,
        ..plain
    };
    let lora = LoraSetup {
        cfg: LoraConfig::new(4, 8.0, 0.0, &["q_proj", "v_proj", "down_proj"]).unwrap(),
        seed: 5,
        adapters: None,
    };
    for stage in [0u8, 3] {
        for with_lora in [false, true] {
            let what = format!("stage {stage}, LoRA {with_lora}");
            let d = TempDir::new(&format!("s{stage}-l{with_lora}"));
            let mut cfg = ResolvedConfig::simple(stage, 2, 2);
            // LoRA trains in bf16 (its base parameters bf16), the plain
            // model in f32.
            let (model_cfg, setup) = if with_lora {
                cfg.precision = Precision::Bf16;
                (biased_tied, Some(lora.clone()))
            } else {
                (plain, None)
            };
            let dir = d.0.clone();
            let mut wholes = ThreadGroup::run(2, |comm| {
                if with_lora {
                    export_rank::<bf16, _>(comm, &cfg, model_cfg, setup.clone(), &dir)
                } else {
                    export_rank::<f32, _>(comm, &cfg, model_cfg, setup.clone(), &dir)
                }
            })
            .unwrap();
            let (base, whole) = wholes.remove(0).unwrap_or_else(|e| panic!("{what}: {e}"));
            for w in wholes {
                assert_eq!(w.unwrap().1, whole, "{what}: the ranks' models");
            }
            // With LoRA the merge changed the base (the step trained B away
            // from zero), so the exports hold merged weights.
            assert_eq!(base != whole, with_lora, "{what}: merged");
            for (name, dtype, shard) in OUTPUTS {
                let got = d.0.join(name);
                let r = TempDir::new(&format!("ref-s{stage}-l{with_lora}-{name}"));
                if shard == 0 {
                    let want = r.0.join(name);
                    reference_file(
                        &want,
                        &model_cfg,
                        &whole,
                        &(0..whole.len()).collect::<Vec<_>>(),
                        dtype,
                    );
                    assert!(
                        std::fs::read(&got).unwrap() == std::fs::read(&want).unwrap(),
                        "{what}: {name} is not the whole-model file"
                    );
                    continue;
                }
                // The directory from the model in memory (config and
                // generation config as before), its weights replaced by
                // the reference's.
                let want = r.0.join("in-memory");
                hf::export(
                    &want,
                    &model_cfg,
                    &whole,
                    dtype,
                    None,
                    (Some(data::BOS), Some(data::EOS)),
                    shard,
                )
                .unwrap();
                let old = r.0.join("old-writer");
                std::fs::create_dir_all(&old).unwrap();
                reference_sharded(&old, &model_cfg, &whole, dtype, shard);
                let weight_files: Vec<String> = files(&old).into_iter().map(|(n, _)| n).collect();
                assert_eq!(
                    weight_files.len() > 2,
                    shard == SHARD,
                    "{what}: {name}: {weight_files:?}"
                );
                for f in &weight_files {
                    assert!(
                        std::fs::read(want.join(f)).unwrap() == std::fs::read(old.join(f)).unwrap(),
                        "{what}: {name}: {f} is not the old writer's"
                    );
                }
                same_files(&got, &want, &format!("{what}: {name}"));
            }
        }
    }
}

/// A failed write on the writing rank does not leave the others waiting:
/// every rank fetches every unit (stage 3's collectives stay matched),
/// rank 0 gets the error naming the file and leaves no file behind.
#[test]
fn a_failed_write_still_fetches_every_unit() {
    let d = TempDir::new("fail");
    let model_cfg = Config {
        n_layers: 3,
        ..Config::tiny()
    };
    // The output's directory does not exist: rank 0 cannot create it.
    let path = d.0.join("missing").join("model.safetensors");
    let cfg = ResolvedConfig::simple(3, 2, 1);
    let out = ThreadGroup::run(2, |comm| {
        let rank = comm.rank();
        let mut b = Engine::builder(cfg.clone(), comm).seed(1);
        let model = SftModel::register(&mut b, model_cfg, None, 1, false)?;
        let mut e = b.build()?;
        let mut fetched = 0;
        let r = weights::save_from(
            &path,
            &model_cfg,
            Dtype::Bf16,
            &mut |part| {
                fetched += 1;
                model.part_tensors(&mut e, part).map_err(|e| e.to_string())
            },
            rank == 0,
        );
        // Still in step: a collective after the export completes.
        drop(e.gather(model.head)?);
        Ok::<_, zero::Error>((r, fetched))
    })
    .unwrap();
    let parts = model_cfg.n_layers + 2;
    let (r0, f0) = out[0].as_ref().unwrap();
    let (r1, f1) = out[1].as_ref().unwrap();
    let e = r0.as_ref().unwrap_err();
    assert!(e.contains("missing/model.safetensors"), "{e}");
    assert!(r1.is_ok());
    assert_eq!(
        (*f0, *f1),
        (parts, parts),
        "one fetch per unit on each rank"
    );
    assert!(!path.exists());
}
