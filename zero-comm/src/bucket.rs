//! Bucketing: many small tensors, few large collectives.
//!
//! A model has hundreds of parameter tensors, many of them small (biases,
//! norms). One collective per tensor pays the synchronisation cost of a
//! collective per tensor; DeepSpeed instead copies tensors into flat buckets
//! of `reduce_bucket_size` / `allgather_bucket_size` *elements* and issues one
//! collective per bucket. This module does the same:
//!
//! - [`BucketPlan`] assigns tensors to buckets, once, from their lengths.
//!   Tensors keep their order; a bucket closes when adding the next tensor
//!   would take it past the bucket size; a tensor larger than the bucket
//!   size gets a bucket of its own.
//! - [`Bucketer`] owns one flat buffer per bucket, allocated once through
//!   [`Communicator::alloc`] and reused by every call, and runs a pipeline:
//!   pack bucket b, issue its collective, keep up to
//!   [`Bucketer::max_in_flight`] collectives running, wait for the oldest
//!   and scatter its result back into the tensors.
//!
//! ```text
//!  tensors   [t0 ][t1][t2  ][t3 ────────────][t4][t5 ]     bucket size 8
//!  buckets   [t0  t1  t2  ] [t3 (alone: > 8) ][t4  t5 ]
//!             bucket 0       bucket 1          bucket 2
//!
//!  max_in_flight = 2     caller                          collectives
//!                        pack 0, issue 0   ────────────▶ bucket 0 ─┐
//!                        pack 1, issue 1   ────────────▶ bucket 1 ─┼─┐
//!                        wait 0, unpack 0  ◀───────────────────────┘ │
//!                        pack 2, issue 2   ────────────▶ bucket 2 ─┐ │
//!                        wait 1, unpack 1  ◀─────────────────────────┼─┘
//!                        wait 2, unpack 2  ◀─────────────────────────┘
//! ```
//!
//! # Oversized tensors: own bucket, not split
//!
//! A tensor larger than the bucket size is not split across buckets: it
//! gets a bucket (and a collective) of its own, as in DeepSpeed's gradient
//! buckets and PyTorch DDP. Splitting would bound every bucket buffer by the
//! bucket size, but the buffers here are per bucket and persistent anyway
//! (they hold, together, every tensor once, like DDP's bucket views), so
//! splitting would buy no memory; it would only add collectives and make a
//! tensor's result depend on several of them. With whole tensors, a tensor
//! is complete as soon as its one bucket is.
//!
//! # Sharded layout (ZeRO stage 3)
//!
//! [`Bucketer::all_gather`] and [`Bucketer::reduce_scatter`] work on
//! tensors sharded the way DeepSpeed ZeRO-3 partitions a parameter: a tensor
//! of `n` elements over `world` ranks has shards of
//! `s = ceil(n / world)` elements ([`shard_len`]); rank r's shard holds
//! elements `r*s .. min((r+1)*s, n)` ([`shard_range`]), padded at the end
//! to `s`. Every rank's shard has the same length, so a bucket's collective
//! has equal counts on every rank (what NCCL's all-gather and
//! reduce-scatter require). The bucket buffer is rank-major:
//!
//! ```text
//!  bucket of tensors a (n=5) and b (n=3) over 2 ranks: shards of 3 and 2
//!  buffer   [ a0 a1 a2 b0 b1 | a3 a4 __ b2 __ ]      __ = padding
//!             rank 0's part    rank 1's part
//! ```
//!
//! # Errors
//!
//! Tensors that do not match the plan (count or lengths) are reported as
//! [`Error::InvalidArgument`] naming the tensor and the sizes. Like an
//! argument error of any collective, the error goes through the
//! communicator, so it fails (later collectives return [`Error::Poisoned`])
//! and peers waiting in a collective get [`Error::PeerFailed`] at once
//! instead of waiting for the timeout.

use std::collections::VecDeque;
use std::ops::Range;

use zero_core::{Element, HostBuffer};

use crate::communicator::RawOp;
use crate::work::Work;
use crate::{Communicator, Error, ReduceOp, Result};

/// Elements of each shard of a tensor of `len` elements sharded over
/// `world` ranks: `ceil(len / world)` (DeepSpeed ZeRO-3's partition size).
///
/// # Panics
/// If `world` is 0.
pub fn shard_len(len: usize, world: usize) -> usize {
    assert!(world > 0, "world size must be positive");
    len.div_ceil(world)
}

/// The elements of a `len`-element tensor that rank `rank` of `world`
/// holds: `rank*s .. min((rank+1)*s, len)` with `s = shard_len(len, world)`.
/// The range is shorter than `s` (possibly empty) on the last ranks; the
/// shard is padded to `s`.
///
/// # Panics
/// If `world` is 0.
pub fn shard_range(len: usize, world: usize, rank: usize) -> Range<usize> {
    let s = shard_len(len, world);
    (rank * s).min(len)..((rank + 1) * s).min(len)
}

/// How a plan lays tensors out in its buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BucketLayout {
    /// Whole tensors back to back; for [`Bucketer::all_reduce`].
    Flat,
    /// Tensors sharded over `world` ranks, rank-major (see the
    /// [module doc](crate::bucket)); for [`Bucketer::all_gather`] and
    /// [`Bucketer::reduce_scatter`].
    Sharded {
        /// Number of ranks the tensors are sharded over.
        world: usize,
    },
}

