//! Span tracing ([`zero::trace`]) on the threads backend: the engine's
//! gather, reduce, optimizer and offload spans for every rank, the Chrome
//! trace file, `gather_events` across per-rank tracers, and a disabled
//! tracer that records nothing and changes nothing.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use zero::comm::{Communicator, ThreadGroup};
use zero::core::bf16;
use zero::core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero::trace::{gather_events, write_chrome_trace, Event, SpanGuard, Tracer};
use zero::{Engine, UnitState};
use zero_testkit::mlp::{batch, Mlp};
use zero_testkit::runs::*;
use zero_testkit::temp::TempDir;

static_assertions::assert_impl_all!(Tracer: Clone, Send, Sync, Default);
static_assertions::assert_impl_all!(SpanGuard: Send, Sync);
static_assertions::assert_impl_all!(Event: Clone, Send, Sync);

fn now_us() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
        * 1e6
}

/// 2 ranks, `stage`, bf16, optimizer offload to the CPU.
fn cpu_offload_config(stage: u8) -> ResolvedConfig {
    let mut c = config(2, stage, 1, Precision::Bf16);
    c.zero.sub_group_size = 256;
    c.zero.offload_optimizer.device = OffloadDevice::Cpu;
    c
}

/// Stage 3 on 2 ranks with optimizer and parameter offload to nvme (no
/// host cache of shards: every gather reads the swap file).
fn nvme_config(dir: &Path) -> ResolvedConfig {
    let mut c = config(2, 3, 1, Precision::Bf16);
    c.zero.sub_group_size = 97;
    c.zero.aio.block_size = 4096;
    c.zero.offload_optimizer.device = OffloadDevice::Nvme;
    c.zero.offload_optimizer.buffer_count = 3;
    c.zero.offload_optimizer.nvme_path = Some(dir.join("opt"));
    let p = &mut c.zero.offload_param;
    p.device = OffloadDevice::Nvme;
    p.buffer_count = 4;
    p.buffer_size = 1024;
    p.max_in_cpu = 0;
    p.nvme_path = Some(dir.join("params"));
    c
}

/// Trains `steps` steps on one rank with `tracer`, recording a
/// `micro-batch` span per micro-batch as a trainer would; the final state.
fn train_traced<C: Communicator>(
    comm: C,
    cfg: &ResolvedConfig,
    steps: usize,
    tracer: Tracer,
) -> zero::Result<Vec<UnitState>> {
    let (world, rank) = (comm.world_size(), comm.rank());
    let mut b = Engine::builder(cfg.clone(), comm).seed(5).tracer(tracer);
    let model = Mlp::register(&mut b, DIMS)?;
    let mut e = b.build()?;
    for s in 0..steps {
        let (x, y) = batch(((s * world + rank) * MB) as u64, MB, DIMS[0]);
        let span = e
            .tracer()
            .span_with(rank, || format!("micro-batch {s}"), "compute");
        model.train_micro_batch::<bf16, C, _>(&mut e, &x, &y)?;
        drop(span);
        e.step()?;
    }
    e.unit_ids().into_iter().map(|u| e.unit_state(u)).collect()
}

/// Trains on 2 thread ranks, every rank with `tracer(rank)`; rank 0's
/// final state.
fn run(
    cfg: &ResolvedConfig,
    steps: usize,
    tracer: impl Fn(usize) -> Tracer + Sync,
) -> Vec<UnitState> {
    let out = ThreadGroup::run(2, |comm| {
        let t = tracer(comm.rank());
        train_traced(comm, cfg, steps, t)
    })
    .expect("ranks ran");
    let mut states: Vec<_> = out
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("training failed: {e}")))
        .collect();
    states.swap_remove(0)
}

/// Every event lies within the wall-clock window of the run and has a
/// non-negative duration.
fn check_times(events: &[Event], start_us: f64, end_us: f64) {
    // 1 ms of slack for the wall clock read at construction.
    for e in events {
        assert!(e.dur_us >= 0.0, "{e:?}");
        assert!(
            e.ts_us >= start_us - 1e3 && e.ts_us + e.dur_us <= end_us + 1e3,
            "{e:?} outside [{start_us}, {end_us}]"
        );
    }
}

fn names_of(events: &[Event], rank: usize) -> BTreeSet<String> {
    events
        .iter()
        .filter(|e| e.rank == rank)
        .map(|e| e.name.to_string())
        .collect()
}

