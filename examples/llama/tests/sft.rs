//! The engine glue of the Llama SFT example (`zero_llama::train`) on a
//! tiny model and the addition task:
//!
//! - greedy decoding with the KV cache ([`generate`]) gives the tokens of a
//!   naive decode that re-runs the whole prefix at every step;
//! - [`SftModel::train_micro_batch`] (LM head on the loss rows only) gives
//!   the loss and, read back from AdamW's first moment, the gradients of
//!   [`Model::forward`] / [`Model::backward`] on the same parameters;
//! - training is bit-identical across stages 0–3, optimizer offload (cpu,
//!   nvme), stage-3 parameter offload (cpu, nvme), and with activation
//!   checkpointing, which keeps fewer activation bytes;
//! - stage 3 keeps one gather order through training and snapshots;
//! - the tiny model learns.

use std::path::{Path, PathBuf};
use zero_testkit::backend::assert_same_bits;
use zero_testkit::temp::TempDir;

use zero::comm::{Communicator, ThreadComm, ThreadGroup};
use zero::core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero::core::memory::{Category, Tier};
use zero::core::optim::LrSchedule;
use zero::core::{bf16, Element};
use zero::{Engine, EngineStats, Tracer, UnitState};
use zero_llama as llama;

use llama::data::{self, Sample};
use llama::lora::{self, LoraConfig};
use llama::train::{generate, LoraSetup, SftModel};
use llama::{tensors, Block, BlockParams, Config, Kind, Model, XorShift};

/// Samples per rank per micro-batch.
const MB: usize = 4;
/// GEMM threads per rank (two thread ranks share a 2-core machine).
const THREADS: usize = 1;
/// Seed of the data split, the sample order and the initialisation.
const SEED: u64 = 42;

/// The training samples of the addition task.
fn train_set() -> Vec<Sample> {
    data::addition_task(SEED).train
}

/// A tiny model over the task's vocabulary with room for `max_seq` tokens.
fn tiny(max_seq: usize) -> Config {
    Config {
        vocab: data::VOCAB,
        dim: 32,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        hidden: 64,
        max_seq,
        ..Config::tiny()
    }
}

/// Sequence length of a training batch: the longest training sample.
fn seq_len(train: &[Sample]) -> usize {
    data::max_len(train)
}

/// The model of the engine runs: [`tiny`] with room for the longest sample.
fn model_config() -> Config {
    tiny(seq_len(&train_set()))
}

/// Parameters in [`tensors`] order with varied outputs: every matrix
/// normal(0, `std`), every norm weight `1 + 0.2 * normal` (so a norm read
/// from the wrong tensor shows).
fn random_params(cfg: &Config, seed: u64, std: f32) -> Vec<Vec<f32>> {
    let mut rng = XorShift::new(seed);
    tensors(cfg)
        .iter()
        .map(|t| {
            (0..t.numel())
                .map(|_| match t.kind {
                    Kind::Norm => 1.0 + 0.2 * rng.normal(),
                    _ => std * rng.normal(),
                })
                .collect()
        })
        .collect()
}

/// Tokens and targets of rank `rank`'s share of global micro-batch `k`: the
/// same samples whatever the stage or offload mode.
fn micro_batch(
    train: &[Sample],
    order: &[usize],
    k: usize,
    rank: usize,
    world: usize,
    seq: usize,
) -> (Vec<u32>, Vec<i32>) {
    let first = (k * world + rank) * MB;
    let samples: Vec<&Sample> = (first..first + MB)
        .map(|i| &train[order[i % order.len()]])
        .collect();
    data::make_batch(&samples, seq).expect("samples fit in seq")
}

// ---------------------------------------------------------------------------
// 1. Generation with a KV cache

/// Logits of the last position of `tokens` (one sequence), from the full
/// forward pass of every block over the whole prefix.
fn last_logits(cfg: &Config, block: &Block, params: &[Vec<f32>], tokens: &[u32]) -> Vec<f32> {
    let len = tokens.len();
    let mut x = llama::ops::embedding_forward(&params[0], tokens, cfg.dim);
    for l in 0..cfg.n_layers {
        let refs: Vec<&[f32]> = params[cfg.layer_range(l)]
            .iter()
            .map(Vec::as_slice)
            .collect();
        x = block
            .forward(&BlockParams::from_slices(&refs), &x, 1, len)
            .y;
    }
    let last = &x[(len - 1) * cfg.dim..];
    let (xn, _) = llama::ops::rmsnorm_forward(last, &params[cfg.norm_index()], cfg.norm_eps);
    llama::ops::linear_forward(
        &xn,
        &params[cfg.head_index()],
        1,
        cfg.dim,
        cfg.vocab,
        THREADS,
    )
}

/// The index of the first largest value.
fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding without a cache: every step re-runs the whole prefix.
/// Same budget and stop rule as [`generate`].
fn naive_generate(
    cfg: &Config,
    block: &Block,
    params: &[Vec<f32>],
    prompt: &[u32],
    max_new: usize,
    stop: u32,
) -> Vec<u32> {
    let budget = max_new.min(cfg.max_seq.saturating_sub(prompt.len()));
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..budget {
        let t = argmax(&last_logits(cfg, block, params, &seq));
        out.push(t);
        if t == stop {
            break;
        }
        seq.push(t);
    }
    out
}