/// One bucket of a [`BucketPlan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    tensors: Range<usize>,
    len: usize,
    part: usize,
}

impl Bucket {
    /// The indices of the tensors in this bucket (consecutive).
    pub fn tensors(&self) -> Range<usize> {
        self.tensors.clone()
    }

    /// Elements of the bucket's flat buffer: the sum of its tensors'
    /// lengths (flat layout) or of their padded lengths (sharded layout).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements (only zero-length tensors); no
    /// collective is issued for such a bucket.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements of one rank's part of the buffer: the sum of the tensors'
    /// shard lengths (sharded layout); the whole length (flat layout).
    pub fn part_len(&self) -> usize {
        self.part
    }
}

/// Where a tensor lives in the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    bucket: usize,
    /// Flat: element offset in the bucket buffer. Sharded: offset of the
    /// tensor's shard within each rank's part.
    offset: usize,
}

/// The assignment of tensors to buckets, computed once from the tensor
/// lengths (see the [module doc](crate::bucket) for the rule).
///
/// ```
/// use zero_comm::BucketPlan;
///
/// let plan = BucketPlan::new(&[3, 2, 2, 20, 4, 1], 8).unwrap();
/// let groups: Vec<_> = plan.buckets().iter().map(|b| b.tensors()).collect();
/// assert_eq!(groups, vec![0..3, 3..4, 4..6]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketPlan {
    layout: BucketLayout,
    bucket_size: usize,
    lens: Vec<usize>,
    slots: Vec<Slot>,
    buckets: Vec<Bucket>,
}

impl BucketPlan {
    /// A flat plan for [`Bucketer::all_reduce`]: tensors of `lens` elements
    /// packed into buckets of at most `bucket_size` elements (DeepSpeed's
    /// `reduce_bucket_size`), except that a larger tensor gets a bucket of
    /// its own.
    ///
    /// Fails with [`Error::Config`] (key `bucket_size`) if `bucket_size` is 0.
    pub fn new(lens: &[usize], bucket_size: usize) -> Result<Self> {
        Self::build(lens, bucket_size, BucketLayout::Flat)
    }

    /// A sharded plan for [`Bucketer::all_gather`] and
    /// [`Bucketer::reduce_scatter`]: tensors of `lens` elements (full
    /// lengths) sharded over `world` ranks as in ZeRO-3 (see the module
    /// doc). A tensor counts as its padded length `world * shard_len` toward
    /// `bucket_size` (DeepSpeed's `allgather_bucket_size`: elements that one
    /// all-gather produces).
    ///
    /// Fails with [`Error::Config`] if `bucket_size` (key `bucket_size`) or
    /// `world` (key `world_size`) is 0.
    pub fn sharded(lens: &[usize], world: usize, bucket_size: usize) -> Result<Self> {
        if world == 0 {
            return Err(Error::Config {
                key: "world_size".into(),
                msg: "a sharded bucket plan needs at least one rank".into(),
            });
        }
        Self::build(lens, bucket_size, BucketLayout::Sharded { world })
    }

    fn build(lens: &[usize], bucket_size: usize, layout: BucketLayout) -> Result<Self> {
        if bucket_size == 0 {
            return Err(Error::Config {
                key: "bucket_size".into(),
                msg: "must be at least 1 element".into(),
            });
        }
        // (elements in the buffer, elements in one rank's part) per tensor.
        let size = |n: usize| match layout {
            BucketLayout::Flat => (n, n),
            BucketLayout::Sharded { world } => {
                let s = shard_len(n, world);
                (s * world, s)
            }
        };
        let mut slots = Vec::with_capacity(lens.len());
        let mut buckets: Vec<Bucket> = Vec::new();
        for (i, &n) in lens.iter().enumerate() {
            let (len, part) = size(n);
            let fits = buckets
                .last()
                .is_some_and(|b| b.len == 0 || len == 0 || b.len + len <= bucket_size);
            if !fits {
                buckets.push(Bucket {
                    tensors: i..i,
                    len: 0,
                    part: 0,
                });
            }
            let bucket = buckets.len() - 1;
            let b = &mut buckets[bucket];
            slots.push(Slot {
                bucket,
                offset: b.part,
            });
            b.tensors.end = i + 1;
            b.len += len;
            b.part += part;
        }
        Ok(Self {
            layout,
            bucket_size,
            lens: lens.to_vec(),
            slots,
            buckets,
        })
    }

    /// The layout of the buckets.
    pub fn layout(&self) -> BucketLayout {
        self.layout
    }

    /// The configured bucket size, in elements.
    pub fn bucket_size(&self) -> usize {
        self.bucket_size
    }

    /// The tensors' (full) lengths the plan was built from.
    pub fn tensor_lens(&self) -> &[usize] {
        &self.lens
    }

    /// Number of tensors.
    pub fn num_tensors(&self) -> usize {
        self.lens.len()
    }

    /// The buckets, in order.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// The bucket that holds tensor `i`.
    ///
    /// # Panics
    /// If `i >= num_tensors()`.
    pub fn bucket_of(&self, i: usize) -> usize {
        self.slots[i].bucket
    }

    /// Elements of all bucket buffers together (what a [`Bucketer`] holds).
    pub fn buffer_len(&self) -> usize {
        self.buckets.iter().map(|b| b.len).sum()
    }
}

