//! Checks of the CPU Llama core in `zero_llama`: every operator's
//! backward against central finite differences, one full block, and a tiny
//! model that overfits one batch.

use llama::lora::{self, LoraConfig};
use llama::ops::*;
use llama::{Block, BlockLora, BlockParams, Config, Model, XorShift};
use zero_llama as llama;

/// Perturbation of the per-operator checks.
const H: f32 = 1e-3;
/// Perturbation of the composite (block, model) checks: their f32 forward
/// passes are long enough that rounding noise in the loss difference,
/// divided by 2h, reaches ~4e-3 at h = 1e-3; the truncation error
/// (h^2/6 times the third derivative) is still far below tolerance here.
const H_COMPOSITE: f32 = 3e-3;
const RTOL: f64 = 1e-2;
const ATOL: f64 = 2e-3;

fn randv(rng: &mut XorShift, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| scale * rng.normal()).collect()
}

/// Projects an output onto fixed weights, accumulating in f64: a scalar loss.
fn dot64(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// Compares `analytic` against central differences at up to `sample`
/// indices; `eval(i, d)` is the loss with element `i` shifted by `d`.
fn check(
    name: &str,
    analytic: &[f32],
    sample: usize,
    seed: u64,
    eval: impl FnMut(usize, f32) -> f64,
) {
    check_h(name, analytic, sample, seed, H, eval)
}

/// [`check`] with perturbation `h`.
fn check_h(
    name: &str,
    analytic: &[f32],
    sample: usize,
    seed: u64,
    h: f32,
    mut eval: impl FnMut(usize, f32) -> f64,
) {
    let n = analytic.len();
    let idx: Vec<usize> = if n <= sample {
        (0..n).collect()
    } else {
        let mut rng = XorShift::new(seed);
        (0..sample).map(|_| rng.below(n)).collect()
    };
    let (mut err2, mut ref2) = (0.0f64, 0.0f64);
    for &i in &idx {
        let num = (eval(i, h) - eval(i, -h)) / (2.0 * h as f64);
        let a = analytic[i] as f64;
        let err = (a - num).abs();
        assert!(
            err <= RTOL * a.abs().max(num.abs()) + ATOL,
            "{name}[{i}]: analytic {a:.6e} vs numeric {num:.6e}"
        );
        err2 += err * err;
        ref2 += num * num;
    }
    assert!(
        ref2 > 0.0 || err2 == 0.0,
        "{name}: all-zero gradient sample"
    );
    let rel = (err2 / ref2.max(1e-30)).sqrt();
    assert!(rel < RTOL, "{name}: relative error {rel:.3e}");
}

fn naive(a: &[f32], b: &[f32], p: Mm, out: &mut [f32]) {
    for i in 0..p.m {
        for j in 0..p.n {
            let mut s = 0.0f64;
            for k in 0..p.k {
                let av = if p.ta {
                    a[k * p.lda + i]
                } else {
                    a[i * p.lda + k]
                };
                let bv = if p.tb {
                    b[j * p.ldb + k]
                } else {
                    b[k * p.ldb + j]
                };
                s += av as f64 * bv as f64;
            }
            let o = &mut out[i * p.ldc + j];
            *o = p.alpha * s as f32 + if p.beta == 0.0 { 0.0 } else { p.beta * *o };
        }
    }
}

#[test]
fn matmul_matches_naive() {
    let mut rng = XorShift::new(1);
    let (m, n, k) = (37, 29, 45);
    for threads in [1, 2] {
        for ta in [false, true] {
            for tb in [false, true] {
                for beta in [0.0, 1.0, 0.5] {
                    let (ar, ac) = if ta { (k, m) } else { (m, k) };
                    let (br, bc) = if tb { (n, k) } else { (k, n) };
                    let (lda, ldb, ldc) = (ac + 3, bc + 1, n + 2);
                    let a = randv(&mut rng, ar * lda, 1.0);
                    let b = randv(&mut rng, br * ldb, 1.0);
                    let c0 = randv(&mut rng, m * ldc, 1.0);
                    let mut p = Mm::new(m, n, k)
                        .ld(lda, ldb, ldc)
                        .alpha(0.7)
                        .threads(threads);
                    p.ta = ta;
                    p.tb = tb;
                    p.beta = beta;
                    let mut got = c0.clone();
                    matmul(&mut got, &a, &b, p);
                    let mut want = c0.clone();
                    naive(&a, &b, p, &mut want);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() < 1e-4 * (1.0 + w.abs()),
                            "ta={ta} tb={tb} beta={beta} [{i}] {g} vs {w}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn linear_grad() {
    let mut rng = XorShift::new(2);
    let (rows, di, dout) = (6, 7, 5);
    let x = randv(&mut rng, rows * di, 1.0);
    let w = randv(&mut rng, dout * di, 0.5);
    let r = randv(&mut rng, rows * dout, 1.0);
    let loss = |x: &[f32], w: &[f32]| dot64(&linear_forward(x, w, rows, di, dout, 1), &r);
    let (mut dw, mut dx) = (vec![0.0; w.len()], vec![0.0; x.len()]);
    linear_backward(&r, &x, &w, &mut dw, &mut dx, (rows, di, dout), 1);
    check("linear.dx", &dx, 100, 1, |i, d| {
        let mut x = x.clone();
        x[i] += d;
        loss(&x, &w)
    });
    check("linear.dw", &dw, 100, 2, |i, d| {
        let mut w = w.clone();
        w[i] += d;
        loss(&x, &w)
    });
}

#[test]
fn embedding_grad() {
    let mut rng = XorShift::new(3);
    let (vocab, dim) = (11, 6);
    let tokens = [3u32, 7, 3, 0, 10, 3, 7];
    let table = randv(&mut rng, vocab * dim, 1.0);
    let r = randv(&mut rng, tokens.len() * dim, 1.0);
    let out = embedding_forward(&table, &tokens, dim);
    assert_eq!(&out[dim..2 * dim], &table[7 * dim..8 * dim]);
    let mut dt = vec![0.0; table.len()];
    embedding_backward(&r, &tokens, dim, &mut dt, None);
    check("embedding.dtable", &dt, 1000, 3, |i, d| {
        let mut t = table.clone();
        t[i] += d;
        dot64(&embedding_forward(&t, &tokens, dim), &r)
    });
    // Padding token 3 (transformers' padding_idx): its row keeps what it
    // held, every other row gets the same gradient as without padding.
    let mut padded = vec![0.0; table.len()];
    padded[3 * dim..4 * dim].fill(0.5);
    embedding_backward(&r, &tokens, dim, &mut padded, Some(3));
    for (i, (&p, &g)) in padded.iter().zip(&dt).enumerate() {
        let want = if i / dim == 3 { 0.5 } else { g };
        assert_eq!(p, want, "element {i}");
    }
    // A padding token absent from the batch changes nothing.
    let mut absent = vec![0.0; table.len()];
    embedding_backward(&r, &tokens, dim, &mut absent, Some(5));
    assert_eq!(absent, dt);
}

#[test]
fn rmsnorm_grad() {
    let mut rng = XorShift::new(4);
    let (rows, dim) = (5, 12);
    let x = randv(&mut rng, rows * dim, 1.0);
    let w: Vec<f32> = (0..dim).map(|_| 1.0 + 0.3 * rng.normal()).collect();
    let r = randv(&mut rng, rows * dim, 1.0);
    let eps = 1e-5;
    let (y, inv) = rmsnorm_forward(&x, &w, eps);
    // Output rows have mean square ≈ mean(w²) when w is the only scale.
    let ms: f32 = (0..dim).map(|i| (y[i] / w[i]).powi(2)).sum::<f32>() / dim as f32;
    assert!((ms - 1.0).abs() < 1e-3);
    let (mut dx, mut dw) = (vec![0.0; x.len()], vec![0.0; dim]);
    rmsnorm_backward(&r, &x, &w, &inv, &mut dx, &mut dw);
    check("rmsnorm.dx", &dx, 100, 4, |i, d| {
        let mut x = x.clone();
        x[i] += d;
        dot64(&rmsnorm_forward(&x, &w, eps).0, &r)
    });
    check("rmsnorm.dw", &dw, 100, 5, |i, d| {
        let mut w = w.clone();
        w[i] += d;
        dot64(&rmsnorm_forward(&x, &w, eps).0, &r)
    });
}

#[test]
fn rope_grad_and_properties() {
    let mut rng = XorShift::new(5);
    let (batch, seq, heads, hd) = (2, 6, 3, 8);
    let rope = Rope::new(hd, 16, 10000.0);
    let x = randv(&mut rng, batch * seq * heads * hd, 1.0);
    let r = randv(&mut rng, x.len(), 1.0);
    let fwd = |x: &[f32]| {
        let mut y = x.to_vec();
        rope.forward(&mut y, seq, heads);
        y
    };
    let y = fwd(&x);
    // Position 0 is the identity; rotation preserves each row's norm.
    assert_eq!(&y[..heads * hd], &x[..heads * hd]);
    let n2 = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
    assert!((n2(&y) - n2(&x)).abs() < 1e-3 * n2(&x));
    // Relative position: <rope(q, m), rope(k, n)> depends only on m - n.
    let rot = |v: &[f32], pos: usize| {
        let mut buf = vec![0.0; (pos + 1) * hd];
        buf[pos * hd..].copy_from_slice(v);
        rope.forward(&mut buf, pos + 1, 1);
        buf[pos * hd..].to_vec()
    };
    let (q, k) = (randv(&mut rng, hd, 1.0), randv(&mut rng, hd, 1.0));
    let d1: f32 = rot(&q, 5).iter().zip(rot(&k, 2)).map(|(a, b)| a * b).sum();
    let d2: f32 = rot(&q, 9).iter().zip(rot(&k, 6)).map(|(a, b)| a * b).sum();
    assert!((d1 - d2).abs() < 1e-4, "{d1} vs {d2}");
    let mut dx = r.clone();
    rope.backward(&mut dx, seq, heads);
    check("rope.dx", &dx, 200, 6, |i, d| {
        let mut x = x.clone();
        x[i] += d;
        dot64(&fwd(&x), &r)
    });
}

fn attention_case(n_heads: usize, n_kv_heads: usize, seed: u64) {
    let mut rng = XorShift::new(seed);
    let s = AttnShape {
        batch: 2,
        seq: 5,
        n_heads,
        n_kv_heads,
        head_dim: 4,
    };
    let rows = s.batch * s.seq;
    let q = randv(&mut rng, rows * n_heads * 4, 1.0);
    let k = randv(&mut rng, rows * n_kv_heads * 4, 1.0);
    let v = randv(&mut rng, rows * n_kv_heads * 4, 1.0);
    let r = randv(&mut rng, rows * n_heads * 4, 1.0);
    let (out, probs) = attention_forward(&q, &k, &v, s, 1);
    // Row 0 of each sequence attends only to itself: output = v of its kv head.
    let group = n_heads / n_kv_heads;
    for h in 0..n_heads {
        for e in 0..4 {
            let want = v[(h / group) * 4 + e];
            assert!((out[h * 4 + e] - want).abs() < 1e-5);
        }
    }
    // Probabilities: rows sum to one, zero above the diagonal.
    for (ri, row) in probs.chunks(s.seq).enumerate() {
        let i = ri % s.seq;
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        assert!(row[i + 1..].iter().all(|&p| p == 0.0));
    }
    // Causality: changing the last position's k/v leaves earlier outputs alone.
    let mut k2 = k.clone();
    let mut v2 = v.clone();
    let kd = n_kv_heads * 4;
    for e in 0..kd {
        k2[(s.seq - 1) * kd + e] += 1.0;
        v2[(s.seq - 1) * kd + e] += 1.0;
    }
    let (out2, _) = attention_forward(&q, &k2, &v2, s, 1);
    let qd = n_heads * 4;
    assert_eq!(&out2[..(s.seq - 1) * qd], &out[..(s.seq - 1) * qd]);
    // Large logits stay finite (stable softmax).
    let big: Vec<f32> = q.iter().map(|x| x * 1e4).collect();
    let (ob, _) = attention_forward(&big, &k, &v, s, 1);
    assert!(ob.iter().all(|x| x.is_finite()));

    let (dq, dk, dv) = attention_backward(&r, &q, &k, &v, &probs, s, 1);
    let loss = |q: &[f32], k: &[f32], v: &[f32]| dot64(&attention_forward(q, k, v, s, 1).0, &r);
    check("attn.dq", &dq, 80, seed, |i, d| {
        let mut q = q.clone();
        q[i] += d;
        loss(&q, &k, &v)
    });
    check("attn.dk", &dk, 80, seed + 1, |i, d| {
        let mut k = k.clone();
        k[i] += d;
        loss(&q, &k, &v)
    });
    check("attn.dv", &dv, 80, seed + 2, |i, d| {
        let mut v = v.clone();
        v[i] += d;
        loss(&q, &k, &v)
    });
}

#[test]
fn attention_grad_mha() {
    attention_case(2, 2, 10);
}

#[test]
fn attention_grad_gqa() {
    attention_case(4, 2, 20);
    attention_case(4, 1, 30);
}

#[test]
fn swiglu_grad() {
    let mut rng = XorShift::new(6);
    let (rows, dim, hidden) = (4, 6, 10);
    let x = randv(&mut rng, rows * dim, 1.0);
    let w1 = randv(&mut rng, hidden * dim, 0.5);
    let w3 = randv(&mut rng, hidden * dim, 0.5);
    let w2 = randv(&mut rng, dim * hidden, 0.5);
    let r = randv(&mut rng, rows * dim, 1.0);
    let loss = |x: &[f32], w1: &[f32], w3: &[f32], w2: &[f32]| {
        dot64(&swiglu_forward(x, w1, w3, w2, dim, hidden, 1).0, &r)
    };
    let (_, cache) = swiglu_forward(&x, &w1, &w3, &w2, dim, hidden, 1);
    let mut dx = vec![0.0; x.len()];
    let g = swiglu_backward(&r, &x, &cache, &w1, &w3, &w2, &mut dx, (dim, hidden), 1);
    check("swiglu.dx", &dx, 100, 1, |i, d| {
        let mut x = x.clone();
        x[i] += d;
        loss(&x, &w1, &w3, &w2)
    });
    check("swiglu.dw1", &g.w1, 100, 2, |i, d| {
        let mut w = w1.clone();
        w[i] += d;
        loss(&x, &w, &w3, &w2)
    });
    check("swiglu.dw3", &g.w3, 100, 3, |i, d| {
        let mut w = w3.clone();
        w[i] += d;
        loss(&x, &w1, &w, &w2)
    });
    check("swiglu.dw2", &g.w2, 100, 4, |i, d| {
        let mut w = w2.clone();
        w[i] += d;
        loss(&x, &w1, &w3, &w)
    });
}

#[test]
fn cross_entropy_grad_and_ignore() {
    let mut rng = XorShift::new(7);
    let vocab = 9;
    let targets = [3, IGNORE_INDEX, 0, 8, IGNORE_INDEX, 5];
    let logits = randv(&mut rng, targets.len() * vocab, 2.0);
    let (loss, grad) = cross_entropy(&logits, &targets, vocab);
    // Reference: mean of -log softmax over the 4 kept rows, in f64.
    let mut want = 0.0f64;
    for (r, &t) in targets.iter().enumerate() {
        if t >= 0 {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let lse = row.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
            want += lse - row[t as usize] as f64;
        }
    }
    want /= 4.0;
    assert!((loss as f64 - want).abs() < 1e-5, "{loss} vs {want}");
    // Ignored rows get no gradient; kept rows' gradients sum to zero.
    assert!(grad[vocab..2 * vocab].iter().all(|&g| g == 0.0));
    assert!(grad[..vocab].iter().sum::<f32>().abs() < 1e-6);
    check("xent.dlogits", &grad, 100, 7, |i, d| {
        let mut l = logits.clone();
        l[i] += d;
        cross_entropy(&l, &targets, vocab).0 as f64
    });
    // Huge logits stay finite; all-ignored gives zero.
    let big: Vec<f32> = logits.iter().map(|x| x * 1e4).collect();
    assert!(cross_entropy(&big, &targets, vocab).0.is_finite());
    assert_eq!(cross_entropy(&logits, &[IGNORE_INDEX; 6], vocab).0, 0.0);
}

fn block_cfg() -> Config {
    Config {
        vocab: 13,
        dim: 16,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        hidden: 24,
        max_seq: 8,
        ..Config::tiny()
    }
}

#[test]
fn block_grad() {
    check_block_grad(block_cfg());
}

/// Qwen2's block: q/k/v biases (12 tensors), their gradients the column
/// sums of the projections' output gradients before RoPE.
#[test]
fn block_grad_with_qkv_bias() {
    check_block_grad(Config {
        qkv_bias: true,
        ..block_cfg()
    });
}

/// The block's input and parameter gradients of `cfg` against finite
/// differences (biases, when present, random and nonzero).
fn check_block_grad(cfg: Config) {
    let block = Block::new(cfg, 1);
    let (batch, seq) = (2, 5);
    let mut rng = XorShift::new(8);
    let infos = llama::block_tensors(&cfg, 0);
    assert_eq!(infos.len(), cfg.block_len());
    let params: Vec<Vec<f32>> = infos
        .iter()
        .map(|t| match t.kind {
            llama::Kind::Norm => (0..t.numel()).map(|_| 1.0 + 0.2 * rng.normal()).collect(),
            _ => randv(&mut rng, t.numel(), 0.3),
        })
        .collect();
    let x = randv(&mut rng, batch * seq * cfg.dim, 1.0);
    let r = randv(&mut rng, x.len(), 1.0);
    let loss = |ps: &[Vec<f32>], x: &[f32]| {
        let sl: Vec<&[f32]> = ps.iter().map(Vec::as_slice).collect();
        dot64(
            &block
                .forward(&BlockParams::from_slices(&sl), x, batch, seq)
                .y,
            &r,
        )
    };
    let sl: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
    let p = BlockParams::from_slices(&sl);
    let cache = block.forward(&p, &x, batch, seq);
    let (dx, grads) = block.backward(&p, &cache, &r);
    check_h("block.dx", &dx, 60, 100, H_COMPOSITE, |i, d| {
        let mut x = x.clone();
        x[i] += d;
        loss(&params, &x)
    });
    for (t, (info, g)) in infos.iter().zip(grads.into_vec()).enumerate() {
        assert_eq!(g.len(), info.numel());
        check_h(&info.name, &g, 40, 200 + t as u64, H_COMPOSITE, |i, d| {
            let mut ps = params.clone();
            ps[t][i] += d;
            loss(&ps, &x)
        });
    }
}

#[test]
fn model_grad_embedding_and_head() {
    // The whole-model backward (embedding scatter, final norm, head, loss)
    // against finite differences on a few tensors. Weights are scaled to
    // std 0.1 (norms to 5) so attention is neither uniform nor saturated and
    // every checked gradient stands well above the f32 noise of the loss.
    let cfg = block_cfg();
    let model = Model::new(cfg, 1);
    let params: Vec<Vec<f32>> = llama::init_params(&cfg, 9)
        .into_iter()
        .map(|v| v.into_iter().map(|x| x * 5.0).collect())
        .collect();
    let n = params.len();
    check_model_grad(&model, &params, &[0, 1, 9, n - 2, n - 1], 300);
}

/// [`Model::backward`] for tensors `checked` of `params` against finite
/// differences of the whole-model loss on a fixed batch of 2 × 4 tokens.
fn check_model_grad(model: &Model, params: &[Vec<f32>], checked: &[usize], seed: u64) {
    let (batch, seq) = (2, 4);
    let tokens = [1u32, 5, 5, 12, 0, 3, 7, 1];
    let targets = [5, 5, 12, IGNORE_INDEX, 3, 7, 1, 2];
    let loss = |ps: &[Vec<f32>]| {
        let sl: Vec<&[f32]> = ps.iter().map(Vec::as_slice).collect();
        model.forward(&sl, &tokens, &targets, batch, seq).0 as f64
    };
    let sl: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
    let (_, cache) = model.forward(&sl, &tokens, &targets, batch, seq);
    let grads = model.backward(&sl, &cache);
    for &t in checked {
        check(
            &format!("model[{t}]"),
            &grads[t],
            40,
            seed + t as u64,
            |i, d| {
                let mut ps = params.to_vec();
                ps[t][i] += d;
                loss(&ps)
            },
        );
    }
}

/// Tied embeddings and q/k/v biases: the embedding's gradient (lookup and
/// LM head summed), a layer's biases, the last layer's q weight and the
/// final norm against finite differences.
#[test]
fn model_grad_tied_embeddings_and_biases() {
    let cfg = Config {
        qkv_bias: true,
        tie_embeddings: true,
        ..block_cfg()
    };
    let model = Model::new(cfg, 1);
    let mut rng = XorShift::new(21);
    let params: Vec<Vec<f32>> = llama::tensors(&cfg)
        .iter()
        .map(|t| match t.kind {
            llama::Kind::Norm => (0..t.numel()).map(|_| 5.0 + rng.normal()).collect(),
            _ => randv(&mut rng, t.numel(), 0.1),
        })
        .collect();
    assert_eq!(params.len(), cfg.tensor_count());
    assert_eq!(cfg.head_index(), 0);
    let l1 = cfg.layer_range(1);
    let checked = [0, 10, 11, 12, l1.start, l1.end - 3, cfg.norm_index()];
    check_model_grad(&model, &params, &checked, 500);
}

#[test]
fn tensor_list_with_biases_and_tied_embeddings() {
    let cfg = Config {
        qkv_bias: true,
        tie_embeddings: true,
        ..Config::tiny()
    };
    let t = llama::tensors(&cfg);
    assert_eq!(t.len(), 2 + 12 * cfg.n_layers);
    assert_eq!(t.len(), cfg.tensor_count());
    assert_eq!(t[10].name, "model.layers.0.self_attn.q_proj.bias");
    assert_eq!(t[10].shape, vec![64]);
    assert_eq!(t[11].shape, vec![32]); // k_proj.bias: 2 kv heads × 16
    assert_eq!(t[12].name, "model.layers.0.self_attn.v_proj.bias");
    assert_eq!(t[13].name, "model.layers.1.self_attn.q_proj.weight");
    assert_eq!(t[t.len() - 1].name, "model.norm.weight");
    assert_eq!(cfg.norm_index(), t.len() - 1);
    assert!(t.iter().all(|x| x.name != "lm_head.weight"));
    let untied = Config::tiny();
    assert_eq!(
        llama::param_count(&cfg),
        llama::param_count(&untied) - 256 * 64 + 2 * (64 + 32 + 32)
    );
}

#[test]
fn tensor_list_and_count() {
    let cfg = Config::tiny();
    let t = llama::tensors(&cfg);
    assert_eq!(t.len(), 3 + 9 * cfg.n_layers);
    assert_eq!(t[0].name, "model.embed_tokens.weight");
    assert_eq!(t[1].name, "model.layers.0.self_attn.q_proj.weight");
    assert_eq!(t[2].shape, vec![32, 64]); // k_proj: 2 kv heads × 16
    assert_eq!(t[7].name, "model.layers.0.mlp.down_proj.weight");
    assert_eq!(t[7].shape, vec![64, 172]);
    assert_eq!(t[t.len() - 2].name, "model.norm.weight");
    assert_eq!(t[t.len() - 1].name, "lm_head.weight");
    let per_layer = 64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 172 + 2 * 64;
    assert_eq!(llama::param_count(&cfg), 2 * 256 * 64 + 64 + 2 * per_layer);
    let s = Config::small();
    s.validate();
    assert_eq!(llama::tensors(&s).len(), 3 + 9 * s.n_layers);
}

#[test]
fn tiny_model_overfits_one_batch() {
    let cfg = Config {
        vocab: 64,
        max_seq: 32,
        ..Config::tiny()
    };
    let model = Model::new(cfg, 1);
    let (batch, seq) = (2, 16);
    let mut rng = XorShift::new(42);
    let tokens: Vec<u32> = (0..batch * seq)
        .map(|_| rng.below(cfg.vocab) as u32)
        .collect();
    // Next-token targets; the first 3 positions act as an ignored prompt and
    // the last position has no next token.
    let targets: Vec<i32> = (0..batch * seq)
        .map(|r| {
            if r % seq < 3 || r % seq == seq - 1 {
                IGNORE_INDEX
            } else {
                tokens[r + 1] as i32
            }
        })
        .collect();
    let mut params = llama::init_params(&cfg, 7);
    let mut m: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    let mut v = m.clone();
    let (lr, b1, b2, eps) = (1e-2f32, 0.9f32, 0.999f32, 1e-8f32);
    let start = std::time::Instant::now();
    let mut first = 0.0;
    let mut last = f32::INFINITY;
    let mut steps = 0;
    for step in 1..=300 {
        let sl: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
        let (loss, cache) = model.forward(&sl, &tokens, &targets, batch, seq);
        if step == 1 {
            first = loss;
        }
        last = loss;
        steps = step;
        if loss < 0.05 {
            break;
        }
        let grads = model.backward(&sl, &cache);
        let (c1, c2) = (1.0 - b1.powi(step), 1.0 - b2.powi(step));
        for (((p, g), m), v) in params.iter_mut().zip(&grads).zip(&mut m).zip(&mut v) {
            for i in 0..p.len() {
                m[i] = b1 * m[i] + (1.0 - b1) * g[i];
                v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
                p[i] -= lr * (m[i] / c1) / ((v[i] / c2).sqrt() + eps);
            }
        }
    }
    eprintln!(
        "overfit: loss {first:.4} -> {last:.4} in {steps} steps, {:?}",
        start.elapsed()
    );
    // Start near ln(64) ≈ 4.16 (uniform prediction); < 0.05 means the
    // model puts ~95% probability on every memorized next token.
    assert!(
        (first - (cfg.vocab as f32).ln()).abs() < 0.3,
        "initial loss {first}"
    );
    assert!(last < 0.05, "loss only reached {last} after {steps} steps");
}

/// LoRA on all seven projections, rank 2, dropout 0.25 (the masks fixed
/// by their key), non-zero random A and B.
fn lora_cfg() -> LoraConfig {
    let all: Vec<&str> = lora::TARGETS.iter().map(|t| t.0).collect();
    LoraConfig::new(2, 3.0, 0.25, &all).unwrap()
}

/// Random adapters for layer `layer` (A and B non-zero).
fn lora_values(cfg: &Config, l: &LoraConfig, layer: usize, rng: &mut XorShift) -> Vec<Vec<f32>> {
    lora::lora_tensors(cfg, l, layer)
        .iter()
        .map(|t| randv(rng, t.numel(), 0.3))
        .collect()
}

/// A block with adapters (and q/k/v biases): the input gradient and every
/// adapter's gradient against finite differences; the base's gradients
/// are not computed (frozen).
#[test]
fn block_grad_with_lora() {
    let cfg = Config {
        qkv_bias: true,
        ..block_cfg()
    };
    let lc = lora_cfg();
    let block = Block::new(cfg, 1);
    let (batch, seq) = (2, 5);
    let mut rng = XorShift::new(18);
    let base: Vec<Vec<f32>> = llama::block_tensors(&cfg, 0)
        .iter()
        .map(|t| match t.kind {
            llama::Kind::Norm => (0..t.numel()).map(|_| 1.0 + 0.2 * rng.normal()).collect(),
            _ => randv(&mut rng, t.numel(), 0.3),
        })
        .collect();
    let ad = lora_values(&cfg, &lc, 0, &mut rng);
    let infos = lora::lora_tensors(&cfg, &lc, 0);
    let x = randv(&mut rng, batch * seq * cfg.dim, 1.0);
    let r = randv(&mut rng, x.len(), 1.0);
    let key = Some(lora::dropout_key(5, 1, 0, 0, 0));
    let run = |ad: &[Vec<f32>], x: &[f32]| {
        let sl: Vec<&[f32]> = base.iter().map(Vec::as_slice).collect();
        let al: Vec<&[f32]> = ad.iter().map(Vec::as_slice).collect();
        let p = BlockParams::from_slices(&sl).with_lora(BlockLora::from_slices(&lc, &al, key));
        let cache = block.forward(&p, x, batch, seq);
        let loss = dot64(&cache.y, &r);
        let (dx, g) = block.backward(&p, &cache, &r);
        (loss, dx, g)
    };
    let (_, dx, grads) = run(&ad, &x);
    assert!(grads.wq.is_empty() && grads.down.is_empty() && grads.qkv_bias.is_none());
    check_h("lora block.dx", &dx, 60, 100, H_COMPOSITE, |i, d| {
        let mut x = x.clone();
        x[i] += d;
        run(&ad, &x).0
    });
    let g = grads.lora_vec();
    assert_eq!(g.len(), infos.len());
    for (t, (info, g)) in infos.iter().zip(&g).enumerate() {
        assert_eq!(g.len(), info.numel(), "{}", info.name);
        check_h(&info.name, g, 30, 200 + t as u64, H_COMPOSITE, |i, d| {
            let mut a = ad.clone();
            a[t][i] += d;
            run(&a, &x).0
        });
    }
}

/// The whole tiny model with adapters on every layer (dropout on): every
/// adapter's gradient against finite differences of the loss; the base's
/// gradients are empty.
#[test]
fn model_grad_with_lora() {
    let cfg = Config {
        qkv_bias: true,
        tie_embeddings: true,
        ..block_cfg()
    };
    let lc = lora_cfg();
    let mut model = Model::with_lora(cfg, lc.clone(), 1);
    model.dropout_seed = Some(3);
    let mut rng = XorShift::new(31);
    let mut params: Vec<Vec<f32>> = llama::tensors(&cfg)
        .iter()
        .map(|t| match t.kind {
            llama::Kind::Norm => (0..t.numel()).map(|_| 5.0 + rng.normal()).collect(),
            _ => randv(&mut rng, t.numel(), 0.1),
        })
        .collect();
    for l in 0..cfg.n_layers {
        params.extend(lora_values(&cfg, &lc, l, &mut rng));
    }
    assert_eq!(params.len(), model.param_tensors());
    let (batch, seq) = (2, 4);
    let tokens = [1u32, 5, 5, 12, 0, 3, 7, 1];
    let targets = [5, 5, 12, IGNORE_INDEX, 3, 7, 1, 2];
    let sl: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
    let (_, cache) = model.forward(&sl, &tokens, &targets, batch, seq);
    let grads = model.backward(&sl, &cache);
    assert!(grads[..cfg.tensor_count()].iter().all(Vec::is_empty));
    for t in cfg.tensor_count()..params.len() {
        check(
            &format!("model lora[{t}]"),
            &grads[t],
            20,
            700 + t as u64,
            |i, d| {
                let mut ps = params.clone();
                ps[t][i] += d;
                let sl: Vec<&[f32]> = ps.iter().map(Vec::as_slice).collect();
                model.forward(&sl, &tokens, &targets, batch, seq).0 as f64
            },
        );
    }
}

/// Adapters with `B = 0` (PEFT's start) give the base model's logits and
/// loss bit for bit, dropout on or off.
#[test]
fn zero_b_gives_the_base_logits_bit_for_bit() {
    let cfg = Config {
        qkv_bias: true,
        ..block_cfg()
    };
    let lc = lora_cfg();
    let base = llama::init_params(&cfg, 4);
    let mut params = base.clone();
    for l in 0..cfg.n_layers {
        params.extend(lora::init_adapters(&cfg, &lc, l, 9));
    }
    assert!(
        params[cfg.tensor_count()].iter().any(|&a| a != 0.0),
        "A is not zero"
    );
    let (batch, seq) = (2, 4);
    let tokens = [1u32, 5, 5, 12, 0, 3, 7, 1];
    let targets = [5, 5, 12, IGNORE_INDEX, 3, 7, 1, 2];
    let logits = |m: &Model, ps: &[Vec<f32>]| {
        let sl: Vec<&[f32]> = ps.iter().map(Vec::as_slice).collect();
        let (loss, c) = m.forward(&sl, &tokens, &targets, batch, seq);
        let l = linear_forward(
            &c.xn,
            sl[cfg.head_index()],
            batch * seq,
            cfg.dim,
            cfg.vocab,
            1,
        );
        (
            loss.to_bits(),
            l.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        )
    };
    let want = logits(&Model::new(cfg, 1), &base);
    for seed in [None, Some(7)] {
        let mut m = Model::with_lora(cfg, lc.clone(), 1);
        m.dropout_seed = seed;
        assert_eq!(logits(&m, &params), want, "dropout seed {seed:?}");
    }
    // A non-zero B changes them.
    params.last_mut().unwrap()[0] = 0.5;
    assert_ne!(logits(&Model::with_lora(cfg, lc, 1), &params), want);
}
