//! Weights stream between their files and the engine. In: building a
//! Llama of 55.6 M parameters (212 MiB as f32) from an F32 safetensors file
//! (`weights::open`, `Init::Source`) with the optimizer state and the
//! parameters on nvme (ZeRO-Infinity) grows the process's peak RSS
//! (`VmHWM`) by no more than the engine's plan plus slack, far below the
//! model's f32 size, which reading the weights (`weights::load`, what
//! `Init::Values` needs) adds on its own. Out: `llama_sft --export`
//! (`hf::export_from` over `SftModel::export_tensors`: the parameters and
//! fp32 master of one unit at a time) holds a few units, not the model.
//!
//! Its own test binary, its tests one at a time ([`SERIAL`]): `VmHWM` is
//! the peak of the whole process.

use std::io::Write;
use std::sync::{Arc, Mutex};

use zero::comm::ThreadGroup;
use zero::core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero::core::memory::Tier;
use zero::{Engine, Init};
use zero_llama::hf::{self, Export};
use zero_llama::train::SftModel;
use zero_llama::weights::{Dtype, SafetensorsFile};
use zero_llama::{block_tensors, tensors, weights, Config};

const MB: u64 = 1 << 20;

/// The tests measure the process's peak RSS: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// A field of `/proc/self/status`, in bytes.
fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))
        .unwrap_or_else(|| panic!("{field} in /proc/self/status"));
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("a size in kB");
    kb * 1024
}

/// Resets the peak RSS (`VmHWM`) to the current resident set
/// (`/proc/self/clear_refs`, Linux 4.0 and later) and returns that.
fn reset_peak() -> u64 {
    std::fs::write("/proc/self/clear_refs", "5").expect("write /proc/self/clear_refs");
    status_bytes("VmRSS")
}

/// Peak RSS growth since `base`.
fn grown_since(base: u64) -> u64 {
    status_bytes("VmHWM").saturating_sub(base)
}

/// Element `i` of tensor `t`.
fn value(t: usize, i: usize) -> f32 {
    ((i * 31 + t * 7) % 1013) as f32 * 1e-3 - 0.5
}

/// Writes the model of `cfg` as an F32 safetensors file, a MiB at a time
/// (the test's own memory stays small).
fn write_model(path: &std::path::Path, cfg: &Config) {
    let infos = tensors(cfg);
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut at = 0usize;
    for t in &infos {
        let end = at + 4 * t.numel();
        header.insert(
            t.name.clone(),
            serde_json::json!({ "dtype": "F32", "shape": t.shape, "data_offsets": [at, end] }),
        );
        at = end;
    }
    let mut text = serde_json::to_string(&header).unwrap().into_bytes();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    f.write_all(&(text.len() as u64).to_le_bytes()).unwrap();
    f.write_all(&text).unwrap();
    let mut chunk = Vec::with_capacity(1 << 20);
    for (ti, t) in infos.iter().enumerate() {
        for start in (0..t.numel()).step_by(1 << 18) {
            chunk.clear();
            for i in start..(start + (1 << 18)).min(t.numel()) {
                chunk.extend_from_slice(&value(ti, i).to_le_bytes());
            }
            f.write_all(&chunk).unwrap();
        }
    }
    f.into_inner().unwrap().sync_all().unwrap();
}

/// The model: 55.6 M parameters, 212 MiB as f32, a block 12.3 MiB.
fn model() -> Config {
    Config {
        vocab: 4096,
        dim: 512,
        n_layers: 16,
        n_heads: 8,
        n_kv_heads: 8,
        hidden: 1408,
        max_seq: 64,
        ..Config::tiny()
    }
}