/// Runs collectives on many tensors through the buckets of a
/// [`BucketPlan`], with reusable bucket buffers (see the
/// [module doc](crate::bucket)).
///
/// Every rank must build the same plan and make the same calls in the same
/// order, as for any collective. The buffers hold
/// [`BucketPlan::buffer_len`] elements in all.
///
/// ```
/// use zero_comm::{BucketPlan, Bucketer, Communicator, ReduceOp, ThreadGroup};
///
/// let grads = ThreadGroup::run(2, |comm| {
///     let plan = BucketPlan::new(&[3, 1, 4], 4).unwrap();
///     let mut bucketer = Bucketer::<f32>::new(&comm, plan).unwrap();
///     let r = comm.rank() as f32;
///     let (mut a, mut b, mut c) = (vec![r; 3], vec![r; 1], vec![r; 4]);
///     let mut tensors = [&mut a[..], &mut b[..], &mut c[..]];
///     bucketer.all_reduce(&comm, &mut tensors, ReduceOp::Sum).unwrap();
///     (a, b, c)
/// })
/// .unwrap();
/// assert_eq!(grads[0], (vec![1.0; 3], vec![1.0], vec![1.0; 4]));
/// ```
#[derive(Debug)]
pub struct Bucketer<T: Element> {
    plan: BucketPlan,
    /// One buffer per bucket; `None` while its collective runs, for empty
    /// buckets, and after a failed collective kept it.
    bufs: Vec<Option<HostBuffer<T>>>,
    max_in_flight: usize,
    /// Per-rank counts of the current bucket's collective (reused).
    counts: Vec<usize>,
    /// Collectives issued and not yet unpacked; empty between calls.
    in_flight: VecDeque<(usize, Work<HostBuffer<T>>)>,
}

/// Default of [`Bucketer::max_in_flight`]: double buffering, as DeepSpeed's
/// `overlap_comm`.
const DEFAULT_MAX_IN_FLIGHT: usize = 2;

