//! The GPU measurements of the CUDA issue, each against a baseline timed in
//! the same run:
//!
//! | section | measured | baseline | target |
//! |---|---|---|---|
//! | `adamw` | `GpuAdamW::step`, four variants | D2D copy moving the same bytes | ≥ 85% |
//! | `norm` | `GpuAdamW::sum_squares_into`, f32 / bf16 grad | D2D copy moving the same bytes | none (information) |
//! | `copy` | `PinnedHostBuffer` ⇄ arena buffer through `Streams` | cudarc `memcpy_htod`/`memcpy_dtoh`, pinned | ≥ 90% |
//! | `nccl` | all-reduce, reduce-scatter, all-gather | bus bandwidth (nccl-tests' formulas) | none |
//!
//! **AdamW** (`--elems N`, default 50M): per variant the exact bytes the
//! kernel reads and writes per element are
//!
//! | variant | reads | writes | bytes/elem |
//! |---|---|---|---|
//! | fp32 state + fp32 grad | p, g, m, v (f32) | p, m, v | 28 |
//! | + bf16 copy | p, g, m, v | p, m, v, copy (bf16) | 30 |
//! | bf16 grad + bf16 copy | p, m, v (f32), g (bf16) | p, m, v, copy | 28 |
//! | bf16 moments + bf16 grad + bf16 copy | p (f32), g, m, v (bf16) | p, m, v, copy | 20 |
//!
//! (the variants of `benches/cpu_adam.rs`). The baseline is a
//! device-to-device `memcpy_dtod` of half those bytes (it reads them and
//! writes them: the same total traffic) on the same stream. Kernel and copy
//! alternate rep by rep after 3 warm-ups of each; each sample is `k`
//! back-to-back launches of one of them between two CUDA events (the stream
//! idle before and after; `k` chosen so that a sample moves ≥ 4 GB, at most
//! 200, which spreads one launch latency over the sample), and the medians
//! of the per-launch times are compared: fraction = copy time ÷ kernel
//! time, i.e. the kernel's GB/s over the copy's.
//!
//! **Norm pass**: `sum_squares_into` reads the gradient once (n × its
//! element size; the per-chunk sums are 1/65536 of that). The baseline is a
//! D2D copy of half the gradient's bytes, which moves as many bytes (read +
//! write). A read-only kernel can beat a copy's traffic, so more than 100%
//! is possible; no target is set.
//!
//! **Copies** (64 MiB and 1 GiB): H2D and D2H between a `PinnedHostBuffer`
//! and a `DeviceBuffer` of a `DeviceArena`, through `Streams::copy_h2d` /
//! `copy_d2h` (the copy streams, with their event hand-offs), against cudarc's
//! plain `memcpy_htod` / `memcpy_dtoh` between driver-pinned memory
//! (`cuMemHostAlloc`, flags 0 like `PinnedHostBuffer`) and a `CudaSlice`
//! on the same stream, interleaved; CUDA events around each copy. For
//! information, the same cudarc copies from/to pageable memory (a `Vec`),
//! timed on the host from the call to the stream's completion (the driver
//! stages pageable memory on the host, which events would miss).
//!
//! **NCCL** (1 MiB to 1 GiB, f32, out of place, `ReduceOp::Sum`): ranks as
//! threads through `NcclGroup`, one GPU each: world size 1, then 2 and the
//! number of GPUs when there are more. With one GPU, NCCL ≥ 2.30 and
//! `NCCL_MULTI_RANK_GPU_ENABLE=1`, world size 2 also runs with both ranks on
//! GPU 0 (labelled "shared"; a sharing test, not a bandwidth). Each rep: the
//! ranks meet at a host barrier, then CUDA events on each rank's
//! communication stream around the launch; the rep's time is the slowest
//! rank's, and the median over reps is reported. As nccl-tests: `size` is
//! the all-reduce buffer, the reduce-scatter input, the all-gather output;
//! algBw = size / time; busBw = algBw × 2(n−1)/n for all-reduce and
//! × (n−1)/n for the others. At world size 1 busBw is not defined (nothing
//! crosses a link; NCCL copies the buffer), so only algBw is given. Each
//! sample is one call (an `NcclWork` borrows its buffers until waited for),
//! so small sizes include one launch latency: below nccl-tests' figures,
//! which pipeline many launches.
//!
//! GB/s are 10⁹ bytes per second. Without a GPU, driver, NVRTC or NCCL,
//! each section that needs it prints one `skipped:` line with the reason
//! and the bench exits 0; a section that fails on a GPU prints `FAILED:`
//! and the bench exits 1 after running the others (a panic is caught and
//! reported the same way).
//!
//! Output: the tables on stdout and `target/zero-bench/cuda.json` (or
//! `--json PATH`).
//!
//! `cargo bench --features cuda --bench cuda [-- --elems N --reps R
//! --only adamw,norm,copy,nccl --json PATH]` (`--reps` default 20;
//! `--only` takes one section or a comma-separated list; add
//! `--no-default-features` where MPI is not installed).
//! `scripts/gpu-session.sh` runs it with the CUDA tests on a GPU machine.

use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits,
};
use serde_json::{json, Value};
use zero::comm::nccl::{self, NcclError, NcclFailure};
use zero::comm::{CommOptions, NcclComm, NcclGroup, ReduceOp};
use zero::core::cuda::arena::{ArenaPlan, BufferRequest, DeviceArena};
use zero::core::cuda::kernels::{norm_scratch_len, nvrtc_available, GpuAdamW, KernelError};
use zero::core::cuda::stream::{PinnedHostBuffer, Streams};
use zero::core::memory::{Category, MemoryTracker};
use zero::core::optim::{sum_squares, AdamWParams, AdamWStep};
use zero::core::{bf16, CudaDevice, Element};