/// Stages 2 and 3 with cpu optimizer offload, one tracer shared by both
/// ranks: each rank has gather, reduce, optimizer and offload spans within
/// the run's wall window, and the trained state is that of the untraced
/// run, bit for bit.
#[test]
fn shared_tracer_records_every_phase_of_every_rank() {
    for stage in [2u8, 3] {
        let cfg = cpu_offload_config(stage);
        let untraced = run(&cfg, 3, |_| Tracer::disabled());
        let tracer = Tracer::new();
        let start = now_us();
        let traced = run(&cfg, 3, |_| tracer.clone());
        let end = now_us();
        assert_bits_eq(
            &untraced,
            &traced,
            &format!("stage {stage}: traced vs untraced"),
        );

        let events = tracer.events();
        check_times(&events, start, end);
        for rank in 0..2 {
            let names = names_of(&events, rank);
            for want in ["gather", "reduce", "optimizer", "micro-batch 2"] {
                assert!(
                    names.contains(want),
                    "stage {stage} rank {rank}: no `{want}` in {names:?}"
                );
            }
            let of = |name: &str| events.iter().find(|e| e.rank == rank && e.name == name);
            assert_eq!(of("gather").unwrap().cat, "comm");
            assert_eq!(of("reduce").unwrap().cat, "comm");
            assert_eq!(of("optimizer").unwrap().cat, "optimizer");
            let offload: BTreeSet<_> = events
                .iter()
                .filter(|e| e.rank == rank && e.cat == "offload")
                .map(|e| e.name.to_string())
                .collect();
            for want in ["grad to host", "param copy-out"] {
                assert!(
                    offload.contains(want),
                    "stage {stage} rank {rank}: {offload:?}"
                );
            }
            // Three optimizer steps, each inside the run.
            let opt = events
                .iter()
                .filter(|e| e.rank == rank && e.name == "optimizer")
                .count();
            assert_eq!(opt, 3, "stage {stage} rank {rank}");
        }
    }
}

/// nvme optimizer and parameter offload (stage 3): the swap traffic and
/// the parameter fetches and write-backs show as offload spans.
#[test]
fn nvme_offload_spans() {
    let dir = TempDir::new("trace-nvme");
    let cfg = nvme_config(&dir);
    let tracer = Tracer::new();
    let start = now_us();
    run(&cfg, 2, |_| tracer.clone());
    let end = now_us();
    let events = tracer.events();
    check_times(&events, start, end);
    for rank in 0..2 {
        let offload: BTreeSet<_> = events
            .iter()
            .filter(|e| e.rank == rank && e.cat == "offload")
            .map(|e| e.name.to_string())
            .collect();
        for want in ["swap read", "swap write", "param fetch", "param write back"] {
            assert!(
                offload.contains(want),
                "rank {rank}: no `{want}` in {offload:?}"
            );
        }
    }
}

/// The default tracer records nothing.
#[test]
fn disabled_tracer_records_nothing() {
    let cfg = cpu_offload_config(3);
    let out = ThreadGroup::run(2, |comm| {
        let mut b = Engine::builder(cfg.clone(), comm).seed(5);
        let model = Mlp::register(&mut b, DIMS)?;
        let mut e = b.build()?;
        let (x, y) = batch(0, MB, DIMS[0]);
        model.train_micro_batch::<bf16, _, _>(&mut e, &x, &y)?;
        e.step()?;
        assert!(!e.tracer().is_enabled());
        Ok::<_, zero::Error>(e.tracer().events())
    })
    .unwrap();
    for events in out {
        assert!(events.unwrap().is_empty());
    }
    let explicit = Tracer::disabled();
    run(&cfg, 1, |_| explicit.clone());
    assert!(explicit.events().is_empty());
}