impl<T: Element> Bucketer<T> {
    /// A bucketer for `plan`, with its bucket buffers allocated through
    /// `comm` ([`Communicator::alloc`]). `max_in_flight` starts at 2.
    ///
    /// Fails with [`Error::InvalidArgument`] if the plan is sharded over a
    /// number of ranks other than `comm.world_size()`.
    pub fn new<C: Communicator>(comm: &C, plan: BucketPlan) -> Result<Self> {
        let world = comm.world_size();
        if let BucketLayout::Sharded { world: w } = plan.layout {
            if w != world {
                return Err(Error::InvalidArgument {
                    rank: comm.rank(),
                    op: "Bucketer::new",
                    msg: format!("the plan shards over {w} ranks but the communicator has {world}"),
                });
            }
        }
        let bufs = plan
            .buckets
            .iter()
            .map(|b| (!b.is_empty()).then(|| comm.alloc(b.len)).transpose())
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            plan,
            bufs,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            counts: vec![0; world],
            in_flight: VecDeque::with_capacity(DEFAULT_MAX_IN_FLIGHT),
        })
    }

    /// This bucketer with at most `n` bucket collectives running at once
    /// (at least 1; 0 counts as 1). More overlaps packing and unpacking
    /// with communication; 1 runs the buckets one after another.
    pub fn with_max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n.max(1);
        self.in_flight.reserve(self.max_in_flight);
        self
    }

    /// How many bucket collectives may run at once.
    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight
    }

    /// The plan.
    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// All-reduces every tensor in place with `op`, one collective per
    /// bucket. `tensors` must have the plan's lengths (flat plan).
    ///
    /// The results are bit-identical to one [`Communicator::all_reduce`] per
    /// tensor. On error the tensors' contents are unspecified.
    pub fn all_reduce<C: Communicator>(
        &mut self,
        comm: &C,
        tensors: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "bucketed all_reduce";
        if let Some(msg) = self.check_layout(comm, false, "all_reduce") {
            return Err(fail(comm, OP, msg));
        }
        let lens = tensors.iter().map(|t| t.len());
        if let Some(msg) = check_lens(&self.plan.lens, lens, "tensor", |n| n) {
            return Err(fail(comm, OP, msg));
        }
        self.pipeline(comm, &mut AllReduceJob { tensors, op })
    }

    /// Gathers sharded tensors: `shards[i]` is this rank's shard of tensor
    /// i (`shard_len(n_i, world)` elements, see the
    /// [module doc](crate::bucket); its padding is ignored), and afterwards
    /// `tensors[i]` (`n_i` elements) holds the whole tensor on every rank.
    /// Sharded plan.
    ///
    /// The results are bit-identical to one [`Communicator::all_gather`]
    /// per tensor. On error the tensors' contents are unspecified.
    pub fn all_gather<C: Communicator>(
        &mut self,
        comm: &C,
        shards: &[&[T]],
        tensors: &mut [&mut [T]],
    ) -> Result<()> {
        const OP: &str = "bucketed all_gather";
        let world = comm.world_size();
        if let Some(msg) = self.check_layout(comm, true, "all_gather") {
            return Err(fail(comm, OP, msg));
        }
        let msg = check_lens(
            &self.plan.lens,
            shards.iter().map(|s| s.len()),
            "shard",
            |n| shard_len(n, world),
        )
        .or_else(|| {
            check_lens(
                &self.plan.lens,
                tensors.iter().map(|t| t.len()),
                "tensor",
                |n| n,
            )
        });
        if let Some(msg) = msg {
            return Err(fail(comm, OP, msg));
        }
        let rank = comm.rank();
        self.pipeline(
            comm,
            &mut AllGatherJob {
                shards,
                tensors,
                rank,
                world,
            },
        )
    }

    /// Reduces whole tensors and scatters them in shards: afterwards
    /// `shards[i]` (`shard_len(n_i, world)` elements) holds this rank's
    /// shard of `op` over all ranks' `tensors[i]` (`n_i` elements), with
    /// zeros in its padding. Sharded plan; the gradient step of ZeRO
    /// stages 2 and 3.
    ///
    /// The results are bit-identical to one
    /// [`Communicator::reduce_scatter`] per tensor with padded even counts.
    /// On error the shards' contents are unspecified.
    pub fn reduce_scatter<C: Communicator>(
        &mut self,
        comm: &C,
        tensors: &[&[T]],
        shards: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "bucketed reduce_scatter";
        let world = comm.world_size();
        if let Some(msg) = self.check_layout(comm, true, "reduce_scatter") {
            return Err(fail(comm, OP, msg));
        }
        let msg = check_lens(
            &self.plan.lens,
            tensors.iter().map(|t| t.len()),
            "tensor",
            |n| n,
        )
        .or_else(|| {
            check_lens(
                &self.plan.lens,
                shards.iter().map(|s| s.len()),
                "shard",
                |n| shard_len(n, world),
            )
        });
        if let Some(msg) = msg {
            return Err(fail(comm, OP, msg));
        }
        let rank = comm.rank();
        self.pipeline(
            comm,
            &mut ReduceScatterJob {
                tensors,
                shards,
                op,
                rank,
                world,
            },
        )
    }

    /// Why the plan's layout does not suit `method` on `comm`, if it does not.
    fn check_layout<C: Communicator>(
        &self,
        comm: &C,
        sharded: bool,
        method: &str,
    ) -> Option<String> {
        match (self.plan.layout, sharded) {
            (BucketLayout::Flat, false) => None,
            (BucketLayout::Flat, true) => Some(format!(
                "{method} needs a sharded plan (BucketPlan::sharded), this one is flat"
            )),
            (BucketLayout::Sharded { world }, false) => Some(format!(
                "{method} needs a flat plan (BucketPlan::new), this one is sharded over {world} ranks"
            )),
            (BucketLayout::Sharded { world }, true) => (world != comm.world_size()).then(|| {
                format!(
                    "the plan shards over {world} ranks but the communicator has {}",
                    comm.world_size()
                )
            }),
        }
    }

    /// Packs, issues, waits and unpacks every bucket, keeping up to
    /// `max_in_flight` collectives running. Returns the first error, after
    /// waiting for everything it issued.
    fn pipeline<C: Communicator, J: Job<T>>(&mut self, comm: &C, job: &mut J) -> Result<()> {
        let Self {
            plan,
            bufs,
            max_in_flight,
            counts,
            in_flight,
        } = self;
        debug_assert!(in_flight.is_empty());
        let mut first: Option<Error> = None;
        for (b, bucket) in plan.buckets.iter().enumerate() {
            if bucket.is_empty() {
                continue;
            }
            if in_flight.len() >= *max_in_flight {
                let (done, work) = in_flight.pop_front().expect("in_flight is full");
                match work.wait() {
                    Ok(buf) => {
                        job.unpack(plan, done, &buf);
                        bufs[done] = Some(buf);
                    }
                    Err(e) => {
                        first = Some(e);
                        break;
                    }
                }
            }
            // A buffer is missing only if an earlier call's collective
            // failed and kept it; the communicator then refuses this one too.
            let mut buf = match bufs[b].take() {
                Some(buf) => buf,
                None => match comm.alloc(bucket.len) {
                    Ok(buf) => buf,
                    Err(e) => {
                        first = Some(e);
                        break;
                    }
                },
            };
            job.pack(plan, b, &mut buf);
            counts.fill(bucket.part);
            in_flight.push_back((b, job.issue(comm, buf, counts)));
        }
        while let Some((done, work)) = in_flight.pop_front() {
            match work.wait() {
                Ok(buf) => {
                    if first.is_none() {
                        job.unpack(plan, done, &buf);
                    }
                    bufs[done] = Some(buf);
                }
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }
}

/// Compares the given lengths with the plan's; `want` maps a tensor's full
/// length to the expected one.
fn check_lens(
    plan: &[usize],
    got: impl ExactSizeIterator<Item = usize>,
    what: &str,
    want: impl Fn(usize) -> usize,
) -> Option<String> {
    if got.len() != plan.len() {
        return Some(format!(
            "got {} {what}s but the plan has {} tensors",
            got.len(),
            plan.len()
        ));
    }
    plan.iter().zip(got).enumerate().find_map(|(i, (&n, g))| {
        let w = want(n);
        (g != w).then(|| {
            if what == "tensor" {
                format!("{what} {i} has {g} elements but the plan says {w}")
            } else {
                format!(
                    "{what} {i} has {g} elements but tensor {i} ({n} elements) has shards of {w}"
                )
            }
        })
    })
}

/// Reports an argument error through the communicator, as its collectives
/// do: the communicator fails, and peers waiting in a collective get
/// [`Error::PeerFailed`] at once instead of waiting for the timeout.
/// Returns the error for the caller.
fn fail<C: Communicator>(comm: &C, op: &'static str, msg: String) -> Error {
    let make = || Error::InvalidArgument {
        rank: comm.rank(),
        op,
        msg: msg.clone(),
    };
    let raw = RawOp::barrier(Vec::new(), Some(make()));
    // The backend reports the error in sequence; if the communicator had
    // failed already it says Poisoned instead, but the caller gets the
    // argument error either way.
    let _ = comm.submit(raw).wait();
    make()
}

/// What a bucketed collective does with a bucket.
trait Job<T: Element> {
    /// Fills bucket `b`'s buffer from the inputs.
    fn pack(&self, plan: &BucketPlan, b: usize, buf: &mut [T]);
    /// Issues the bucket's collective.
    fn issue<C: Communicator>(
        &self,
        comm: &C,
        buf: HostBuffer<T>,
        counts: &[usize],
    ) -> Work<HostBuffer<T>>;
    /// Copies bucket `b`'s result to the outputs.
    fn unpack(&mut self, plan: &BucketPlan, b: usize, buf: &[T]);
}

struct AllReduceJob<'a, 'b, T> {
    tensors: &'a mut [&'b mut [T]],
    op: ReduceOp,
}