/// Warm-up reps before the timed ones, in every section.
const WARMUP: usize = 3;
/// The GPU AdamW's target: its GB/s over a D2D copy's.
const ADAMW_TARGET: f64 = 0.85;
/// The pinned copies' target: their GB/s over cudarc's plain copies'.
const COPY_TARGET: f64 = 0.90;
/// Sizes of the copy section.
const COPY_SIZES: [usize; 2] = [64 << 20, 1 << 30];
/// Smallest and largest NCCL sizes (powers of two in between).
const NCCL_MIN: usize = 1 << 20;
const NCCL_MAX: usize = 1 << 30;
/// Bound on every NCCL wait and host barrier: a hang becomes an error.
const NCCL_TIMEOUT: Duration = Duration::from_secs(120);

const MIB: f64 = (1u64 << 20) as f64;

// ---------------------------------------------------------------------------
// Arguments
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Section {
    Adamw,
    Norm,
    Copy,
    Nccl,
}

impl Section {
    const ALL: [Section; 4] = [Section::Adamw, Section::Norm, Section::Copy, Section::Nccl];

    fn name(self) -> &'static str {
        match self {
            Section::Adamw => "adamw",
            Section::Norm => "norm",
            Section::Copy => "copy",
            Section::Nccl => "nccl",
        }
    }
}

struct Args {
    elems: usize,
    reps: usize,
    sections: Vec<Section>,
    json: Option<PathBuf>,
}

fn parse_args() -> Args {
    let mut a = Args {
        elems: 50_000_000,
        reps: 20,
        sections: Section::ALL.to_vec(),
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .unwrap_or_else(|| usage(&format!("{flag} needs a value")))
        };
        match flag.as_str() {
            "--elems" => {
                a.elems = value()
                    .parse()
                    .unwrap_or_else(|e| usage(&format!("--elems: {e}")))
            }
            "--reps" => {
                a.reps = value()
                    .parse()
                    .unwrap_or_else(|e| usage(&format!("--reps: {e}")))
            }
            "--only" => {
                let v = value();
                a.sections = v
                    .split(',')
                    .map(|s| {
                        Section::ALL
                            .into_iter()
                            .find(|x| x.name() == s.trim())
                            .unwrap_or_else(|| usage(&format!("--only: unknown section `{s}`")))
                    })
                    .collect();
            }
            "--json" => a.json = Some(PathBuf::from(value())),
            // cargo bench passes --bench to harness = false benches.
            "--bench" => {}
            other => usage(&format!("unknown option `{other}`")),
        }
    }
    a.reps = a.reps.max(1);
    a.elems = a.elems.max(1);
    a
}

fn usage(msg: &str) -> ! {
    eprintln!(
        "cuda bench: {msg}\noptions: --elems N (default 50000000) --reps R (default 20) \
         --only adamw|norm|copy|nccl[,...] --json PATH"
    );
    std::process::exit(2)
}

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------

/// Errors of this bench: a message that says what was being done.
type Res<T> = Result<T, String>;

trait Context<T> {
    fn ctx(self, what: &str) -> Res<T>;
}

impl<T, E: Display> Context<T> for Result<T, E> {
    fn ctx(self, what: &str) -> Res<T> {
        self.map_err(|e| format!("{what}: {e}"))
    }
}

/// Median, min and max of some durations in seconds.
#[derive(Debug, Clone, Copy)]
struct Stats {
    median: f64,
    min: f64,
    max: f64,
}

impl Stats {
    fn of(times: &[f64]) -> Stats {
        let mut v = times.to_vec();
        v.sort_by(f64::total_cmp);
        Stats {
            median: v.get(v.len() / 2).copied().unwrap_or(f64::NAN),
            min: v.first().copied().unwrap_or(f64::NAN),
            max: v.last().copied().unwrap_or(f64::NAN),
        }
    }

    fn json(&self) -> Value {
        json!({ "median_s": self.median, "min_s": self.min, "max_s": self.max })
    }
}

fn gbps(bytes: f64, secs: f64) -> f64 {
    bytes / secs / 1e9
}

fn verdict(fraction: f64, target: f64) -> &'static str {
    if fraction >= target {
        "ok"
    } else {
        "MISS"
    }
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 30 && bytes.is_multiple_of(1 << 30) {
        format!("{} GiB", bytes >> 30)
    } else if bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{:.2} MiB", bytes as f64 / MIB)
    }
}

/// Two timing events: CUDA events with timing on (cudarc's default
/// disables it).
struct Timer {
    start: CudaEvent,
    end: CudaEvent,
}

impl Timer {
    fn new(ctx: &Arc<CudaContext>) -> Res<Timer> {
        let event = || {
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .ctx("cuEventCreate")
        };
        Ok(Timer {
            start: event()?,
            end: event()?,
        })
    }

    fn begin(&self, stream: &CudaStream) -> Res<()> {
        self.start.record(stream).ctx("cuEventRecord (start)")
    }

    fn finish(&self, stream: &CudaStream) -> Res<()> {
        self.end.record(stream).ctx("cuEventRecord (end)")
    }

    /// Seconds between the two records (waits for the end).
    fn elapsed(&self) -> Res<f64> {
        let ms = self.start.elapsed_ms(&self.end).ctx("cuEventElapsedTime")?;
        Ok(f64::from(ms) / 1e3)
    }

    /// Times the work `enqueue` puts on `stream`.
    fn time(&self, stream: &CudaStream, enqueue: impl FnOnce() -> Res<()>) -> Res<f64> {
        self.begin(stream)?;
        enqueue()?;
        self.finish(stream)?;
        self.elapsed()
    }