/// The KV-cache decode gives the tokens of the naive decode, for prompts of
/// several lengths (two of equal length decode as one batch), one whose
/// budget is cut by `max_seq`, and with a stop token that occurs; also
/// with q/k/v biases and tied embeddings.
#[test]
fn generate_matches_naive_decode() {
    let plain = tiny(20);
    check_generate(plain);
    check_generate(Config {
        qkv_bias: true,
        tie_embeddings: true,
        ..plain
    });
}

fn check_generate(cfg: Config) {
    let block = Block::new(cfg, THREADS);
    let max_new = 10;
    let prompts = vec![
        data::prompt_for(5),
        data::prompt_for(123),
        data::prompt_for(1807),
        data::prompt_for(456),
        // 15 tokens: only 5 fit under max_seq 20.
        data::encode_prompt("12345678901=", ""),
    ];
    for seed in [1u64, 2, 3] {
        let params = random_params(&cfg, seed, 0.3);
        let never = u32::MAX;
        let got = generate(&cfg, &block, &params, &prompts, max_new, never, THREADS);
        let mut distinct = std::collections::BTreeSet::new();
        for (p, g) in prompts.iter().zip(&got) {
            let want = naive_generate(&cfg, &block, &params, p, max_new, never);
            assert_eq!(g, &want, "seed {seed}, prompt {:?}", data::decode(p));
            assert_eq!(g.len(), max_new.min(cfg.max_seq - p.len()));
            distinct.extend(g.iter().copied());
        }
        assert!(
            distinct.len() >= 3,
            "seed {seed}: outputs too uniform to test anything: {got:?}"
        );
        // Stop at a token that does occur: the third token of the first
        // prompt's output (not an earlier one, so decoding goes on a bit).
        let stop = got[0][2];
        let stopped = generate(&cfg, &block, &params, &prompts, max_new, stop, THREADS);
        for (p, g) in prompts.iter().zip(&stopped) {
            let want = naive_generate(&cfg, &block, &params, p, max_new, stop);
            assert_eq!(
                g,
                &want,
                "seed {seed}, stop {stop}, prompt {:?}",
                data::decode(p)
            );
        }
        assert_eq!(stopped[0].last(), Some(&stop));
        assert!(stopped[0].len() <= 3);
    }
}

// ---------------------------------------------------------------------------
// Engine runs

/// The example's engine config (`engine_config` of `llama_sft.rs`) with
/// small buckets, so reductions, gathers and prefetches come in several
/// pieces.
fn engine_config(world: usize, stage: u8, ga: usize, precision: Precision) -> ResolvedConfig {
    let mut c = ResolvedConfig::simple(stage, world, MB);
    c.gradient_accumulation_steps = ga;
    c.train_batch_size = MB * ga * world;
    c.precision = precision;
    c.optimizer.lr = 1e-3;
    c.optimizer.beta2 = 0.95;
    c.optimizer.weight_decay = 0.0;
    c.scheduler = LrSchedule::Constant { lr: 1e-3 };
    c.gradient_clipping = 1.0;
    c.zero.reduce_bucket_size = 6000;
    c.zero.allgather_bucket_size = 7000;
    c.zero.prefetch_bucket_size = 12000;
    c.zero.param_persistence_threshold = 0;
    c
}

/// What a training run does besides the config.
#[derive(Clone, Copy)]
struct Opts {
    /// Optimizer steps.
    steps: usize,
    /// [`SftModel::checkpointing`].
    checkpointing: bool,
    /// Read [`SftModel::snapshot`] after every optimizer step.
    snapshot_every_step: bool,
    /// Gather and release the head unit after every optimizer step, as an
    /// evaluation that reads parameters through gathers would.
    gather_every_step: bool,
    /// LoRA ([`lora_setup`]) on every block, the base frozen.
    lora: bool,
}

impl Opts {
    /// `steps` plain steps: no checkpointing, nothing between steps.
    fn steps(steps: usize) -> Self {
        Opts {
            steps,
            checkpointing: false,
            snapshot_every_step: false,
            gather_every_step: false,
            lora: false,
        }
    }
}

/// One rank's view of a run.
struct RankRun {
    /// Every micro-batch's loss (this rank's samples).
    losses: Vec<f32>,
    /// Largest `activation_bytes` of any micro-batch.
    activation_bytes: u64,
    /// [`SftModel::snapshot`] at the end.
    snapshot: Vec<Vec<f32>>,
    /// Every unit's full state at the end.
    states: Vec<UnitState>,
    /// [`Engine::warnings`] at the end.
    warnings: Vec<String>,
    /// [`Engine::stats`] at the end.
    stats: EngineStats,
    /// [`SftModel::snapshot_adapters`] at the end (empty without LoRA).
    adapters: Vec<Vec<f32>>,
    /// Bytes of gradients (device and host), master and moments after
    /// build, and the trainable elements of the units (padded).
    bytes: [u64; 4],
}

