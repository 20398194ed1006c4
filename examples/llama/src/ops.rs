//! Hand-written f32 operators with forward and backward passes.
//!
//! Layout is row-major throughout: activations are `[rows, features]` with
//! `rows = batch * seq` (sequence-major within a batch item), and linear
//! weights are HF-style `[out, in]` so a linear layer computes `y = x Wᵀ`.

use gemm::Parallelism;

/// Shape, transposition, leading dimensions and scaling of one product
/// `out[m, n] = alpha * op(a)[m, k] * op(b)[k, n] + beta * out`.
///
/// Storage is row-major: a non-transposed `a` is `[m, k]` with row stride
/// `lda`; a transposed `a` is stored `[k, m]` (row stride `lda`). Likewise
/// `b` is `[k, n]` or, transposed, `[n, k]`. `out` has row stride `ldc`.
#[derive(Clone, Copy, Debug)]
pub struct Mm {
    /// Rows of the output.
    pub m: usize,
    /// Columns of the output.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// `a` is stored transposed.
    pub ta: bool,
    /// `b` is stored transposed.
    pub tb: bool,
    /// Row stride of `a` as stored.
    pub lda: usize,
    /// Row stride of `b` as stored.
    pub ldb: usize,
    /// Row stride of `out`.
    pub ldc: usize,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of the previous `out` (0: overwrite).
    pub beta: f32,
    /// 0 or 1: single-threaded; more: rayon with that many tasks.
    pub threads: usize,
}

impl Mm {
    /// Dense `out = a * b` with contiguous operands, no transposition.
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        Mm {
            m,
            n,
            k,
            ta: false,
            tb: false,
            lda: k,
            ldb: n,
            ldc: n,
            alpha: 1.0,
            beta: 0.0,
            threads: 1,
        }
    }
    /// `a` is stored transposed (`[k, m]`, contiguous).
    pub fn ta(mut self) -> Self {
        self.ta = true;
        self.lda = self.m;
        self
    }
    /// `b` is stored transposed (`[n, k]`, contiguous).
    pub fn tb(mut self) -> Self {
        self.tb = true;
        self.ldb = self.k;
        self
    }
    /// Explicit row strides.
    pub fn ld(mut self, lda: usize, ldb: usize, ldc: usize) -> Self {
        self.lda = lda;
        self.ldb = ldb;
        self.ldc = ldc;
        self
    }
    /// Accumulate into `out` (`beta = 1`).
    pub fn acc(mut self) -> Self {
        self.beta = 1.0;
        self
    }
    /// Scale the product by `alpha`.
    pub fn alpha(mut self, alpha: f32) -> Self {
        self.alpha = alpha;
        self
    }
    /// Thread count.
    pub fn threads(mut self, threads: usize) -> Self {
        self.threads = threads;
        self
    }
}

fn extent(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * ld + cols
    }
}

/// The one GEMM entry point: `out = alpha * op(a) op(b) + beta * out` (see [`Mm`]).
pub fn matmul(out: &mut [f32], a: &[f32], b: &[f32], p: Mm) {
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
        threads,
    } = p;
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        ldc >= n && out.len() >= extent(m, n, ldc),
        "matmul: out too small"
    );
    if k == 0 {
        for i in 0..m {
            for x in &mut out[i * ldc..i * ldc + n] {
                *x *= beta;
            }
        }
        return;
    }
    // Element (i, p) of op(a) lives at a[i * a_rs + p * a_cs].
    let (a_rs, a_cs) = if ta {
        assert!(
            lda >= m && a.len() >= extent(k, m, lda),
            "matmul: a too small"
        );
        (1, lda)
    } else {
        assert!(
            lda >= k && a.len() >= extent(m, k, lda),
            "matmul: a too small"
        );
        (lda, 1)
    };
    let (b_rs, b_cs) = if tb {
        assert!(
            ldb >= k && b.len() >= extent(n, k, ldb),
            "matmul: b too small"
        );
        (1, ldb)
    } else {
        assert!(
            ldb >= n && b.len() >= extent(k, n, ldb),
            "matmul: b too small"
        );
        (ldb, 1)
    };
    let par = if threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    // gemm computes dst := alpha·dst + beta·lhs·rhs (its names are swapped
    // relative to BLAS); dst is not read at all when read_dst is false.
    // SAFETY: the asserts above guarantee every index reached through the
    // given shapes and strides lies inside the slices; `out` is borrowed
    // mutably and does not alias `a` or `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            ldc as isize,
            beta != 0.0,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            beta,
            alpha,
            false,
            false,
            false,
            par,
        );
    }
}