    /// Seconds per launch of `launches` back-to-back launches of `enqueue`
    /// on `stream` (the GPU runs the first while the host queues the
    /// next, so one launch latency is spread over all).
    fn time_each(
        &self,
        stream: &CudaStream,
        launches: usize,
        mut enqueue: impl FnMut() -> Res<()>,
    ) -> Res<f64> {
        let total = self.time(stream, || (0..launches).try_for_each(|_| enqueue()))?;
        Ok(total / launches as f64)
    }
}

/// Launches per timed sample for work that moves `traffic` bytes: enough
/// for 4 GB per sample (a few ms on an H100), at most 200.
fn launches_for(traffic: usize) -> usize {
    (4e9 / traffic.max(1) as f64).ceil().clamp(1.0, 200.0) as usize
}

/// Times `kernel`, which moves `traffic` bytes (read + written), and a
/// D2D copy of the same traffic (`traffic / 2` bytes copied) alternately
/// on `stream`: `WARMUP` untimed rounds, then `reps` samples of each,
/// every sample [`launches_for`]`(traffic)` back-to-back launches timed
/// by events. Seconds per launch, kernel and copy.
fn against_copy(
    timer: &Timer,
    stream: &Arc<CudaStream>,
    reps: usize,
    traffic: usize,
    mut kernel: impl FnMut() -> Res<()>,
) -> Res<(Vec<f64>, Vec<f64>)> {
    let src = zeros::<u8>(stream, traffic / 2)?;
    let mut dst = zeros::<u8>(stream, traffic / 2)?;
    let mut copy = || stream.memcpy_dtod(&src, &mut dst).ctx("cuMemcpyDtoDAsync");
    let launches = launches_for(traffic);
    let (mut tk, mut tc) = (Vec::new(), Vec::new());
    for rep in 0..WARMUP + reps {
        let k = timer.time_each(stream, launches, &mut kernel)?;
        let c = timer.time_each(stream, launches, &mut copy)?;
        if rep >= WARMUP {
            tk.push(k);
            tc.push(c);
        }
    }
    stream.synchronize().ctx("cuStreamSynchronize")?;
    Ok((tk, tc))
}

/// `n` elements `f(i)` on the device.
fn upload<T: Element + DeviceRepr>(
    stream: &Arc<CudaStream>,
    n: usize,
    f: impl Fn(usize) -> f32,
) -> Res<CudaSlice<T>> {
    let host: Vec<T> = (0..n).map(|i| T::from_f32(f(i))).collect();
    stream.clone_htod(&host).ctx("cuMemcpyHtoD (inputs)")
}

fn zeros<T: DeviceRepr + ValidAsZeroBits>(stream: &Arc<CudaStream>, n: usize) -> Res<CudaSlice<T>> {
    stream
        .alloc_zeros::<T>(n)
        .ctx(&format!("cuMemAlloc of {}", human(n * size_of::<T>())))
}

// ---------------------------------------------------------------------------
// The GPU
// ---------------------------------------------------------------------------

struct Gpu {
    dev: CudaDevice,
    name: String,
    capability: (i32, i32),
    count: usize,
}

fn open_gpu() -> Res<Gpu> {
    let dev = CudaDevice::new(0).map_err(|e| e.to_string())?;
    let ctx = dev.context();
    let name = ctx
        .name()
        .unwrap_or_else(|e| format!("(name unknown: {e})"));
    let capability = ctx.compute_capability().ctx("compute capability")?;
    let count = CudaContext::device_count().unwrap_or(1).max(1) as usize;
    Ok(Gpu {
        dev,
        name,
        capability,
        count,
    })
}

/// The kernels, or why they cannot be had: `Ok(Err(reason))` is a skip
/// (no NVRTC), `Err` a failure.
fn load_kernels(gpu: &Gpu) -> Res<Result<GpuAdamW, String>> {
    if !nvrtc_available() {
        return Ok(Err(KernelError::NvrtcNotFound.to_string()));
    }
    match GpuAdamW::new(&gpu.dev) {
        Ok(k) => Ok(Ok(k)),
        Err(zero::core::Error::Cuda(e))
            if e.downcast_ref::<KernelError>() == Some(&KernelError::NvrtcNotFound) =>
        {
            Ok(Err(e.to_string()))
        }
        Err(e) => Err(format!("GpuAdamW::new: {e}")),
    }
}

// ---------------------------------------------------------------------------
// AdamW and the norm pass
// ---------------------------------------------------------------------------

