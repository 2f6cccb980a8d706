//! A sharded model's state on disk: one safetensors file per rank (its parameter shards and
//! AdamW moments, flat per block) and the block layout, reloadable at any world size. Loading
//! cuts each block's full flat buffer — the saved shards end to end — at the new world size's
//! boundaries, reading only the files that overlap this rank's part.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::Tensor;
use verl_actor::{OPTIMIZER_FILE, TrainState};
use verl_model::{ModelError, SINGLE_FILE, read_safetensors, write_safetensors};

use super::strategy::TRAIN_STATE_FILE;

use super::layout::BlockLayout;
use super::{Result, ShardError, ShardedModel};

/// Written by rank 0 next to the shards.
pub const LAYOUT_FILE: &str = "fsdp_layout.json";

/// The file rank `rank` of `world` writes.
pub fn shard_file(rank: u32, world: u32) -> String {
    format!("fsdp_shard_{rank:05}_of_{world:05}.safetensors")
}

const PARAM: &str = "param";
/// AdamW's names for its moments (`<moment>.<parameter>`; here the parameter is the block).
const MOMENTS: [&str; 2] = ["exp_avg", "exp_avg_sq"];

#[derive(Debug, Serialize, Deserialize)]
struct SavedLayout {
    world_size: u32,
    /// AdamW updates applied.
    steps: u64,
    /// Whether the shards hold AdamW moments.
    optimizer: bool,
    blocks: Vec<BlockLayout>,
}

