//! The CPU AdamW and the norm pass against their memory rooflines.
//!
//! On 50M elements (default) with every core, for each variant it prints
//! elements/s and GB/s of the kernel ([`CpuAdamW`]) and of its roofline,
//! and the kernel's speed as a fraction of the roofline's:
//!
//! | variant | arrays read | arrays written |
//! |---|---|---|
//! | fp32 state + fp32 grad | p, g, m, v (f32) | p, m, v |
//! | + bf16 param copy (what offload runs) | p, g, m, v | p, m, v, copy (bf16) |
//! | bf16 grad in, bf16 copy | p, m, v, g (bf16) | p, m, v, copy |
//! | bf16 moments (`bf16_optimizer_states`) | p (f32), g, m, v (bf16) | p, m, v, copy |
//! | scalar fallback (+ bf16 copy) | as the second row, one element at a time | |
//! | norm pass, fp32 / bf16 grad | g | — |
//!
//! The roofline of an AdamW variant is [`CpuAdamW::traffic_many`]: the same
//! arrays read and written by the same threads in the same tiles with the
//! same stores (streaming for the copy, when on), with trivial arithmetic
//! (`p += g; m += g; v += g; copy = p`). The scalar fallback is compared
//! with the SIMD roofline, i.e. memory speed. The roofline of the norm pass
//! is a plain read of the same array in the same chunks by the same threads
//! (an XOR of the bits, which the compiler vectorizes). GB/s counts each
//! array's bytes once per pass (reads plus writes; no read-for-ownership).
//!
//! The machine is shared and noisy, so kernel and roofline are timed
//! alternately, `--reps` times each, and the medians are compared.
//! Streaming stores for the copy are measured on and off (the default is
//! on); `--sweep` also times tile sizes.
//!
//! `cargo bench --bench cpu_adam [-- --elems N --reps R --threads T --isa avx2 --sweep]`

use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use zero::core::optim::{AdamWParams, AdamWSlices, AdamWStep, CpuAdamW, Isa, NORM_CHUNK};
use zero::core::{bf16, Element};

struct Args {
    elems: usize,
    reps: usize,
    threads: Option<usize>,
    isa: Option<Isa>,
    sweep: bool,
}

fn parse_args() -> Args {
    let mut a = Args {
        elems: 50_000_000,
        reps: 7,
        threads: None,
        isa: None,
        sweep: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .unwrap_or_else(|| fail(&format!("{flag} needs a value")))
        };
        match flag.as_str() {
            "--elems" => a.elems = value().parse().unwrap_or_else(|e| fail(&format!("--elems: {e}"))),
            "--reps" => a.reps = value().parse().unwrap_or_else(|e| fail(&format!("--reps: {e}"))),
            "--threads" => a.threads = Some(value().parse().unwrap_or_else(|e| fail(&format!("--threads: {e}")))),
            "--isa" => a.isa = Some(value().parse().unwrap_or_else(|e: String| fail(&e))),
            "--sweep" => a.sweep = true,
            "--bench" => {}
            other => fail(&format!(
                "unknown option {other}; options: --elems N --reps R --threads T --isa avx512|avx2|neon|scalar --sweep"
            )),
        }
    }
    a.reps = a.reps.max(1);
    a
}

fn fail(msg: &str) -> ! {
    eprintln!("cpu_adam: {msg}");
    std::process::exit(2)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Times `kernel` and `roof` alternately, `reps` times each, after one
/// warm-up of each; returns their medians.
fn pair(reps: usize, mut kernel: impl FnMut(), mut roof: impl FnMut()) -> (Duration, Duration) {
    kernel();
    roof();
    let (mut k, mut r) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let t0 = Instant::now();
        roof();
        r.push(t0.elapsed());
        let t0 = Instant::now();
        kernel();
        k.push(t0.elapsed());
    }
    (median(k), median(r))
}

struct Row {
    name: String,
    bytes_per_elem: f64,
    kernel: Duration,
    roof: Duration,
}

