//! [`MpiComm`]: set-up, the `Communicator` implementation, the native MPI
//! baselines, and teardown.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use zero_core::{Element, HostBuffer};

use super::engine::{Engine, NativeFn, NativeJob};
use super::net::{Net, Notices};
use super::pool::{bounce_bytes, pool_size_from_env};
use super::raw;
use super::runtime::{Comm, Runtime};
use super::window::Node;
use crate::communicator::RawOp;
use crate::exec::Executor;
use crate::shm::{ShmGroup, ShmMemory, STATE_FAILED, STATE_LEFT};
use crate::work::Work;
use crate::{CommOptions, Communicator, Error, Result};

/// Environment variable that splits each node into k pseudo-nodes (blocks
/// of consecutive ranks), to exercise the multi-node paths on one machine.
pub(crate) const SIMULATE_ENV: &str = "ZERO_MPI_SIMULATE_NODES";

/// One rank of an MPI job: a process started by `mpirun`/`srun`.
///
/// ```text
///  node (ranks that share memory)              other nodes
///  ┌──────────────────────────────────────┐
///  │ rank 0          rank 1               │
///  │ user ─▶ progress thread ◀─ user      │   MPI collectives
///  │          │ (all MPI calls)           │◀──────────────────▶
///  │   MPI-3 shared window in /dev/shm:   │  (all_reduce: only
///  │   control slots | pool 0 | pool 1    │   1/N of the buffer
///  └──────────────────────────────────────┘   per rank)
/// ```
///
/// - **Within a node** MPI's collectives are not used: ranks run the same
///   zero-copy shared-memory algorithms as [`ThreadComm`], reading and
///   writing each other's buffers through an MPI-3 shared window.
/// - **Buffers** from [`Communicator::alloc`] live in this rank's segment
///   of that window (`ZERO_MPI_SHM_POOL` bytes per rank, default 1 GiB of
///   address space, backed by pages only as buffers use them), so
///   collectives on them copy nothing. Any other [`HostBuffer`] works too:
///   it is staged through a bounded bounce region of the pool, chunk by
///   chunk.
/// - **Across nodes**, all-reduce is hierarchical (reduce within the node
///   into f32, all-reduce each rank's chunk with the same local rank on the
///   other nodes, write back) when all nodes have as many ranks; the other
///   collectives use MPI's non-blocking collectives, bounded by
///   [`CommOptions::timeout`]. `ZERO_MPI_SIMULATE_NODES=k` splits each node
///   into k pseudo-nodes, to run these paths on one machine.
/// - **Order of reduction**: within a node, bit-identical to
///   [`reference_reduce`](crate::reference_reduce). Across nodes, bf16/f16
///   are widened to f32 and rounded once, but node partials are combined in
///   MPI's order, so f32 rounding can differ from strict rank order (not
///   for two nodes' partials, one f32 addition; never for Max).
/// - **Failures**: as for threads within a node (timeouts that name the
///   ranks that arrived, mismatches always detected, failed, departed or
///   dead peers — the last seen through `kill(pid, 0)` — give
///   [`Error::PeerFailed`] at once). Across nodes, MPI waits are bounded by
///   the timeout, [`CommOptions::validate`] compares descriptors over MPI,
///   and a failing rank notifies the other nodes.
/// - Every MPI call after [`MpiComm::init`] is made by the progress thread,
///   so `MPI_THREAD_SERIALIZED` is enough. MPI is finalised when the last
///   `MpiComm` and the last buffer from a pool are dropped.
///
/// [`ThreadComm`]: crate::ThreadComm
pub struct MpiComm {
    rank: usize,
    size: usize,
    local_rank: usize,
    local_size: usize,
    /// Ranks on this machine (the shared-memory communicator's size, before
    /// any simulated split into pseudo-nodes).
    host_size: usize,
    node_count: usize,
    node: Arc<Node>,
    group: Arc<ShmGroup>,
    notices: Option<Arc<Mutex<Notices>>>,
    current: Arc<AtomicU64>,
    exec: Executor,
}

struct Config {
    pool: usize,
    simulate: usize,
}

fn read_config(shared_size: usize) -> Result<Config> {
    let pool = pool_size_from_env()?;
    let simulate = match std::env::var(SIMULATE_ENV) {
        Err(_) => 1,
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(k) if (1..=shared_size).contains(&k) => k,
            _ => {
                return Err(Error::Config {
                    key: SIMULATE_ENV.into(),
                    msg: format!(
                        "`{v}`: expected a number of pseudo-nodes from 1 to the {shared_size} \
                         ranks on this node"
                    ),
                })
            }
        },
    };
    Ok(Config { pool, simulate })
}