/// The LoRA of the engine runs: rank 4 on q, v, o and down (attention and
/// MLP, inputs of three widths), dropout 0.1.
fn lora_setup() -> LoraSetup {
    LoraSetup {
        cfg: LoraConfig::new(4, 8.0, 0.1, &["q_proj", "v_proj", "o_proj", "down_proj"]).unwrap(),
        seed: SEED,
        adapters: None,
    }
}

/// One rank of a run: `opts.steps` optimizer steps over the task's
/// samples in a fixed order, from the engine's default initialisation.
fn train_rank<T: Element, C: Communicator>(
    comm: C,
    cfg: &ResolvedConfig,
    model_cfg: Config,
    opts: Opts,
) -> zero::Result<RankRun> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let train = train_set();
    let seq = seq_len(&train);
    let order = data::epoch_order(train.len(), 0, SEED);
    let mut b = Engine::builder(cfg.clone(), comm).seed(SEED);
    let lora = opts.lora.then(lora_setup);
    let model =
        SftModel::register_lora(&mut b, model_cfg, None, lora, THREADS, opts.checkpointing)?;
    let mut e = b.build()?;
    let t = e.tracker();
    let mut bytes = [
        t.current(Tier::Device, Category::Grads) + t.current(Tier::Host, Category::Grads),
        t.current(Tier::Device, Category::Master) + t.current(Tier::Host, Category::Master),
        t.current(Tier::Device, Category::Moments) + t.current(Tier::Host, Category::Moments),
        0,
    ];
    for u in e.unit_ids() {
        bytes[3] += e.layout(u)?.padded_numel as u64;
    }
    let tracer = Tracer::disabled();
    let ga = cfg.gradient_accumulation_steps;
    let mut losses = Vec::new();
    let mut activation_bytes = 0;
    for s in 0..opts.steps {
        for m in 0..ga {
            let (tokens, targets) = micro_batch(&train, &order, s * ga + m, rank, world, seq);
            let st =
                model.train_micro_batch::<T, C>(&mut e, &tokens, &targets, MB, seq, &tracer)?;
            assert!(st.target_tokens > 0);
            losses.push(st.loss);
            activation_bytes = activation_bytes.max(st.activation_bytes);
            e.step()?;
        }
        assert_eq!(e.steps(), s as u64 + 1, "step {s} was not applied");
        if opts.snapshot_every_step {
            model.snapshot(&mut e)?;
        }
        if opts.gather_every_step {
            drop(e.gather(model.head)?);
        }
    }
    let snapshot = model.snapshot(&mut e)?;
    let adapters = model.snapshot_adapters(&mut e)?;
    let mut states = Vec::new();
    for u in e.unit_ids() {
        states.push(e.unit_state(u)?);
    }
    Ok(RankRun {
        losses,
        activation_bytes,
        snapshot,
        states,
        warnings: e.warnings().to_vec(),
        stats: e.stats().clone(),
        adapters,
        bytes,
    })
}

/// Trains on `world` thread ranks; every rank's view.
fn run(world: usize, cfg: &ResolvedConfig, model_cfg: Config, opts: Opts) -> Vec<RankRun> {
    ThreadGroup::run(world, |comm: ThreadComm| match cfg.precision {
        Precision::Fp32 => train_rank::<f32, _>(comm, cfg, model_cfg, opts),
        Precision::Bf16 => train_rank::<bf16, _>(comm, cfg, model_cfg, opts),
        Precision::Fp16 => train_rank::<zero::core::f16, _>(comm, cfg, model_cfg, opts),
    })
    .expect("ranks ran")
    .into_iter()
    .map(|r| r.unwrap_or_else(|e| panic!("training failed: {e}")))
    .collect()
}

/// Losses, snapshot and every unit's parameters, master, m and v agree bit
/// for bit, rank by rank.
fn assert_same_run(base: &[RankRun], t: &[RankRun], what: &str) {
    assert_eq!(base.len(), t.len());
    let names = tensors(&model_config());
    for (r, (x, y)) in base.iter().zip(t).enumerate() {
        assert_same_bits(&x.losses, &y.losses, &format!("{what}: rank {r} losses"));
        assert_eq!(x.snapshot.len(), y.snapshot.len());
        for (k, (p, q)) in x.snapshot.iter().zip(&y.snapshot).enumerate() {
            let name = names.get(k).map_or("?", |t| t.name.as_str());
            assert_same_bits(p, q, &format!("{what}: rank {r} snapshot {name}"));
        }
        assert_eq!(x.states.len(), y.states.len());
        for (u, (p, q)) in x.states.iter().zip(&y.states).enumerate() {
            for (field, a, b) in [
                ("params", &p.params, &q.params),
                ("master", &p.master, &q.master),
                ("m", &p.m, &q.m),
                ("v", &p.v, &q.v),
            ] {
                assert_same_bits(a, b, &format!("{what}: rank {r} unit {u} {field}"));
            }
        }
    }
}