// ---------------------------------------------------------------- linear

/// `y[rows, out] = x[rows, in] Wᵀ` with `w` `[out, in]`.
pub fn linear_forward(
    x: &[f32],
    w: &[f32],
    rows: usize,
    d_in: usize,
    d_out: usize,
    threads: usize,
) -> Vec<f32> {
    let mut y = vec![0.0; rows * d_out];
    matmul(
        &mut y,
        x,
        w,
        Mm::new(rows, d_out, d_in).tb().threads(threads),
    );
    y
}

/// Backward of [`linear_forward`]: accumulates `dw += dyᵀ x` and returns or
/// accumulates `dx = dy W` (into `dx` when given, `beta = 1`).
pub fn linear_backward(
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    dw: &mut [f32],
    dx: &mut [f32],
    dims: (usize, usize, usize),
    threads: usize,
) {
    let (rows, d_in, d_out) = dims;
    matmul(
        dw,
        dy,
        x,
        Mm::new(d_out, d_in, rows).ta().acc().threads(threads),
    );
    matmul(dx, dy, w, Mm::new(rows, d_in, d_out).acc().threads(threads));
}

/// Panics unless `len` values are whole rows of `width` (`width > 0`).
fn assert_rows(op: &str, len: usize, width: usize) {
    assert!(
        width > 0 && len.is_multiple_of(width),
        "{op}: {len} values are not rows of {width}"
    );
}

/// Adds the bias `b` `[out]` to every row of `y` `[rows, out]`.
pub fn add_bias(y: &mut [f32], b: &[f32]) {
    assert_rows("add_bias", y.len(), b.len());
    for row in y.chunks_exact_mut(b.len()) {
        for (v, bi) in row.iter_mut().zip(b) {
            *v += bi;
        }
    }
}

/// Backward of [`add_bias`]: accumulates the column sums of `dy`
/// `[rows, out]` into `db` `[out]`, rows in order.
pub fn bias_backward(dy: &[f32], db: &mut [f32]) {
    assert_rows("bias_backward", dy.len(), db.len());
    for row in dy.chunks_exact(db.len()) {
        for (g, d) in db.iter_mut().zip(row) {
            *g += d;
        }
    }
}

// ---------------------------------------------------------------- embedding

/// Gathers rows of `table` `[vocab, dim]` for `tokens`.
pub fn embedding_forward(table: &[f32], tokens: &[u32], dim: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(tokens.len() * dim);
    for &t in tokens {
        let t = t as usize;
        out.extend_from_slice(&table[t * dim..(t + 1) * dim]);
    }
    out
}

/// Scatter-adds `dout` `[tokens, dim]` into `dtable` `[vocab, dim]`, rows
/// in order, except the rows of token `pad` (transformers' `padding_idx`:
/// the padding token's embedding gets no gradient from its lookups).
pub fn embedding_backward(
    dout: &[f32],
    tokens: &[u32],
    dim: usize,
    dtable: &mut [f32],
    pad: Option<u32>,
) {
    for (r, &t) in tokens.iter().enumerate() {
        if Some(t) == pad {
            continue;
        }
        let t = t as usize;
        for (g, d) in dtable[t * dim..(t + 1) * dim]
            .iter_mut()
            .zip(&dout[r * dim..(r + 1) * dim])
        {
            *g += d;
        }
    }
}

// ---------------------------------------------------------------- RMSNorm

/// `Σ x²` of `x`, each square and the sum in f64 (the square of an f32 is
/// exact in f64, so only the additions round, at 2^-53).
pub fn sum_sq(x: &[f32]) -> f64 {
    let mut acc = 0.0f64;
    for &v in x {
        let v = f64::from(v);
        acc += v * v;
    }
    acc
}