/// One AdamW variant against a D2D copy of the same traffic; one JSON row.
fn adamw_variant<G, M, P>(
    adam: &GpuAdamW,
    stream: &Arc<CudaStream>,
    timer: &Timer,
    a: &Args,
    name: &str,
    with_copy: bool,
) -> Res<Value>
where
    G: Element + DeviceRepr + ValidAsZeroBits,
    M: Element + DeviceRepr + ValidAsZeroBits,
    P: Element + DeviceRepr + ValidAsZeroBits,
{
    let n = a.elems;
    let (sg, sm, sp) = (size_of::<G>(), size_of::<M>(), size_of::<P>());
    let read = 4 + sg + 2 * sm;
    let written = 4 + 2 * sm + if with_copy { sp } else { 0 };
    let traffic = n * (read + written);
    // Gradients small and non-negative, v > 0: no NaN, nothing subnormal.
    let mut master = upload::<f32>(stream, n, |i| ((i % 1000) as f32 - 500.0) * 1e-3)?;
    let grad = upload::<G>(stream, n, |i| (i % 7) as f32 * 1e-3)?;
    let mut m = zeros::<M>(stream, n)?;
    let mut v = upload::<M>(stream, n, |_| 1e-4)?;
    let mut low = if with_copy {
        Some(zeros::<P>(stream, n)?)
    } else {
        None
    };
    let k = AdamWStep::new(&AdamWParams::torch_default(), 1e-3, 10, 0.5);
    let (tk, tc) = against_copy(timer, stream, a.reps, traffic, || {
        adam.step(stream, &k, &mut master, &grad, &mut m, &mut v, low.as_mut())
            .ctx("GpuAdamW::step")
    })?;
    let (sk, sc) = (Stats::of(&tk), Stats::of(&tc));
    let (gk, gc) = (
        gbps(traffic as f64, sk.median),
        gbps(traffic as f64, sc.median),
    );
    let fraction = sc.median / sk.median;
    println!(
        "{name:<40} {:>4} {:>8.3} {:>7.3}..{:<7.3} {:>7.0} | {:>8.3} {:>7.0} | {:>6.1}% {:>5}",
        read + written,
        sk.median * 1e3,
        sk.min * 1e3,
        sk.max * 1e3,
        gk,
        sc.median * 1e3,
        gc,
        fraction * 100.0,
        verdict(fraction, ADAMW_TARGET),
    );
    Ok(json!({
        "variant": name,
        "grad": G::DTYPE.to_string(),
        "moments": M::DTYPE.to_string(),
        "copy": if with_copy { Some(P::DTYPE.to_string()) } else { None },
        "elems": n,
        "bytes_read_per_elem": read,
        "bytes_written_per_elem": written,
        "bytes": traffic,
        "launches_per_sample": launches_for(traffic),
        "kernel": sk.json(),
        "kernel_gbps": gk,
        "baseline": "memcpy_dtod of bytes/2 (read + write = bytes), same stream, interleaved",
        "baseline_copy_bytes": traffic / 2,
        "baseline_time": sc.json(),
        "baseline_gbps": gc,
        "fraction": fraction,
        "target": ADAMW_TARGET,
        "met": fraction >= ADAMW_TARGET,
    }))
}

fn adamw_header(a: &Args, adam: &GpuAdamW) {
    println!(
        "\n== GPU AdamW: {} elements, kernels for {}, {} reps after {WARMUP} warm-ups, CUDA \
         events on one stream, per-launch times of samples of back-to-back launches moving \
         >= 4 GB; baseline: D2D copy of the same read+write bytes, interleaved",
        a.elems,
        adam.arch(),
        a.reps
    );
    println!(
        "{:<40} {:>4} {:>8} {:>16} {:>7} | {:>8} {:>7} | {:>7} {:>5}",
        "variant", "B/el", "ms med", "ms min..max", "GB/s", "copy ms", "GB/s", "frac", "≥85%"
    );
}

fn run_adamw(gpu: &Gpu, adam: &GpuAdamW, a: &Args, rows: &mut Vec<Value>) -> Res<()> {
    let streams = Streams::new(&gpu.dev).ctx("Streams::new")?;
    let stream = streams.compute();
    let timer = Timer::new(gpu.dev.context())?;
    adamw_header(a, adam);
    let t = &timer;
    rows.push(adamw_variant::<f32, f32, bf16>(
        adam,
        stream,
        t,
        a,
        "fp32 state + fp32 grad",
        false,
    )?);
    rows.push(adamw_variant::<f32, f32, bf16>(
        adam,
        stream,
        t,
        a,
        "+ bf16 copy",
        true,
    )?);
    rows.push(adamw_variant::<bf16, f32, bf16>(
        adam,
        stream,
        t,
        a,
        "bf16 grad + bf16 copy",
        true,
    )?);
    let name = "bf16 moments + bf16 grad + bf16 copy";
    rows.push(adamw_variant::<bf16, bf16, bf16>(
        adam, stream, t, a, name, true,
    )?);
    Ok(())
}

/// The norm pass over `G` gradients against a D2D copy of the same traffic.
fn norm_variant<G>(
    adam: &GpuAdamW,
    stream: &Arc<CudaStream>,
    timer: &Timer,
    a: &Args,
    name: &str,
) -> Res<Value>
where
    G: Element + DeviceRepr + ValidAsZeroBits,
{
    let n = a.elems;
    let bytes = n * size_of::<G>();
    let host: Vec<G> = (0..n).map(|i| G::from_f32((i % 7) as f32 * 1e-3)).collect();
    let reference = sum_squares(&host);
    let grad = stream.clone_htod(&host).ctx("cuMemcpyHtoD (grad)")?;
    drop(host);
    let mut sums = zeros::<f64>(stream, norm_scratch_len(n).max(1))?;
    let mut out = zeros::<f64>(stream, 1)?;
    let (tk, tc) = against_copy(timer, stream, a.reps, bytes, || {
        adam.sum_squares_into(stream, &grad, &mut sums, &mut out)
            .ctx("GpuAdamW::sum_squares_into")
    })?;
    let value = stream.clone_dtoh(&out).ctx("cuMemcpyDtoH (norm)")?;
    stream.synchronize().ctx("cuStreamSynchronize")?;
    let sum = value.first().copied().unwrap_or(f64::NAN);
    let same = sum.to_bits() == reference.to_bits();
    let (sk, sc) = (Stats::of(&tk), Stats::of(&tc));
    let (gk, gc) = (gbps(bytes as f64, sk.median), gbps(bytes as f64, sc.median));
    let fraction = sc.median / sk.median;
    println!(
        "{name:<40} {:>4} {:>8.3} {:>7.3}..{:<7.3} {:>7.0} | {:>8.3} {:>7.0} | {:>6.1}%   (sum of squares {sum:.6e}: {})",
        size_of::<G>(),
        sk.median * 1e3,
        sk.min * 1e3,
        sk.max * 1e3,
        gk,
        sc.median * 1e3,
        gc,
        fraction * 100.0,
        if same {
            "the CPU reference's bits".to_string()
        } else {
            format!("DIFFERS from the CPU reference {reference:.6e}")
        }
    );
    Ok(json!({
        "variant": name,
        "grad": G::DTYPE.to_string(),
        "elems": n,
        "bytes": bytes,
        "launches_per_sample": launches_for(bytes),
        "kernel": sk.json(),
        "kernel_gbps": gk,
        "baseline": "memcpy_dtod of bytes/2 (read + write = the bytes the norm reads), same stream, interleaved",
        "baseline_copy_bytes": bytes / 2,
        "baseline_time": sc.json(),
        "baseline_gbps": gc,
        "fraction": fraction,
        "target": Value::Null,
        "sum_of_squares": sum,
        "cpu_reference": reference,
        "matches_cpu_bits": same,
    }))
}