/// The Chrome trace file is JSON with a complete (`X`) event per span;
/// each rank is a process named `rank N`, each of its tracks is named, the
/// engine's collectives have their own track, and the slices of every
/// track nest properly (what a viewer needs to draw them).
#[test]
fn chrome_trace_file_parses() {
    let dir = TempDir::new("trace-file");
    let tracer = Tracer::new();
    run(&cpu_offload_config(3), 2, |_| tracer.clone());
    let events = tracer.events();
    assert!(
        events.iter().any(
            |e| e.cat == "collective" && (e.name == "all_gather" || e.name == "reduce_scatter")
        ),
        "the engine records when its collectives ran"
    );
    let path = dir.join("trace.json");
    write_chrome_trace(&path, &events).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(v["displayTimeUnit"], "ms");
    let all = v["traceEvents"].as_array().expect("traceEvents");
    let x: Vec<_> = all.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(x.len(), events.len());
    let pids: BTreeSet<u64> = x.iter().map(|e| e["pid"].as_u64().unwrap()).collect();
    assert_eq!(pids, BTreeSet::from([0, 1]));
    let named = |what: &str| -> BTreeSet<(u64, u64, String)> {
        all.iter()
            .filter(|e| e["ph"] == "M" && e["name"] == what)
            .map(|e| {
                (
                    e["pid"].as_u64().unwrap(),
                    e["tid"].as_u64().unwrap(),
                    e["args"]["name"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    assert_eq!(
        named("process_name"),
        BTreeSet::from([(0, 0, "rank 0".to_string()), (1, 0, "rank 1".to_string())])
    );
    let tracks = named("thread_name");
    let mut per_track: std::collections::BTreeMap<(u64, u64), Vec<(f64, f64)>> = Default::default();
    for e in &x {
        assert!(e["name"].is_string() && e["cat"].is_string(), "{e}");
        assert!(e["ts"].as_f64().unwrap() > 0.0 && e["dur"].as_f64().unwrap() >= 0.0);
        let (pid, tid) = (e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap());
        let track = tracks
            .iter()
            .find(|(p, t, _)| (*p, *t) == (pid, tid))
            .unwrap_or_else(|| panic!("{e}: its track has no name"));
        if e["cat"] == "collective" {
            assert!(track.2.starts_with("collectives"), "{e} on {track:?}");
        }
        let ts = e["ts"].as_f64().unwrap();
        per_track
            .entry((pid, tid))
            .or_default()
            .push((ts, ts + e["dur"].as_f64().unwrap()));
    }
    for (track, mut spans) in per_track {
        spans.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.total_cmp(&a.1)));
        let mut open: Vec<f64> = Vec::new();
        for (a, b) in spans {
            while open.last().is_some_and(|&end| end <= a) {
                open.pop();
            }
            assert!(
                open.last().is_none_or(|&end| end >= b),
                "track {track:?}: a slice {a}..{b} overlaps another without nesting"
            );
            open.push(b);
        }
    }
}

/// One tracer per rank (as with MPI): `gather_events` gives rank 0 every
/// rank's events, exactly, and the other ranks `None`.
#[test]
fn gather_events_collects_per_rank_tracers_on_rank_0() {
    let cfg = cpu_offload_config(2);
    let out = ThreadGroup::run(2, |comm| {
        let tracer = Tracer::new();
        let rank = comm.rank();
        let mut b = Engine::builder(cfg.clone(), comm)
            .seed(5)
            .tracer(tracer.clone());
        let model = Mlp::register(&mut b, DIMS)?;
        let mut e = b.build()?;
        let (x, y) = batch((rank * MB) as u64, MB, DIMS[0]);
        model.train_micro_batch::<bf16, _, _>(&mut e, &x, &y)?;
        e.step()?;
        // Rank 1 records more than rank 0: unequal byte lengths.
        if rank == 1 {
            let _span = tracer.span(rank, String::from("eval – ü"), "compute");
        }
        let mine = tracer.events();
        let gathered = gather_events(e.comm(), mine.clone())?;
        Ok::<_, zero::Error>((mine, gathered))
    })
    .unwrap();
    let mut out: Vec<_> = out.into_iter().map(Result::unwrap).collect();
    let (mine1, none) = out.pop().unwrap();
    let (mine0, all) = out.pop().unwrap();
    assert!(none.is_none());
    assert!(mine0.iter().all(|e| e.rank == 0) && mine1.iter().all(|e| e.rank == 1));
    assert!(mine1.len() > mine0.len());
    let expected: Vec<Event> = mine0.into_iter().chain(mine1).collect();
    assert_eq!(all.expect("rank 0 gets Some"), expected);

    // Nothing recorded anywhere: rank 0 gets an empty list.
    let out = ThreadGroup::run(2, |comm| gather_events(&comm, Vec::new())).unwrap();
    let out: Vec<_> = out.into_iter().map(Result::unwrap).collect();
    assert_eq!(out, vec![Some(Vec::new()), None]);
}