/// Every rank reads out the same snapshot and states.
fn assert_ranks_agree(runs: &[RankRun], what: &str) {
    for (r, t) in runs.iter().enumerate().skip(1) {
        for (k, (p, q)) in runs[0].snapshot.iter().zip(&t.snapshot).enumerate() {
            assert_same_bits(p, q, &format!("{what}: snapshot tensor {k}, rank 0 vs {r}"));
        }
    }
}

/// Stage 3 kept one gather order and warned about nothing.
fn assert_steady_gathers(runs: &[RankRun], what: &str) {
    for (r, t) in runs.iter().enumerate() {
        assert!(t.warnings.is_empty(), "{what}: rank {r}: {:?}", t.warnings);
        assert_eq!(t.stats.gather_order_changes, 0, "{what}: rank {r}");
    }
}

/// Files left under `dir` (none once the engines are gone).
fn files_left(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------
// 2. Loss and gradients against the model core

/// One rank's engine results and the model core's on the same parameters
/// and batch; gradients are all tensors concatenated in [`tensors`] order.
struct Reference {
    /// [`SftModel::train_micro_batch`]'s loss.
    engine_loss: f32,
    /// [`Model::forward`]'s loss.
    model_loss: f32,
    /// [`Model::backward`]'s gradients of this rank's batch.
    model_grad: Vec<f32>,
    /// The gradient the engine applied (the mean over ranks), read back from
    /// AdamW's first moment after one step: `m = (1 - beta1) * g` from zero,
    /// with clipping off.
    engine_grad: Vec<f32>,
    /// [`SftModel::snapshot`] before the step.
    snapshot: Vec<Vec<f32>>,
}

/// One rank of [`loss_and_gradients_match_the_model_core`]: fp32, `stage`,
/// initialised with `init`, one micro-batch and one step.
fn reference_rank<C: Communicator>(
    comm: C,
    stage: u8,
    model_cfg: Config,
    init: &[Vec<f32>],
) -> zero::Result<Reference> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let train = train_set();
    let seq = seq_len(&train);
    let order = data::epoch_order(train.len(), 0, SEED);
    let mut cfg = engine_config(world, stage, 1, Precision::Fp32);
    cfg.gradient_clipping = 0.0;
    let beta1 = cfg.optimizer.beta1;
    let mut b = Engine::builder(cfg, comm).seed(SEED);
    let model = SftModel::register(&mut b, model_cfg, Some(init.to_vec()), THREADS, false)?;
    let mut e = b.build()?;
    let snapshot = model.snapshot(&mut e)?;
    let (tokens, targets) = micro_batch(&train, &order, 0, rank, world, seq);
    let st = model.train_micro_batch::<f32, C>(
        &mut e,
        &tokens,
        &targets,
        MB,
        seq,
        &Tracer::disabled(),
    )?;
    e.step()?;
    let mut engine_grad = Vec::new();
    for u in std::iter::once(model.embed)
        .chain(model.layers.iter().copied())
        .chain(std::iter::once(model.head))
    {
        let m = e.unit_state(u)?.m;
        engine_grad.extend(m.iter().map(|&m| m / (1.0 - beta1) as f32));
    }
    let core = Model::new(model_cfg, THREADS);
    let refs: Vec<&[f32]> = snapshot.iter().map(Vec::as_slice).collect();
    let (model_loss, cache) = core.forward(&refs, &tokens, &targets, MB, seq);
    let model_grad = core.backward(&refs, &cache).concat();
    Ok(Reference {
        engine_loss: st.loss,
        model_loss,
        model_grad,
        engine_grad,
        snapshot,
    })
}

/// `|a - b| <= rtol * max|b| + atol` per tensor, naming the worst element.
fn assert_close_per_tensor(cfg: &Config, got: &[f32], want: &[f32], rtol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut at = 0;
    for t in tensors(cfg) {
        let (g, w) = (&got[at..at + t.numel()], &want[at..at + t.numel()]);
        at += t.numel();
        let scale = w.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(scale > 0.0, "{what}: {}: zero gradient", t.name);
        let (i, err) = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .enumerate()
            .fold((0, 0f32), |m, (i, e)| if e > m.1 { (i, e) } else { m });
        assert!(
            err <= rtol * scale + 1e-9,
            "{what}: {} element {i}: {} vs {} (max |g| {scale})",
            t.name,
            g[i],
            w[i]
        );
    }
}