impl MpiComm {
    /// Joins the MPI job as this process's rank: initialises MPI on first
    /// use (asking for `MPI_THREAD_MULTIPLE`; `MPI_THREAD_SERIALIZED` is
    /// enough) and sets up a communicator over all ranks of
    /// `MPI_COMM_WORLD`.
    ///
    /// Collective: every rank must call it, from one thread at a time and
    /// in the same order as its other `init` calls. Calling it again while an
    /// `MpiComm` is alive creates another, independent communicator (on a
    /// duplicate of the world). MPI is finalised when the last `MpiComm`
    /// and the last buffer from its pool are dropped, and cannot be
    /// initialised again in the same process.
    ///
    /// Environment: `ZERO_MPI_SHM_POOL` (pool bytes per rank; suffixes
    /// K, M, G, T; default 1G) and `ZERO_MPI_SIMULATE_NODES` (k: split each
    /// node into k pseudo-nodes of consecutive ranks, for testing).
    pub fn init(opts: &CommOptions) -> Result<MpiComm> {
        let rt = Runtime::get()?;
        let world = Arc::new(Comm::dup_world(&rt)?);
        let (rank, size) = (world.rank(), world.size());
        let shared = world.split_shared()?;
        let host_size = shared.size();
        // Agree that every rank's configuration is valid before the
        // collectives that would hang if one rank stopped here.
        let config = read_config(shared.size());
        let ok = world.all_reduce_i64(i64::from(config.is_ok()), raw::op_min())?;
        let config = match (config, ok) {
            (Err(e), _) => return Err(e),
            (Ok(c), 1) => c,
            (Ok(_), _) => {
                return Err(Error::Mpi(format!(
                    "rank {rank}: another rank rejected its configuration \
                     (ZERO_MPI_SHM_POOL / ZERO_MPI_SIMULATE_NODES); see its error"
                )))
            }
        };
        let local = if config.simulate > 1 {
            let block = shared.rank() * config.simulate / shared.size();
            shared.split(block, shared.rank())?
        } else {
            shared
        };
        let (local_rank, local_size) = (local.rank(), local.size());
        let node_count = world.all_reduce_i64(i64::from(local_rank == 0), raw::op_sum())? as usize;
        let min_local = world.all_reduce_i64(local_size as i64, raw::op_min())?;
        let max_local = world.all_reduce_i64(local_size as i64, raw::op_max())?;
        let labels: Vec<usize> = local
            .all_gather_i64(rank as i64)?
            .into_iter()
            .map(|r| r as usize)
            .collect();
        if node_count == 1 && labels != (0..size).collect::<Vec<_>>() {
            return Err(Error::Mpi(format!(
                "rank {rank}: one node, but the shared-memory communicator orders ranks as {labels:?}"
            )));
        }
        let bounce = world.all_reduce_i64(bounce_bytes(config.pool) as i64, raw::op_min())?;
        let node = Arc::new(Node::create(&local, config.pool, bounce as usize)?);
        let mem: Arc<dyn ShmMemory> = node.clone();
        let keep: Arc<dyn Any + Send + Sync> = node.clone();
        // SAFETY: node.slots() points to local_size slots in the control
        // window, zero-initialised by their owners before the barrier in
        // Node::create, kept mapped by `keep`; this rank uses its own index.
        let group = Arc::new(unsafe {
            ShmGroup::new(
                node.slots(),
                local_size,
                local_rank,
                labels.clone(),
                mem,
                opts.timeout,
                keep,
            )
        });
        group.join();

        let (net, notices) = if node_count > 1 {
            let cross = if min_local == max_local {
                Some(world.split(local_rank, rank)?)
            } else {
                None
            };
            let remote = (0..size).filter(|r| !labels.contains(r)).collect();
            let notices = Arc::new(Mutex::new(Notices::new(&world, remote)?));
            let net = Net::new(world.clone(), cross, notices.clone(), opts.timeout)?;
            (Some(net), Some(notices))
        } else {
            (None, None)
        };

        let current = Arc::new(AtomicU64::new(0));
        let finished = Arc::new(AtomicU64::new(0));
        let mut engine = Engine::new(
            node.clone(),
            group.clone(),
            world,
            net,
            opts.validate,
            current.clone(),
            finished.clone(),
        );
        let on_fail = {
            let (group, node, notices) = (group.clone(), node.clone(), notices.clone());
            move |seq: u64| {
                group.set_state(STATE_FAILED);
                node.mark_failed();
                if let Some(n) = &notices {
                    // The first collective the other nodes cannot count on
                    // this rank for: the one that failed, unless this rank
                    // did all of its MPI part before failing (see
                    // Engine::finished).
                    let doomed = if finished.load(Ordering::Relaxed) == seq {
                        seq + 1
                    } else {
                        seq
                    };
                    n.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .announce(STATE_FAILED, doomed);
                }
            }
        };
        let exec = Executor::spawn(
            format!("zero-mpi-{rank}"),
            rank,
            Box::new(move |seq, op: &RawOp| engine.run(seq, op)),
            Box::new(on_fail),
        )?;
        Ok(MpiComm {
            rank,
            size,
            local_rank,
            local_size,
            host_size,
            node_count,
            node,
            group,
            notices,
            current,
            exec,
        })
    }

