//! Custom operations on a [`CpuBackend`] stream: CPU code that stands for
//! a device kernel (a model's GEMM, norm or loss), run in stream order and,
//! in the checked modes, proved ordered like the backend's own primitives.
//!
//! The caller declares what the operation touches, as [`In`] (read) and
//! [`Out`] (write) element ranges of the backend's buffers, and hands them
//! with the job to [`CpuBackend::launch`]. The job gets them back with a
//! [`Running`] token; only with it do they give their slices, so a job
//! reaches no memory it did not declare, and nothing outside a job reaches
//! declared memory through them.
//!
//! ```
//! use zero_core::backend::{Backend, CpuBackend, CpuMode, Stream};
//!
//! let dev = CpuBackend::new(CpuMode::Checked)?;
//! let mut x = dev.alloc::<f32>(4, "x")?;
//! let mut y = dev.alloc::<f32>(4, "y")?;
//! dev.fill(Stream::Compute, &mut x, 0..4, 3.0)?;
//! let args = (dev.input(&x, 0..4)?, dev.output(&mut y, 0..4)?);
//! dev.launch(Stream::Compute, "square", args, |run, (x, mut y)| {
//!     for (o, v) in y.get(run).iter_mut().zip(x.get(run)) {
//!         *o = v * v;
//!     }
//!     Ok(())
//! })?;
//! dev.sync(&dev.record(Stream::Compute)?)?;
//! assert_eq!(dev.host_slice(&y, 0..4)?, &[9.0; 4]);
//! # Ok::<(), zero_core::Error>(())
//! ```

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use super::kernels::Raw;
use super::{CpuBackend, CpuBuffer};
use crate::backend::checks::range_len;
use crate::backend::hazard::Decl;
use crate::backend::{AccessKind, Stream};
use crate::{Element, Error, Result};

/// Launch ids start at 1: an argument never launched holds 0.
static NEXT_LAUNCH: AtomicU64 = AtomicU64::new(1);

/// Elements of a buffer that a custom operation reads; made by
/// [`CpuBackend::input`], dereferenced in the job with [`In::get`].
pub struct In<'b, T: Element> {
    raw: Raw<T>,
    decl: Decl,
    label: std::sync::Arc<str>,
    launch: u64,
    _buf: PhantomData<&'b CpuBuffer<T>>,
}

/// Elements of a buffer that a custom operation writes; made by
/// [`CpuBackend::output`], dereferenced in the job with [`Out::get`].
pub struct Out<'b, T: Element> {
    raw: Raw<T>,
    decl: Decl,
    label: std::sync::Arc<str>,
    launch: u64,
    _buf: PhantomData<&'b mut CpuBuffer<T>>,
}

impl<T: Element> std::fmt::Debug for In<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "In({:?}[{:?}])", self.label, self.decl.range)
    }
}

impl<T: Element> std::fmt::Debug for Out<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Out({:?}[{:?}])", self.label, self.decl.range)
    }
}

/// Proof that a job of launch `id` is running: the only way to reach the
/// memory of its arguments.
pub struct Running {
    id: u64,
}

impl<T: Element> In<'_, T> {
    /// The declared elements.
    ///
    /// # Panics
    /// When `run` is not the launch this argument was handed to (an
    /// argument kept past its job, or of another launch): a bug of the
    /// calling code, never of its input.
    pub fn get<'r>(&'r self, run: &'r Running) -> &'r [T] {
        assert_eq!(
            self.launch, run.id,
            "In<{:?}> used outside the job it was launched with",
            self.label
        );
        // SAFETY: the launch accepted the declared read (in the checked
        // modes after the hazard checker proved every conflicting access
        // ordered around it; in Inline mode every operation runs in call
        // order), no other argument of the launch writes these elements
        // (`check_aliasing`), and the buffer outlives the job (borrowed for
        // 'b in Inline and Checked mode, where the job runs inside
        // `launch`; in Chaos mode freed memory waits until every queue ran
        // past its drop).
        unsafe { self.raw.slice() }
    }

    /// Elements declared.
    pub fn len(&self) -> usize {
        self.decl.range.len()
    }

    /// Whether no elements are declared.
    pub fn is_empty(&self) -> bool {
        self.decl.range.is_empty()
    }
}

