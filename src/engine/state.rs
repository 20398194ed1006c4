//! Reading a unit's full state (parameters, fp32 master, `m`, `v`) out of
//! the rank's shards, and setting or reading its frozen tensors wherever
//! this rank keeps them: what `unit_state`, the export and the checkpoint's
//! frozen file use. Each read of a sharded value is a collective (stages
//! 1–3): the rank's part, then an all-gather on the host.
//!
//! ```text
//!  local part: device buffer | offloaded tiles (nvme: read, then a verdict)
//!              | parameter offload's home
//!        ──all_gather (stages 1–3)──▶ the unit's real elements
//! ```

use zero_core::{bf16, f16, DType, HostBuffer};

use super::backend::{EngineBackend, EngineComm};
use super::ctx::Ctx;
use super::gatherer::{FrozenHome, ParamGatherer};
use super::health::Health;
use super::optimizer::OptimizerShard;
use super::param_offload::ParamOffload;
use super::unit::Units;
use crate::format::bytes_as_f32;
use crate::{Error, Result};

/// The full (unsharded) state of one unit, read out for evaluation and
/// tests; real elements only (no padding).
#[derive(Debug, Clone, PartialEq)]
pub struct UnitState {
    /// The parameters in their training dtype, as f32: the trainable
    /// segment's real elements (`layout.numel`), then the frozen
    /// segment's (`layout.frozen_numel`).
    pub params: Vec<f32>,
    /// fp32 master weights (trainable tensors only, as the moments).
    pub master: Vec<f32>,
    /// AdamW first moment.
    pub m: Vec<f32>,
    /// AdamW second moment.
    pub v: Vec<f32>,
}

/// What [`StateIo::read`] reads besides the parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StateRead {
    /// The parameters alone (`Engine::unit_params`).
    Params,
    /// The parameters and the fp32 master (`Engine::unit_master`).
    Master,
    /// Everything (`Engine::unit_state`).
    All,
}

impl StateRead {
    /// The engine call that reads this.
    pub(super) fn call(self) -> &'static str {
        match self {
            StateRead::All => "unit_state",
            StateRead::Master => "unit_master",
            StateRead::Params => "unit_params",
        }
    }
}

/// What reading the state needs from the engine, borrowed.
pub(super) struct StateIo<'a, C, B: EngineBackend> {
    pub(super) cx: &'a Ctx<C, B>,
    pub(super) units: &'a mut Units<B>,
    /// Stage 3: where the frozen segments and the resident units are.
    pub(super) s3: &'a mut ParamGatherer<B>,
    pub(super) opt: &'a mut OptimizerShard<B>,
    pub(super) poff: Option<&'a mut ParamOffload>,
    pub(super) health: &'a mut Health,
}