/// Stage 3 in bf16 with the optimizer state and the parameters on nvme
/// under `dir` (ZeRO-Infinity), a block's parameters per swap buffer.
fn infinity(dir: &std::path::Path, model: &Config) -> ResolvedConfig {
    let mut cfg = ResolvedConfig::simple(3, 1, 1);
    cfg.precision = Precision::Bf16;
    let unit: usize = block_tensors(model, 0).iter().map(|t| t.numel()).sum();
    let z = &mut cfg.zero;
    z.reduce_bucket_size = 1 << 18;
    z.prefetch_bucket_size = 1 << 18;
    z.sub_group_size = 1 << 18;
    z.offload_optimizer.device = OffloadDevice::Nvme;
    z.offload_optimizer.nvme_path = Some(dir.join("opt"));
    z.offload_optimizer.buffer_count = 2;
    z.offload_optimizer.swap_gradients = true;
    z.offload_param.device = OffloadDevice::Nvme;
    z.offload_param.nvme_path = Some(dir.join("param"));
    z.offload_param.buffer_count = 2;
    z.offload_param.buffer_size = unit;
    z.offload_param.max_in_cpu = 0;
    z.aio.block_size = 1 << 20;
    cfg
}

#[test]
fn an_engine_streams_its_weights_from_the_file() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("zero-llama-stream-rss-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = model();
    let path = dir.join("model.safetensors");
    write_model(&path, &model);
    let numel: usize = tensors(&model).iter().map(|t| t.numel()).sum();
    let f32_bytes = 4 * numel as u64;

    let cfg = infinity(&dir, &model);

    // The weights streamed: checked from the header, read as the build
    // asks.
    let (planned, streamed, states) = ThreadGroup::run(1, |comm| {
        let base = reset_peak();
        let files =
            weights::open(&path, &model).map_err(|what| zero::Error::Usage { rank: 0, what })?;
        let init = files
            .into_iter()
            .map(|f| Init::Source(Arc::new(f)))
            .collect();
        let mut b = Engine::builder(cfg.clone(), comm);
        let m = SftModel::register_from(&mut b, model, Some(init), None, 1, false)?;
        let mut e = b.build()?;
        let streamed = grown_since(base);
        let r = e.memory_report();
        let peak = |t| r.tier(t).map_or(0, |t| t.peak);
        // A check that the values arrived: the last layer's first master
        // values (read back from the optimizer's swap file).
        let s = e.unit_state(m.layers[model.n_layers - 1])?;
        let planned = peak(Tier::Device) + peak(Tier::Host);
        Ok::<_, zero::Error>((planned, streamed, s.master[..8].to_vec()))
    })
    .unwrap()
    .remove(0)
    .unwrap();
    let last = &block_tensors(&model, model.n_layers - 1)[0].name;
    let first = tensors(&model)
        .iter()
        .position(|t| &t.name == last)
        .unwrap();
    let want: Vec<f32> = (0..8).map(|i| value(first, i)).collect();
    assert_eq!(states, want, "the last layer's first master values");

    // For comparison: the weights read into memory, as Init::Values needs.
    let base = reset_peak();
    let loaded = weights::load(&path, &model).unwrap();
    let held = grown_since(base);
    drop(loaded);

    let bound = planned + planned / 10 + 32 * MB;
    println!(
        "{numel} parameters ({} MiB as f32): peak RSS grew by {} MiB building the engine from the \
         file (planned host + device {} MiB), by {} MiB reading the weights into memory",
        f32_bytes / MB,
        streamed / MB,
        planned / MB,
        held / MB
    );
    assert!(
        streamed <= bound,
        "peak RSS grew by {} MiB, over the plan ({} MiB) + 10% + 32 MiB",
        streamed / MB,
        planned / MB
    );
    // It tells: the model's values in memory at once (what Init::Values
    // holds) would pass the bound on their own.
    assert!(
        bound < f32_bytes,
        "the bound ({} MiB) does not tell against the model's f32 size ({} MiB)",
        bound / MB,
        f32_bytes / MB
    );
    assert!(
        held >= f32_bytes * 9 / 10,
        "reading the weights grew the peak RSS by only {} MiB of {} MiB",
        held / MB,
        f32_bytes / MB
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `llama_sft --export` holds one unit, not the model: exporting a Llama
/// of 55.6 M parameters (212 MiB as f32) from an engine at stage 3 with
/// the optimizer state and the parameters on nvme to a Hugging Face
/// directory ([`hf::export_from`] over [`SftModel::export_tensors`]) grows
/// the peak RSS by a few units' values, far below the model's f32 size,
/// which reading the model whole ([`SftModel::snapshot`], what the export
/// held before) adds on its own.
#[test]
fn an_export_streams_the_model_unit_by_unit() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("zero-llama-export-rss-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = model();
    let numel: usize = tensors(&model).iter().map(|t| t.numel()).sum();
    let f32_bytes = 4 * numel as u64;
    // The largest unit: a block (12.3 MiB as f32; the embedding is 8 MiB).
    let unit: usize = block_tensors(&model, 0).iter().map(|t| t.numel()).sum();
    let unit_bytes = 4 * unit as u64;

    let cfg = infinity(&dir, &model);

    let out = dir.join("export");
    let (streamed, held, first) = ThreadGroup::run(1, |comm| {
        let mut b = Engine::builder(cfg.clone(), comm).seed(3);
        let m = SftModel::register(&mut b, model, None, 1, false)?;
        let mut e = b.build()?;

        let base = reset_peak();
        let export = Export {
            dtypes: Dtype::Bf16.into(),
            source: None,
            bos_eos: (None, None),
            max_shard_bytes: hf::DEFAULT_SHARD_BYTES,
        };
        hf::export_from(
            &out,
            &model,
            &mut |part| m.export_tensors(&mut e, part).map_err(|e| e.to_string()),
            export,
            true,
        )
        .map_err(|what| zero::Error::Usage { rank: 0, what })?;
        let streamed = grown_since(base);

        // For comparison: the whole model read at once, as the export
        // did before it streamed.
        let base = reset_peak();
        let whole = m.snapshot(&mut e)?;
        let held = grown_since(base);
        Ok::<_, zero::Error>((streamed, held, whole[1][..8].to_vec()))
    })
    .unwrap()
    .remove(0)
    .unwrap();

    // The values arrived: the first block's first values, rounded to bf16.
    let mut f = SafetensorsFile::open(&out.join("model.safetensors")).unwrap();
    let q = &block_tensors(&model, 0)[0];
    let got = f.read(&q.name, &q.shape).unwrap();
    let want: Vec<f32> = first
        .iter()
        .map(|&x| half::bf16::from_f32(x).to_f32())
        .collect();
    assert_eq!(got[..8], want[..], "the first block's first values");

    // Six units' f32 values (the unit's fp32 master and parameters, each
    // gathered from the shards and copied out of the receive buffer, its
    // tensors, their bf16 bytes; the allocator keeps some of a unit's
    // freed memory for the next: measured 77 MiB on a development machine,
    // 93 MiB on CI) and 32 MiB for buffers: half the model's f32 size, far
    // below reading it whole.
    let bound = 6 * unit_bytes + 32 * MB;
    println!(
        "{numel} parameters ({} MiB as f32, a unit {:.1} MiB): peak RSS grew by {} MiB exporting \
         unit by unit, by {} MiB reading the model whole; the bound {} MiB",
        f32_bytes / MB,
        unit_bytes as f64 / MB as f64,
        streamed / MB,
        held / MB,
        bound / MB
    );
    assert!(
        streamed <= bound,
        "the streamed export grew the peak RSS by {} MiB, over {} MiB",
        streamed / MB,
        bound / MB
    );
    // It tells: the whole model in memory is over the bound on its own.
    assert!(
        held > bound,
        "reading the model whole grew the peak RSS by only {} MiB, the bound is {} MiB",
        held / MB,
        bound / MB
    );
    let _ = std::fs::remove_dir_all(&dir);
}