    /// This rank's index among the ranks of its node (shared memory).
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Number of ranks on this node (that share memory with this one).
    pub fn local_size(&self) -> usize {
        self.local_size
    }

    /// Number of nodes (pseudo-nodes with `ZERO_MPI_SIMULATE_NODES`).
    pub fn node_count(&self) -> usize {
        self.node_count
    }

    /// Whether `buf` lies in this rank's shared-memory pool (came from
    /// [`Communicator::alloc`] on this communicator), so that collectives
    /// use it in place without staging.
    pub fn is_registered<T: Element>(&self, buf: &HostBuffer<T>) -> bool {
        self.node
            .registered(buf.as_ptr().cast(), buf.size_in_bytes())
    }

    /// Baseline: `MPI_Allreduce` (sum, in place) of `buf` over all ranks,
    /// on the progress thread, blocking, with MPI's own algorithm. For
    /// comparing against [`Communicator::all_reduce`] on the same buffers.
    pub fn native_all_reduce(&self, buf: &mut HostBuffer<f32>) -> Result<()> {
        let n = raw::count(buf.len(), "MPI_Allreduce")?;
        let p = buf.as_mut_ptr() as usize;
        self.native(Box::new(move |e: &Engine| {
            let (comm, rt) = (e.world.raw(), e.world.runtime());
            match rt.in_place() {
                Some(ip) => rt.call(|| {
                    // SAFETY: `p` is valid for n f32 while the caller, which
                    // holds `&mut buf`, waits for this job; `ip` is this
                    // library's MPI_IN_PLACE.
                    unsafe { raw::allreduce_sum_f32(ip, p as *mut f32, n, comm) }
                }),
                None => {
                    // SAFETY: as above.
                    let copy =
                        unsafe { std::slice::from_raw_parts(p as *const f32, n as usize) }.to_vec();
                    rt.call(|| {
                        // SAFETY: `copy` and `p` hold n f32 each, distinct.
                        unsafe {
                            raw::allreduce_sum_f32(copy.as_ptr().cast(), p as *mut f32, n, comm)
                        }
                    })
                }
            }
        }))
    }

    /// Baseline: `MPI_Reduce_scatter_block` (sum): `send` holds
    /// `world_size() * recv.len()` elements; rank r receives the sum of
    /// block r. On the progress thread, blocking.
    pub fn native_reduce_scatter_block(
        &self,
        send: &HostBuffer<f32>,
        recv: &mut HostBuffer<f32>,
    ) -> Result<()> {
        if send.len() != recv.len() * self.size {
            return Err(Error::InvalidArgument {
                rank: self.rank,
                op: "native_reduce_scatter_block",
                msg: format!(
                    "input has {} elements; expected {} ranks x {} (output)",
                    send.len(),
                    self.size,
                    recv.len()
                ),
            });
        }
        let n = raw::count(recv.len(), "MPI_Reduce_scatter_block")?;
        let (s, r) = (send.as_ptr() as usize, recv.as_mut_ptr() as usize);
        self.native(Box::new(move |e: &Engine| {
            let comm = e.world.raw();
            // SAFETY: the caller holds both buffers borrowed while it waits
            // for this job; sizes checked above.
            e.world.runtime().call(|| unsafe {
                raw::reduce_scatter_block_sum_f32(s as *const f32, r as *mut f32, n, comm)
            })
        }))
    }