impl<T: Element> Out<'_, T> {
    /// The declared elements, to write.
    ///
    /// # Panics
    /// As [`In::get`].
    pub fn get<'r>(&'r mut self, run: &'r Running) -> &'r mut [T] {
        assert_eq!(
            self.launch, run.id,
            "Out<{:?}> used outside the job it was launched with",
            self.label
        );
        // SAFETY: as in `In::get`, and no other argument of the launch
        // touches these elements (`check_aliasing`); `&mut self` keeps this
        // slice the only one.
        unsafe { self.raw.slice_mut() }
    }

    /// Elements declared.
    pub fn len(&self) -> usize {
        self.decl.range.len()
    }

    /// Whether no elements are declared.
    pub fn is_empty(&self) -> bool {
        self.decl.range.is_empty()
    }
}

/// The arguments of a custom operation: an [`In`], an [`Out`], an
/// `Option` or `Vec` of arguments, or a tuple of up to eight.
pub trait LaunchArgs: Send + private::Sealed {}

mod private {
    use std::sync::Arc;

    use crate::backend::hazard::Decl;

    /// The declared accesses of a launch, with their buffers' labels.
    #[derive(Default)]
    pub struct Decls(pub(crate) Vec<(Decl, Arc<str>)>);

    pub trait Sealed {
        /// Stamps every argument with launch `id` and lists its accesses.
        fn stamp(&mut self, id: u64, decls: &mut Decls);
    }
}

use private::Decls;

impl<T: Element> LaunchArgs for In<'_, T> {}
impl<T: Element> private::Sealed for In<'_, T> {
    fn stamp(&mut self, id: u64, decls: &mut Decls) {
        self.launch = id;
        decls.0.push((self.decl.clone(), self.label.clone()));
    }
}

impl<T: Element> LaunchArgs for Out<'_, T> {}
impl<T: Element> private::Sealed for Out<'_, T> {
    fn stamp(&mut self, id: u64, decls: &mut Decls) {
        self.launch = id;
        decls.0.push((self.decl.clone(), self.label.clone()));
    }
}

impl<A: LaunchArgs> LaunchArgs for Option<A> {}
impl<A: LaunchArgs> private::Sealed for Option<A> {
    fn stamp(&mut self, id: u64, decls: &mut Decls) {
        if let Some(a) = self {
            a.stamp(id, decls);
        }
    }
}

impl<A: LaunchArgs> LaunchArgs for Vec<A> {}
impl<A: LaunchArgs> private::Sealed for Vec<A> {
    fn stamp(&mut self, id: u64, decls: &mut Decls) {
        for a in self {
            a.stamp(id, decls);
        }
    }
}

macro_rules! tuple_args {
    ($($name:ident),+) => {
        impl<$($name: LaunchArgs),+> LaunchArgs for ($($name,)+) {}
        impl<$($name: LaunchArgs),+> private::Sealed for ($($name,)+) {
            #[allow(non_snake_case)]
            fn stamp(&mut self, id: u64, decls: &mut Decls) {
                let ($($name,)+) = self;
                $($name.stamp(id, decls);)+
            }
        }
    };
}
tuple_args!(A);
tuple_args!(A, B2);
tuple_args!(A, B2, C);
tuple_args!(A, B2, C, D);
tuple_args!(A, B2, C, D, E);
tuple_args!(A, B2, C, D, E, F);
tuple_args!(A, B2, C, D, E, F, G);
tuple_args!(A, B2, C, D, E, F, G, H);

/// Refuses a launch whose write overlaps another declared access of the
/// same buffer (the job would hold two slices of the same elements, one
/// of them mutable), naming the operation, the buffer and both ranges.
fn check_aliasing(op: &'static str, decls: &[(Decl, std::sync::Arc<str>)]) -> Result<()> {
    for (i, (a, label)) in decls.iter().enumerate() {
        for (b, _) in &decls[i + 1..] {
            let touches = a.range.start < b.range.end && b.range.start < a.range.end;
            let writes = a.kind == AccessKind::Write || b.kind == AccessKind::Write;
            if a.id == b.id && touches && writes {
                return Err(Error::InvalidSize {
                    op,
                    msg: format!(
                        "arguments {:?} and {:?} of buffer {label:?} ({}) overlap, and one \
                         of them is written",
                        a.range, b.range, a.id
                    ),
                });
            }
        }
    }
    Ok(())
}

