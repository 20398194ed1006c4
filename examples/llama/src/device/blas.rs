//! [`LlamaDevice::gemm`](super::LlamaDevice::gemm)'s row-major products
//! as the column-major calls of a BLAS (cuBLAS), with every check the call
//! needs, as a pure function the host tests evaluate.
//!
//! A row-major matrix `[r, c]` with row stride `ld` is, in the same
//! memory, the column-major `[c, r]` with leading dimension `ld`: its
//! transpose. So the row-major `C = op(A) op(B)` is the column-major
//! `Cᵀ = op(B)ᵀ op(A)ᵀ`: the call takes the trait's `b` as its first
//! operand and `a` as its second, swaps `m` and `n`, and keeps each
//! operand's transposition flag (`b` stored transposed is the first
//! operand transposed).
//!
//! Only the CUDA backend calls it; the tests run in every build.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use zero::core::Error;

use super::Batch;
use crate::ops::Mm;

/// One operand of [`plan`]: the buffer's length, its label, and the
/// element the operand starts at.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operand<'a> {
    /// Elements in the buffer.
    pub len: usize,
    /// The buffer's label, for errors.
    pub label: &'a str,
    /// The operand's first element.
    pub at: usize,
}

/// A column-major strided-batched GEMM: for each `i < count`,
/// `C_i = alpha · op_a(A_i) · op_b(B_i) + beta · C_i` with `C_i` `[m, n]`
/// (leading dimension `ldc`), `op_a(A_i)` `[m, k]`, `op_b(B_i)` `[k, n]`;
/// `A_i` starts `i · stride_a` elements after `A_0` (likewise `B`, `C`).
/// `A` is the trait's `b`, `B` the trait's `a`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ColGemm {
    /// `A` is transposed (`op_a(A) = Aᵀ`, `A` stored `[k, m]`).
    pub transa: bool,
    /// `B` is transposed (`B` stored `[n, k]`).
    pub transb: bool,
    /// Rows of `C` (the trait's `n`).
    pub m: i32,
    /// Columns of `C` (the trait's `m`).
    pub n: i32,
    /// The inner dimension.
    pub k: i32,
    /// Leading dimension of `A` (the trait's `ldb`), at least 1.
    pub lda: i32,
    /// Leading dimension of `B` (the trait's `lda`), at least 1.
    pub ldb: i32,
    /// Leading dimension of `C` (the trait's `ldc`), at least 1.
    pub ldc: i32,
    /// Elements between two products' `A` (the trait's `batch.b`).
    pub stride_a: i64,
    /// Elements between two products' `B` (the trait's `batch.a`).
    pub stride_b: i64,
    /// Elements between two products' `C`.
    pub stride_c: i64,
    /// Products.
    pub count: i32,
    /// Scale of the products.
    pub alpha: f32,
    /// Scale of the previous `C`.
    pub beta: f32,
}

/// What [`plan`] found: the elements each operand spans from its first
/// (for the device views) and the call, `None` when there is nothing to
/// compute (no products, or an empty output).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct GemmPlan {
    /// Elements the trait's `a` spans over the batch.
    pub a_len: usize,
    /// Elements `b` spans.
    pub b_len: usize,
    /// Elements the output spans.
    pub out_len: usize,
    /// The column-major call.
    pub call: Option<ColGemm>,
}

impl Operand<'_> {
    /// Errors unless the buffer holds `need` elements from `at`
    /// ([`Error::InvalidSize`] of `op`, naming operand `what` and the
    /// buffer).
    pub fn check(&self, op: &'static str, what: &str, need: usize) -> Result<(), Error> {
        if self.at > self.len || self.len - self.at < need {
            return Err(invalid(
                op,
                format!(
                    "operand {what} spans {need} elements from element {} of buffer {:?}, \
                     which holds {}",
                    self.at, self.label, self.len
                ),
            ));
        }
        Ok(())
    }
}

fn invalid(op: &'static str, msg: String) -> Error {
    Error::InvalidSize { op, msg }
}

/// Elements that `n` pieces of `len` elements, `stride` apart, span from
/// the first: a matrix's `n` rows of `len` with row stride `stride`, or a
/// batch's `n` operands; 0 when either is empty.
fn extent(
    op: &'static str,
    what: &str,
    n: usize,
    len: usize,
    stride: usize,
) -> Result<usize, Error> {
    if n == 0 || len == 0 {
        return Ok(0);
    }
    (n - 1)
        .checked_mul(stride)
        .and_then(|x| x.checked_add(len))
        .ok_or_else(|| {
            invalid(
                op,
                format!("{what}: {n} pieces of {len} elements, {stride} apart, overflow"),
            )
        })
}

