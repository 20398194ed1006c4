//! What the engine integration tests share: training the [`Mlp`] on
//! thread ranks and comparing states bit for bit.

use zero::comm::{Communicator, ThreadGroup};
use zero::core::backend::{CpuBackend, CpuMode};
use zero::core::config::{Precision, ResolvedConfig};
use zero::core::optim::LossScaleConfig;
use zero::core::{bf16, f16, Element};
use zero::{Engine, EngineBackend, EngineBuilder, EngineComm, StepOutcome, UnitState};

use crate::mlp::{batch, Mlp};

/// The layer sizes of the tests' MLP: 6 inputs, two hidden layers, 1 output.
pub const DIMS: &[usize] = &[6, 24, 40, 1];
/// Samples per rank per micro-batch in [`config`].
pub const MB: usize = 4;

/// What one rank saw: final state of every unit and every step's outcome.
pub struct Trained {
    /// Every unit's final state, in unit order.
    pub states: Vec<UnitState>,
    /// The outcome of every step that reached a boundary.
    pub outcomes: Vec<StepOutcome>,
    /// Every micro-batch's loss on this rank.
    pub losses: Vec<f32>,
    /// The engine's counters at the end of training.
    pub stats: zero::EngineStats,
}

/// A backend the engine tests run on (see [`test_device!`](crate::test_device)):
/// the CPU backend, production-like (`Inline`) or with the hazard checker
/// (`Checked`), and with the `cuda` feature the CUDA backend on GPU 0,
/// its ranks' device collectives staged through host memory
/// ([`zero::comm::HostStaged`]: the GPU machines here have one GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestDevice {
    /// [`CpuBackend`] in a mode.
    Cpu(CpuMode),
    /// `CudaBackend` on GPU 0.
    #[cfg(feature = "cuda")]
    Cuda,
}

impl Default for TestDevice {
    /// The production CPU backend.
    fn default() -> Self {
        TestDevice::Cpu(CpuMode::Inline)
    }
}

impl TestDevice {
    /// Every device these tests can run on here: the CPU backend's modes,
    /// and with the `cuda` feature the GPU where one is present.
    pub fn present() -> Vec<TestDevice> {
        #[allow(unused_mut)]
        let mut all = vec![
            TestDevice::Cpu(CpuMode::Inline),
            TestDevice::Cpu(CpuMode::Checked),
        ];
        #[cfg(feature = "cuda")]
        if cuda_backend().is_some() {
            all.push(TestDevice::Cuda);
        }
        all
    }

    /// A builder on this CPU device (one backend per rank); an error for
    /// the GPU, whose builder has another type (see [`train_setup`]).
    pub fn builder<C: Communicator>(
        self,
        cfg: ResolvedConfig,
        comm: C,
    ) -> zero::Result<zero::EngineBuilder<C>> {
        match self {
            TestDevice::Cpu(mode) => Ok(Engine::builder(cfg, comm).backend(CpuBackend::new(mode)?)),
            #[cfg(feature = "cuda")]
            TestDevice::Cuda => Err(zero::Error::Unsupported {
                what: "TestDevice::builder on the GPU: its builder has another type; train \
                       through runs::train_setup"
                    .into(),
            }),
        }
    }
}

/// The CUDA backend on GPU 0, or `None` (with the reason on stderr) when
/// no GPU is present; a GPU that is there but cannot start the backend
/// fails the test.
#[cfg(feature = "cuda")]
pub fn cuda_backend() -> Option<zero::core::backend::CudaBackend> {
    use std::io::Write;
    match zero::core::backend::CudaBackend::new(0) {
        Ok(dev) => Some(dev),
        Err(zero::core::Error::NoDevice { reason, .. }) => {
            // Straight to stderr: libtest hides `eprintln!` of passing tests.
            let _ = writeln!(std::io::stderr(), "cuda: skipped: no GPU ({reason})");
            None
        }
        Err(e) => panic!("a GPU is present but the CUDA backend cannot start: {e}"),
    }
}

/// Runs a test body once per backend present ([`TestDevice::present`]):
/// `test_device!(name, |device| { ... })` defines the module `name` with
/// one `#[test]` per device, each calling the body with its
/// [`TestDevice`].
#[macro_export]
macro_rules! test_device {
    ($name:ident, |$device:ident| $body:block) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            fn run($device: $crate::runs::TestDevice) $body

            #[test]
            fn cpu_inline() {
                run($crate::runs::TestDevice::Cpu(
                    zero::core::backend::CpuMode::Inline,
                ));
            }

            #[test]
            fn cpu_checked() {
                run($crate::runs::TestDevice::Cpu(
                    zero::core::backend::CpuMode::Checked,
                ));
            }

            /// On the GPU where one is present (feature `cuda`); without
            /// one it prints `cuda: skipped: no GPU (...)` and passes.
            #[cfg(feature = "cuda")]
            #[test]
            fn cuda() {
                if $crate::runs::cuda_backend().is_some() {
                    run($crate::runs::TestDevice::Cuda);
                }
            }

            #[test]
            fn covers_every_device_present() {
                #[allow(unused_mut)]
                let mut tested = vec![
                    $crate::runs::TestDevice::Cpu(zero::core::backend::CpuMode::Inline),
                    $crate::runs::TestDevice::Cpu(zero::core::backend::CpuMode::Checked),
                ];
                #[cfg(feature = "cuda")]
                if $crate::runs::cuda_backend().is_some() {
                    tested.push($crate::runs::TestDevice::Cuda);
                }
                assert_eq!($crate::runs::TestDevice::present(), tested);
            }
        }
    };
}

