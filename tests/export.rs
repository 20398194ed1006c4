//! Safetensors export on the threads backend: live
//! ([`Engine::export_safetensors`]) against the engine's master and
//! parameters, offline ([`export_checkpoint`]) byte for byte against live
//! (any saving world size, stage and offload mode),
//! `stage3_gather_16bit_weights_on_model_save`, the Llama example's round
//! trip through its `--init-from` loader, and the errors (missing
//! directory, malformed manifest, truncated or corrupted rank file,
//! unwritable output).

use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use serde_json::{json, Value};
use zero::comm::{Communicator, ThreadComm, ThreadGroup};
use zero::core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero::core::{bf16, f16, Element};
use zero::engine::{export_checkpoint, ExportDtype};
use zero::{Engine, UnitState};
use zero_llama as llama;
use zero_testkit::mlp::{batch, Mlp};
use zero_testkit::runs::*;
use zero_testkit::temp::TempDir;

/// Trains the MLP ([`DIMS`]) `steps` steps on `world` thread ranks, then
/// runs `after` on every rank; every rank's result.
fn trained<R: Send>(
    world: usize,
    cfg: &ResolvedConfig,
    steps: usize,
    after: impl Fn(&mut Engine<ThreadComm>) -> zero::Result<R> + Sync,
) -> Vec<zero::Result<R>> {
    ThreadGroup::run(world, |comm| {
        let rank = comm.rank();
        let mut b = Engine::builder(cfg.clone(), comm).seed(5);
        let model = Mlp::register(&mut b, DIMS)?;
        let mut e = b.build()?;
        for s in 0..steps {
            let (x, y) = batch(((s * world + rank) * MB) as u64, MB, DIMS[0]);
            match cfg.precision {
                Precision::Fp32 => model.train_micro_batch::<f32, _, _>(&mut e, &x, &y)?,
                Precision::Bf16 => model.train_micro_batch::<bf16, _, _>(&mut e, &x, &y)?,
                Precision::Fp16 => model.train_micro_batch::<f16, _, _>(&mut e, &x, &y)?,
            };
            e.step()?;
        }
        after(&mut e)
    })
    .expect("ranks ran")
}

/// Rank 0's result; every rank must succeed.
fn rank0<R>(all: Vec<zero::Result<R>>) -> R {
    let mut ok: Vec<R> = all
        .into_iter()
        .enumerate()
        .map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r} failed: {e}")))
        .collect();
    ok.swap_remove(0)
}

fn states(e: &mut Engine<ThreadComm>) -> zero::Result<Vec<UnitState>> {
    e.unit_ids().into_iter().map(|u| e.unit_state(u)).collect()
}

/// Every unit's state, a live export in F32 and in BF16 (`live-f32`,
/// `live-bf16` under `dir`), and a checkpoint saved under `dir/ckpt`.
struct Run {
    states: Vec<UnitState>,
    saved: PathBuf,
}

fn export_and_save(world: usize, cfg: &ResolvedConfig, dir: &Path) -> Run {
    rank0(trained(world, cfg, 3, |e| {
        let states = states(e)?;
        e.export_safetensors(&dir.join("live-f32.safetensors"), ExportDtype::F32)?;
        e.export_safetensors(&dir.join("live-bf16.safetensors"), ExportDtype::Bf16)?;
        let saved = e.save_checkpoint(&dir.join("ckpt"), json!({ "note": "export test" }))?;
        Ok(Run { states, saved })
    }))
}

/// The MLP's exported tensors: `layer{l}.weight` `[o, i]` and
/// `layer{l}.bias` `[o]` (the registered names repeat across units, so
/// they are qualified by the unit), with the values `pick` takes from each
/// unit's state.
fn mlp_tensors(
    states: &[UnitState],
    pick: impl Fn(&UnitState) -> &[f32],
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut out = Vec::new();
    for (l, s) in states.iter().enumerate() {
        let (i, o) = (DIMS[l], DIMS[l + 1]);
        let v = pick(s);
        assert_eq!(v.len(), o * i + o);
        out.push((format!("layer{l}.weight"), vec![o, i], v[..o * i].to_vec()));
        out.push((format!("layer{l}.bias"), vec![o], v[o * i..].to_vec()));
    }
    out
}