/// fp32: the engine-driven micro-batch (head on the loss rows only) has the
/// loss of [`Model::forward`] on the same parameters and batch, and the
/// gradient the engine applies is [`Model::backward`]'s (the mean over
/// ranks with 2); `register` with initial values and `snapshot` keep
/// [`tensors`] order. Also with Qwen2's q/k/v biases and tied embeddings
/// (the embedding unit gathered twice, its gradient summed over both uses).
#[test]
fn loss_and_gradients_match_the_model_core() {
    let train = train_set();
    let plain = tiny(seq_len(&train));
    let qwen = Config {
        qkv_bias: true,
        tie_embeddings: true,
        ..plain
    };
    for (cfg, world, stage) in [
        (plain, 1usize, 0u8),
        (plain, 2, 3),
        (qwen, 1, 0),
        (qwen, 2, 3),
    ] {
        let init = random_params(&cfg, 11, 0.1);
        let what = format!(
            "world {world} stage {stage} (biases {}, tied {})",
            cfg.qkv_bias, cfg.tie_embeddings
        );
        let refs = ThreadGroup::run(world, |comm| reference_rank(comm, stage, cfg, &init))
            .expect("ranks ran")
            .into_iter()
            .map(|r| r.unwrap_or_else(|e| panic!("{what}: {e}")))
            .collect::<Vec<_>>();
        for (r, x) in refs.iter().enumerate() {
            for (k, (p, q)) in x.snapshot.iter().zip(&init).enumerate() {
                assert_same_bits(
                    p,
                    q,
                    &format!("{what}: rank {r} snapshot tensor {k} vs init"),
                );
            }
            let rel = (x.engine_loss - x.model_loss).abs() / x.model_loss.abs();
            assert!(
                rel < 1e-6,
                "{what}: rank {r}: engine loss {} vs model loss {}",
                x.engine_loss,
                x.model_loss
            );
            assert!(
                x.model_loss > 1.0,
                "{what}: loss {} is implausible",
                x.model_loss
            );
        }
        let n = refs[0].model_grad.len();
        let mean: Vec<f32> = (0..n)
            .map(|i| refs.iter().map(|x| x.model_grad[i]).sum::<f32>() / world as f32)
            .collect();
        for (r, x) in refs.iter().enumerate() {
            assert_close_per_tensor(
                &cfg,
                &x.engine_grad,
                &mean,
                1e-5,
                &format!("{what}: rank {r} gradient"),
            );
        }
    }
}

// ---------------------------------------------------------------------------
// 3. Every stage and offload mode

/// bf16 on 2 ranks, 3 steps: stages 1–3, optimizer offload cpu and nvme
/// (stages 1–3), stage-3 parameter offload cpu and nvme, and stage 3 with
/// gradient accumulation 2, all give the losses, snapshot, master weights
/// and moments of stage 0 bit for bit; stage 3 keeps its gather order.
#[test]
fn stages_and_offload_are_bit_identical() {
    let dir = TempDir::new("llama-sft-exact");
    let model_cfg = model_config();
    let world = 2;
    let opts = Opts::steps(3);
    for ga in [1usize, 2] {
        let base = run(
            world,
            &engine_config(world, 0, ga, Precision::Bf16),
            model_cfg,
            opts,
        );
        assert_ranks_agree(&base, "stage 0");
        assert_eq!(base[0].losses.len(), 3 * ga);
        assert_ne!(
            base[0].losses, base[1].losses,
            "ranks must see different samples"
        );
        let mut variants: Vec<(u8, OffloadDevice, OffloadDevice)> = Vec::new();
        if ga == 1 {
            for stage in 1..=3u8 {
                for opt in [OffloadDevice::None, OffloadDevice::Cpu, OffloadDevice::Nvme] {
                    variants.push((stage, opt, OffloadDevice::None));
                }
            }
            for param in [OffloadDevice::Cpu, OffloadDevice::Nvme] {
                variants.push((3, OffloadDevice::None, param));
            }
        } else {
            variants.push((3, OffloadDevice::None, OffloadDevice::None));
            variants.push((3, OffloadDevice::Nvme, OffloadDevice::Nvme));
        }
        for (stage, opt, param) in variants {
            let mut c = engine_config(world, stage, ga, Precision::Bf16);
            c.zero.offload_optimizer.device = opt;
            if opt == OffloadDevice::Nvme {
                c.zero.offload_optimizer.nvme_path = Some(dir.join("optimizer"));
            }
            c.zero.offload_param.device = param;
            if param == OffloadDevice::Nvme {
                // No host cache: every gather reads the swap file.
                c.zero.offload_param.max_in_cpu = 0;
                c.zero.offload_param.nvme_path = Some(dir.join("params"));
            }
            let what = format!(
                "stage {stage} ga {ga} offload_optimizer {opt:?} offload_param {param:?} vs stage 0"
            );
            let t = run(world, &c, model_cfg, opts);
            assert_ranks_agree(&t, &what);
            assert_same_run(&base, &t, &what);
            if stage == 3 {
                assert_steady_gathers(&t, &what);
            }
        }
    }
    let left = files_left(&dir);
    assert!(left.is_empty(), "swap files left behind: {left:?}");
}