fn run_norm(gpu: &Gpu, adam: &GpuAdamW, a: &Args, rows: &mut Vec<Value>) -> Res<()> {
    let streams = Streams::new(&gpu.dev).ctx("Streams::new")?;
    let stream = streams.compute();
    let timer = Timer::new(gpu.dev.context())?;
    println!(
        "\n== norm pass (sum of squares): {} elements, {} reps after {WARMUP} warm-ups; \
         baseline: D2D copy of half the gradient's bytes (same traffic); no target",
        a.elems, a.reps
    );
    println!(
        "{:<40} {:>4} {:>8} {:>16} {:>7} | {:>8} {:>7} | {:>7}",
        "variant", "B/el", "ms med", "ms min..max", "GB/s", "copy ms", "GB/s", "frac"
    );
    rows.push(norm_variant::<f32>(
        adam,
        stream,
        &timer,
        a,
        "norm pass, fp32 grad",
    )?);
    rows.push(norm_variant::<bf16>(
        adam,
        stream,
        &timer,
        a,
        "norm pass, bf16 grad",
    )?);
    Ok(())
}

// ---------------------------------------------------------------------------
// Pinned copies
// ---------------------------------------------------------------------------

/// Driver-pinned memory for the baseline, allocated as `PinnedHostBuffer`
/// does (flags 0) and filled with ones.
fn cudarc_pinned(ctx: &Arc<CudaContext>, len: usize) -> Res<cudarc::driver::PinnedHostSlice<f32>> {
    // SAFETY: the memory is unset until the write_bytes below; no
    // reference to it is made before then.
    let mut p = unsafe { ctx.alloc_pinned_with_flags::<f32>(len, 0) }
        .ctx(&format!("cuMemHostAlloc of {}", human(len * 4)))?;
    let raw = p.as_mut_ptr().ctx("pinned pointer")?;
    // SAFETY: `raw` points to the `len` f32 just allocated, owned by `p`,
    // with no copy in flight; all-zero bits are a valid f32.
    unsafe { std::ptr::write_bytes(raw, 0, len) };
    p.as_mut_slice().ctx("pinned slice")?.fill(1.0);
    Ok(p)
}

fn cudarc_call(dir: &str) -> &'static str {
    if dir == "h2d" {
        "memcpy_htod"
    } else {
        "memcpy_dtoh"
    }
}