fn encode(dtype: safetensors::Dtype, v: &[f32]) -> Vec<u8> {
    match dtype {
        safetensors::Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        safetensors::Dtype::BF16 => v
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
            .collect(),
        safetensors::Dtype::F16 => v
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_le_bytes())
            .collect(),
        other => panic!("unexpected dtype {other:?}"),
    }
}

/// The file at `path` parses with the `safetensors` crate, has
/// `__metadata__` `{"format": "pt"}` and exactly the tensors `want` (name,
/// shape, dtype, values bit for bit — `want`'s values must be exact in
/// `dtype`).
fn assert_file(path: &Path, dtype: safetensors::Dtype, want: &[(String, Vec<usize>, Vec<f32>)]) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    assert_eq!(n % 8, 0, "{}: header length {n}", path.display());
    let (_, meta) = SafeTensors::read_metadata(&bytes).expect("a safetensors header");
    let format = meta.metadata().as_ref().and_then(|m| m.get("format"));
    assert_eq!(format.map(String::as_str), Some("pt"));
    let st = SafeTensors::deserialize(&bytes).expect("a safetensors file");
    assert_eq!(st.len(), want.len(), "{}: tensor count", path.display());
    for (name, shape, values) in want {
        let t = st
            .tensor(name)
            .unwrap_or_else(|e| panic!("{}: `{name}`: {e}", path.display()));
        assert_eq!(t.dtype(), dtype, "`{name}`");
        assert_eq!(t.shape(), &shape[..], "`{name}`");
        let exact = encode(dtype, values);
        assert!(
            t.data() == &exact[..],
            "{}: `{name}` differs from the expected values",
            path.display()
        );
    }
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// No `.tmp` file or directory is left under `dir`.
fn assert_no_tmp(dir: &Path) {
    for e in std::fs::read_dir(dir).expect("list").flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        assert!(
            !name.ends_with(".tmp") && !name.starts_with(".tmp"),
            "{} left behind",
            e.path().display()
        );
        if e.path().is_dir() {
            assert_no_tmp(&e.path());
        }
    }
}

/// Stage 3 on 2 ranks, bf16: the F32 export is the fp32 master of every
/// unit bit for bit, the BF16 export the parameters, under the qualified
/// MLP names, shapes and dtypes.
#[test]
fn live_export_is_the_master_and_the_params() {
    let dir = TempDir::new("export-live");
    let run = export_and_save(2, &config(2, 3, 1, Precision::Bf16), &dir);
    let master = mlp_tensors(&run.states, |s| &s.master);
    let params = mlp_tensors(&run.states, |s| &s.params);
    assert!(
        master.iter().zip(&params).any(|(m, p)| m.2 != p.2),
        "training moved the master off the bf16 grid (else the test shows nothing)"
    );
    assert_file(
        &dir.join("live-f32.safetensors"),
        safetensors::Dtype::F32,
        &master,
    );
    assert_file(
        &dir.join("live-bf16.safetensors"),
        safetensors::Dtype::BF16,
        &params,
    );
    assert_no_tmp(&dir);
}