    /// Baseline: `MPI_Allgather`: `recv` (`world_size() * send.len()`
    /// elements) receives every rank's `send` in rank order. On the progress
    /// thread, blocking.
    pub fn native_all_gather(
        &self,
        send: &HostBuffer<f32>,
        recv: &mut HostBuffer<f32>,
    ) -> Result<()> {
        if recv.len() != send.len() * self.size {
            return Err(Error::InvalidArgument {
                rank: self.rank,
                op: "native_all_gather",
                msg: format!(
                    "output has {} elements; expected {} ranks x {} (input)",
                    recv.len(),
                    self.size,
                    send.len()
                ),
            });
        }
        let n = raw::count(send.len(), "MPI_Allgather")?;
        let (s, r) = (send.as_ptr() as usize, recv.as_mut_ptr() as usize);
        self.native(Box::new(move |e: &Engine| {
            let comm = e.world.raw();
            // SAFETY: the caller holds both buffers borrowed while it waits
            // for this job; sizes checked above.
            e.world
                .runtime()
                .call(|| unsafe { raw::allgather_f32(s as *const f32, r as *mut f32, n, comm) })
        }))
    }

    /// Baseline: `MPI_Allgather` in place (`MPI_IN_PLACE`): `buf` holds
    /// `world_size()` equal parts and rank r's part is already at part r.
    /// Where this library's `MPI_IN_PLACE` is not known, the own part is
    /// copied out and the out-of-place call is used. On the progress thread,
    /// blocking; for comparing against [`Communicator::all_gather_in_place`].
    pub fn native_all_gather_in_place(&self, buf: &mut HostBuffer<f32>) -> Result<()> {
        if !buf.len().is_multiple_of(self.size) {
            return Err(Error::InvalidArgument {
                rank: self.rank,
                op: "native_all_gather_in_place",
                msg: format!(
                    "buffer has {} elements, not a multiple of {} ranks",
                    buf.len(),
                    self.size
                ),
            });
        }
        let part = buf.len() / self.size;
        let n = raw::count(part, "MPI_Allgather")?;
        let (p, rank) = (buf.as_mut_ptr() as usize, self.rank);
        self.native(Box::new(move |e: &Engine| {
            let (comm, rt) = (e.world.raw(), e.world.runtime());
            match rt.in_place() {
                Some(ip) => rt.call(|| {
                    // SAFETY: `p` holds size * n f32 while the caller, which
                    // holds `&mut buf`, waits for this job; `ip` is this
                    // library's MPI_IN_PLACE.
                    unsafe { raw::allgather_f32(ip.cast(), p as *mut f32, n, comm) }
                }),
                None => {
                    // SAFETY: part `rank` lies within the buffer (checked).
                    let own = unsafe {
                        std::slice::from_raw_parts((p as *const f32).add(rank * part), part)
                    }
                    .to_vec();
                    rt.call(|| {
                        // SAFETY: `own` holds n f32, distinct from `p`.
                        unsafe { raw::allgather_f32(own.as_ptr(), p as *mut f32, n, comm) }
                    })
                }
            }
        }))
    }

    /// Runs `f` on the progress thread, in sequence, and waits for it.
    fn native(&self, f: NativeFn) -> Result<()> {
        let op = RawOp::barrier(vec![Box::new(NativeJob(Mutex::new(Some(f))))], None);
        self.exec.submit(op).wait().map(|_| ())
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn ranks_on_host(&self) -> usize {
        self.host_size
    }

    fn alloc<T: Element>(&self, len: usize) -> Result<HostBuffer<T>> {
        self.node.alloc::<T>(self.rank, len)
    }

    fn submit(&self, op: RawOp) -> Work<Vec<Box<dyn Any + Send>>> {
        self.exec.submit(op)
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // Finish what was queued (joins the progress thread, which owns the
        // engine), then tell the peers this rank is gone. MPI itself is
        // finalised when the last handle on the runtime goes.
        self.exec.shutdown();
        let failed = std::thread::panicking() || self.exec.poisoned().is_some();
        let state = if failed { STATE_FAILED } else { STATE_LEFT };
        self.group.set_state(state);
        if failed {
            self.node.mark_failed();
        }
        if let Some(n) = &self.notices {
            let next = self.current.load(Ordering::Relaxed) + 1;
            n.lock()
                .unwrap_or_else(|e| e.into_inner())
                .announce(state, next);
        }
    }
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("world_size", &self.size)
            .field("local_rank", &self.local_rank)
            .field("local_size", &self.local_size)
            .field("node_count", &self.node_count)
            .finish()
    }
}