/// `1 / sqrt(sumsq / d + eps)` in f64, rounded once to f32: the inverse
/// RMS of a row of `d` whose squares add up to `sumsq`.
pub fn rms_inv(sumsq: f64, d: usize, eps: f32) -> f32 {
    (1.0 / (sumsq / d as f64 + f64::from(eps)).sqrt()) as f32
}

/// `y = x / sqrt(mean(x²) + eps) * w` per row; returns `y` and the per-row
/// inverse RMS (the cache). The mean square is summed and the inverse RMS
/// computed in f64 ([`sum_sq`], [`rms_inv`]), then rounded to f32.
pub fn rmsnorm_forward(x: &[f32], w: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let d = w.len();
    let rows = x.len() / d;
    let mut y = vec![0.0; x.len()];
    let mut inv = vec![0.0; rows];
    for r in 0..rows {
        let xr = &x[r * d..(r + 1) * d];
        let s = rms_inv(sum_sq(xr), d, eps);
        inv[r] = s;
        for ((o, xv), wv) in y[r * d..(r + 1) * d].iter_mut().zip(xr).zip(w) {
            *o = xv * s * wv;
        }
    }
    (y, inv)
}

/// Backward of [`rmsnorm_forward`]: accumulates into `dx` and `dw`. The
/// row's `Σ dy·w·x` is summed in f64 ([`rms_bwd_coef`]).
pub fn rmsnorm_backward(
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    inv: &[f32],
    dx: &mut [f32],
    dw: &mut [f32],
) {
    let d = w.len();
    for (r, &s) in inv.iter().enumerate() {
        let xr = &x[r * d..(r + 1) * d];
        let dyr = &dy[r * d..(r + 1) * d];
        let mut dot = 0.0f64;
        for i in 0..d {
            dot += f64::from(dyr[i]) * f64::from(w[i]) * f64::from(xr[i]);
            dw[i] += dyr[i] * xr[i] * s;
        }
        let c = rms_bwd_coef(s, dot, d);
        for (i, o) in dx[r * d..(r + 1) * d].iter_mut().enumerate() {
            *o += s * (dyr[i] * w[i] - xr[i] * c);
        }
    }
}

/// `inv² · dot / d` in f64, rounded once to f32: the coefficient of `x` in
/// the RMSNorm backward of a row of `d` with inverse RMS `inv` and
/// `dot = Σ dy·w·x`.
pub fn rms_bwd_coef(inv: f32, dot: f64, d: usize) -> f32 {
    let s = f64::from(inv);
    (s * s * dot / d as f64) as f32
}

// ---------------------------------------------------------------- RoPE

/// Precomputed rotary tables `[max_seq, head_dim / 2]` (HF-Llama "rotate
/// half" convention: element `i` pairs with `i + head_dim / 2`).
pub struct Rope {
    /// `cos(pos * freq_i)`, `[max_seq, half]`.
    pub cos: Vec<f32>,
    /// `sin(pos * freq_i)`, `[max_seq, half]`.
    pub sin: Vec<f32>,
    /// `head_dim / 2`.
    pub half: usize,
    /// Positions in the tables.
    pub max_seq: usize,
}