/// The offline export of a saved checkpoint (from its directory and from
/// its root through `latest`) equals the live export byte for byte, in F32
/// and BF16, whatever the saving world size (1, 2, 3), stage and
/// optimizer offload.
#[test]
fn offline_export_equals_live_export() {
    let base = TempDir::new("export-offline");
    let cases = [
        (2, 3, OffloadDevice::None),
        (3, 3, OffloadDevice::None),
        (3, 2, OffloadDevice::Nvme),
        (2, 1, OffloadDevice::Cpu),
        (2, 0, OffloadDevice::None),
        (1, 2, OffloadDevice::None),
    ];
    for (world, stage, opt) in cases {
        let what = format!("world {world} stage {stage} offload_optimizer {opt:?}");
        let dir = base.join(format!("w{world}s{stage}{opt:?}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut cfg = config(world, stage, 1, Precision::Bf16);
        if opt != OffloadDevice::None {
            cfg.zero.sub_group_size = 97;
            cfg.zero.offload_optimizer.device = opt;
            cfg.zero.offload_optimizer.buffer_count = 3;
            cfg.zero.offload_optimizer.nvme_path = Some(dir.join("swap"));
            cfg.zero.aio.block_size = 4096;
        }
        let run = export_and_save(world, &cfg, &dir);
        for (dtype, live) in [
            (ExportDtype::F32, "live-f32.safetensors"),
            (ExportDtype::Bf16, "live-bf16.safetensors"),
        ] {
            let live = read(&dir.join(live));
            for from in [run.saved.clone(), dir.join("ckpt")] {
                let out = dir.join("offline.safetensors");
                let used =
                    export_checkpoint(&from, &out, dtype).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(used, run.saved, "{what}");
                assert!(
                    read(&out) == live,
                    "{what} {dtype:?} from {}: the offline export differs from the live one",
                    from.display()
                );
            }
        }
        assert_no_tmp(&dir);
    }
}

/// `zero_optimization.stage3_gather_16bit_weights_on_model_save`: the
/// checkpoint directory holds `model.safetensors` in the parameter dtype
/// (BF16, F16, F32), equal to the parameters, listed in the manifest with
/// its length and CRC32; the checkpoint still loads, bit for bit.
#[test]
fn gather_16bit_weights_on_model_save() {
    let base = TempDir::new("export-gather16");
    let cases = [
        (Precision::Bf16, 3, safetensors::Dtype::BF16, "BF16"),
        (Precision::Fp16, 2, safetensors::Dtype::F16, "F16"),
        (Precision::Fp32, 1, safetensors::Dtype::F32, "F32"),
    ];
    for (precision, stage, dtype, name) in cases {
        let dir = base.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let mut cfg = config(2, stage, 1, precision);
        cfg.zero.gather_16bit_weights_on_model_save = true;
        let run = export_and_save(2, &cfg, &dir);
        let model = run.saved.join("model.safetensors");
        assert_file(&model, dtype, &mlp_tensors(&run.states, |s| &s.params));
        if precision == Precision::Bf16 {
            assert!(read(&model) == read(&dir.join("live-bf16.safetensors")));
        }
        let text = std::fs::read_to_string(run.saved.join("manifest.json")).unwrap();
        let manifest: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(manifest["version"], 1);
        let entry = &manifest["model"];
        assert_eq!(entry["name"], "model.safetensors", "{entry}");
        assert_eq!(entry["dtype"], name, "{entry}");
        let bytes = read(&model);
        assert_eq!(entry["bytes"], bytes.len() as u64, "{entry}");
        assert_eq!(entry["crc32"], crc32fast::hash(&bytes), "{entry}");
        assert_no_tmp(&dir);
        // Loads as before, on the same and another world size.
        for world in [2, 3] {
            let loaded = rank0(
                ThreadGroup::run(world, |comm| {
                    let mut c = config(world, stage, 1, precision);
                    c.zero.gather_16bit_weights_on_model_save = true;
                    let mut b = Engine::builder(c, comm).seed(5);
                    Mlp::register(&mut b, DIMS)?;
                    let (mut e, client) = Engine::load_checkpoint(b, &run.saved)?;
                    assert_eq!(client["note"], "export test");
                    states(&mut e)
                })
                .expect("ranks ran"),
            );
            assert_eq!(loaded, run.states, "{name}: loaded at world {world}");
        }
    }
    // Without the option there is no model file and no `model` key.
    let dir = base.join("off");
    std::fs::create_dir_all(&dir).unwrap();
    let run = export_and_save(2, &config(2, 3, 1, Precision::Bf16), &dir);
    assert!(!run.saved.join("model.safetensors").exists());
    let text = std::fs::read_to_string(run.saved.join("manifest.json")).unwrap();
    assert!(!text.contains("\"model\""), "{text}");
}

mod llama_round_trip {
    use super::*;
    use llama::data;
    use llama::train::SftModel;
    use llama::{tensors, weights, Config};
    use zero::core::optim::LrSchedule;
    use zero::Tracer;

    const MB: usize = 2;
    const SEED: u64 = 42;

    fn model_cfg() -> Config {
        Config {
            vocab: data::VOCAB,
            dim: 16,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            hidden: 24,
            max_seq: data::max_len(&data::addition_task(SEED).train),
            ..Config::tiny()
        }
    }

    fn engine_cfg(world: usize, stage: u8) -> ResolvedConfig {
        let mut c = ResolvedConfig::simple(stage, world, MB);
        c.precision = Precision::Bf16;
        c.optimizer.lr = 1e-2;
        c.scheduler = LrSchedule::Constant { lr: 1e-2 };
        c.gradient_clipping = 1.0;
        c.zero.param_persistence_threshold = 0;
        c
    }

    /// The snapshot (parameters per tensor, in [`tensors`] order) and the
    /// master per tensor.
    struct Trained {
        snapshot: Vec<Vec<f32>>,
        master: Vec<Vec<f32>>,
    }

    fn per_tensor(cfg: &Config, flat: &[f32]) -> Vec<Vec<f32>> {
        let mut rest = flat;
        tensors(cfg)
            .iter()
            .map(|t| {
                let (a, b) = rest.split_at(t.numel());
                rest = b;
                a.to_vec()
            })
            .collect()
    }

    fn read_out(model: &SftModel, e: &mut Engine<ThreadComm>) -> zero::Result<Trained> {
        let snapshot = model.snapshot(e)?;
        let master: Vec<f32> = states(e)?.into_iter().flat_map(|s| s.master).collect();
        Ok(Trained {
            snapshot,
            master: per_tensor(&model.cfg, &master),
        })
    }

    /// Trains the example's model 2 steps on 2 ranks (stage 3, bf16),
    /// saves, exports offline; `weights::load` (what `--init-from` calls)
    /// reads back the master from the F32 file and the parameters from the
    /// BF16 file; an engine registered with the loaded F32 values
    /// (`--init-from`, stage 1 on 3 ranks) starts from the same master and
    /// parameters.
    #[test]
    fn export_loads_back_with_init_from() {
        let dir = TempDir::new("export-llama");
        let cfg = model_cfg();
        let ecfg = engine_cfg(2, 3);
        let train = data::addition_task(SEED).train;
        let seq = data::max_len(&train);
        let order = data::epoch_order(train.len(), 0, SEED);
        let root = dir.join("ckpt");
        let (run, saved) = rank0(
            ThreadGroup::run(2, |comm| {
                let (rank, world) = (comm.rank(), comm.world_size());
                let mut b = Engine::builder(ecfg.clone(), comm).seed(SEED);
                let model = SftModel::register(&mut b, cfg, None, 1, false)?;
                let mut e = b.build()?;
                for s in 0..2 {
                    let first = (s * world + rank) * MB;
                    let samples: Vec<&data::Sample> = (first..first + MB)
                        .map(|i| &train[order[i % order.len()]])
                        .collect();
                    let (tokens, targets) = data::make_batch(&samples, seq).expect("fits");
                    let tracer = Tracer::disabled();
                    model.train_micro_batch::<bf16, _>(
                        &mut e, &tokens, &targets, MB, seq, &tracer,
                    )?;
                    e.step()?;
                }
                let out = read_out(&model, &mut e)?;
                let saved = e.save_checkpoint(&root, Value::Null)?;
                Ok((out, saved))
            })
            .expect("ranks ran"),
        );
        assert_ne!(
            run.master, run.snapshot,
            "bf16 parameters differ from the master"
        );

        let f32_file = dir.join("model-f32.safetensors");
        let bf16_file = dir.join("model-bf16.safetensors");
        export_checkpoint(&root, &f32_file, ExportDtype::F32).expect("export F32");
        export_checkpoint(&saved, &bf16_file, ExportDtype::Bf16).expect("export BF16");
        let (loaded, ignored) = weights::load_with_report(&f32_file, &cfg).expect("load F32");
        assert!(ignored.is_empty(), "{ignored:?}");
        assert_eq!(loaded, run.master, "F32 export = master, with HF names");
        let loaded16 = weights::load(&bf16_file, &cfg).expect("load BF16");
        assert_eq!(loaded16, run.snapshot, "BF16 export = the bf16 parameters");

        // `--init-from`: a fresh engine at another world size and stage.
        let back = rank0(
            ThreadGroup::run(3, |comm| {
                let mut b = Engine::builder(engine_cfg(3, 1), comm).seed(7);
                let model = SftModel::register(&mut b, cfg, Some(loaded.clone()), 1, false)?;
                let mut e = b.build()?;
                read_out(&model, &mut e)
            })
            .expect("ranks ran"),
        );
        assert_eq!(back.master, run.master);
        assert_eq!(back.snapshot, run.snapshot);
    }
}

/// Errors name the file and what is wrong; a failed export leaves no file.
#[test]
fn errors_name_the_file() {
    let dir = TempDir::new("export-errors");
    let out = dir.join("out.safetensors");
    let msg = |r: zero::Result<PathBuf>| match r {
        Ok(p) => panic!("exported from {}", p.display()),
        Err(e) => e.to_string(),
    };

    // A missing checkpoint directory.
    let missing = dir.join("no-such-checkpoint");
    let e = msg(export_checkpoint(&missing, &out, ExportDtype::F32));
    assert!(
        e.contains("no-such-checkpoint") && e.contains("no such"),
        "{e}"
    );
    // A directory that is neither a checkpoint nor a root.
    let e = msg(export_checkpoint(&dir, &out, ExportDtype::F32));
    assert!(e.contains("neither a checkpoint directory"), "{e}");

    // A live export into a missing directory fails on every rank.
    let bad_out = dir.join("missing-dir").join("x.safetensors");
    let runs = trained(2, &config(2, 3, 1, Precision::Bf16), 2, |e| {
        let export = e.export_safetensors(&bad_out, ExportDtype::F32);
        let saved = e.save_checkpoint(&dir.join("ckpt"), Value::Null)?;
        Ok((export.map_err(|e| e.to_string()), saved))
    });
    let mut saved = PathBuf::new();
    for (r, run) in runs.into_iter().enumerate() {
        let (export, s) = run.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        let e = export.expect_err("export into a missing directory");
        if r == 0 {
            assert!(
                e.contains("missing-dir/x.safetensors") && e.contains("cannot create"),
                "{e}"
            );
        } else {
            assert!(e.contains("rank 0 could not create"), "rank {r}: {e}");
        }
        saved = s;
    }
    // And so does the offline one.
    let e = msg(export_checkpoint(&saved, &bad_out, ExportDtype::Bf16));
    assert!(e.contains("missing-dir/x.safetensors"), "{e}");

    // A corrupted rank file: the CRC error names it; nothing is written.
    let copy = |name: &str| {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        for f in std::fs::read_dir(&saved).unwrap().flatten() {
            std::fs::copy(f.path(), d.join(f.file_name())).unwrap();
        }
        d
    };
    let corrupt = copy("corrupt");
    let rank1 = corrupt.join("rank00001.bin");
    let mut bytes = read(&rank1);
    let at = bytes.len() - 5;
    bytes[at] ^= 0x40;
    std::fs::write(&rank1, &bytes).unwrap();
    let e = msg(export_checkpoint(&corrupt, &out, ExportDtype::F32));
    assert!(
        e.contains("rank00001.bin") && e.contains("corrupted"),
        "{e}"
    );
    assert!(!out.exists());

    // A truncated rank file.
    let truncated = copy("truncated");
    let rank0_file = truncated.join("rank00000.bin");
    let bytes = read(&rank0_file);
    std::fs::write(&rank0_file, &bytes[..bytes.len() - 4]).unwrap();
    let e = msg(export_checkpoint(&truncated, &out, ExportDtype::F32));
    assert!(
        e.contains("rank00000.bin") && e.contains("truncated"),
        "{e}"
    );

    // A missing rank file.
    let lost = copy("lost");
    std::fs::remove_file(lost.join("rank00001.bin")).unwrap();
    let e = msg(export_checkpoint(&lost, &out, ExportDtype::F32));
    assert!(
        e.contains("rank00001.bin") && e.contains("missing rank file"),
        "{e}"
    );

    // A manifest that is not JSON.
    let garbled = copy("garbled");
    std::fs::write(garbled.join("manifest.json"), "{ not json").unwrap();
    let e = msg(export_checkpoint(&garbled, &out, ExportDtype::F32));
    assert!(e.contains("manifest.json") && e.contains("not JSON"), "{e}");

    assert!(!out.exists());
    assert_no_tmp(&dir);
    // The intact checkpoint still exports.
    export_checkpoint(&saved, &out, ExportDtype::F32).expect("intact checkpoint");
}

/// Element types line up with the engine's: `ExportDtype::of` each
/// parameter dtype names the safetensors dtype of that width.
#[test]
fn export_dtype_of_param_dtype() {
    use zero::core::DType;
    for (dt, name) in [
        (DType::F32, "F32"),
        (DType::BF16, "BF16"),
        (DType::F16, "F16"),
    ] {
        assert_eq!(ExportDtype::of(dt).safetensors_name(), name);
    }
    assert_eq!(ExportDtype::of(<bf16 as Element>::DTYPE).size(), 2);
}