impl<C: EngineComm<B>, B: EngineBackend> StateIo<'_, C, B> {
    /// The real elements (`numel`) of a unit whose rank parts are `local`
    /// (`shard` elements each): an all-gather in stages 1–3.
    fn gather_f32(&self, local: &[f32], shard: usize, numel: usize) -> Result<Vec<f32>> {
        if self.cx.stage == 0 || shard == 0 {
            return Ok(local[..numel].to_vec());
        }
        let world = self.cx.comm.world_size();
        let send = HostBuffer::from_slice(local)?;
        let recv = HostBuffer::<f32>::zeros(shard * world)?;
        let (_, recv) = self
            .cx
            .comm
            .all_gather(send, recv, &vec![shard; world])
            .wait()?;
        Ok(recv[..numel].to_vec())
    }

    /// Unit `i`'s state, reading what `what` says (the fields not read are
    /// empty); every parameter all-gather of stages 1–2 is complete.
    pub(super) fn read(&mut self, i: usize, what: StateRead) -> Result<UnitState> {
        let (numel, shard) = (self.units[i].layout.numel, self.units[i].layout.shard_len);
        // The moments are gathered only when asked for (an empty local
        // part is never gathered).
        let moments = what == StateRead::All;
        let gather3 = |this: &Self, master: &[f32], m: &[f32], v: &[f32]| {
            let moment = |x: &[f32]| match moments {
                true => this.gather_f32(x, shard, numel),
                false => Ok(Vec::new()),
            };
            Ok::<_, Error>((
                this.gather_f32(master, shard, numel)?,
                moment(m)?,
                moment(v)?,
            ))
        };
        let (master, m, v) = match self.opt.offload() {
            _ if what == StateRead::Params => (Vec::new(), Vec::new(), Vec::new()),
            None => {
                let (master, m, v) = self.opt.moments(i).host(&self.cx.backend)?;
                gather3(self, &master, &m, &v)?
            }
            Some(off) => {
                let local = off.read_unit(i);
                if off.is_nvme() {
                    self.health
                        .read_verdict(&self.cx.comm, local.as_ref().err(), "optimizer")?;
                }
                let (master, m, v) = local?;
                gather3(self, &master, &m, &v)?
            }
        };
        let mut params = if let Some(po) = self.poff.as_deref() {
            let local = po.shard_f32(i, self.cx.pdt);
            if po.is_nvme() {
                self.health
                    .read_verdict(&self.cx.comm, local.as_ref().err(), "parameter")?;
            }
            self.gather_f32(&local?, shard, numel)?
        } else {
            let p = self.units[i]
                .home()
                .expect("params are home outside collectives");
            let mut params = Vec::with_capacity(numel);
            if self.cx.stage == 3 {
                let mut local = Vec::with_capacity(shard);
                p.extend_f32(&self.cx.backend, 0..shard, &mut local)?;
                params = self.gather_f32(&local, shard, numel)?;
            } else {
                p.extend_f32(&self.cx.backend, 0..numel, &mut params)?;
            }
            params
        };
        self.extend_frozen(i, &mut params)?;
        Ok(UnitState {
            params,
            master,
            m,
            v,
        })
    }

    /// Unit `i`'s full fp32 master (at least its real elements): a
    /// collective in stages 1–3.
    pub(super) fn master(&mut self, i: usize) -> Result<HostBuffer<f32>> {
        let (local, nvme) = match self.opt.offload() {
            None => (
                self.opt
                    .moments(i)
                    .host(&self.cx.backend)
                    .and_then(|(master, _, _)| Ok(HostBuffer::from_slice(&master)?)),
                false,
            ),
            Some(off) => (
                off.read_master(i)
                    .and_then(|master| Ok(HostBuffer::from_slice(&master)?)),
                off.is_nvme(),
            ),
        };
        if nvme {
            self.health
                .read_verdict(&self.cx.comm, local.as_ref().err(), "optimizer")?;
        }
        let local = local?;
        if self.cx.stage == 0 {
            return Ok(local);
        }
        let world = self.cx.comm.world_size();
        let shard = self.units[i].layout.shard_len;
        let recv = HostBuffer::<f32>::zeros(shard * world)?;
        let (_, recv) = self
            .cx
            .comm
            .all_gather(local, recv, &vec![shard; world])
            .wait()?;
        Ok(recv)
    }

    /// Sets unit `i`'s frozen real elements (`values`, as
    /// [`StateIo::extend_frozen`] gives them) where this rank keeps them.
    pub(super) fn set_frozen(&mut self, i: usize, values: &[f32]) -> Result<()> {
        let l = self.units[i].layout.clone();
        let (rank, pdt) = (self.cx.comm.rank(), self.cx.pdt);
        if let Some(b) = self.s3.resident_mut(i, rank)? {
            return b.store_slice(&self.cx.backend, l.frozen_offset(), values);
        }
        let fs = l.frozen_shard_len();
        let own = (rank * fs).min(values.len())..((rank + 1) * fs).min(values.len());
        match self.s3.frozen_mut(i) {
            Some(FrozenHome::Resident(_)) => Err(self.cx.usage(format!(
                "internal: the resident parameters of unit `{}` are in flight while its frozen \
                 tensors are set",
                l.name
            ))),
            Some(FrozenHome::Shard(f)) => f.store_slice(&self.cx.backend, 0, &values[own]),
            Some(FrozenHome::Host(bytes)) => {
                let n = own.len() * pdt.size_in_bytes();
                store_as(pdt, &values[own], &mut bytes[..n]);
                Ok(())
            }
            None => {
                let at = l.frozen_offset();
                self.units[i]
                    .params_mut()
                    .store_slice(&self.cx.backend, at, values)
            }
        }
    }

    /// Appends unit `i`'s frozen real elements (as f32) to `out`.
    pub(super) fn extend_frozen(&mut self, i: usize, out: &mut Vec<f32>) -> Result<()> {
        let (world, rank) = (self.cx.comm.world_size(), self.cx.comm.rank());
        if self.cx.stage == 3 {
            // A resident unit's gather into its own buffer completes first.
            self.s3.settle(i, &self.cx.backend, &self.cx.tracer, rank)?;
        }
        let l = &self.units[i].layout;
        if l.frozen_numel == 0 {
            return Ok(());
        }
        let frozen = l.frozen_offset()..l.frozen_offset() + l.frozen_numel;
        let shard = |local: Vec<f32>| -> Result<Vec<f32>> {
            let fs = local.len();
            let send = HostBuffer::from_slice(&local)?;
            let recv = HostBuffer::<f32>::zeros(fs * world)?;
            let (_, recv) = self
                .cx
                .comm
                .all_gather(send, recv, &vec![fs; world])
                .wait()?;
            Ok(recv[..l.frozen_numel].to_vec())
        };
        if let Some(b) = self.s3.resident(i) {
            return b.extend_f32(&self.cx.backend, frozen, out);
        }
        match self.s3.frozen(i) {
            Some(FrozenHome::Resident(_)) => Err(self.cx.usage(format!(
                "internal: the resident parameters of unit `{}` are neither kept nor gathered",
                l.name
            ))),
            Some(FrozenHome::Shard(f)) => {
                let mut local = Vec::with_capacity(f.len());
                f.extend_f32(&self.cx.backend, 0..f.len(), &mut local)?;
                out.extend(shard(local)?);
                Ok(())
            }
            Some(FrozenHome::Host(bytes)) => {
                out.extend(shard(bytes_as_f32(self.cx.pdt, bytes))?);
                Ok(())
            }
            None => {
                let p = self.units[i]
                    .home()
                    .expect("params are home outside collectives");
                p.extend_f32(&self.cx.backend, frozen, out)
            }
        }
    }
}

/// `values` converted to `dtype`, as bytes into `out` (of exactly their
/// size, aligned for `dtype`).
pub(super) fn store_as(dtype: DType, values: &[f32], out: &mut [u8]) {
    match dtype {
        DType::F32 => out.copy_from_slice(bytemuck::cast_slice(values)),
        DType::BF16 => zero_core::convert(values, bytemuck::cast_slice_mut::<u8, bf16>(out), false),
        DType::F16 => zero_core::convert(values, bytemuck::cast_slice_mut::<u8, f16>(out), false),
    }
}