fn checkpoint_error(path: &Path, reason: impl Into<String>) -> ShardError {
    ShardError::Checkpoint {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

impl ShardedModel {
    /// Writes this rank's shard of the parameters and optimizer moments into `dir` (created if
    /// needed); rank 0 also writes the layout. Not collective: the caller makes the directory
    /// complete (every rank's file) before using it.
    pub fn save_shard(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|source| ModelError::Io {
            path: dir.to_owned(),
            source,
        })?;
        let mut tensors: Vec<(String, Tensor)> = self
            .blocks
            .iter()
            .map(|b| {
                (
                    format!("{PARAM}.{}", b.layout.name),
                    b.shard.shallow_clone(),
                )
            })
            .collect();
        if let Some(optimizer) = &self.optimizer {
            tensors.extend(optimizer.state_tensors());
        }
        write_safetensors(&dir.join(shard_file(self.rank, self.world)), &tensors)?;
        if self.rank == 0 {
            let layout = SavedLayout {
                world_size: self.world,
                steps: self.steps(),
                optimizer: self.optimizer.is_some(),
                blocks: self.layouts().cloned().collect(),
            };
            let path = dir.join(LAYOUT_FILE);
            let json = serde_json::to_vec_pretty(&layout).expect("the layout serialises");
            std::fs::write(&path, json).map_err(|source| ModelError::Io {
                path: path.clone(),
                source,
            })?;
        }
        Ok(())
    }

    /// Restores what [`Self::save_shard`] wrote at any world size into this model (the same
    /// architecture), and clears the gradients; a whole-model checkpoint (one rank's
    /// `save_training_state`: `model.safetensors`, `optimizer.safetensors`, `train_state.json`)
    /// reads as the one shard of a world of one. Not collective.
    pub fn load_shards(&mut self, dir: &Path) -> Result<()> {
        let kinds = self.kinds();
        let layout_path = dir.join(LAYOUT_FILE);
        let (saved, files) = if layout_path.is_file() {
            let saved = read_layout(&layout_path)?;
            self.check_layout(&layout_path, &saved)?;
            let files = self.needed_files(dir, &saved)?;
            (saved, files)
        } else {
            self.whole_as_one_shard(dir, &kinds)?
        };
        let ranges: Vec<(i64, i64)> = self
            .blocks
            .iter()
            .map(|b| new_range(&b.layout, self.rank, self.world))
            .collect();
        let moments: HashMap<String, Tensor> = self
            .optimizer
            .as_ref()
            .map(|o| o.state_tensors().into_iter().collect())
            .unwrap_or_default();
        tch::no_grad(|| -> Result<()> {
            for (block, &(start, end)) in self.blocks.iter().zip(&ranges) {
                let name = &block.layout.name;
                let old_len = block.layout.shard_len(saved.world_size);
                let new_len = block.layout.shard_len(self.world);
                for kind in &kinds {
                    let key = format!("{kind}.{name}");
                    let mut target = if *kind == PARAM {
                        block.shard.shallow_clone()
                    } else {
                        moments[&key].shallow_clone()
                    };
                    let restored = target.zeros_like();
                    let mut at = start;
                    while at < end {
                        let rank = (at / old_len) as u32;
                        let (path, tensors) = &files[&rank];
                        let source =
                            tensors.get(&key).ok_or_else(|| ModelError::MissingTensor {
                                path: path.clone(),
                                tensor: key.clone(),
                            })?;
                        if source.size() != [old_len] {
                            return Err(ModelError::ShapeMismatch {
                                path: path.clone(),
                                tensor: key.clone(),
                                found: source.size(),
                                expected: vec![old_len],
                            }
                            .into());
                        }
                        let until = end.min(i64::from(rank + 1) * old_len);
                        restored
                            .narrow(0, at - start, until - at)
                            .copy_(&source.narrow(0, at - i64::from(rank) * old_len, until - at));
                        at = until;
                    }
                    debug_assert_eq!(restored.size(), [new_len]);
                    target.copy_(&restored);
                }
            }
            Ok(())
        })?;
        if let Some(optimizer) = &mut self.optimizer {
            optimizer.restore_steps(saved.steps);
        }
        self.zero_grad();
        Ok(())
    }

    /// What the shards hold: the parameters, and AdamW's moments when the model trains.
    fn kinds(&self) -> Vec<&'static str> {
        if self.optimizer.is_some() {
            std::iter::once(PARAM).chain(MOMENTS).collect()
        } else {
            vec![PARAM]
        }
    }

    /// The saved files (by the rank that wrote them) that hold part of this rank's ranges.
    fn needed_files(&self, dir: &Path, saved: &SavedLayout) -> Result<SavedFiles> {
        let needed: BTreeSet<u32> = self
            .blocks
            .iter()
            .flat_map(|b| {
                let (start, end) = new_range(&b.layout, self.rank, self.world);
                let old_len = b.layout.shard_len(saved.world_size).max(1);
                (start < end)
                    .then(|| (start / old_len) as u32..=((end - 1) / old_len) as u32)
                    .into_iter()
                    .flatten()
            })
            .collect();
        needed
            .into_iter()
            .map(|rank| {
                let path = dir.join(shard_file(rank, saved.world_size));
                let tensors = read_safetensors(&path)?.into_iter().collect();
                Ok((rank, (path, tensors)))
            })
            .collect()
    }

    /// A whole-model checkpoint as the layout and the one file of a world of one: each block's
    /// parameters (and moments) flattened as [`Self::save_shard`] would have at one rank.
    fn whole_as_one_shard(
        &self,
        dir: &Path,
        kinds: &[&'static str],
    ) -> Result<(SavedLayout, SavedFiles)> {
        let state_path = dir.join(TRAIN_STATE_FILE);
        let text = std::fs::read(&state_path).map_err(|source| ModelError::Io {
            path: state_path.clone(),
            source,
        })?;
        let state: TrainState =
            serde_json::from_slice(&text).map_err(|source| ModelError::Json {
                path: state_path,
                source,
            })?;
        let model_path = dir.join(SINGLE_FILE);
        let mut tensors: HashMap<String, Tensor> =
            read_safetensors(&model_path)?.into_iter().collect();
        let optimizer_path = dir.join(OPTIMIZER_FILE);
        if self.optimizer.is_some() {
            tensors.extend(read_safetensors(&optimizer_path)?);
        }
        let mut flat = HashMap::new();
        for block in &self.blocks {
            for &kind in kinds {
                let (prefix, path) = if kind == PARAM {
                    (String::new(), &model_path)
                } else {
                    (format!("{kind}."), &optimizer_path)
                };
                let parts = block
                    .layout
                    .params
                    .iter()
                    .map(|slot| {
                        let key = format!("{prefix}{}", slot.name);
                        tensors.remove(&key).ok_or(ModelError::MissingTensor {
                            path: path.clone(),
                            tensor: key,
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let name = format!("{kind}.{}", block.layout.name);
                flat.insert(name, block.layout.flatten(&parts, 1, &block.shard));
            }
        }
        let layout = SavedLayout {
            world_size: 1,
            steps: state.step,
            optimizer: self.optimizer.is_some(),
            blocks: self.layouts().cloned().collect(),
        };
        Ok((layout, HashMap::from([(0, (model_path, flat))])))
    }

    fn check_layout(&self, path: &Path, saved: &SavedLayout) -> Result<()> {
        if saved.world_size == 0 {
            return Err(checkpoint_error(path, "world_size 0"));
        }
        if self.optimizer.is_some() && !saved.optimizer {
            return Err(checkpoint_error(
                path,
                "saved without optimizer state (by a model that does not train)",
            ));
        }
        let mine: Vec<&BlockLayout> = self.layouts().collect();
        if saved.blocks.len() != mine.len() {
            return Err(checkpoint_error(
                path,
                format!(
                    "{} blocks saved, this model has {}",
                    saved.blocks.len(),
                    mine.len()
                ),
            ));
        }
        for (theirs, ours) in saved.blocks.iter().zip(mine) {
            if theirs != ours {
                let describe = |b: &BlockLayout| {
                    b.params
                        .iter()
                        .map(|p| format!("{} {:?}", p.name, p.shape))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                return Err(checkpoint_error(
                    path,
                    format!(
                        "block `{}` was saved with [{}]; this model's block `{}` has [{}]",
                        theirs.name,
                        describe(theirs),
                        ours.name,
                        describe(ours)
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// The tensors of each saved file, with its path, by the rank that wrote it.
type SavedFiles = HashMap<u32, (PathBuf, HashMap<String, Tensor>)>;

fn read_layout(path: &Path) -> Result<SavedLayout> {
    let text = std::fs::read(path).map_err(|source| ModelError::Io {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_slice(&text)
        .map_err(|e| checkpoint_error(path, format!("invalid layout: {e}")))
}

/// The whole model of a sharded checkpoint in `dir` — the parameters by name and, when saved,
/// AdamW's moments as `exp_avg.<name>` / `exp_avg_sq.<name>` (as `AdamW::state_tensors` names
/// them), with the file each came from — for a model held whole (one rank); `None` when `dir`
/// holds no sharded checkpoint.
pub fn read_whole(dir: &Path) -> Result<Option<(PathBuf, HashMap<String, Tensor>)>> {
    let layout_path = dir.join(LAYOUT_FILE);
    if !layout_path.is_file() {
        return Ok(None);
    }
    let saved = read_layout(&layout_path)?;
    let files = (0..saved.world_size)
        .map(|rank| {
            let path = dir.join(shard_file(rank, saved.world_size));
            let tensors: HashMap<String, Tensor> = read_safetensors(&path)?.into_iter().collect();
            Ok((path, tensors))
        })
        .collect::<Result<Vec<_>>>()?;
    let kinds: &[&str] = if saved.optimizer {
        &[PARAM, MOMENTS[0], MOMENTS[1]]
    } else {
        &[PARAM]
    };
    let mut whole = HashMap::new();
    for block in &saved.blocks {
        let len = block.shard_len(saved.world_size);
        for &kind in kinds {
            let key = format!("{kind}.{}", block.name);
            let shards = files
                .iter()
                .map(|(path, tensors)| {
                    let shard = tensors.get(&key).ok_or_else(|| ModelError::MissingTensor {
                        path: path.clone(),
                        tensor: key.clone(),
                    })?;
                    if shard.size() != [len] {
                        return Err(ModelError::ShapeMismatch {
                            path: path.clone(),
                            tensor: key.clone(),
                            found: shard.size(),
                            expected: vec![len],
                        }
                        .into());
                    }
                    Ok(shard.shallow_clone())
                })
                .collect::<Result<Vec<_>>>()?;
            let flat = Tensor::cat(&shards, 0);
            for slot in &block.params {
                let name = if kind == PARAM {
                    slot.name.clone()
                } else {
                    format!("{kind}.{}", slot.name)
                };
                whole.insert(
                    name,
                    flat.narrow(0, slot.offset, slot.numel).reshape(&slot.shape),
                );
            }
        }
    }
    Ok(Some((layout_path, whole)))
}

/// This rank's elements of a block's flat buffer at `world` ranks, without the padding
/// (padding elements are zero in every saved shard and restored as zeros).
fn new_range(block: &BlockLayout, rank: u32, world: u32) -> (i64, i64) {
    let len = block.shard_len(world);
    let start = (i64::from(rank) * len).min(block.numel);
    (start, (start + len).min(block.numel))
}