impl Rope {
    /// Tables for heads of `head_dim` (even), positions `0..max_seq`, base `theta`.
    pub fn new(head_dim: usize, max_seq: usize, theta: f64) -> Self {
        assert!(head_dim.is_multiple_of(2), "RoPE needs an even head_dim");
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(max_seq * half);
        let mut sin = Vec::with_capacity(max_seq * half);
        for pos in 0..max_seq {
            for i in 0..half {
                let freq = theta.powf(-((2 * i) as f64) / head_dim as f64);
                let a = pos as f64 * freq;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Rope {
            cos,
            sin,
            half,
            max_seq,
        }
    }

    /// Rotates `x` `[batch * seq, n_heads * head_dim]` in place; the position
    /// of row `r` is `r % seq`. `inverse` applies the transposed rotation
    /// (the backward pass).
    fn apply(&self, x: &mut [f32], seq: usize, n_heads: usize, inverse: bool) {
        assert!(seq <= self.max_seq, "sequence longer than max_seq");
        let half = self.half;
        let hd = 2 * half;
        let width = n_heads * hd;
        let sign = if inverse { -1.0 } else { 1.0 };
        for (r, row) in x.chunks_exact_mut(width).enumerate() {
            let pos = r % seq;
            let c = &self.cos[pos * half..(pos + 1) * half];
            let s = &self.sin[pos * half..(pos + 1) * half];
            for head in row.chunks_exact_mut(hd) {
                let (lo, hi) = head.split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (lo[i], hi[i]);
                    let si = sign * s[i];
                    lo[i] = a * c[i] - b * si;
                    hi[i] = b * c[i] + a * si;
                }
            }
        }
    }

    /// Forward rotation, in place.
    pub fn forward(&self, x: &mut [f32], seq: usize, n_heads: usize) {
        self.apply(x, seq, n_heads, false);
    }

    /// Backward: maps the gradient w.r.t. the rotated values to the gradient
    /// w.r.t. the inputs, in place.
    pub fn backward(&self, dx: &mut [f32], seq: usize, n_heads: usize) {
        self.apply(dx, seq, n_heads, true);
    }
}

// ---------------------------------------------------------------- attention

/// Shape of a causal (grouped-query) attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (dividing `n_heads`).
    pub n_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

impl AttnShape {
    fn check(&self) {
        assert!(
            self.n_kv_heads > 0 && self.n_heads.is_multiple_of(self.n_kv_heads),
            "n_kv_heads must divide n_heads"
        );
    }
}

/// Causal softmax in place on `[t, t]` score matrices: row `i` over
/// columns `0..=i`, the rest set to 0. The exponentials are f32, their sum
/// f64; each is scaled by the sum's reciprocal rounded to f32.
pub fn softmax_causal(p: &mut [f32], t: usize) {
    for row_start in (0..p.len()).step_by(t * t) {
        let m = &mut p[row_start..row_start + t * t];
        for i in 0..t {
            let row = &mut m[i * t..(i + 1) * t];
            let max = row_max(&row[..=i]);
            let mut sum = 0.0f64;
            for x in &mut row[..=i] {
                *x = (*x - max).exp();
                sum += f64::from(*x);
            }
            let r = (1.0 / sum) as f32;
            for x in &mut row[..=i] {
                *x *= r;
            }
            for x in &mut row[i + 1..] {
                *x = 0.0;
            }
        }
    }
}

/// Backward of [`softmax_causal`] on `[t, t]` matrices: `ds` holds `dP` on
/// entry and `dS = P ∘ (dP − rowsum(dP ∘ P)) · scale` (0 above the
/// diagonal) on return; the row sum is f64, rounded to f32 once.
pub fn softmax_causal_backward(p: &[f32], ds: &mut [f32], t: usize, scale: f32) {
    for (pm, dm) in p.chunks_exact(t * t).zip(ds.chunks_exact_mut(t * t)) {
        for i in 0..t {
            let pr = &pm[i * t..(i + 1) * t];
            let dr = &mut dm[i * t..(i + 1) * t];
            let dot = pr[..=i]
                .iter()
                .zip(&dr[..=i])
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum::<f64>() as f32;
            for j in 0..t {
                dr[j] = if j <= i {
                    pr[j] * (dr[j] - dot) * scale
                } else {
                    0.0
                };
            }
        }
    }
}

/// Causal softmax attention. `q` `[batch*seq, n_heads*hd]`, `k`, `v`
/// `[batch*seq, n_kv_heads*hd]`; query head `h` reads kv head
/// `h / (n_heads / n_kv_heads)`. Returns the output `[batch*seq, n_heads*hd]`
/// and the probabilities `[batch, n_heads, seq, seq]` (the cache).
pub fn attention_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: AttnShape,
    threads: usize,
) -> (Vec<f32>, Vec<f32>) {
    s.check();
    let AttnShape {
        batch,
        seq: t,
        n_heads,
        n_kv_heads,
        head_dim: hd,
    } = s;
    let (qd, kd) = (n_heads * hd, n_kv_heads * hd);
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0.0; batch * t * qd];
    let mut probs = vec![0.0; batch * n_heads * t * t];
    for b in 0..batch {
        for h in 0..n_heads {
            let g = h / group;
            let qo = b * t * qd + h * hd;
            let ko = b * t * kd + g * hd;
            let p = &mut probs[(b * n_heads + h) * t * t..(b * n_heads + h + 1) * t * t];
            let mm = Mm::new(t, t, hd)
                .tb()
                .ld(qd, kd, t)
                .alpha(scale)
                .threads(threads);
            matmul(p, &q[qo..], &k[ko..], mm);
            softmax_causal(p, t);
            let mm = Mm::new(t, hd, t).ld(t, kd, qd).threads(threads);
            matmul(&mut out[qo..], p, &v[ko..], mm);
        }
    }
    (out, probs)
}

