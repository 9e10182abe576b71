//! Criterion benches for the engine's hot paths. Group names say what varies:
//! `ops/<op>/<size>`, `decode_step/<model>`, `prefill/<model>/<tokens>`,
//! `ssd_restore/<what>/<size>`.
//! Run: `cargo bench --bench engine` (single-threaded MLX use: criterion runs one bench at a time).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use engine::generate::Session;
use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
use mlx_rs::ops::{quantize, quantized_matmul};
use mlx_rs::{random, Array};

fn normal(shape: &[i32], seed: u64) -> Array {
    let a = random::normal::<f32>(shape, None, None, &random::key(seed).unwrap()).unwrap();
    a.eval().unwrap();
    a
}

fn model_dir(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("goldens/models")
        .join(name)
}

fn ops(c: &mut Criterion) {
    let mut g = c.benchmark_group("ops/rms_norm");
    for dim in [256, 1024, 4096] {
        let x = normal(&[32, dim], 1);
        let w = normal(&[dim], 2);
        g.bench_with_input(
            BenchmarkId::new("rows=32", format!("dim={dim}")),
            &dim,
            |b, _| b.iter(|| fast::rms_norm(&x, Some(&w), 1e-5).unwrap().eval().unwrap()),
        );
    }
    g.finish();

    let mut g = c.benchmark_group("ops/sdpa");
    for kv_len in [128, 512] {
        let q = normal(&[1, 8, 1, 64], 3);
        let k = normal(&[1, 2, kv_len, 64], 4);
        let v = normal(&[1, 2, kv_len, 64], 5);
        g.bench_with_input(
            BenchmarkId::new("decode q=1", format!("kv={kv_len}")),
            &kv_len,
            |b, _| {
                b.iter(|| {
                    fast::scaled_dot_product_attention(&q, &k, &v, 0.125, None, None)
                        .unwrap()
                        .eval()
                        .unwrap()
                })
            },
        );
        let qp = normal(&[1, 8, kv_len, 64], 6);
        g.bench_with_input(
            BenchmarkId::new("prefill causal", format!("len={kv_len}")),
            &kv_len,
            |b, _| {
                b.iter(|| {
                    fast::scaled_dot_product_attention(
                        &qp,
                        &k,
                        &v,
                        0.125,
                        ScaledDotProductAttentionMask::Causal,
                        None,
                    )
                    .unwrap()
                    .eval()
                    .unwrap()
                })
            },
        );
    }
    g.finish();

    let mut g = c.benchmark_group("ops/quantized_matmul");
    let w = normal(&[1024, 1024], 7);
    let x = normal(&[1, 1024], 8);
    for bits in [4, 8] {
        let (wq, s, bias) = quantize(&w, 64, bits).unwrap();
        g.bench_with_input(
            BenchmarkId::new("1x1024·1024x1024", format!("bits={bits}")),
            &bits,
            |b, _| {
                b.iter(|| {
                    quantized_matmul(&x, &wq, &s, &bias, true, 64, bits)
                        .unwrap()
                        .eval()
                        .unwrap()
                })
            },
        );
    }
    g.finish();
}

fn model_paths(c: &mut Criterion) {
    let name = "tiny-llama-trained";
    let model = engine::model::load(&model_dir(name)).unwrap();
    let prompt: Vec<u32> = (0..64).map(|i| 10 + (i * 7) % 500).collect();

    let mut session = Session::new(model.as_ref());
    session.prefill(&prompt).unwrap().eval().unwrap();
    c.bench_function(&format!("decode_step/{name}/context=64"), |b| {
        b.iter(|| {
            session.step(&[42]).unwrap().eval().unwrap();
            for cache in session.caches.iter_mut() {
                cache.trim(1); // keep the context length fixed across iterations
            }
        })
    });

    let mut g = c.benchmark_group(format!("prefill/{name}"));
    for tokens in [32usize, 128] {
        let ids: Vec<u32> = (0..tokens as u32).map(|i| 10 + (i * 7) % 500).collect();
        g.bench_with_input(
            BenchmarkId::from_parameter(format!("tokens={tokens}")),
            &tokens,
            |b, _| {
                b.iter(|| {
                    let mut s = Session::new(model.as_ref());
                    s.prefill(&ids).unwrap().eval().unwrap()
                })
            },
        );
    }
    g.finish();
    lone_row(c, model.as_ref(), &prompt);
}