impl<T: Element> Job<T> for AllReduceJob<'_, '_, T> {
    fn pack(&self, plan: &BucketPlan, b: usize, buf: &mut [T]) {
        for i in plan.buckets[b].tensors() {
            let o = plan.slots[i].offset;
            let t = &self.tensors[i];
            buf[o..o + t.len()].copy_from_slice(t);
        }
    }

    fn issue<C: Communicator>(
        &self,
        comm: &C,
        buf: HostBuffer<T>,
        _counts: &[usize],
    ) -> Work<HostBuffer<T>> {
        comm.all_reduce(buf, self.op)
    }

    fn unpack(&mut self, plan: &BucketPlan, b: usize, buf: &[T]) {
        for i in plan.buckets[b].tensors() {
            let o = plan.slots[i].offset;
            let t = &mut self.tensors[i];
            let n = t.len();
            t.copy_from_slice(&buf[o..o + n]);
        }
    }
}

struct AllGatherJob<'a, 'b, 'c, T> {
    shards: &'a [&'b [T]],
    tensors: &'a mut [&'c mut [T]],
    rank: usize,
    world: usize,
}

impl<T: Element> Job<T> for AllGatherJob<'_, '_, '_, T> {
    fn pack(&self, plan: &BucketPlan, b: usize, buf: &mut [T]) {
        // Only this rank's part: the gather fills the others.
        let base = self.rank * plan.buckets[b].part;
        for i in plan.buckets[b].tensors() {
            let o = base + plan.slots[i].offset;
            let s = self.shards[i];
            buf[o..o + s.len()].copy_from_slice(s);
        }
    }

    fn issue<C: Communicator>(
        &self,
        comm: &C,
        buf: HostBuffer<T>,
        counts: &[usize],
    ) -> Work<HostBuffer<T>> {
        comm.all_gather_in_place(buf, counts)
    }

    fn unpack(&mut self, plan: &BucketPlan, b: usize, buf: &[T]) {
        let part = plan.buckets[b].part;
        for i in plan.buckets[b].tensors() {
            let t = &mut self.tensors[i];
            for q in 0..self.world {
                let r = shard_range(t.len(), self.world, q);
                let o = q * part + plan.slots[i].offset;
                let n = r.len();
                t[r].copy_from_slice(&buf[o..o + n]);
            }
        }
    }
}

struct ReduceScatterJob<'a, 'b, 'c, T> {
    tensors: &'a [&'b [T]],
    shards: &'a mut [&'c mut [T]],
    op: ReduceOp,
    rank: usize,
    world: usize,
}