fn run_copy(gpu: &Gpu, a: &Args, rows: &mut Vec<Value>) -> Res<()> {
    let dev = &gpu.dev;
    let ctx = dev.context();
    let streams = Streams::new(dev).ctx("Streams::new")?;
    let (h2d, d2h) = (streams.h2d(), streams.d2h());
    let timer = Timer::new(ctx)?;
    let tracker = MemoryTracker::new(0);
    println!(
        "\n== pinned copies: PinnedHostBuffer ⇄ arena DeviceBuffer through Streams (copy \
         streams) vs cudarc memcpy_htod/memcpy_dtoh with driver-pinned memory on the same \
         stream, interleaved, CUDA events; {} reps after {WARMUP} warm-ups; pageable: host \
         time to completion, for information",
        a.reps
    );
    println!(
        "{:<8} {:<4} | {:>9} {:>7} | {:>9} {:>7} | {:>7} {:>5} | {:>13}",
        "size", "dir", "zero ms", "GB/s", "cudarc ms", "GB/s", "frac", "≥90%", "pageable GB/s"
    );
    for &bytes in &COPY_SIZES {
        let len = bytes / 4;
        let plan = ArenaPlan::new(
            0,
            [BufferRequest::new(
                "bench.copy",
                Category::CommBuffers,
                bytes as u64,
            )],
        )
        .ctx("ArenaPlan::new")?;
        let arena = DeviceArena::new(&streams, plan, &tracker).ctx("DeviceArena::new")?;
        let mut dbuf = arena.take::<f32>("bench.copy").ctx("DeviceArena::take")?;
        let mut pinned = PinnedHostBuffer::<f32>::zeros(dev, len)
            .ctx(&format!("PinnedHostBuffer::zeros({})", human(bytes)))?;
        pinned.as_mut_slice().ctx("PinnedHostBuffer")?.fill(1.0);
        let mut raw = cudarc_pinned(ctx, len)?;
        let mut dslice = zeros::<f32>(h2d, len)?;
        let mut pageable = vec![1.0f32; len];
        h2d.synchronize().ctx("cuStreamSynchronize")?;

        for dir in ["h2d", "d2h"] {
            let stream = if dir == "h2d" { h2d } else { d2h };
            let (mut tz, mut tc, mut tp) = (Vec::new(), Vec::new(), Vec::new());
            for rep in 0..WARMUP + a.reps {
                timer.begin(stream)?;
                let transfer = if dir == "h2d" {
                    streams.copy_h2d(&mut pinned, &mut dbuf)
                } else {
                    streams.copy_d2h(&mut dbuf, &mut pinned)
                }
                .ctx(&format!("Streams::copy_{dir}"))?;
                timer.finish(stream)?;
                transfer.wait().ctx("Transfer::wait")?;
                let zero = timer.elapsed()?;
                let plain = timer.time(stream, || {
                    if dir == "h2d" {
                        stream.memcpy_htod(&raw, &mut dslice)
                    } else {
                        stream.memcpy_dtoh(&dslice, &mut raw)
                    }
                    .ctx(&format!("cudarc {} (pinned)", cudarc_call(dir)))
                })?;
                let t0 = Instant::now();
                if dir == "h2d" {
                    stream.memcpy_htod(&pageable, &mut dslice)
                } else {
                    stream.memcpy_dtoh(&dslice, &mut pageable)
                }
                .ctx(&format!("cudarc {} (pageable)", cudarc_call(dir)))?;
                stream.synchronize().ctx("cuStreamSynchronize")?;
                let paged = t0.elapsed().as_secs_f64();
                if rep >= WARMUP {
                    tz.push(zero);
                    tc.push(plain);
                    tp.push(paged);
                }
            }
            let (sz, sc, sp) = (Stats::of(&tz), Stats::of(&tc), Stats::of(&tp));
            let b = bytes as f64;
            let (gz, gc, gp) = (gbps(b, sz.median), gbps(b, sc.median), gbps(b, sp.median));
            let fraction = sc.median / sz.median;
            println!(
                "{:<8} {:<4} | {:>9.3} {:>7.2} | {:>9.3} {:>7.2} | {:>6.1}% {:>5} | {:>13.2}",
                human(bytes),
                dir,
                sz.median * 1e3,
                gz,
                sc.median * 1e3,
                gc,
                fraction * 100.0,
                verdict(fraction, COPY_TARGET),
                gp
            );
            rows.push(json!({
                "bytes": bytes,
                "direction": dir,
                "pinned_host_buffer": sz.json(),
                "pinned_host_buffer_gbps": gz,
                "baseline": "cudarc memcpy_htod/memcpy_dtoh, cuMemHostAlloc(flags 0) memory, same stream",
                "cudarc_pinned": sc.json(),
                "cudarc_pinned_gbps": gc,
                "fraction": fraction,
                "target": COPY_TARGET,
                "met": fraction >= COPY_TARGET,
                "pageable_host_timed": sp.json(),
                "pageable_gbps": gp,
            }));
        }
        // Order the frees after the last copies.
        d2h.synchronize().ctx("cuStreamSynchronize")?;
        h2d.synchronize().ctx("cuStreamSynchronize")?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// NCCL
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Coll {
    AllReduce,
    ReduceScatter,
    AllGather,
}

impl Coll {
    const ALL: [Coll; 3] = [Coll::AllReduce, Coll::ReduceScatter, Coll::AllGather];

    fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "all_reduce",
            Coll::ReduceScatter => "reduce_scatter",
            Coll::AllGather => "all_gather",
        }
    }

    /// nccl-tests' busBw factor; `None` at world size 1.
    fn bus_factor(self, world: usize) -> Option<f64> {
        if world < 2 {
            return None;
        }
        let n = world as f64;
        Some(match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::ReduceScatter | Coll::AllGather => (n - 1.0) / n,
        })
    }

    /// (send, recv) lengths for `total` elements (nccl-tests' size).
    fn lens(self, total: usize, world: usize) -> (usize, usize) {
        match self {
            Coll::AllReduce => (total, total),
            Coll::ReduceScatter => (total, total / world),
            Coll::AllGather => (total / world, total),
        }
    }
}

/// A host barrier of the rank threads with a timeout, which one rank can
/// break (after a failure) so that the others stop waiting.
struct Rendezvous {
    n: usize,
    /// (arrived, generation, broken)
    state: Mutex<(usize, u64, bool)>,
    cv: Condvar,
}

impl Rendezvous {
    fn new(n: usize) -> Self {
        Rendezvous {
            n,
            state: Mutex::new((0, 0, false)),
            cv: Condvar::new(),
        }
    }