fn to_i32(op: &'static str, what: &str, v: usize) -> Result<i32, Error> {
    i32::try_from(v).map_err(|_| invalid(op, format!("{what} = {v} exceeds the BLAS's i32")))
}

fn to_i64(op: &'static str, what: &str, v: usize) -> Result<i64, Error> {
    i64::try_from(v).map_err(|_| invalid(op, format!("{what} = {v} exceeds the BLAS's i64")))
}

/// Checks `mm` over `batch` against its operands (each operand's span
/// within its buffer, row strides at least the rows' widths, outputs of a
/// batch apart, sizes within the BLAS's integers) and maps it onto the
/// column-major call; errors ([`Error::InvalidSize`] of `op`) name the
/// operand.
pub(crate) fn plan(
    op: &'static str,
    mm: &Mm,
    batch: &Batch,
    a: Operand<'_>,
    b: Operand<'_>,
    out: Operand<'_>,
) -> Result<GemmPlan, Error> {
    let Mm {
        m,
        n,
        k,
        ta,
        tb,
        lda,
        ldb,
        ldc,
        alpha,
        beta,
        ..
    } = *mm;
    // One product's extents, as the CPU backend computes them.
    let (ra, ca) = if ta { (k, m) } else { (m, k) };
    let (rb, cb) = if tb { (n, k) } else { (k, n) };
    let ea = extent(op, "a", ra, ca, lda)?;
    let eb = extent(op, "b", rb, cb, ldb)?;
    let ec = extent(op, "out", m, n, ldc)?;
    let count = batch.count;
    if count > 1 && batch.out < ec {
        return Err(invalid(
            op,
            format!(
                "outputs of {ec} elements {} apart overlap within the batch",
                batch.out
            ),
        ));
    }
    let a_len = extent(op, "a", count, ea, batch.a)?;
    let b_len = extent(op, "b", count, eb, batch.b)?;
    let out_len = extent(op, "out", count, ec, batch.out)?;
    a.check(op, "a", a_len)?;
    b.check(op, "b", b_len)?;
    out.check(op, "out", out_len)?;
    if count == 0 || m == 0 || n == 0 {
        return Ok(GemmPlan {
            a_len,
            b_len,
            out_len,
            call: None,
        });
    }
    // Row strides: at least the stored rows' widths (a BLAS rejects less).
    // An operand with no columns (k = 0) is never read.
    let mut strides = vec![("out", ldc, n)];
    if k > 0 {
        strides.push(("a", lda, ca));
        strides.push(("b", ldb, cb));
    }
    for (what, ld, width) in strides {
        if ld < width {
            return Err(invalid(
                op,
                format!("operand {what}: row stride {ld} < its rows' {width} elements"),
            ));
        }
    }
    // The BLAS's least leading dimensions: its A is `[m', k]` (`m' = n`)
    // or, transposed, `[k, m']`, its B `[k, n']` or `[n', k]`, and at
    // least 1. The checks above give them, except for operands without
    // columns (k = 0), which are never read: raised to them.
    let (min_a, min_b) = (if tb { k } else { n }, if ta { m } else { k });
    let call = ColGemm {
        transa: tb,
        transb: ta,
        m: to_i32(op, "n", n)?,
        n: to_i32(op, "m", m)?,
        k: to_i32(op, "k", k)?,
        lda: to_i32(op, "ldb", ldb.max(min_a).max(1))?,
        ldb: to_i32(op, "lda", lda.max(min_b).max(1))?,
        ldc: to_i32(op, "ldc", ldc.max(1))?,
        stride_a: to_i64(op, "batch.b", batch.b)?,
        stride_b: to_i64(op, "batch.a", batch.a)?,
        stride_c: to_i64(op, "batch.out", batch.out)?,
        count: to_i32(op, "batch.count", count)?,
        alpha,
        beta,
    };
    Ok(GemmPlan {
        a_len,
        b_len,
        out_len,
        call: Some(call),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::matmul;
    use crate::XorShift;

    const OP: &str = "llama_gemm";

    fn whole(len: usize) -> Operand<'static> {
        Operand {
            len,
            label: "buf",
            at: 0,
        }
    }

    /// [`plan`] with buffers long enough for anything.
    fn unbounded(mm: &Mm, batch: &Batch) -> Result<GemmPlan, Error> {
        let all = whole(usize::MAX);
        plan(OP, mm, batch, all, all, all)
    }

    /// The column-major call on the host, as a BLAS defines it: `a` is the
    /// call's `A`, `b` its `B` (f64 sums).
    fn col_major(g: &ColGemm, a: &[f32], b: &[f32], c: &mut [f32]) {
        let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
        let (lda, ldb, ldc) = (g.lda as usize, g.ldb as usize, g.ldc as usize);
        for p in 0..g.count as usize {
            let a = &a[p * g.stride_a as usize..];
            let b = &b[p * g.stride_b as usize..];
            let c = &mut c[p * g.stride_c as usize..];
            for j in 0..n {
                for i in 0..m {
                    let mut acc = 0.0f64;
                    for l in 0..k {
                        let x = if g.transa {
                            a[l + i * lda]
                        } else {
                            a[i + l * lda]
                        };
                        let y = if g.transb {
                            b[j + l * ldb]
                        } else {
                            b[l + j * ldb]
                        };
                        acc += x as f64 * y as f64;
                    }
                    let o = &mut c[i + j * ldc];
                    let old = if g.beta == 0.0 {
                        0.0
                    } else {
                        g.beta as f64 * *o as f64
                    };
                    *o = (g.alpha as f64 * acc + old) as f32;
                }
            }
        }
    }

    fn random(rng: &mut XorShift, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.normal()).collect()
    }

    /// `mm` over `batch` on random operands just long enough: the
    /// column-major call of [`plan`] against [`matmul`] per product.
    fn check(mm: Mm, batch: Batch, seed: u64) {
        let mut rng = XorShift::new(seed);
        let probe = unbounded(&mm, &batch).unwrap();
        let a = random(&mut rng, probe.a_len);
        let b = random(&mut rng, probe.b_len);
        let c0 = random(&mut rng, probe.out_len);
        let p = plan(
            OP,
            &mm,
            &batch,
            whole(a.len()),
            whole(b.len()),
            whole(c0.len()),
        )
        .unwrap();
        assert_eq!(p, probe);
        // The CPU's row-major products, one at a time.
        let mut want = c0.clone();
        for i in 0..batch.count {
            matmul(
                &mut want[i * batch.out..],
                &a[i * batch.a..],
                &b[i * batch.b..],
                mm,
            );
        }
        let mut got = c0.clone();
        if let Some(g) = p.call {
            // What cuBLAS requires of the leading dimensions.
            let (m, n, k) = (g.m, g.n, g.k);
            assert!(
                g.lda >= if g.transa { k } else { m }.max(1),
                "{mm:?}: {g:?}"
            );
            assert!(
                g.ldb >= if g.transb { n } else { k }.max(1),
                "{mm:?}: {g:?}"
            );
            assert!(g.ldc >= m.max(1), "{mm:?}: {g:?}");
            // The call's A is the trait's b.
            col_major(&g, &b, &a, &mut got);
        }
        let scale = want.iter().fold(1.0f32, |m, x| m.max(x.abs()));
        for (i, (x, y)) in got.iter().zip(&want).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * scale,
                "{mm:?} {batch:?}: element {i}: column-major {x} vs matmul {y}"
            );
        }
        // Elements between the outputs' rows and products are untouched.
        let ldc = mm.ldc.max(1);
        let written = |i: usize| {
            (0..batch.count).any(|p| {
                i.checked_sub(p * batch.out)
                    .is_some_and(|r| r / ldc < mm.m && r % ldc < mm.n)
            })
        };
        for (i, (x, y)) in got.iter().zip(&c0).enumerate() {
            if !written(i) {
                assert_eq!(x.to_bits(), y.to_bits(), "{mm:?}: element {i} between rows");
            }
        }
    }

    #[test]
    fn every_transposition_stride_scale_and_accumulation_matches_matmul() {
        let mut seed = 1;
        for (m, n, k) in [(5, 7, 3), (1, 4, 6), (6, 1, 1), (3, 3, 0)] {
            for ta in [false, true] {
                for tb in [false, true] {
                    let mut mm = Mm::new(m, n, k);
                    if ta {
                        mm = mm.ta();
                    }
                    if tb {
                        mm = mm.tb();
                    }
                    // Contiguous, then padded row strides.
                    let padded = mm.ld(mm.lda + 3, mm.ldb + 2, mm.ldc + 5);
                    for mm in [mm, padded] {
                        for (alpha, acc) in [(1.0, false), (0.37, false), (1.0, true), (-2.5, true)]
                        {
                            let mut mm = mm.alpha(alpha);
                            if acc {
                                mm = mm.acc();
                            }
                            seed += 1;
                            check(mm, Batch::ONE, seed);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn attention_products_match_matmul_with_shared_operands() {
        // The trainer's per-head products over the sequences of a batch
        // (heads 4, kv heads 2, head dim 8, sequence 6, 3 sequences).
        let (t, hd, heads, kv, seqs) = (6, 8, 4, 2, 3);
        let (qd, kd) = (heads * hd, kv * hd);
        let mats = heads * t * t;
        let cases = [
            // scores = Q Kᵀ · scale
            (
                Mm::new(t, t, hd).tb().ld(qd, kd, t).alpha(0.35),
                Batch {
                    count: seqs,
                    a: t * qd,
                    b: t * kd,
                    out: mats,
                },
            ),
            // attn = P V
            (
                Mm::new(t, hd, t).ld(t, kd, qd),
                Batch {
                    count: seqs,
                    a: mats,
                    b: t * kd,
                    out: t * qd,
                },
            ),
            // dV += Pᵀ dO
            (
                Mm::new(t, hd, t).ta().ld(t, qd, kd).acc(),
                Batch {
                    count: seqs,
                    a: mats,
                    b: t * qd,
                    out: t * kd,
                },
            ),
            // A weight shared by every product (stride 0), accumulated.
            (
                Mm::new(4, 5, 3).tb().acc().alpha(0.5),
                Batch {
                    count: 3,
                    a: 12,
                    b: 0,
                    out: 20,
                },
            ),
            // Products spaced further apart than their outputs.
            (
                Mm::new(2, 3, 4).ta(),
                Batch {
                    count: 4,
                    a: 9,
                    b: 0,
                    out: 7,
                },
            ),
        ];
        for (i, (mm, batch)) in cases.into_iter().enumerate() {
            check(mm, batch, 100 + i as u64);
            let p = unbounded(&mm, &batch).unwrap();
            let g = p.call.unwrap();
            assert_eq!(
                (g.stride_a, g.stride_b, g.stride_c),
                (batch.b as i64, batch.a as i64, batch.out as i64),
                "the call's A is the trait's b"
            );
            assert_eq!((g.transa, g.transb), (mm.tb, mm.ta));
        }
    }

    #[test]
    fn extents_and_strides_are_checked_naming_the_operand() {
        let mm = Mm::new(4, 5, 3).tb();
        let batch = Batch {
            count: 2,
            a: 12,
            b: 0,
            out: 20,
        };
        let (a, b, c) = (24, 15, 40);
        let ok = plan(OP, &mm, &batch, whole(a), whole(b), whole(c)).unwrap();
        assert_eq!((ok.a_len, ok.b_len, ok.out_len), (24, 15, 40));
        let err = |a: Operand, b: Operand, c: Operand| {
            plan(OP, &mm, &batch, a, b, c).unwrap_err().to_string()
        };
        let e = err(whole(a - 1), whole(b), whole(c));
        assert!(
            e.contains("llama_gemm") && e.contains("operand a spans 24"),
            "{e}"
        );
        let e = err(whole(a), whole(b - 1), whole(c));
        assert!(e.contains("operand b spans 15"), "{e}");
        let late = Operand {
            len: c + 5,
            label: "logits",
            at: 6,
        };
        let e = err(whole(a), whole(b), late);
        assert!(
            e.contains("operand out spans 40 elements from element 6 of buffer \"logits\""),
            "{e}"
        );
        let past = Operand {
            len: 3,
            label: "x",
            at: 9,
        };
        let e = err(past, whole(b), whole(c));
        assert!(e.contains("operand a"), "{e}");
        // Outputs of a batch must not overlap.
        let e = plan(
            OP,
            &mm,
            &Batch { out: 19, ..batch },
            whole(a),
            whole(b),
            whole(100),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("overlap"), "{e}");
        // Row strides below the rows' widths.
        for (bad, what) in [
            (mm.ld(2, 3, 5), "operand a: row stride 2 < its rows' 3"),
            (mm.ld(3, 2, 5), "operand b: row stride 2 < its rows' 3"),
            (mm.ld(3, 3, 4), "operand out: row stride 4 < its rows' 5"),
        ] {
            let e = plan(OP, &bad, &Batch::ONE, whole(100), whole(100), whole(100))
                .unwrap_err()
                .to_string();
            assert!(e.contains(what), "{e}");
        }
        // Extents past the address space.
        let e = unbounded(&Mm::new(3, 2, 2).ld(usize::MAX / 2, 2, 2), &Batch::ONE)
            .unwrap_err()
            .to_string();
        assert!(e.contains("a: 3 pieces") && e.contains("overflow"), "{e}");
        // Sizes past the BLAS's integers.
        let huge = Mm::new(1, 1usize << 31, 1);
        let e = unbounded(&huge, &Batch::ONE).unwrap_err().to_string();
        assert!(e.contains("exceeds the BLAS's i32"), "{e}");
        // No inner dimension: `out = beta · out`, whatever the unread
        // operands' strides.
        check(Mm::new(3, 4, 0).ld(0, 0, 5).acc().alpha(2.0), Batch::ONE, 9);
        check(Mm::new(3, 4, 0).ta().tb().ld(0, 0, 4), Batch::ONE, 10);
        // Nothing to compute: no call, the extents still checked.
        let empty = plan(
            OP,
            &mm,
            &Batch { count: 0, ..batch },
            whole(0),
            whole(0),
            whole(0),
        )
        .unwrap();
        assert_eq!(empty.call, None);
    }
}
