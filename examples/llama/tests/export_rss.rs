//! `llama_sft --export` holds one unit, not the model: exporting a Llama
//! of 55.6 M parameters (212 MiB as f32) from an engine at stage 3 with
//! the optimizer state and the parameters on nvme (ZeRO-Infinity) to a
//! Hugging Face directory ([`hf::export_from`] over
//! [`SftModel::part_tensors`]) grows the process's peak RSS (`VmHWM`) by
//! a few units' values, far below the model's f32 size, which reading
//! the model whole ([`SftModel::snapshot`], what the export held before)
//! adds on its own.
//!
//! Its own test binary: `VmHWM` is the peak of the whole process.

use zero::comm::ThreadGroup;
use zero::core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero::Engine;
use zero_llama::hf::{self, Export};
use zero_llama::train::SftModel;
use zero_llama::weights::{Dtype, SafetensorsFile};
use zero_llama::{block_tensors, tensors, Config};

const MB: u64 = 1 << 20;

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

#[test]
fn an_export_streams_the_model_unit_by_unit() {
    let dir = std::env::temp_dir().join(format!("zero-llama-export-rss-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = Config {
        vocab: 4096,
        dim: 512,
        n_layers: 16,
        n_heads: 8,
        n_kv_heads: 8,
        hidden: 1408,
        max_seq: 64,
        ..Config::tiny()
    };
    let numel: usize = tensors(&model).iter().map(|t| t.numel()).sum();
    let f32_bytes = 4 * numel as u64;
    // The largest unit: a block (12.6 MiB as f32; the embedding is 8 MiB).
    let unit: usize = block_tensors(&model, 0).iter().map(|t| t.numel()).sum();
    let unit_bytes = 4 * unit as u64;

    let mut cfg = ResolvedConfig::simple(3, 1, 1);
    cfg.precision = Precision::Bf16;
    let z = &mut cfg.zero;
    z.reduce_bucket_size = 1 << 18;
    z.prefetch_bucket_size = 1 << 18;
    z.sub_group_size = 1 << 18;
    z.offload_optimizer.device = OffloadDevice::Nvme;
    z.offload_optimizer.nvme_path = Some(dir.join("opt"));
    z.offload_optimizer.buffer_count = 2;
    z.offload_param.device = OffloadDevice::Nvme;
    z.offload_param.nvme_path = Some(dir.join("param"));
    z.offload_param.buffer_count = 2;
    z.offload_param.buffer_size = unit;
    z.offload_param.max_in_cpu = 0;
    z.aio.block_size = 1 << 20;

    let out = dir.join("export");
    let (streamed, held, first) = ThreadGroup::run(1, |comm| {
        let mut b = Engine::builder(cfg.clone(), comm).seed(3);
        let m = SftModel::register(&mut b, model, None, 1, false)?;
        let mut e = b.build()?;

        let base = reset_peak();
        let export = Export {
            dtype: Dtype::Bf16,
            source: None,
            bos_eos: (None, None),
            max_shard_bytes: hf::DEFAULT_SHARD_BYTES,
        };
        hf::export_from(
            &out,
            &model,
            &mut |part| m.part_tensors(&mut e, part).map_err(|e| e.to_string()),
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

    // Four units' f32 values (the unit's parameters as read and as
    // gathered, its tensors, their bf16 bytes) and 32 MiB for buffers and
    // the allocator.
    let bound = 4 * unit_bytes + 32 * MB;
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
