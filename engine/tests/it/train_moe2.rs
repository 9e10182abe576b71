//! Segmented backward on the families of oracles/make_moe2.py whose LoRA is gated against
//! mlx-lm's trainer (tests/it/train_lora.rs): glm4_moe (grouped sigmoid routing, shared
//! experts), ernie4_5_moe, minimax, phimoe (sparsemixer, LayerNorms) and llama4_text (a NoPE
//! layer); and, since their train-gate rows, the MLA families of oracles/make_mla.py beside
//! deepseek_v3 (glm4_moe_lite, deepseek_v32, kimi_k25, minicpm3) and llama4's wrapper
//! (chunked attention). With one block a segment their gradients are the whole step's bit
//! for bit; the planted DropCotangent (each segment's backward from zeros) breaks them.

use crate::train_families::segmented_gap;

const MODELS: [&str; 5] = [
    "tiny-glm4-moe",
    "tiny-ernie4-5-moe",
    "tiny-minimax",
    "tiny-phimoe",
    "tiny-llama4-text",
];

#[test]
fn segmented_gradients_match_the_whole_step_on_the_moe2_families() {
    for name in MODELS {
        let gap = segmented_gap(name);
        println!("{name}: segmented vs whole max gradient gap {gap:e}");
        assert_eq!(gap, 0.0, "{name}");
    }
    let _on = engine::plant::on(engine::plant::Defect::DropCotangent).unwrap();
    for name in MODELS {
        let gap = segmented_gap(name);
        println!("{name}: planted DropCotangent, gap {gap:e}");
        assert!(gap > 0.0, "{name}");
    }
}

/// The MLA families beside deepseek_v3 (glm4_moe_lite, deepseek_v32 with its indexer,
/// kimi_k25's wrapper, minicpm3) and llama4's wrapper (chunked attention: the segments'
/// cache-less masks against the whole step's): one block a segment gives the whole step's
/// gradients bit for bit; planted DropCotangent breaks each.
#[test]
fn segmented_gradients_match_the_whole_step_on_the_mla_families_and_llama4() {
    let models = [
        "tiny-glm4-moe-lite",
        "tiny-deepseek-v32",
        "tiny-kimi-k25",
        "tiny-minicpm3",
        "tiny-llama4",
    ];
    for name in models {
        let gap = segmented_gap(name);
        println!("{name}: segmented vs whole max gradient gap {gap:e}");
        assert_eq!(gap, 0.0, "{name}");
    }
    let _on = engine::plant::on(engine::plant::Defect::DropCotangent).unwrap();
    for name in models {
        let gap = segmented_gap(name);
        println!("{name}: planted DropCotangent, gap {gap:e}");
        assert!(gap > 0.0, "{name}");
    }
}