impl CpuBackend {
    /// Elements `range` of `buf` as an argument a custom operation reads.
    /// Errors: a range outside the buffer, another backend's buffer.
    pub fn input<'b, T: Element>(
        &self,
        buf: &'b CpuBuffer<T>,
        range: Range<usize>,
    ) -> Result<In<'b, T>> {
        const OP: &str = "launch (input)";
        self.own(buf, OP)?;
        let len = range_len(OP, &range)?;
        Ok(In {
            raw: buf.raw(OP, range.start, len)?,
            decl: buf.decl(range.start, len, AccessKind::Read),
            label: buf.label.clone(),
            launch: 0,
            _buf: PhantomData,
        })
    }

    /// Elements `range` of `buf` as an argument a custom operation writes.
    /// Errors: as [`input`](CpuBackend::input).
    pub fn output<'b, T: Element>(
        &self,
        buf: &'b mut CpuBuffer<T>,
        range: Range<usize>,
    ) -> Result<Out<'b, T>> {
        const OP: &str = "launch (output)";
        self.own(buf, OP)?;
        let len = range_len(OP, &range)?;
        let raw = buf.raw_mut(OP, range.start, len)?;
        Ok(Out {
            raw,
            decl: buf.decl(range.start, len, AccessKind::Write),
            label: buf.label.clone(),
            launch: 0,
            _buf: PhantomData,
        })
    }

    /// Runs `job` as operation `op` on `stream` over `args`, like the
    /// backend's own primitives: at once in `Inline` mode; in `Checked`
    /// mode after the hazard checker accepted every declared access; in
    /// `Chaos` mode queued on the stream's worker. Its error is returned
    /// (in Chaos mode by a later call, as a worker's errors are).
    ///
    /// Errors, before anything runs: a write that overlaps another argument
    /// of the same buffer ([`Error::InvalidSize`]), a hazard
    /// ([`Error::Hazard`]), an earlier operation's stored error.
    pub fn launch<'b, A, F>(
        &self,
        stream: Stream,
        op: &'static str,
        mut args: A,
        job: F,
    ) -> Result<()>
    where
        A: LaunchArgs + 'b,
        F: FnOnce(&Running, A) -> Result<()> + Send + 'static,
    {
        let id = NEXT_LAUNCH.fetch_add(1, Ordering::Relaxed);
        let mut decls = Decls::default();
        args.stamp(id, &mut decls);
        check_aliasing(op, &decls.0)?;
        let run = move || job(&Running { id }, args);
        let boxed: Box<dyn FnOnce() -> Result<()> + Send + 'b> = Box::new(run);
        // SAFETY: the only borrows `boxed` holds are the arguments'
        // `PhantomData` markers (`job` is 'static); the memory they point
        // to stays valid until the job ran: in Inline and Checked mode
        // `submit` runs it before returning, while 'b holds the buffers;
        // in Chaos mode a buffer's memory is freed only once every stream's
        // queue ran past its drop, which comes after this job in `stream`'s
        // queue.
        let boxed: Box<dyn FnOnce() -> Result<()> + Send + 'static> =
            unsafe { std::mem::transmute(boxed) };
        self.submit(
            stream,
            op,
            || decls.0.into_iter().map(|(d, _)| d).collect(),
            boxed,
        )
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::private::Sealed;
    use super::*;
    use crate::backend::{Backend, BufferHandle, CpuMode};

    fn square(dev: &CpuBackend, x: &CpuBuffer<f32>, y: &mut CpuBuffer<f32>) -> Result<()> {
        let n = x.len();
        let args = (dev.input(x, 0..n)?, dev.output(y, 0..n)?);
        dev.launch(Stream::Compute, "square", args, |run, (x, mut y)| {
            for (o, v) in y.get(run).iter_mut().zip(x.get(run)) {
                *o = v * v;
            }
            Ok(())
        })
    }

    #[test]
    fn a_launch_is_checked_like_a_primitive() {
        let dev = CpuBackend::new(CpuMode::Checked).unwrap();
        let mut x = dev.alloc::<f32>(8, "x").unwrap();
        let mut y = dev.alloc::<f32>(8, "y").unwrap();
        dev.fill(Stream::HostToDevice, &mut x, 0..8, 3.0).unwrap();
        let e = square(&dev, &x, &mut y).unwrap_err().to_string();
        assert!(e.contains("square") && e.contains("fill"), "{e}");
        let up = dev.record(Stream::HostToDevice).unwrap();
        dev.wait(Stream::Compute, &up).unwrap();
        square(&dev, &x, &mut y).unwrap();
        // A later reader on another stream must wait for the launch.
        let mut z = dev.alloc::<f32>(8, "z").unwrap();
        let e = dev
            .copy_d2d(Stream::Comm, &y, 0, &mut z, 0, 8)
            .unwrap_err()
            .to_string();
        assert!(e.contains("square"), "{e}");
        dev.sync(&dev.record(Stream::Compute).unwrap()).unwrap();
        assert_eq!(dev.host_slice(&y, 0..8).unwrap(), &[9.0; 8]);
    }

    #[test]
    fn chaos_runs_launches_in_stream_order() {
        let dev = CpuBackend::new(CpuMode::Chaos { seed: 7 }).unwrap();
        let mut x = dev.alloc::<f32>(64, "x").unwrap();
        let mut y = dev.alloc::<f32>(64, "y").unwrap();
        for k in 0..20 {
            dev.fill(Stream::Compute, &mut x, 0..64, k as f32).unwrap();
            square(&dev, &x, &mut y).unwrap();
            let args = (
                dev.input(&y, 0..64).unwrap(),
                dev.output(&mut x, 0..64).unwrap(),
            );
            dev.launch(Stream::Compute, "plus_one", args, |run, (y, mut x)| {
                for (o, v) in x.get(run).iter_mut().zip(y.get(run)) {
                    *o = v + 1.0;
                }
                Ok(())
            })
            .unwrap();
            dev.sync(&dev.record(Stream::Compute).unwrap()).unwrap();
            let want = (k * k) as f32 + 1.0;
            assert_eq!(dev.host_slice(&x, 0..64).unwrap(), &[want; 64][..]);
        }
    }

    #[test]
    fn overlapping_writes_are_refused() {
        // The borrows of `input`/`output` make this unreachable through
        // the API; the launch checks it all the same.
        let dev = CpuBackend::new(CpuMode::Checked).unwrap();
        let mut x = dev.alloc::<f32>(8, "x").unwrap();
        let read = dev.input(&x, 0..6).unwrap().decl.clone();
        let mut decls = Decls::default();
        decls.0.push((read.clone(), Arc::from("x")));
        let mut w = dev.output(&mut x, 4..8).unwrap();
        w.stamp(1, &mut decls);
        let e = check_aliasing("op", &decls.0).unwrap_err().to_string();
        assert!(
            e.contains("0..6") && e.contains("4..8") && e.contains("\"x\""),
            "{e}"
        );
        // Reads may overlap; a write may not overlap a write.
        let two_reads = [(read.clone(), Arc::from("x")), (read, Arc::from("x"))];
        check_aliasing("op", &two_reads).unwrap();
    }

    #[test]
    fn ranges_outside_and_foreign_buffers_are_errors() {
        let dev = CpuBackend::new(CpuMode::Checked).unwrap();
        let other = CpuBackend::new(CpuMode::Checked).unwrap();
        let x = dev.alloc::<f32>(8, "x").unwrap();
        assert!(dev.input(&x, 4..9).is_err());
        let e = other.input(&x, 0..8).unwrap_err().to_string();
        assert!(e.contains("another backend"), "{e}");
    }

    #[test]
    #[should_panic(expected = "used outside the job")]
    fn an_argument_kept_past_its_job_cannot_be_read() {
        let dev = CpuBackend::new(CpuMode::Inline).unwrap();
        let x = dev.alloc::<f32>(8, "x").unwrap();
        let kept = std::sync::Mutex::new(None);
        let kept = std::sync::Arc::new(kept);
        let k = kept.clone();
        let arg = dev.input(&x, 0..8).unwrap();
        // SAFETY: the argument is only stashed, never read after the job
        // (`get` below must refuse the stale launch before reading), and
        // `x` outlives both launches.
        let arg: In<'static, f32> = unsafe { std::mem::transmute(arg) };
        dev.launch(Stream::Compute, "stash", arg, move |_, a| {
            *k.lock().unwrap() = Some(a);
            Ok(())
        })
        .unwrap();
        let stale = kept.lock().unwrap().take().unwrap();
        let other = dev.input(&x, 0..8).unwrap();
        dev.launch(Stream::Compute, "read", other, move |run, _| {
            let _ = stale.get(run);
            Ok(())
        })
        .unwrap();
    }
}