/// Backward of [`attention_forward`]: returns `(dq, dk, dv)`.
pub fn attention_backward(
    dout: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    probs: &[f32],
    s: AttnShape,
    threads: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    s.check();
    let AttnShape {
        batch,
        seq: t,
        n_heads,
        n_kv_heads,
        head_dim: hd,
    } = s;
    let (qd, kd) = (n_heads * hd, n_kv_heads * hd);
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut dq = vec![0.0; q.len()];
    let mut dk = vec![0.0; k.len()];
    let mut dv = vec![0.0; v.len()];
    let mut ds = vec![0.0; t * t];
    for b in 0..batch {
        for h in 0..n_heads {
            let g = h / group;
            let qo = b * t * qd + h * hd;
            let ko = b * t * kd + g * hd;
            let p = &probs[(b * n_heads + h) * t * t..(b * n_heads + h + 1) * t * t];
            // dP = dO Vᵀ
            matmul(
                &mut ds,
                &dout[qo..],
                &v[ko..],
                Mm::new(t, t, hd).tb().ld(qd, kd, t).threads(threads),
            );
            // dV += Pᵀ dO
            matmul(
                &mut dv[ko..],
                p,
                &dout[qo..],
                Mm::new(t, hd, t).ta().ld(t, qd, kd).acc().threads(threads),
            );
            softmax_causal_backward(p, &mut ds, t, scale);
            // dQ = dS K, dK += dSᵀ Q
            matmul(
                &mut dq[qo..],
                &ds,
                &k[ko..],
                Mm::new(t, hd, t).ld(t, kd, qd).threads(threads),
            );
            matmul(
                &mut dk[ko..],
                &ds,
                &q[qo..],
                Mm::new(t, hd, t).ta().ld(t, qd, kd).acc().threads(threads),
            );
        }
    }
    (dq, dk, dv)
}

// ---------------------------------------------------------------- SwiGLU

/// The logistic function `1 / (1 + e^-z)`.
pub fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// `silu(h1) ∘ h3`, elementwise.
pub fn swiglu_act(h1: &[f32], h3: &[f32]) -> Vec<f32> {
    h1.iter()
        .zip(h3)
        .map(|(&z, &u)| z * sigmoid(z) * u)
        .collect()
}

/// Backward of [`swiglu_act`]: writes `dh1` and `dh3` for the output
/// gradient `da`.
pub fn swiglu_act_backward(da: &[f32], h1: &[f32], h3: &[f32], dh1: &mut [f32], dh3: &mut [f32]) {
    for i in 0..da.len() {
        let z = h1[i];
        let sg = sigmoid(z);
        dh3[i] = da[i] * z * sg;
        dh1[i] = da[i] * h3[i] * sg * (1.0 + z * (1.0 - sg));
    }
}

/// Activations kept by [`swiglu_forward`].
pub struct SwigluCache {
    /// The gate projection `x W1ᵀ`.
    pub h1: Vec<f32>,
    /// The up projection `x W3ᵀ`.
    pub h3: Vec<f32>,
    /// `silu(h1) ∘ h3`, the input of the down projection.
    pub a: Vec<f32>,
}

/// `y = (silu(x W1ᵀ) ∘ x W3ᵀ) W2ᵀ`; `w1`, `w3` `[hidden, dim]`, `w2` `[dim, hidden]`.
pub fn swiglu_forward(
    x: &[f32],
    w1: &[f32],
    w3: &[f32],
    w2: &[f32],
    dim: usize,
    hidden: usize,
    threads: usize,
) -> (Vec<f32>, SwigluCache) {
    let rows = x.len() / dim;
    let h1 = linear_forward(x, w1, rows, dim, hidden, threads);
    let h3 = linear_forward(x, w3, rows, dim, hidden, threads);
    let a = swiglu_act(&h1, &h3);
    let y = linear_forward(&a, w2, rows, hidden, dim, threads);
    (y, SwigluCache { h1, h3, a })
}