    fn wait(&self) -> Res<()> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.2 {
            return Err("another rank failed".into());
        }
        let generation = s.1;
        s.0 += 1;
        if s.0 == self.n {
            s.0 = 0;
            s.1 += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + NCCL_TIMEOUT;
        while s.1 == generation && !s.2 {
            let now = Instant::now();
            if now >= deadline {
                s.2 = true;
                self.cv.notify_all();
                return Err(format!(
                    "host barrier: not every rank arrived in {NCCL_TIMEOUT:?}"
                ));
            }
            s = self
                .cv
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        if s.1 != generation {
            Ok(())
        } else {
            Err("another rank failed".into())
        }
    }

    fn break_it(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.2 = true;
        self.cv.notify_all();
    }
}

/// Per rank: for each collective and size, the time of each timed rep.
type RankTimes = Vec<(Coll, usize, Vec<f64>)>;

fn nccl_sizes() -> Vec<usize> {
    std::iter::successors(Some(NCCL_MIN), |&s| (s < NCCL_MAX).then_some(s * 2)).collect()
}

fn nccl_rank(comm: &NcclComm, meet: &Rendezvous, reps: usize) -> Res<RankTimes> {
    let world = comm.world_size();
    let stream = comm.stream().clone();
    let timer = Timer::new(stream.context())?;
    let max = NCCL_MAX / 4;
    let send = zeros::<f32>(&stream, max)?;
    let mut recv = zeros::<f32>(&stream, max)?;
    stream.synchronize().ctx("cuStreamSynchronize")?;
    let mut out = Vec::new();
    for coll in Coll::ALL {
        for bytes in nccl_sizes() {
            let total = (bytes / 4) / world * world;
            let (ns, nr) = coll.lens(total, world);
            let sv = send.slice(..ns);
            let mut rv = recv.slice_mut(..nr);
            let mut times = Vec::with_capacity(reps);
            for rep in 0..WARMUP + reps {
                meet.wait()?;
                timer.begin(&stream)?;
                let work = match coll {
                    Coll::AllReduce => comm.all_reduce_into(&sv, &mut rv, ReduceOp::Sum),
                    Coll::ReduceScatter => comm.reduce_scatter(&sv, &mut rv, ReduceOp::Sum),
                    Coll::AllGather => comm.all_gather(&sv, &mut rv),
                }
                .ctx(&format!(
                    "rank {} {} of {}",
                    comm.rank(),
                    coll.name(),
                    human(bytes)
                ))?;
                timer.finish(&stream)?;
                work.wait().ctx(&format!(
                    "rank {} waiting for {} of {}",
                    comm.rank(),
                    coll.name(),
                    human(bytes)
                ))?;
                let t = timer.elapsed()?;
                if rep >= WARMUP {
                    times.push(t);
                }
            }
            out.push((coll, total * 4, times));
        }
    }
    Ok(out)
}

fn nccl_world(
    gpu0: &CudaDevice,
    ordinals: &[usize],
    label: &str,
    reps: usize,
    rows: &mut Vec<Value>,
) -> Res<()> {
    let world = ordinals.len();
    let devices = ordinals
        .iter()
        .map(|&o| match o {
            0 => Ok(gpu0.clone()),
            _ => CudaDevice::new(o).ctx(&format!("CudaDevice::new({o})")),
        })
        .collect::<Res<Vec<_>>>()?;
    let opts = CommOptions::default().with_timeout(NCCL_TIMEOUT);
    let group = NcclGroup::new(devices, &opts).ctx("NcclGroup::new")?;
    let meet = Rendezvous::new(world);
    let per_rank = group
        .run(|comm| {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                nccl_rank(&comm, &meet, reps)
            }))
            .unwrap_or_else(|p| {
                Err(format!(
                    "rank {} panicked: {}",
                    comm.rank(),
                    panic_text(&*p)
                ))
            });
            if r.is_err() {
                meet.break_it();
            }
            r
        })
        .ctx(&format!("NcclGroup::run (world {world})"))?;
    // The cause, not the "another rank failed" it led to elsewhere.
    let (ok, errors): (Vec<_>, Vec<_>) = per_rank.into_iter().partition(Result::is_ok);
    let mut errors: Vec<String> = errors.into_iter().filter_map(Result::err).collect();
    errors.sort_by_key(|e| e.contains("another rank failed"));
    if let Some(e) = errors.into_iter().next() {
        return Err(e);
    }
    let per_rank: Vec<RankTimes> = ok.into_iter().filter_map(Result::ok).collect();
    println!(
        "\n-- world size {world} ({label}), f32, out of place, Sum; {reps} reps after {WARMUP} \
         warm-ups; per rep the slowest rank"
    );
    println!(
        "{:<15} {:>9} {:>10} {:>10} {:>10} {:>11}",
        "collective", "size", "us med", "us min", "algBw GB/s", "busBw GB/s"
    );
    let first = per_rank.first().ok_or("no ranks")?;
    for (i, (coll, bytes, _)) in first.iter().enumerate() {
        // The rep's time is the slowest rank's.
        let slowest: Vec<f64> = (0..reps)
            .map(|r| {
                per_rank
                    .iter()
                    .map(|rank| rank[i].2.get(r).copied().unwrap_or(f64::NAN))
                    .fold(0.0, f64::max)
            })
            .collect();
        let s = Stats::of(&slowest);
        let alg = gbps(*bytes as f64, s.median);
        let bus = coll.bus_factor(world).map(|f| alg * f);
        println!(
            "{:<15} {:>9} {:>10.1} {:>10.1} {:>10.2} {:>11}",
            coll.name(),
            human(*bytes),
            s.median * 1e6,
            s.min * 1e6,
            alg,
            bus.map_or("n/a (ws 1)".to_string(), |b| format!("{b:.2}"))
        );
        rows.push(json!({
            "world_size": world,
            "ordinals": ordinals,
            "placement": label,
            "collective": coll.name(),
            "dtype": "f32",
            "bytes": bytes,
            "time": s.json(),
            "alg_gbps": alg,
            "bus_gbps": bus,
            "bus_note": if bus.is_none() { "busBw is not defined at world size 1" } else { "nccl-tests formula" },
        }));
    }
    Ok(())
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic".into())
}

/// NCCL's version code, or why NCCL cannot be used here (a skip).
fn nccl_version() -> Result<i32, String> {
    nccl::version().map_err(|e| match NcclError::find(&e).map(|n| &n.failure) {
        Some(NcclFailure::Missing { tried }) => format!(
            "libnccl not found (tried {}): put a `libnccl.so` link to libnccl.so.2 on \
             LD_LIBRARY_PATH",
            tried.join(", ")
        ),
        _ => e.to_string(),
    })
}

