//! scratch: batch step time vs rows (not committed)
use engine::generate::batch::Batch;
use engine::generate::Session;
use std::time::Instant;

fn main() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../goldens/models/tiny-llama-trained");
    let model = engine::model::load(&dir).unwrap();
    let prompt: Vec<u32> = vec![1, 450, 2217, 19964];
    let steps = 200;
    let mode = std::env::args().nth(1).unwrap_or("greedy".into());
    let bs: Vec<usize> = std::env::var("BS")
        .map(|s| s.split(",").map(|x| x.parse().unwrap()).collect())
        .unwrap_or(vec![1, 2, 4, 8, 12, 16, 24, 32]);
    for b in bs {
        let mut batch = Batch::new(model.as_ref());
        let mut sessions = Vec::new();
        for _ in 0..b {
            let mut s = Session::new(model.as_ref());
            s.prefill(&prompt[..prompt.len() - 1])
                .unwrap()
                .eval()
                .unwrap();
            sessions.push(s);
        }
        let last = vec![prompt[prompt.len() - 1]; b];
        let l = batch.admit(sessions, &last).unwrap();
        let (mut y, _) = engine::generate::decode::greedy_rows(&l).unwrap();
        y.eval().unwrap();
        let t = Instant::now();
        for _ in 0..steps {
            let logits = batch.step_ids(&y).unwrap();
            let (ny, lp) = engine::generate::decode::greedy_rows(&logits).unwrap();
            if mode == "lp" {
                mlx_rs::transforms::eval([&ny, &lp]).unwrap();
            } else {
                ny.eval().unwrap();
            }
            if mode == "rows" {
                for r in 0..b as i32 {
                    use mlx_rs::ops::indexing::IndexOp;
                    let x = lp.index(r..r + 1);
                    let _ = x;
                }
            }
            y = ny;
        }
        let ms = t.elapsed().as_secs_f64() * 1e3 / steps as f64;
        println!(
            "B={b:2} step {ms:.3} ms  per-row {:.0} tok/s  total {:.0} tok/s",
            1e3 / ms,
            b as f64 * 1e3 / ms
        );
    }
}