/// Gradients of the three SwiGLU weights.
pub struct SwigluGrads {
    /// Gradient of the gate projection.
    pub w1: Vec<f32>,
    /// Gradient of the up projection.
    pub w3: Vec<f32>,
    /// Gradient of the down projection.
    pub w2: Vec<f32>,
}

/// Backward of [`swiglu_forward`]: accumulates into `dx`, returns weight grads.
#[allow(clippy::too_many_arguments)]
pub fn swiglu_backward(
    dy: &[f32],
    x: &[f32],
    c: &SwigluCache,
    w1: &[f32],
    w3: &[f32],
    w2: &[f32],
    dx: &mut [f32],
    dims: (usize, usize),
    threads: usize,
) -> SwigluGrads {
    let (dim, hidden) = dims;
    let rows = x.len() / dim;
    let mut g = SwigluGrads {
        w1: vec![0.0; w1.len()],
        w3: vec![0.0; w3.len()],
        w2: vec![0.0; w2.len()],
    };
    let mut da = vec![0.0; rows * hidden];
    linear_backward(
        dy,
        &c.a,
        w2,
        &mut g.w2,
        &mut da,
        (rows, hidden, dim),
        threads,
    );
    let mut dh1 = vec![0.0; rows * hidden];
    let mut dh3 = vec![0.0; rows * hidden];
    swiglu_act_backward(&da, &c.h1, &c.h3, &mut dh1, &mut dh3);
    linear_backward(&dh1, x, w1, &mut g.w1, dx, (rows, dim, hidden), threads);
    linear_backward(&dh3, x, w3, &mut g.w3, dx, (rows, dim, hidden), threads);
    g
}

// ---------------------------------------------------------------- loss

/// Targets below zero (HF uses -100) are ignored.
pub const IGNORE_INDEX: i32 = -100;

/// The largest value of `row` (-inf when empty).
fn row_max(row: &[f32]) -> f32 {
    row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x))
}

/// `(max, Σ exp(x - max))` of `row`: each exponential in f32, their sum in
/// f64, so that at a vocabulary of 150k the small terms are not lost (an f32
/// running sum of 150k terms reads low by up to ~1e-3 relative).
pub fn max_and_exp_sum(row: &[f32]) -> (f32, f64) {
    let max = row_max(row);
    let sum = row.iter().map(|&x| f64::from((x - max).exp())).sum();
    (max, sum)
}

/// Mean cross-entropy over non-ignored rows of `logits` `[rows, vocab]`.
/// Returns `(loss, dlogits)` where `dlogits` is the gradient of the loss
/// (a loss of 0 and zero gradient when every row is ignored).
///
/// Per row: `ln Σ exp(x - max)` is computed in f64 ([`max_and_exp_sum`]);
/// the row's loss `max - x[target] + ln Σ` in f64 (the mean over rows too);
/// the gradient `exp((x - max) - ln Σ) / rows` with `ln Σ` rounded to f32.
pub fn cross_entropy(logits: &[f32], targets: &[i32], vocab: usize) -> (f32, Vec<f32>) {
    assert_eq!(logits.len(), targets.len() * vocab);
    let count = targets.iter().filter(|&&t| t >= 0).count();
    let mut grad = vec![0.0; logits.len()];
    if count == 0 {
        return (0.0, grad);
    }
    let inv = 1.0 / count as f32;
    let mut loss = 0.0f64;
    for (r, &t) in targets.iter().enumerate() {
        if t < 0 {
            continue;
        }
        let t = t as usize;
        assert!(t < vocab, "target out of range");
        let row = &logits[r * vocab..(r + 1) * vocab];
        let (max, sum) = max_and_exp_sum(row);
        let ln_sum = sum.ln();
        loss += f64::from(max) - f64::from(row[t]) + ln_sum;
        let ln_sum = ln_sum as f32;
        let gr = &mut grad[r * vocab..(r + 1) * vocab];
        for (g, &x) in gr.iter_mut().zip(row) {
            *g = ((x - max) - ln_sum).exp() * inv;
        }
        gr[t] -= inv;
    }
    ((loss / count as f64) as f32, grad)
}