fn run_nccl(gpu: &Gpu, a: &Args, version: i32, rows: &mut Vec<Value>) -> Res<()> {
    let v = format!(
        "{}.{}.{}",
        version / 10000,
        version / 100 % 100,
        version % 100
    );
    println!(
        "\n== NCCL {v}: bus bandwidth, {}..{} (nccl-tests: size = all-reduce buffer, \
         reduce-scatter input, all-gather output; busBw = algBw x 2(n-1)/n for all-reduce, \
         x (n-1)/n otherwise), {} GPU(s)",
        human(NCCL_MIN),
        human(NCCL_MAX),
        gpu.count
    );
    let mut worlds: Vec<(Vec<usize>, String)> = vec![(vec![0], "GPU 0".into())];
    if gpu.count >= 2 {
        worlds.push((vec![0, 1], "GPUs 0,1".into()));
        if gpu.count > 2 {
            worlds.push((
                (0..gpu.count).collect(),
                format!("GPUs 0..{}", gpu.count - 1),
            ));
        }
    } else {
        let shared = std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").is_ok_and(|s| s.trim() == "1");
        if version >= 23_000 && shared {
            worlds.push((vec![0, 0], "shared: 2 ranks on GPU 0".into()));
        } else {
            let why = format!(
                "1 GPU; two ranks on one GPU need NCCL >= 2.30 (this is {v}) and \
                 NCCL_MULTI_RANK_GPU_ENABLE=1"
            );
            println!("world size 2: skipped: {why}");
            rows.push(json!({ "world_size": 2, "skipped": why }));
        }
    }
    for (ordinals, label) in &worlds {
        nccl_world(&gpu.dev, ordinals, label, a.reps, rows)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Main
// ---------------------------------------------------------------------------

enum Outcome {
    Done,
    Skipped(String),
    Failed(String),
}

/// Runs a section, turning a panic into a failure. `f` returns
/// `Ok(Some(reason))` to skip.
fn guarded(f: impl FnOnce() -> Res<Option<String>>) -> Outcome {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(None)) => Outcome::Done,
        Ok(Ok(Some(why))) => Outcome::Skipped(why),
        Ok(Err(e)) => Outcome::Failed(e),
        Err(p) => Outcome::Failed(format!("panicked: {}", panic_text(&*p))),
    }
}

fn out_path(a: &Args) -> PathBuf {
    if let Some(p) = &a.json {
        return p.clone();
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    target.join("zero-bench").join("cuda.json")
}

fn write_json(path: &Path, doc: &Value) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let text = serde_json::to_string_pretty(doc).map_err(std::io::Error::other)?;
    std::fs::write(path, text + "\n")
}

fn main() {
    let a = parse_args();
    let t0 = Instant::now();
    let gpu = open_gpu();
    let mut meta = json!({
        "elems": a.elems,
        "reps": a.reps,
        "warmup": WARMUP,
        "sections": a.sections.iter().map(|s| s.name()).collect::<Vec<_>>(),
        "gbps": "1e9 bytes per second",
    });
    match &gpu {
        Ok(g) => {
            println!(
                "cuda bench: {} (compute capability {}.{}), {} GPU(s) visible",
                g.name, g.capability.0, g.capability.1, g.count
            );
            meta["gpu"] = json!(g.name);
            meta["compute_capability"] = json!(format!("{}.{}", g.capability.0, g.capability.1));
            meta["gpus"] = json!(g.count);
        }
        Err(why) => println!("cuda bench: no CUDA device: {why}"),
    }

    // The kernels serve two sections: load them once, when wanted.
    let wants_kernels = a
        .sections
        .iter()
        .any(|s| matches!(s, Section::Adamw | Section::Norm));
    let kernels: Option<Res<Result<GpuAdamW, String>>> = match &gpu {
        Ok(g) if wants_kernels => {
            let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| load_kernels(g)))
                .unwrap_or_else(|p| {
                    Err(format!("loading the kernels panicked: {}", panic_text(&*p)))
                });
            if let Ok(Ok(k)) = &loaded {
                meta["kernel_arch"] = json!(k.arch());
            }
            Some(loaded)
        }
        _ => None,
    };

    let mut doc = json!({ "meta": Value::Null, "skipped": {}, "failed": {} });
    let mut failed = false;
    for &section in &a.sections {
        // Rows measured before a failure are kept.
        let mut rows = Vec::new();
        let outcome = match (&gpu, section) {
            (Err(why), _) => Outcome::Skipped(why.clone()),
            (Ok(g), Section::Adamw | Section::Norm) => match kernels.as_ref() {
                Some(Ok(Ok(adam))) => guarded(|| {
                    if section == Section::Adamw {
                        run_adamw(g, adam, &a, &mut rows)?;
                    } else {
                        run_norm(g, adam, &a, &mut rows)?;
                    }
                    Ok(None)
                }),
                Some(Ok(Err(why))) => Outcome::Skipped(format!("no NVRTC: {why}")),
                Some(Err(e)) => Outcome::Failed(e.clone()),
                None => Outcome::Failed("the kernels were not loaded".into()),
            },
            (Ok(g), Section::Copy) => guarded(|| run_copy(g, &a, &mut rows).map(|()| None)),
            (Ok(g), Section::Nccl) => guarded(|| match nccl_version() {
                Ok(v) => {
                    meta["nccl_version"] = json!(v);
                    run_nccl(g, &a, v, &mut rows).map(|()| None)
                }
                Err(why) => Ok(Some(format!("NCCL is not available: {why}"))),
            }),
        };
        let name = section.name();
        if !rows.is_empty() {
            doc[name] = Value::Array(rows);
        }
        match outcome {
            Outcome::Done => {}
            Outcome::Skipped(why) => {
                println!("{name}: skipped: {why}");
                doc["skipped"][name] = json!(why);
            }
            Outcome::Failed(e) => {
                println!("{name}: FAILED: {e}");
                doc["failed"][name] = json!(e);
                failed = true;
            }
        }
    }
    meta["wall_s"] = json!(t0.elapsed().as_secs_f64());
    doc["meta"] = meta;

    let path = out_path(&a);
    match write_json(&path, &doc) {
        Ok(()) => println!("\nwrote {}", path.display()),
        Err(e) => eprintln!("cuda bench: writing {}: {e}", path.display()),
    }
    println!("total {:.1} s", t0.elapsed().as_secs_f64());
    if failed {
        std::process::exit(1);
    }
}