/// Qwen2's shape (q/k/v biases, tied embeddings: the embedding unit is
/// gathered twice per forward): bf16 on 2 ranks, 3 steps, stages 1–3 and
/// stage 3 with parameter offload give stage 0's run bit for bit; stage 3
/// keeps its gather order.
#[test]
fn tied_embeddings_and_biases_are_bit_identical_across_stages() {
    let model_cfg = Config {
        qkv_bias: true,
        tie_embeddings: true,
        ..model_config()
    };
    let world = 2;
    let opts = Opts::steps(3);
    let base = run(
        world,
        &engine_config(world, 0, 1, Precision::Bf16),
        model_cfg,
        opts,
    );
    assert_ranks_agree(&base, "stage 0");
    for (stage, param) in [
        (1u8, OffloadDevice::None),
        (2, OffloadDevice::None),
        (3, OffloadDevice::None),
        (3, OffloadDevice::Cpu),
    ] {
        let mut c = engine_config(world, stage, 1, Precision::Bf16);
        c.zero.offload_param.device = param;
        let what = format!("tied: stage {stage} offload_param {param:?} vs stage 0");
        let t = run(world, &c, model_cfg, opts);
        assert_ranks_agree(&t, &what);
        assert_same_run(&base, &t, &what);
        if stage == 3 {
            assert_steady_gathers(&t, &what);
        }
    }
}

/// Generation from the engine unit by unit (`generate_from` over
/// `EngineSource`, what `llama_sft` evaluates with) gives what generation
/// from a whole-model snapshot gives, on each of 2 ranks whose prompts
/// differ in number and length (the ranks read units in step), with tied
/// embeddings and q/k/v biases, stage 3 with parameter offload, with and
/// without a stop token.
#[test]
fn generation_from_the_engine_matches_the_snapshot_on_every_rank() {
    use llama::train::{generate_from, EngineSource};
    let model_cfg = Config {
        qkv_bias: true,
        tie_embeddings: true,
        ..model_config()
    };
    let world = 2;
    let mut cfg = engine_config(world, 3, 1, Precision::Bf16);
    cfg.zero.offload_param.device = OffloadDevice::Cpu;
    let params = random_params(&model_cfg, 7, 0.3);
    let prompts = [
        vec![
            data::prompt_for(5),
            data::prompt_for(123),
            data::prompt_for(1807),
        ],
        vec![
            data::prompt_for(456),
            data::encode_prompt("12345678901=", ""),
        ],
    ];
    let max_new = 8;
    let outs = ThreadGroup::run(world, |comm| -> zero::Result<_> {
        let rank = comm.rank();
        let mut b = Engine::builder(cfg.clone(), comm).seed(SEED);
        let model = SftModel::register(&mut b, model_cfg, Some(params.clone()), THREADS, false)?;
        let mut e = b.build()?;
        let snapshot = model.snapshot(&mut e)?;
        let block = &model.block;
        // A stop token that occurs: the third of rank 0's first output.
        let probe = generate(
            &model_cfg,
            block,
            &snapshot,
            &prompts[0],
            max_new,
            u32::MAX,
            THREADS,
        );
        let mut got = Vec::new();
        for stop in [u32::MAX, probe[0][2]] {
            let mut src = EngineSource {
                e: &mut e,
                model: &model,
            };
            let streamed = generate_from(
                &model_cfg,
                block,
                &mut src,
                &prompts[rank],
                max_new,
                stop,
                THREADS,
            )?;
            let full = generate(
                &model_cfg,
                block,
                &snapshot,
                &prompts[rank],
                max_new,
                stop,
                THREADS,
            );
            assert_eq!(streamed, full, "rank {rank}, stop {stop}");
            got.push(streamed);
        }
        Ok(got)
    })
    .unwrap();
    let mut distinct = std::collections::BTreeSet::new();
    for (r, o) in outs.into_iter().enumerate() {
        let o = o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(
            o[0].len(),
            prompts[r].len(),
            "rank {r}: an output per prompt"
        );
        distinct.extend(o.into_iter().flatten().flatten());
    }
    assert!(distinct.len() >= 3, "outputs too uniform to test anything");
}

// ---------------------------------------------------------------------------
// 4. Activation checkpointing

/// Stage 3, 2 ranks, bf16: recomputing each block in backward gives the
/// losses and final state of keeping its activations, bit for bit, and
/// keeps fewer activation bytes.
#[test]
fn checkpointing_is_bit_identical_and_smaller() {
    let model_cfg = model_config();
    let cfg = engine_config(2, 3, 1, Precision::Bf16);
    let full = run(2, &cfg, model_cfg, Opts::steps(3));
    let ckpt = run(
        2,
        &cfg,
        model_cfg,
        Opts {
            checkpointing: true,
            ..Opts::steps(3)
        },
    );
    assert_same_run(&full, &ckpt, "checkpointing vs not");
    assert_steady_gathers(&ckpt, "checkpointing");
    for (r, (f, c)) in full.iter().zip(&ckpt).enumerate() {
        assert!(c.activation_bytes > 0, "rank {r}");
        assert!(
            c.activation_bytes < f.activation_bytes,
            "rank {r}: checkpointing keeps {} activation bytes, without {}",
            c.activation_bytes,
            f.activation_bytes
        );
    }
}

// ---------------------------------------------------------------------------
// 5. Stage-3 gather order