/// Trains the MLP ([`DIMS`], seed 5) for `steps` steps of `mb` samples
/// per rank per micro-batch on `comm`, in parameter dtype `T`; this rank's
/// view. Rank r's micro-batch m of step s holds the same samples whatever
/// the stage.
pub fn train_with<T: Element, C: Communicator>(
    comm: C,
    cfg: &ResolvedConfig,
    steps: usize,
    mb: usize,
) -> zero::Result<Trained> {
    train_on::<T, C>(TestDevice::default(), comm, cfg, steps, mb)
}

/// [`train_with`] on `device`.
pub fn train_on<T: Element, C: Communicator>(
    device: TestDevice,
    comm: C,
    cfg: &ResolvedConfig,
    steps: usize,
    mb: usize,
) -> zero::Result<Trained> {
    train_setup::<T, C>(device, comm, cfg, steps, mb, |b| b)
}

/// [`train_on`] with `setup` applied to the builder before the model is
/// registered (parameter groups, ...).
pub fn train_setup<T: Element, C: Communicator>(
    device: TestDevice,
    comm: C,
    cfg: &ResolvedConfig,
    steps: usize,
    mb: usize,
    setup: impl FnOnce(EngineBuilder<C>) -> EngineBuilder<C>,
) -> zero::Result<Trained> {
    struct Train<'a, T> {
        cfg: &'a ResolvedConfig,
        steps: usize,
        mb: usize,
        _t: std::marker::PhantomData<T>,
    }
    impl<T: Element> OnDevice for Train<'_, T> {
        type Out = Trained;
        fn run<C: EngineComm<B>, B: EngineBackend>(
            self,
            b: EngineBuilder<C, B>,
        ) -> zero::Result<Trained> {
            train_built::<T, C, B>(b, self.cfg, self.steps, self.mb)
        }
    }
    let job = Train::<T> {
        cfg,
        steps,
        mb,
        _t: std::marker::PhantomData,
    };
    device.with_builder(cfg, comm, |b| setup(b.seed(5)), job)
}

/// Work on an engine builder of any backend (what a generic closure would
/// be): [`TestDevice::with_builder`] runs it on the device's builder.
pub trait OnDevice {
    /// What the work returns.
    type Out;
    /// Does the work on `b`.
    fn run<C: EngineComm<B>, B: EngineBackend>(
        self,
        b: EngineBuilder<C, B>,
    ) -> zero::Result<Self::Out>;
}

impl TestDevice {
    /// Runs `job` on a builder on this device for `cfg` over `comm`, after
    /// `setup` (applied on the CPU builder, before the communicator and
    /// backend are set: on the GPU the ranks' device collectives are
    /// staged through host memory, `zero::comm::HostStaged`).
    pub fn with_builder<C: Communicator, J: OnDevice>(
        self,
        cfg: &ResolvedConfig,
        comm: C,
        setup: impl FnOnce(EngineBuilder<C>) -> EngineBuilder<C>,
        job: J,
    ) -> zero::Result<J::Out> {
        match self {
            TestDevice::Cpu(mode) => {
                job.run(setup(Engine::builder(cfg.clone(), comm)).backend(CpuBackend::new(mode)?))
            }
            #[cfg(feature = "cuda")]
            TestDevice::Cuda => {
                use std::sync::Arc;
                use zero::comm::{HostStaged, Paired};
                let Some(gpu) = cuda_backend() else {
                    return Err(zero::Error::Unsupported {
                        what: "TestDevice::Cuda without a GPU (TestDevice::present leaves it out)"
                            .into(),
                    });
                };
                let b = setup(Engine::builder(cfg.clone(), comm))
                    .map_comm(|c| {
                        let c = Arc::new(c);
                        Paired::new(c.clone(), HostStaged::new(c))
                    })
                    .backend(gpu);
                job.run(b)
            }
        }
    }
}

