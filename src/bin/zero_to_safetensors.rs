//! `zero_to_safetensors CHECKPOINT_DIR_OR_ROOT OUT.safetensors [--dtype fp32|bf16|fp16]`
//!
//! Consolidates the fp32 master weights of a sharded checkpoint (written by
//! `Engine::save_checkpoint`, any world size, stage and offload mode) into
//! one safetensors file, like DeepSpeed's `zero_to_fp32.py`, without an
//! engine or the ranks that saved it: one unit at a time, reading only the
//! byte ranges of the master and verifying their CRC32 blocks. Given a
//! checkpoint root, it follows `latest`. See `zero::engine::export_checkpoint`.

use std::path::PathBuf;
use std::process::ExitCode;

use zero::engine::{export_checkpoint, ExportDtype};

const USAGE: &str = "usage: zero_to_safetensors CHECKPOINT_DIR_OR_ROOT OUT.safetensors \
                     [--dtype fp32|bf16|fp16]

Writes the fp32 master weights of a zero checkpoint as one safetensors file
(default dtype fp32; bf16 and fp16 round to nearest even). Given a checkpoint
root, the checkpoint named by its `latest` file is exported.";

struct Args {
    checkpoint: PathBuf,
    out: PathBuf,
    dtype: ExportDtype,
}

/// `Ok(None)`: help was asked for.
fn parse(mut args: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let mut paths = Vec::new();
    let mut dtype = ExportDtype::F32;
    while let Some(a) = args.next() {
        if a == "-h" || a == "--help" {
            return Ok(None);
        } else if a == "--dtype" {
            let v = args
                .next()
                .ok_or("--dtype needs a value: fp32, bf16 or fp16")?;
            dtype = v.parse()?;
        } else if let Some(v) = a.strip_prefix("--dtype=") {
            dtype = v.parse()?;
        } else if a.starts_with('-') && a.len() > 1 {
            return Err(format!("unknown option `{a}`"));
        } else {
            paths.push(PathBuf::from(a));
        }
    }
    match <[PathBuf; 2]>::try_from(paths) {
        Ok([checkpoint, out]) => Ok(Some(Args {
            checkpoint,
            out,
            dtype,
        })),
        Err(p) => Err(format!(
            "expected a checkpoint and an output path, got {} path(s)",
            p.len()
        )),
    }
}

fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("zero_to_safetensors: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let t = std::time::Instant::now();
    match export_checkpoint(&args.checkpoint, &args.out, args.dtype) {
        Ok(dir) => {
            let bytes = std::fs::metadata(&args.out).map_or(0, |m| m.len());
            println!(
                "zero_to_safetensors: wrote {} ({} bytes, {}) from {} in {:.2?}",
                args.out.display(),
                bytes,
                args.dtype.safetensors_name(),
                dir.display(),
                t.elapsed()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("zero_to_safetensors: error: {e}");
            ExitCode::FAILURE
        }
    }
}
