//! The tower's config (`vision_config`, mlx-vlm's `VisionConfig`) and mlx-vlm's weight
//! sanitize for it (qwen3_vl.py `Model.sanitize`, vision.py `VisionModel.sanitize`).

use serde::Deserialize;

use super::QwenVitError;

/// config.json's `vision_config`, mlx-vlm's `VisionConfig` defaults for what it leaves out.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct VisionConfig {
    pub model_type: String,
    pub depth: usize,
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub out_hidden_size: i32,
    pub num_heads: i32,
    pub patch_size: i32,
    pub temporal_patch_size: i32,
    pub spatial_merge_size: i32,
    pub in_channels: i32,
    pub num_position_embeddings: i32,
    pub deepstack_visual_indexes: Vec<usize>,
}

impl Default for VisionConfig {
    fn default() -> Self {
        VisionConfig {
            model_type: "qwen3_vl".into(),
            depth: 32,
            hidden_size: 1280,
            intermediate_size: 3420,
            out_hidden_size: 1536,
            num_heads: 16,
            patch_size: 14,
            temporal_patch_size: 2,
            spatial_merge_size: 2,
            in_channels: 3,
            num_position_embeddings: 2304,
            deepstack_visual_indexes: Vec::new(),
        }
    }
}

/// The model types `VisionModel.__init__` accepts.
pub(super) const TOWER_TYPES: [&str; 7] = [
    "qwen3_vl",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_5_vision",
    "qwen3_5_moe_vision",
    "qwen4_exp",
    "qwen4_exp_vision",
];

impl VisionConfig {
    pub(super) fn check(&self) -> Result<(), QwenVitError> {
        let bad = |m: String| Err(QwenVitError::Config(m));
        if !TOWER_TYPES.contains(&self.model_type.as_str()) {
            return bad(format!(
                "model_type `{}` is not a Qwen3-VL tower (one of {TOWER_TYPES:?})",
                self.model_type
            ));
        }
        let side = (self.num_position_embeddings as f64).sqrt() as i32;
        if self.num_heads < 1
            || self.hidden_size % self.num_heads != 0
            || (self.hidden_size / self.num_heads) % 4 != 0
        {
            return bad(format!(
                "hidden_size {} over num_heads {}: need a head width that is a multiple of 4",
                self.hidden_size, self.num_heads
            ));
        }
        if side < 1 || self.spatial_merge_size < 1 || self.patch_size < 1 {
            return bad(
                "num_position_embeddings, spatial_merge_size and patch_size must be positive"
                    .into(),
            );
        }
        if let Some(i) = self
            .deepstack_visual_indexes
            .iter()
            .find(|&&i| i >= self.depth)
        {
            return bad(format!(
                "deepstack_visual_indexes names block {i} of a {}-block tower",
                self.depth
            ));
        }
        Ok(())
    }
}

/// `check_array_shape` of mlx-vlm's vision.py: whether a 5-D Conv3d kernel is already in
/// MLX's layout (`[out, T, P, P, C]`, read as `B, out_channels, kH, KW, t`: `t == 3`, or
/// "out_channels" the largest with square kH, KW).
pub(super) fn conv_in_mlx_layout(shape: &[i32]) -> bool {
    if shape.len() != 5 {
        return false;
    }
    let (out, kh, kw, t) = (shape[1], shape[2], shape[3], shape[4]);
    t == 3 || (out >= kh && out >= kw && kh == kw)
}

/// mlx-vlm's sanitize, one name: `Model.sanitize` (`model.visual` → `vision_tower`, for a
/// name with `model` in it) then `VisionModel.sanitize` (`position_ids` dropped). None: not a
/// tower tensor (or dropped).
pub(crate) fn tower_name(name: &str) -> Option<String> {
    if name.contains("model.language_model") {
        return None;
    }
    let name = name.replace("model.visual", "vision_tower");
    if name.contains("position_ids") {
        return None;
    }
    name.strip_prefix("vision_tower.").map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_layout_is_told_as_mlx_vlm_tells_it() {
        assert!(conv_in_mlx_layout(&[1152, 2, 16, 16, 3]), "MLX layout");
        assert!(!conv_in_mlx_layout(&[1152, 3, 2, 16, 16]), "PyTorch layout");
        assert!(
            !conv_in_mlx_layout(&[16, 3, 2, 16, 16]),
            "a narrow PyTorch kernel"
        );
    }

    #[test]
    fn tower_names_follow_the_sanitize_of_both_layouts() {
        assert_eq!(
            tower_name("model.visual.blocks.0.attn.qkv.weight").as_deref(),
            Some("blocks.0.attn.qkv.weight")
        );
        assert_eq!(
            tower_name("vision_tower.merger.norm.bias").as_deref(),
            Some("merger.norm.bias")
        );
        assert_eq!(
            tower_name("model.language_model.layers.0.mlp.up_proj.weight"),
            None
        );
        assert_eq!(tower_name("lm_head.weight"), None);
        assert_eq!(tower_name("vision_tower.position_ids"), None);
    }
}