fn print_rows(n: usize, rows: &[Row]) {
    println!(
        "{:<44} {:>9} {:>7} | {:>9} {:>7} | {:>8}",
        "variant", "Gelem/s", "GB/s", "roof Ge/s", "GB/s", "fraction"
    );
    for r in rows {
        let ge = |d: Duration| n as f64 / d.as_secs_f64() / 1e9;
        println!(
            "{:<44} {:>9.3} {:>7.1} | {:>9.3} {:>7.1} | {:>7.1}%",
            r.name,
            ge(r.kernel),
            ge(r.kernel) * r.bytes_per_elem,
            ge(r.roof),
            ge(r.roof) * r.bytes_per_elem,
            100.0 * r.roof.as_secs_f64() / r.kernel.as_secs_f64()
        );
    }
}

/// One AdamW variant: the kernel `eng` and its roofline `roof` (the same
/// engine unless comparing the scalar path with memory speed) on the same
/// arrays.
#[allow(clippy::too_many_arguments)]
fn adam_row<G: Element, M: Element>(
    name: &str,
    reps: usize,
    eng: &CpuAdamW,
    roof: &CpuAdamW,
    k: &AdamWStep,
    p: &mut [f32],
    g: &[G],
    m: &mut [M],
    v: &mut [M],
    low: Option<&mut [bf16]>,
) -> Row {
    let sz = |b: usize| b as f64;
    let bytes = sz(4 * 2)
        + sz(size_of::<G>())
        + 4.0 * sz(size_of::<M>())
        + if low.is_some() { 2.0 } else { 0.0 };
    let cell = std::cell::RefCell::new((p, m, v, low));
    let (kt, rt) = pair(
        reps,
        || {
            let mut c = cell.borrow_mut();
            let (p, m, v, low) = &mut *c;
            eng.step(k, p, g, m, v, low.as_deref_mut())
                .expect("lengths agree");
        },
        || {
            let mut c = cell.borrow_mut();
            let (p, m, v, low) = &mut *c;
            roof.traffic_many(vec![AdamWSlices {
                master: p,
                grad: g,
                m,
                v,
                low: low.as_deref_mut(),
            }])
            .expect("lengths agree");
        },
    );
    Row {
        name: name.to_string(),
        bytes_per_elem: bytes,
        kernel: kt,
        roof: rt,
    }
}

/// A plain read of `x` in the norm pass's chunks by `threads` threads: the
/// XOR of every element's bits.
fn read_roofline<G: Element>(threads: usize, x: &[G]) -> u64 {
    let chunks: Vec<&[G]> = x.chunks(NORM_CHUNK).collect();
    let next = AtomicUsize::new(0);
    let work = || {
        let mut acc = 0u64;
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(c) = chunks.get(i) else { break };
            let bytes: &[u8] = bytemuck::cast_slice(c);
            let (head, words, tail) = bytemuck::pod_align_to::<u8, u64>(bytes);
            acc ^= words.iter().fold(0u64, |a, w| a ^ w);
            acc ^= head.iter().chain(tail).fold(0u64, |a, &b| a ^ u64::from(b));
        }
        acc
    };
    std::thread::scope(|s| {
        let hs: Vec<_> = (1..threads).map(|_| s.spawn(work)).collect();
        hs.into_iter()
            .fold(work(), |a, h| a ^ h.join().expect("reader"))
    })
}

fn norm_row<G: Element>(name: &str, reps: usize, eng: &CpuAdamW, g: &[G]) -> Row {
    let (kt, rt) = pair(
        reps,
        || {
            black_box(eng.sum_squares(black_box(g)));
        },
        || {
            black_box(read_roofline(eng.threads(), black_box(g)));
        },
    );
    Row {
        name: name.to_string(),
        bytes_per_elem: size_of::<G>() as f64,
        kernel: kt,
        roof: rt,
    }
}