/// Registers the MLP on `b`, builds and trains (see [`train_with`]).
fn train_built<T: Element, C: EngineComm<B>, B: EngineBackend>(
    mut b: EngineBuilder<C, B>,
    cfg: &ResolvedConfig,
    steps: usize,
    mb: usize,
) -> zero::Result<Trained> {
    let ga = cfg.gradient_accumulation_steps;
    let model = Mlp::register(&mut b, DIMS)?;
    let mut e = b.build()?;
    let (world, rank) = (e.world_size(), e.rank());
    let mut outcomes = Vec::new();
    let mut losses = Vec::new();
    for s in 0..steps {
        for m in 0..ga {
            // Rank r's micro-batch m of step s: the same samples whatever
            // the stage; a single rank with the full batch reads them all.
            let first = (((s * ga + m) * world + rank) * mb) as u64;
            let (x, y) = batch(first, mb, DIMS[0]);
            losses.push(model.train_micro_batch::<T, C, B>(&mut e, &x, &y)?);
            let o = e.step()?;
            if o.boundary {
                outcomes.push(o);
            }
        }
    }
    let stats = e.stats().clone();
    let mut states = Vec::new();
    for u in e.unit_ids() {
        states.push(e.unit_state(u)?);
    }
    Ok(Trained {
        states,
        outcomes,
        losses,
        stats,
    })
}

/// Trains on `world` thread ranks; rank 0's view.
pub fn train(world: usize, cfg: &ResolvedConfig, steps: usize, mb: usize) -> Trained {
    train_device(TestDevice::default(), world, cfg, steps, mb)
}

/// [`train`] on `device`.
pub fn train_device(
    device: TestDevice,
    world: usize,
    cfg: &ResolvedConfig,
    steps: usize,
    mb: usize,
) -> Trained {
    let out = ThreadGroup::run(world, |comm| match cfg.precision {
        Precision::Fp32 => train_on::<f32, _>(device, comm, cfg, steps, mb),
        Precision::Bf16 => train_on::<bf16, _>(device, comm, cfg, steps, mb),
        Precision::Fp16 => train_on::<f16, _>(device, comm, cfg, steps, mb),
    })
    .expect("ranks ran");
    let mut all: Vec<Trained> = out
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("training failed: {e}")))
        .collect();
    // Every rank reads out the same full state.
    for t in &all[1..] {
        assert_bits_eq(&all[0].states, &t.states, "rank 0 vs another rank");
    }
    all.swap_remove(0)
}

/// A config for `world` ranks at `stage`: [`MB`] samples per micro-batch,
/// `ga` micro-batches per step, constant learning rate 1e-2, clipping at
/// 1, small buckets (several per step); with fp16, a dynamic loss scale
/// that starts high enough to overflow.
pub fn config(world: usize, stage: u8, ga: usize, precision: Precision) -> ResolvedConfig {
    let mut c = ResolvedConfig::simple(stage, world, MB);
    c.gradient_accumulation_steps = ga;
    c.train_batch_size = MB * ga * world;
    c.precision = precision;
    c.optimizer.lr = 1e-2;
    c.scheduler = zero::core::optim::LrSchedule::Constant { lr: 1e-2 };
    c.gradient_clipping = 1.0;
    // Small buckets: several per step, so bucketing is exercised.
    c.zero.reduce_bucket_size = 700;
    c.zero.allgather_bucket_size = 900;
    c.zero.prefetch_bucket_size = 1500;
    c.zero.param_persistence_threshold = 0;
    if precision == Precision::Fp16 {
        // 2^17 overflows f16 gradients at first: the run skips steps and
        // lowers the scale, then trains.
        c.loss_scale = Some(LossScaleConfig::Dynamic {
            initial_scale_power: 17,
            window: 3,
            hysteresis: 1,
            consecutive_hysteresis: false,
            min_scale: 1.0,
        });
    }
    c
}

/// The bits of a unit's params, master, m and v.
pub fn bits(s: &UnitState) -> Vec<Vec<u32>> {
    [&s.params, &s.master, &s.m, &s.v]
        .iter()
        .map(|v| v.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// The same states, step outcomes and losses, bit for bit.
pub fn assert_same_run(base: &Trained, t: &Trained, what: &str) {
    assert_bits_eq(&base.states, &t.states, what);
    // Debug text: NaN norms of skipped steps compare equal.
    assert_eq!(
        format!("{:?}", base.outcomes),
        format!("{:?}", t.outcomes),
        "{what}"
    );
    assert_eq!(base.losses, t.losses, "{what}");
}

/// The same unit states, bit for bit; a failure names `what`, the unit,
/// the state and the element.
pub fn assert_bits_eq(a: &[UnitState], b: &[UnitState], what: &str) {
    assert_eq!(a.len(), b.len());
    for (u, (x, y)) in a.iter().zip(b).enumerate() {
        let names = ["params", "master", "m", "v"];
        for (k, (p, q)) in bits(x).iter().zip(bits(y)).enumerate() {
            if let Some(i) = p.iter().zip(&q).position(|(a, b)| a != b) {
                panic!(
                    "{what}: unit {u} {} element {i}: {} vs {}",
                    names[k],
                    f32::from_bits(p[i]),
                    f32::from_bits(q[i])
                );
            }
        }
    }
}