/// Stage 3, 2 ranks: several steps (with and without gradient accumulation)
/// and a snapshot after every step leave the recorded gather order alone
/// (no warning, no order change), and the snapshots do not change training.
/// The control: a gather between steps is noticed (a warning and order
/// changes), so the checks above are not vacuous.
#[test]
fn stage3_gather_order_is_steady_across_snapshots() {
    let model_cfg = model_config();
    for ga in [1usize, 2] {
        let mut cfg = engine_config(2, 3, ga, Precision::Bf16);
        cfg.zero.offload_param.device = OffloadDevice::Cpu;
        let plain = run(2, &cfg, model_cfg, Opts::steps(4));
        let snap = run(
            2,
            &cfg,
            model_cfg,
            Opts {
                snapshot_every_step: true,
                ..Opts::steps(4)
            },
        );
        let what = format!("ga {ga}");
        assert_steady_gathers(&plain, &what);
        assert_steady_gathers(&snap, &format!("{what} with snapshots"));
        assert!(snap[0].stats.prefetches > 0, "{what}: nothing prefetched");
        assert_same_run(&plain, &snap, &format!("{what}: snapshots vs none"));
        let gathered = run(
            2,
            &cfg,
            model_cfg,
            Opts {
                gather_every_step: true,
                ..Opts::steps(4)
            },
        );
        for (r, t) in gathered.iter().enumerate() {
            assert!(
                t.stats.gather_order_changes > 0 && !t.warnings.is_empty(),
                "{what}: rank {r}: a gather between steps went unnoticed"
            );
        }
        assert_same_run(&plain, &gathered, &format!("{what}: gathers vs none"));
    }
}

// ---------------------------------------------------------------------------
// 6. Learning

/// The tiny model on 2 ranks (stage 2, bf16, the example's learning rate
/// 3e-3) halves its loss within 60 steps.
#[test]
fn tiny_model_learns() {
    let model_cfg = model_config();
    let mut cfg = engine_config(2, 2, 1, Precision::Bf16);
    cfg.optimizer.lr = 3e-3;
    cfg.scheduler = LrSchedule::Constant { lr: 3e-3 };
    let runs = run(2, &cfg, model_cfg, Opts::steps(60));
    // The global loss of a step: the mean over both ranks.
    let step_loss = |s: usize| (runs[0].losses[s] + runs[1].losses[s]) / 2.0;
    let first = step_loss(0);
    let last: f32 = (55..60).map(step_loss).sum::<f32>() / 5.0;
    assert!(first.is_finite() && first > 3.0, "first loss {first}");
    assert!(
        last < 0.5 * first,
        "loss went from {first} to {last} (mean of the last 5 steps)"
    );
}

// ---------------------------------------------------------------------------
// 4. LoRA

/// LoRA (base frozen, adapters trainable, dropout on), bf16, 3 steps, on 1
/// and 2 ranks: stages 1–3 × optimizer offload none/cpu/nvme, stage 3
/// with parameter offload cpu and activation checkpointing give stage 0's losses, adapters, master and
/// moments bit for bit; the base (snapshot) is bit-identical to its
/// initial values; the adapters moved; the memory report holds gradient,
/// master and moment bytes for the adapters only.
#[test]
fn lora_is_bit_identical_across_stages_and_the_base_stays_frozen() {
    let dir = TempDir::new("llama-sft-lora");
    let model_cfg = model_config();
    let lc = lora_setup().cfg;
    let adapter_numel: usize = (0..model_cfg.n_layers)
        .flat_map(|l| lora::lora_tensors(&model_cfg, &lc, l))
        .map(|t| t.numel())
        .sum();
    let opts = Opts {
        lora: true,
        ..Opts::steps(3)
    };
    for world in [1usize, 2] {
        let base = run(
            world,
            &engine_config(world, 0, 1, Precision::Bf16),
            model_cfg,
            opts,
        );
        assert_ranks_agree(&base, "lora stage 0");
        // The frozen base: the engine's default initialisation, untouched.
        let plain = run(
            world,
            &engine_config(world, 0, 1, Precision::Bf16),
            model_cfg,
            Opts::steps(0),
        );
        for (k, (p, q)) in base[0].snapshot.iter().zip(&plain[0].snapshot).enumerate() {
            assert_same_bits(
                p,
                q,
                &format!("world {world}: base tensor {k} after training"),
            );
        }
        // The adapters trained: every B moved off zero.
        for (k, a) in base[0].adapters.iter().enumerate() {
            assert!(a.iter().any(|&x| x != 0.0), "adapter tensor {k} is zero");
        }
        // Only the adapters have optimizer state (padded to the shard
        // alignment, well under the base's size).
        let [grads, master, moments, trainable] = base[0].bytes;
        assert!(
            trainable as usize >= adapter_numel && (trainable as usize) < 2 * adapter_numel + 4096
        );
        assert_eq!(master, 4 * trainable, "world {world}: master bytes");
        assert_eq!(moments, 8 * trainable, "world {world}: moment bytes");
        // Gradient bytes per trainable element as without LoRA: none for
        // the base.
        let [plain_grads, _, _, plain_trainable] = plain[0].bytes;
        assert!(plain_trainable > 4 * trainable);
        assert_eq!(
            grads * plain_trainable,
            plain_grads * trainable,
            "world {world}: {grads} gradient bytes for {trainable} trainable elements, \
             {plain_grads} for {plain_trainable} without LoRA"
        );
        let mut variants: Vec<(u8, OffloadDevice, OffloadDevice)> = Vec::new();
        for stage in 1..=3u8 {
            for opt in [OffloadDevice::None, OffloadDevice::Cpu, OffloadDevice::Nvme] {
                variants.push((stage, opt, OffloadDevice::None));
            }
        }
        variants.push((3, OffloadDevice::None, OffloadDevice::Cpu));
        // Activation checkpointing recomputes each block with the same masks.
        let ckpt = run(
            world,
            &engine_config(world, 0, 1, Precision::Bf16),
            model_cfg,
            Opts {
                checkpointing: true,
                ..opts
            },
        );
        assert_same_run(
            &base,
            &ckpt,
            &format!("lora world {world}: checkpointing vs not"),
        );
        for (stage, opt, param) in variants {
            let mut c = engine_config(world, stage, 1, Precision::Bf16);
            c.zero.offload_optimizer.device = opt;
            if opt == OffloadDevice::Nvme {
                c.zero.offload_optimizer.nvme_path = Some(dir.join("optimizer"));
            }
            c.zero.offload_param.device = param;
            let what = format!(
                "lora world {world} stage {stage} offload_optimizer {opt:?} offload_param {param:?} vs stage 0"
            );
            let t = run(world, &c, model_cfg, opts);
            assert_ranks_agree(&t, &what);
            assert_same_run(&base, &t, &what);
            for (k, (p, q)) in base[0].adapters.iter().zip(&t[0].adapters).enumerate() {
                assert_same_bits(p, q, &format!("{what}: adapter tensor {k}"));
            }
            if stage == 3 {
                assert_steady_gathers(&t, &what);
            }
        }
    }
    let left = files_left(&dir);
    assert!(left.is_empty(), "swap files left behind: {left:?}");
}

