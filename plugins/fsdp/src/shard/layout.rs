//! How a model's parameters are grouped into blocks and laid out flat: one buffer per block, the
//! parameters concatenated in name order and padded to a multiple of the world size; rank `r`
//! holds elements `[r·L, (r+1)·L)` with `L = ⌈numel / world⌉` (FSDP's flat parameter).

use serde::{Deserialize, Serialize};
use tch::Tensor;

/// Where one parameter lies in its block's flat buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamSlot {
    /// The Hugging Face name (`model.layers.0.mlp.up_proj.weight`).
    pub name: String,
    pub shape: Vec<i64>,
    pub offset: i64,
    pub numel: i64,
}

/// One block's parameters, flat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockLayout {
    /// `embed`, `layers.<i>` or `final` (the last norm and the head).
    pub name: String,
    pub params: Vec<ParamSlot>,
    /// Elements before padding.
    pub numel: i64,
}

impl BlockLayout {
    /// Elements each rank holds: the block padded to a multiple of `world`, divided by it.
    pub fn shard_len(&self, world: u32) -> i64 {
        let world = i64::from(world);
        (self.numel + world - 1) / world
    }

    /// The block's flat buffer from tensors shaped as its parameters (gradients of them, or the
    /// parameters themselves), zero-padded to `world` shards; an undefined tensor (a parameter
    /// the loss does not reach) counts as zeros.
    pub fn flatten(&self, tensors: &[Tensor], world: u32, like: &Tensor) -> Tensor {
        let padding = self.shard_len(world) * i64::from(world) - self.numel;
        let mut parts: Vec<Tensor> = self
            .params
            .iter()
            .zip(tensors)
            .map(|(slot, t)| {
                if t.defined() {
                    t.reshape([-1])
                } else {
                    like.new_zeros([slot.numel], (like.kind(), like.device()))
                }
            })
            .collect();
        if padding > 0 {
            parts.push(like.new_zeros([padding], (like.kind(), like.device())));
        }
        Tensor::cat(&parts, 0)
    }
}

/// The block a parameter belongs to, by its Hugging Face name: the embedding, one block per
/// decoder layer, and everything after the last layer (final norm, LM or value head).
pub fn block_of(name: &str, layers: usize) -> usize {
    if name.starts_with("model.embed_tokens.") {
        return 0;
    }
    let layer = name
        .strip_prefix("model.layers.")
        .and_then(|rest| rest.split('.').next())
        .and_then(|index| index.parse::<usize>().ok());
    match layer {
        Some(i) if i < layers => 1 + i,
        _ => layers + 1,
    }
}

/// Block names in order: `embed`, `layers.0` … `layers.<n-1>`, `final`.
pub fn block_name(block: usize, layers: usize) -> String {
    match block {
        0 => "embed".to_owned(),
        b if b <= layers => format!("layers.{}", b - 1),
        _ => "final".to_owned(),
    }
}

/// The layouts of `named` parameters (a model's `named_tensors`, name-sorted) over `layers`
/// decoder layers.
pub fn layouts(named: &[(String, Tensor)], layers: usize) -> Vec<BlockLayout> {
    let mut blocks: Vec<BlockLayout> = (0..layers + 2)
        .map(|b| BlockLayout {
            name: block_name(b, layers),
            params: Vec::new(),
            numel: 0,
        })
        .collect();
    for (name, tensor) in named {
        let block = &mut blocks[block_of(name, layers)];
        let numel = tensor.numel() as i64;
        block.params.push(ParamSlot {
            name: name.clone(),
            shape: tensor.size(),
            offset: block.numel,
            numel,
        });
        block.numel += numel;
    }
    blocks
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn parameters_fall_into_embedding_layer_and_final_blocks() {
        for (name, block) in [
            ("model.embed_tokens.weight", 0),
            ("model.layers.0.self_attn.q_proj.weight", 1),
            ("model.layers.11.mlp.down_proj.weight", 12),
            ("model.norm.weight", 13),
            ("lm_head.weight", 13),
            ("score.bias", 13),
        ] {
            assert_eq!(block_of(name, 12), block, "{name}");
        }
        assert_eq!(
            (0..4).map(|b| block_name(b, 2)).collect::<Vec<_>>(),
            ["embed", "layers.0", "layers.1", "final"]
        );
    }

    #[test]
    fn odd_sizes_pad_to_a_multiple_of_the_world_size() {
        let cpu = (Kind::Float, Device::Cpu);
        let named = vec![
            ("model.layers.0.a".to_owned(), Tensor::ones([3, 1], cpu)),
            ("model.layers.0.b".to_owned(), Tensor::ones([2], cpu) * 2.0),
        ];
        let blocks = layouts(&named, 1);
        let layer = &blocks[1];
        assert_eq!(layer.numel, 5);
        assert_eq!(layer.params[1].offset, 3);
        assert_eq!([1, 2, 3, 4].map(|w| layer.shard_len(w)), [5, 3, 2, 2]);
        let tensors: Vec<Tensor> = named.iter().map(|(_, t)| t.shallow_clone()).collect();
        let flat = layer.flatten(&tensors, 4, &tensors[0]);
        let values = Vec::<f32>::try_from(&flat).unwrap();
        assert_eq!(values, [1.0, 1.0, 1.0, 2.0, 2.0, 0.0, 0.0, 0.0]);
        // A gradient the loss did not reach is zeros.
        let flat = layer.flatten(&[Tensor::new(), tensors[1].shallow_clone()], 2, &tensors[0]);
        let values = Vec::<f32>::try_from(&flat).unwrap();
        assert_eq!(values, [0.0, 0.0, 0.0, 2.0, 2.0, 0.0]);
    }
}