fn main() {
    let a = parse_args();
    let n = a.elems;
    let mut eng = CpuAdamW::new();
    if let Some(isa) = a.isa {
        eng = eng.with_isa(isa).unwrap_or_else(|e| fail(&e.to_string()));
    }
    if let Some(t) = a.threads {
        eng = eng.with_threads(t);
    }
    println!(
        "cpu_adam: {n} elements, isa {} (available: {:?}), {} threads, tile {} elements, streaming copy stores {}, {} reps (medians)",
        eng.isa(),
        Isa::available(),
        eng.threads(),
        eng.tile(),
        eng.streaming_stores(),
        a.reps
    );

    // Gradients are small and non-negative so that the roofline's
    // `v += g` keeps v >= 0: no NaN or subnormal slows either kernel.
    let t0 = Instant::now();
    let mut p: Vec<f32> = (0..n).map(|i| ((i % 1000) as f32 - 500.0) * 1e-3).collect();
    let g32: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 1e-3).collect();
    let g16: Vec<bf16> = g32.iter().map(|&x| bf16::from_f32(x)).collect();
    let mut m = vec![0f32; n];
    let mut v = vec![1e-4f32; n];
    let mut mb = vec![bf16::ZERO; n];
    let mut vb = vec![bf16::from_f32(1e-4); n];
    let mut low = vec![bf16::ZERO; n];
    eprintln!("arrays ready in {:.1} s", t0.elapsed().as_secs_f64());
    let k = AdamWStep::new(&AdamWParams::torch_default(), 1e-3, 10, 0.5);
    let scalar = eng
        .clone()
        .with_isa(Isa::Scalar)
        .expect("scalar runs everywhere");
    let no_stream = eng.clone().with_streaming_stores(false);

    let mut rows = vec![
        adam_row(
            "adamw fp32 state + fp32 grad",
            a.reps,
            &eng,
            &eng,
            &k,
            &mut p,
            &g32,
            &mut m,
            &mut v,
            None,
        ),
        adam_row(
            "adamw fp32 state + fp32 grad + bf16 copy",
            a.reps,
            &eng,
            &eng,
            &k,
            &mut p,
            &g32,
            &mut m,
            &mut v,
            Some(&mut low),
        ),
        adam_row(
            "adamw bf16 grad in + bf16 copy",
            a.reps,
            &eng,
            &eng,
            &k,
            &mut p,
            &g16,
            &mut m,
            &mut v,
            Some(&mut low),
        ),
        adam_row(
            "adamw bf16 moments + bf16 grad + bf16 copy",
            a.reps,
            &eng,
            &eng,
            &k,
            &mut p,
            &g16,
            &mut mb,
            &mut vb,
            Some(&mut low),
        ),
        adam_row(
            "  same as row 2, copy without streaming",
            a.reps,
            &no_stream,
            &no_stream,
            &k,
            &mut p,
            &g32,
            &mut m,
            &mut v,
            Some(&mut low),
        ),
    ];
    rows.push(adam_row(
        "scalar fallback (row 2; roof: SIMD traffic)",
        a.reps.min(3),
        &scalar,
        &eng,
        &k,
        &mut p,
        &g32,
        &mut m,
        &mut v,
        Some(&mut low),
    ));
    rows.push(norm_row("norm pass, fp32 grad", a.reps, &eng, &g32));
    rows.push(norm_row("norm pass, bf16 grad", a.reps, &eng, &g16));
    if a.sweep {
        for tile in [1usize << 12, 1 << 13, 1 << 14, 1 << 16, 1 << 18] {
            let e = eng.clone().with_tile(tile);
            rows.push(adam_row(
                &format!("  row 2 with tile {tile}"),
                a.reps,
                &e,
                &e,
                &k,
                &mut p,
                &g32,
                &mut m,
                &mut v,
                Some(&mut low),
            ));
        }
    }
    print_rows(n, &rows);
    black_box((&p, &m, &v, &mb, &vb, &low));
}