/// With LoRA, training through the engine gives the adapter gradients of
/// [`Model::backward`] (no dropout, one rank, fp32): read back from AdamW's
/// first moment after one step.
#[test]
fn lora_gradients_match_the_model() {
    let model_cfg = model_config();
    let mut setup = lora_setup();
    setup.cfg.dropout = 0.0;
    let train = train_set();
    let seq = seq_len(&train);
    let order = data::epoch_order(train.len(), 0, SEED);
    let (tokens, targets) = micro_batch(&train, &order, 0, 0, 1, seq);
    let mut cfg = engine_config(1, 0, 1, Precision::Fp32);
    cfg.gradient_clipping = 0.0;
    let lc = setup.cfg.clone();
    let init = random_params(&model_cfg, 5, 0.1);
    // Non-zero B so every gradient is non-trivial.
    let mut rng = XorShift::new(77);
    let mut adapters = Vec::new();
    for l in 0..model_cfg.n_layers {
        for t in lora::lora_tensors(&model_cfg, &lc, l) {
            adapters.push(
                (0..t.numel())
                    .map(|_| 0.1 * rng.normal())
                    .collect::<Vec<f32>>(),
            );
        }
    }
    let m1: Vec<Vec<f32>> =
        ThreadGroup::run(1, |comm: ThreadComm| -> zero::Result<Vec<Vec<f32>>> {
            let mut b = Engine::builder(cfg.clone(), comm).seed(SEED);
            let s = LoraSetup {
                adapters: Some(adapters.clone()),
                ..setup.clone()
            };
            let model = SftModel::register_lora(
                &mut b,
                model_cfg,
                Some(init.clone()),
                Some(s),
                THREADS,
                false,
            )?;
            let mut e = b.build()?;
            model.train_micro_batch::<f32, _>(
                &mut e,
                &tokens,
                &targets,
                MB,
                seq,
                &Tracer::disabled(),
            )?;
            e.step()?;
            let mut out = Vec::new();
            for (l, &u) in model.layers.iter().enumerate() {
                let st = e.unit_state(u)?;
                let lay = e.layout(u)?;
                for t in lora::lora_tensors(&model_cfg, &lc, l) {
                    out.push(st.m[lay.tensor(&t.name).unwrap().range()].to_vec());
                }
            }
            Ok(out)
        })
        .expect("ranks ran")
        .remove(0)
        .unwrap();
    let model = Model::with_lora(model_cfg, lc.clone(), 1);
    let mut params = init.clone();
    params.extend(adapters.clone());
    let sl: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
    let (_, cache) = model.forward(&sl, &tokens, &targets, MB, seq);
    let grads = model.backward(&sl, &cache);
    let beta1 = 1.0 - cfg.optimizer.beta1 as f32;
    for (k, (m, g)) in m1
        .iter()
        .zip(&grads[model_cfg.tensor_count()..])
        .enumerate()
    {
        let scale = g.iter().fold(0f32, |a, x| a.max(x.abs()));
        assert!(scale > 0.0, "adapter {k}: zero gradient");
        for (i, (a, b)) in m.iter().zip(g).enumerate() {
            assert!(
                (a / beta1 - b).abs() <= 1e-4 * scale,
                "adapter {k}[{i}]: engine {} vs model {b}",
                a / beta1
            );
        }
    }
}