impl<T: Element> Job<T> for ReduceScatterJob<'_, '_, '_, T> {
    fn pack(&self, plan: &BucketPlan, b: usize, buf: &mut [T]) {
        let part = plan.buckets[b].part;
        for i in plan.buckets[b].tensors() {
            let t = self.tensors[i];
            let s = shard_len(t.len(), self.world);
            for q in 0..self.world {
                let r = shard_range(t.len(), self.world, q);
                let o = q * part + plan.slots[i].offset;
                let dst = &mut buf[o..o + s];
                let n = r.len();
                dst[..n].copy_from_slice(&t[r]);
                dst[n..].fill(T::zeroed());
            }
        }
    }

    fn issue<C: Communicator>(
        &self,
        comm: &C,
        buf: HostBuffer<T>,
        counts: &[usize],
    ) -> Work<HostBuffer<T>> {
        comm.reduce_scatter_in_place(buf, counts, self.op)
    }

    fn unpack(&mut self, plan: &BucketPlan, b: usize, buf: &[T]) {
        let base = self.rank * plan.buckets[b].part;
        for i in plan.buckets[b].tensors() {
            let o = base + plan.slots[i].offset;
            let s = &mut self.shards[i];
            let n = s.len();
            s.copy_from_slice(&buf[o..o + n]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CommOptions, ThreadGroup};
    use proptest::prelude::*;
    use std::time::{Duration, Instant};
    use zero_core::{bf16, f16};

    fn groups(plan: &BucketPlan) -> Vec<Range<usize>> {
        plan.buckets().iter().map(|b| b.tensors()).collect()
    }

    #[test]
    fn packs_in_order_and_isolates_oversized_tensors() {
        let plan = BucketPlan::new(&[3, 2, 2, 20, 4, 1, 8, 0, 5], 8).unwrap();
        assert_eq!(groups(&plan), vec![0..3, 3..4, 4..6, 6..8, 8..9]);
        let lens: Vec<_> = plan.buckets().iter().map(Bucket::len).collect();
        assert_eq!(lens, vec![7, 20, 5, 8, 5]);
        assert_eq!(plan.bucket_of(3), 1);
        assert_eq!(
            plan.bucket_of(7),
            3,
            "a zero-length tensor joins the open bucket"
        );
        assert_eq!(plan.buffer_len(), 45);
        assert_eq!(plan.layout(), BucketLayout::Flat);
        assert_eq!(plan.bucket_size(), 8);
    }

    #[test]
    fn edge_cases() {
        assert!(BucketPlan::new(&[], 4).unwrap().buckets().is_empty());
        let zeros = BucketPlan::new(&[0, 0], 4).unwrap();
        assert_eq!(groups(&zeros), vec![0..2]);
        assert!(zeros.buckets()[0].is_empty());
        // A zero-length tensor after an oversized one stays with it.
        assert_eq!(
            groups(&BucketPlan::new(&[9, 0, 1], 4).unwrap()),
            vec![0..2, 2..3]
        );
        let e = BucketPlan::new(&[1], 0).unwrap_err();
        assert!(
            matches!(&e, Error::Config { key, .. } if key == "bucket_size"),
            "{e}"
        );
        let e = BucketPlan::sharded(&[1], 0, 4).unwrap_err();
        assert!(
            matches!(&e, Error::Config { key, .. } if key == "world_size"),
            "{e}"
        );
    }

    #[test]
    fn sharded_plan_counts_padded_lengths() {
        // Over 4 ranks: 5 → shards of 2 (8 padded), 3 → 1 (4), 9 → 3 (12).
        let plan = BucketPlan::sharded(&[5, 3, 9], 4, 12).unwrap();
        assert_eq!(groups(&plan), vec![0..2, 2..3]);
        assert_eq!(plan.buckets()[0].len(), 12);
        assert_eq!(plan.buckets()[0].part_len(), 3);
        assert_eq!(plan.buckets()[1].part_len(), 3);
        assert_eq!(plan.slots[1].offset, 2);
        assert_eq!(shard_range(5, 4, 2), 4..5);
        assert_eq!(shard_range(5, 4, 3), 5..5);
        assert_eq!(shard_len(0, 3), 0);
    }

    proptest! {
        #[test]
        fn plan_invariants(
            lens in prop::collection::vec(prop_oneof![Just(0usize), 0usize..50, 0usize..300], 0..40),
            bucket_size in 1usize..200,
            world in prop::option::of(1usize..9),
        ) {
            let plan = match world {
                None => BucketPlan::new(&lens, bucket_size).unwrap(),
                Some(w) => BucketPlan::sharded(&lens, w, bucket_size).unwrap(),
            };
            let size = |n: usize| world.map_or(n, |w| shard_len(n, w) * w);
            let part = |n: usize| world.map_or(n, |w| shard_len(n, w));
            // Buckets tile the tensors in order, each tensor exactly once.
            let mut next = 0;
            for (b, bucket) in plan.buckets().iter().enumerate() {
                let t = bucket.tensors();
                prop_assert_eq!(t.start, next);
                prop_assert!(t.end > t.start);
                next = t.end;
                prop_assert_eq!(bucket.len(), t.clone().map(|i| size(lens[i])).sum::<usize>());
                prop_assert_eq!(bucket.part_len(), t.clone().map(|i| part(lens[i])).sum::<usize>());
                // Within the size, unless a single tensor exceeds it alone.
                let positive = t.clone().filter(|&i| lens[i] > 0).count();
                prop_assert!(bucket.len() <= bucket_size || positive == 1);
                // Greedy: the next bucket's first tensor did not fit.
                if let Some(nb) = plan.buckets().get(b + 1) {
                    let first = size(lens[nb.tensors().start]);
                    prop_assert!(first > 0 && bucket.len() + first > bucket_size);
                }
                // Offsets: consecutive within each part.
                let mut off = 0;
                for i in t {
                    prop_assert_eq!(plan.bucket_of(i), b);
                    prop_assert_eq!(plan.slots[i].offset, off);
                    off += part(lens[i]);
                }
            }
            prop_assert_eq!(next, lens.len());
        }
    }

    /// Deterministic finite values, different per rank and tensor.
    fn val<T: Element>(rank: usize, t: usize, i: usize) -> T {
        let h = (rank as u64 + 1)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .wrapping_add((t as u64) << 32 | i as u64)
            .wrapping_mul(0xbf58_476d_1ce4_e5b9);
        T::from_f32(((h >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 37.0)
    }

    fn bits<T: Element>(x: &[T]) -> &[u8] {
        bytemuck::cast_slice(x)
    }

    /// Bucketed collectives equal per-tensor ones bit for bit, over several
    /// calls that reuse the same buffers.
    fn matches_per_tensor<T: Element>(world: usize, lens: &[usize], bucket_size: usize) {
        let out = ThreadGroup::run(world, |comm| {
            let rank = comm.rank();
            let plan = BucketPlan::new(lens, bucket_size).unwrap();
            let mut flat = Bucketer::<T>::new(&comm, plan)
                .unwrap()
                .with_max_in_flight(3);
            let splan = BucketPlan::sharded(lens, world, bucket_size).unwrap();
            let mut sharded = Bucketer::<T>::new(&comm, splan).unwrap();
            let ptrs = |b: &Bucketer<T>| -> Vec<_> {
                b.bufs
                    .iter()
                    .map(|x| x.as_ref().map(|x| x.as_ptr()))
                    .collect()
            };
            let (flat_ptrs, sharded_ptrs) = (ptrs(&flat), ptrs(&sharded));
            for (step, op) in ReduceOp::ALL.into_iter().enumerate() {
                let inputs: Vec<Vec<T>> = lens
                    .iter()
                    .enumerate()
                    .map(|(t, &n)| (0..n).map(|i| val(rank + step, t, i)).collect())
                    .collect();

                // all_reduce
                let mut got = inputs.clone();
                let mut refs: Vec<&mut [T]> = got.iter_mut().map(|v| &mut v[..]).collect();
                flat.all_reduce(&comm, &mut refs, op).unwrap();
                for (t, x) in inputs.iter().enumerate() {
                    let want = comm
                        .all_reduce(HostBuffer::from_slice(x).unwrap(), op)
                        .wait()
                        .unwrap();
                    assert_eq!(bits(&got[t]), bits(&want), "all_reduce {op} tensor {t}");
                }

                // reduce_scatter into padded shards
                let ins: Vec<&[T]> = inputs.iter().map(|v| &v[..]).collect();
                let mut shards: Vec<Vec<T>> = lens
                    .iter()
                    .map(|&n| vec![T::from_f32(9.0); shard_len(n, world)])
                    .collect();
                let mut refs: Vec<&mut [T]> = shards.iter_mut().map(|v| &mut v[..]).collect();
                sharded.reduce_scatter(&comm, &ins, &mut refs, op).unwrap();
                for (t, x) in inputs.iter().enumerate() {
                    let s = shard_len(x.len(), world);
                    let mut padded = HostBuffer::<T>::zeros(s * world).unwrap();
                    padded[..x.len()].copy_from_slice(x);
                    let (_, want) = comm
                        .reduce_scatter(padded, HostBuffer::zeros(s).unwrap(), &vec![s; world], op)
                        .wait()
                        .unwrap();
                    assert_eq!(
                        bits(&shards[t]),
                        bits(&want),
                        "reduce_scatter {op} tensor {t}"
                    );
                }

                // all_gather the shards back
                let shard_refs: Vec<&[T]> = shards.iter().map(|v| &v[..]).collect();
                let mut full: Vec<Vec<T>> =
                    lens.iter().map(|&n| vec![T::from_f32(7.0); n]).collect();
                let mut refs: Vec<&mut [T]> = full.iter_mut().map(|v| &mut v[..]).collect();
                sharded.all_gather(&comm, &shard_refs, &mut refs).unwrap();
                for (t, s) in shards.iter().enumerate() {
                    let n = lens[t];
                    let (_, want) = comm
                        .all_gather(
                            HostBuffer::from_slice(s).unwrap(),
                            HostBuffer::zeros(s.len() * world).unwrap(),
                            &vec![s.len(); world],
                        )
                        .wait()
                        .unwrap();
                    assert_eq!(bits(&full[t]), bits(&want[..n]), "all_gather tensor {t}");
                }
            }
            // Same buffers throughout: allocated once, reused by every call.
            assert_eq!(ptrs(&flat), flat_ptrs);
            assert_eq!(ptrs(&sharded), sharded_ptrs);
        });
        if let Err(e) = out {
            panic!("{e}");
        }
    }

    #[test]
    fn bucketed_equals_per_tensor() {
        let lens = [5usize, 0, 17, 1, 64, 3, 300, 2, 2, 9, 0, 31];
        for world in [1, 2, 3, 4] {
            for bucket_size in [1, 16, 40, 1000] {
                matches_per_tensor::<f32>(world, &lens, bucket_size);
            }
        }
        matches_per_tensor::<bf16>(3, &lens, 40);
        matches_per_tensor::<f16>(4, &lens, 33);
    }

    #[test]
    fn all_gather_round_trips_even_counts_shards() {
        // A tensor gathered from shards cut by shard_range is the tensor.
        let lens = [10usize, 7, 1, 0, 13];
        let out = ThreadGroup::run(3, |comm| {
            let (rank, world) = (comm.rank(), comm.world_size());
            let full: Vec<Vec<f32>> = lens
                .iter()
                .map(|&n| (0..n).map(|i| (i * 10 + n) as f32).collect())
                .collect();
            let shards: Vec<Vec<f32>> = full
                .iter()
                .map(|t| {
                    let mut s = t[shard_range(t.len(), world, rank)].to_vec();
                    s.resize(shard_len(t.len(), world), f32::NAN);
                    s
                })
                .collect();
            let plan = BucketPlan::sharded(&lens, world, 12).unwrap();
            let mut b = Bucketer::<f32>::new(&comm, plan).unwrap();
            let mut got: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0.0; n]).collect();
            let srefs: Vec<&[f32]> = shards.iter().map(|v| &v[..]).collect();
            let mut refs: Vec<&mut [f32]> = got.iter_mut().map(|v| &mut v[..]).collect();
            b.all_gather(&comm, &srefs, &mut refs).unwrap();
            assert_eq!(got, full);
        });
        out.unwrap();
    }

    #[test]
    fn wrong_lengths_name_the_tensor_and_fail_peers_fast() {
        let opts = CommOptions::default().with_timeout(Duration::from_secs(30));
        let t0 = Instant::now();
        let out = ThreadGroup::run_with(2, &opts, |comm| {
            let plan = BucketPlan::new(&[4, 6, 2], 8).unwrap();
            let mut b = Bucketer::<f32>::new(&comm, plan).unwrap();
            let (mut x, mut y, mut z) = (vec![0.0; 4], vec![0.0; 6], vec![0.0; 2]);
            let mut w = [0.0; 5];
            let mut tensors = if comm.rank() == 1 {
                vec![&mut x[..], &mut w[..], &mut z[..]]
            } else {
                vec![&mut x[..], &mut y[..], &mut z[..]]
            };
            let e = b
                .all_reduce(&comm, &mut tensors, ReduceOp::Sum)
                .unwrap_err();
            let next = comm.barrier().wait().unwrap_err();
            (e, next)
        })
        .unwrap();
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        match &out[1].0 {
            Error::InvalidArgument { rank: 1, op, msg } => {
                assert_eq!(*op, "bucketed all_reduce");
                assert_eq!(msg, "tensor 1 has 5 elements but the plan says 6");
            }
            e => panic!("rank 1: {e}"),
        }
        assert!(
            matches!(&out[0].0, Error::PeerFailed { peer: 1, .. }),
            "rank 0: {}",
            out[0].0
        );
        for (e0, next) in &out {
            assert!(matches!(next, Error::Poisoned { .. }), "{e0} then {next}");
        }
    }

    /// A failed bucket collective is returned after everything issued has
    /// been waited for; the next call is refused by the failed
    /// communicator (the lost buffer is allocated again, not a panic).
    #[test]
    fn collective_failure_then_poisoned() {
        let opts = CommOptions::default().with_timeout(Duration::from_secs(30));
        let t0 = Instant::now();
        let out = ThreadGroup::run_with(2, &opts, |comm| {
            if comm.rank() == 1 {
                return None;
            }
            let plan = BucketPlan::new(&[4, 4, 4, 4], 4).unwrap();
            let mut b = Bucketer::<f32>::new(&comm, plan)
                .unwrap()
                .with_max_in_flight(3);
            let mut t = [[1.0f32; 4]; 4];
            let mut refs: Vec<&mut [f32]> = t.iter_mut().map(|x| &mut x[..]).collect();
            let first = b.all_reduce(&comm, &mut refs, ReduceOp::Sum).unwrap_err();
            let next = b.all_reduce(&comm, &mut refs, ReduceOp::Sum).unwrap_err();
            Some((first, next))
        })
        .unwrap();
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        let (first, next) = out[0].as_ref().unwrap();
        assert!(
            matches!(
                first,
                Error::PeerFailed {
                    peer: 1,
                    seq: 1,
                    ..
                }
            ),
            "{first}"
        );
        // Three issued (max_in_flight), the fourth not: the next call is #4.
        assert!(matches!(next, Error::Poisoned { seq: 4, .. }), "{next}");
    }

    #[test]
    fn argument_errors_say_what_is_wrong() {
        let out = ThreadGroup::run(2, |comm| {
            let mut errs = Vec::new();
            let flat = BucketPlan::new(&[3], 8).unwrap();
            let sharded = BucketPlan::sharded(&[3], 2, 8).unwrap();
            let mut b = Bucketer::<f32>::new(&comm, sharded.clone()).unwrap();
            let mut t = [0.0f32; 3];
            errs.push(
                b.all_reduce(&comm, &mut [&mut t[..]], ReduceOp::Sum)
                    .unwrap_err(),
            );
            let s = [0.0f32; 1];
            errs.push(
                b.all_gather(&comm, &[&s[..]], &mut [&mut t[..]])
                    .unwrap_err(),
            );
            let mut f = Bucketer::<f32>::new(&comm, flat).unwrap();
            errs.push(f.all_reduce(&comm, &mut [], ReduceOp::Max).unwrap_err());
            errs.push(
                Bucketer::<f32>::new(&comm, BucketPlan::sharded(&[3], 3, 8).unwrap()).unwrap_err(),
            );
            errs.into_iter().map(|e| e.to_string()).collect::<Vec<_>>()
        })
        .unwrap();
        assert_eq!(
            out[0],
            vec![
                "rank 0: invalid arguments to bucketed all_reduce: all_reduce needs a flat plan \
                 (BucketPlan::new), this one is sharded over 2 ranks",
                "rank 0: invalid arguments to bucketed all_gather: shard 0 has 1 elements but \
                 tensor 0 (3 elements) has shards of 2",
                "rank 0: invalid arguments to bucketed all_reduce: got 0 tensors but the plan has \
                 1 tensors",
                "rank 0: invalid arguments to Bucketer::new: the plan shards over 3 ranks but the \
                 communicator has 2",
            ]
        );
    }
}