/// 64 greedy decode steps of one sequence after a 64-token prompt, timed without the
/// prefill: a single-sequence session (`engine generate`'s path) against the same row
/// alone in a batch (the batch lane's step: batch cache, explicit mask, per-row offsets).
fn lone_row(c: &mut Criterion, model: &dyn engine::model::LanguageModel, prompt: &[u32]) {
    use engine::generate::batch::Batch;
    use std::time::{Duration, Instant};
    const STEPS: usize = 64;
    let argmax = |l: &Array| mlx_rs::ops::indexing::argmax_axis(l, -1, None).unwrap();
    let mut g = c.benchmark_group("lone_row_64_steps/tiny-llama-trained");
    for (name, compile) in [
        ("session", engine::generate::CompileDecode::WherePays),
        ("session_eager", engine::generate::CompileDecode::Off),
    ] {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let mut s = Session::with_compile(model, compile);
                    let mut y = argmax(&s.prefill(prompt).unwrap());
                    y.eval().unwrap();
                    let start = Instant::now();
                    for _ in 0..STEPS {
                        let logits = s.step_array(&y.reshape(&[1]).unwrap()).unwrap();
                        y = argmax(&logits);
                        y.eval().unwrap();
                    }
                    total += start.elapsed();
                }
                total
            })
        });
    }
    g.bench_function("batch_of_one", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut s = Session::new(model);
                s.prefill(&prompt[..prompt.len() - 1])
                    .unwrap()
                    .eval()
                    .unwrap();
                let mut batch = Batch::new(model);
                let mut y = argmax(&batch.admit(vec![s], &prompt[prompt.len() - 1..]).unwrap());
                y.eval().unwrap();
                let start = Instant::now();
                for _ in 0..STEPS {
                    y = argmax(&batch.step_ids(&y.reshape(&[1]).unwrap()).unwrap());
                    y.eval().unwrap();
                }
                total += start.elapsed();
            }
            total
        })
    });
    g.finish();
}

/// `ssd_restore/*/<size>`: one SSD-tier entry of 16 full-attention layers, f32 K/V of 8 heads
/// × 8192 positions × 128 dims (1 GiB of tensors). `read` is a whole restore
/// (`kvstore::read`: the file mapped and paged in, every tensor's checksum on a second
/// thread, the bytes copied into MLX arrays); `copy_into_mlx` is that copy alone, from host
/// memory: what a restore that handed MLX the mapped bytes would save. MLX 0.32.2's CPU
/// backend has no such path (a buffer given to `mlx_array_new_data_managed` is copied and
/// its deleter called at once: `mlx_runtime::mlx_copies_every_buffer_it_is_given`).
fn ssd_restore(c: &mut Criterion) {
    use engine::cache::{kv, kvstore, Meta, Snapshot};
    const LAYERS: u64 = 16;
    const POSITIONS: i32 = 8192;
    let shape = [1, 8, POSITIONS, 128];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("entry.kv");
    let snapshots: Vec<Snapshot> = (0..LAYERS)
        .map(|l| Snapshot {
            kind: kv::KIND.to_owned(),
            offset: POSITIONS,
            quant: None,
            meta: Meta::new(),
            tensors: vec![normal(&shape, 2 * l), normal(&shape, 2 * l + 1)],
        })
        .collect();
    let id = kvstore::Identity {
        model_id: "bench".into(),
        config_fingerprint: "bench".into(),
        ns: "bench".into(),
        tokenizer_hash: "bench".into(),
    };
    let tokens: Vec<u32> = (0..POSITIONS as u32).collect();
    let bytes = kvstore::write(&path, &id, &tokens, &snapshots, "2026-12-06T00:00:00Z").unwrap();
    drop(snapshots);
    let size = format!("{}MiB", bytes >> 20);
    let mut g = c.benchmark_group("ssd_restore");
    g.sample_size(10);
    g.bench_function(BenchmarkId::new("read", &size), |b| {
        b.iter(|| kvstore::read(&path, false).unwrap())
    });
    // The same tensor bytes, already in host memory, copied into MLX arrays one tensor each.
    let tensor = shape.iter().product::<i32>() as usize;
    let host: Vec<f32> = vec![0.5; tensor * 2 * LAYERS as usize];
    g.bench_function(BenchmarkId::new("copy_into_mlx", &size), |b| {
        b.iter(|| {
            host.chunks(tensor)
                .map(|t| Array::from_slice(t, &shape))
                .collect::<Vec<_>>()
        })
    });
    g.finish();
}

criterion_group!(benches, ops, model_paths, ssd_restore);
criterion_main!(benches);
