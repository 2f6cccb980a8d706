//! One tensor-parallel rank's shard of a Llama/Qwen2 model, with Megatron-LM's layout: q/k/v
//! and gate/up split by output features (column-parallel), o and down by input features
//! (row-parallel), the embedding and the LM head by vocabulary rows (vocab-parallel; a tied head
//! is the embedding shard itself). Key/value heads are split like the query heads when there
//! are at least as many as ranks, else each rank holds the one its query heads use (replicated
//! over `tp / kv_heads` ranks). Norms, row-parallel biases and a value head are replicated.
//!
//! The shard is a [`CausalLM`] with the shard's sizes, run sub-layer by sub-layer through its
//! tensor-parallel hooks ([`TensorParallel`]); log-probs and entropy come from the vocabulary
//! shards without ever gathering a full row of logits (max and sum-exp all-reduced, the target's
//! logit from the rank that owns it). With sequence parallelism the residual stream, norms and
//! embeddings hold `1/tp` of the sequence (padded on the right to a multiple of `tp`).

use std::rc::Rc;

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};
use verl_distributed::ReduceOp;
use verl_model::{
    BlockContext, CausalLM, Head, ModelConfig, ModelError, ModelOptions, Packing, ResponseScores,
    Result, ScoreOutputs, TensorParallel,
};

use crate::comm::{Comm, Scope};
use crate::seq;
use crate::tape::{Backward, Tape, all_reduce_identity_backward};

/// How a parameter of the whole model is split over the tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// Every rank holds it whole.
    Replicated,
    /// Dimension 0 in `parts` equal parts; rank `r` holds part `r · parts / tp` (fewer parts
    /// than ranks: key/value heads shared by several ranks).
    Rows { parts: u32 },
    /// Dimension 1 in `tp` equal parts, rank `r` holding part `r`.
    Cols,
    /// The vocabulary's `rows` of the embedding or LM head in `parts` equal parts, padded with
    /// zero rows to a multiple of `parts` as Megatron pads the vocab-parallel embedding
    /// (`make_vocab_size_divisible_by`; a multiple of `tp` is all the split needs); the padded
    /// logits are masked out of every softmax ([`TpModel::response_scores`]).
    Vocab { parts: u32, rows: i64 },
}

impl Split {
    /// The split of parameter `name` of a model with config `c` over `tp` ranks.
    pub fn of(name: &str, c: &ModelConfig, tp: u32) -> Self {
        let param = name.rsplit('.').nth(1).unwrap_or_default();
        let weight = name.ends_with(".weight");
        match param {
            "embed_tokens" | "lm_head" => Self::Vocab {
                parts: tp,
                rows: c.vocab_size,
            },
            "q_proj" | "gate_proj" | "up_proj" => Self::Rows { parts: tp },
            "k_proj" | "v_proj" => Self::Rows {
                parts: tp.min(c.num_key_value_heads as u32),
            },
            "o_proj" | "down_proj" if weight => Self::Cols,
            _ => Self::Replicated,
        }
    }

    /// The number of distinct shards (ranks holding the same one hold copies).
    fn parts(self, tp: u32) -> u32 {
        match self {
            Self::Replicated => 1,
            Self::Rows { parts } | Self::Vocab { parts, .. } => parts,
            Self::Cols => tp,
        }
    }

    /// Which shard rank `r` of `tp` holds.
    fn part_of(self, r: u32, tp: u32) -> u32 {
        r * self.parts(tp) / tp
    }

    /// Rank `r`'s shard of the whole tensor.
    pub fn shard(self, full: &Tensor, r: u32, tp: u32) -> Tensor {
        let part = i64::from(self.part_of(r, tp));
        let parts = i64::from(self.parts(tp));
        match self {
            Self::Replicated => full.shallow_clone(),
            Self::Rows { .. } => {
                let n = full.size()[0] / parts;
                full.narrow(0, part * n, n)
            }
            Self::Vocab { rows, .. } => {
                let n = padded_rows(rows, parts) / parts;
                let (start, end) = ((part * n).min(rows), ((part + 1) * n).min(rows));
                let real = full.narrow(0, start, end - start);
                let mut shape = full.size();
                shape[0] = n - (end - start);
                Tensor::cat(
                    &[
                        real,
                        Tensor::zeros(shape.as_slice(), (full.kind(), full.device())),
                    ],
                    0,
                )
            }
            Self::Cols => {
                let n = full.size()[1] / parts;
                full.narrow(1, part * n, n)
            }
        }
    }

    /// The whole tensor from every rank's shard, stacked `[tp, ..]`.
    pub fn unshard(self, stacked: &Tensor, tp: u32) -> Tensor {
        let parts = self.parts(tp);
        // The first rank holding each part.
        let firsts: Vec<Tensor> = (0..parts)
            .map(|p| stacked.select(0, i64::from(p * tp / parts)))
            .collect();
        match self {
            Self::Replicated => firsts[0].shallow_clone(),
            Self::Rows { .. } => Tensor::cat(&firsts, 0),
            Self::Vocab { rows, .. } => Tensor::cat(&firsts, 0).narrow(0, 0, rows),
            Self::Cols => Tensor::cat(&firsts, 1),
        }
    }

    /// The whole tensor's shape from a shard's.
    pub fn whole_shape(self, shard: &[i64], tp: u32) -> Vec<i64> {
        let mut shape = shard.to_vec();
        match self {
            Self::Rows { parts } => shape[0] *= i64::from(parts),
            Self::Vocab { rows, .. } => shape[0] = rows,
            Self::Cols => shape[1] *= i64::from(tp),
            Self::Replicated => {}
        }
        shape
    }
}

/// `rows` rounded up to a multiple of `parts` (both positive; `i64::div_ceil` is unstable).
fn padded_rows(rows: i64, parts: i64) -> i64 {
    (rows + parts - 1) / parts * parts
}

/// The logit of a padding row of the vocabulary: e^(z − max) is exactly 0 in f32.
const PADDED_LOGIT: f64 = -1e30;

fn invalid(tensor: &str, reason: impl Into<String>) -> ModelError {
    ModelError::InvalidInput {
        tensor: tensor.to_owned(),
        reason: reason.into(),
    }
}

/// What a sharded model cannot be split into.
fn check_divisible(c: &ModelConfig, tp: u32) -> Result<()> {
    let tp64 = i64::from(tp);
    let kv = c.num_key_value_heads;
    // The vocabulary need not divide: its shards are padded (`Split::Vocab`).
    for (what, n) in [
        ("num_attention_heads", c.num_attention_heads),
        ("intermediate_size", c.intermediate_size),
    ] {
        if n % tp64 != 0 {
            return Err(invalid(
                "tensor_model_parallel_size",
                format!("{tp} does not divide the model's {what} {n}"),
            ));
        }
    }
    if kv % tp64 != 0 && tp64 % kv != 0 {
        return Err(invalid(
            "tensor_model_parallel_size",
            format!(
                "{tp} ranks cannot share the model's {kv} key/value heads (one must divide the other)"
            ),
        ));
    }
    Ok(())
}

/// The shard's config: the heads, MLP features and vocabulary rows of one rank.
fn shard_config(c: &ModelConfig, tp: u32) -> ModelConfig {
    let tp = i64::from(tp);
    ModelConfig {
        num_attention_heads: c.num_attention_heads / tp,
        num_key_value_heads: (c.num_key_value_heads / tp).max(1),
        intermediate_size: c.intermediate_size / tp,
        vocab_size: padded_rows(c.vocab_size, tp) / tp,
        ..c.clone()
    }
}

/// One rank's shard and how it joins the others.
pub struct TpModel {
    local: CausalLM,
    full: ModelConfig,
    /// Every parameter of the shard, by name (the whole model's names), with its split.
    splits: Vec<(String, Split)>,
    embed: Tensor,
    /// The LM head's shard (the embedding's when tied); `None` with a value head.
    lm_head: Option<Tensor>,
    /// The value head's weight and bias (replicated); `None` with an LM head.
    value_head: Option<(Tensor, Tensor)>,
    comm: Comm,
    sequence_parallel: bool,
    /// verl's `use_remove_padding`: each micro-batch runs as one packed (THD) stream.
    packed: bool,
}

/// The tensor-parallel hooks of one forward pass: Megatron's `f` and `g`, or sequence
/// parallelism's all-gather and reduce-scatter, as cuts on `tape` when it is differentiated.
struct Hooks<'a> {
    comm: &'a Comm,
    tape: Option<&'a Tape>,
    sequence_parallel: bool,
    /// A packed stream's context-parallel layout (`None`: padded rows, or one context rank).
    packed: Option<Rc<seq::PackedContext>>,
}

impl Hooks<'_> {
    fn cut(&self, source: &Tensor, value: &Tensor, backward: Backward) -> Tensor {
        match self.tape {
            Some(tape) => tape.cut(source, value, backward),
            None => value.shallow_clone(),
        }
    }
}

impl TensorParallel for Hooks<'_> {
    fn enter(&self, x: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            let full = seq::all_gather(self.comm, &x.detach())?;
            Ok(self.cut(x, &full, Backward::ReduceScatterSeq))
        } else {
            Ok(self.cut(x, x, Backward::AllReduce))
        }
    }

    fn exit(&self, y: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            let mine = seq::reduce_scatter(self.comm, &y.detach())?;
            Ok(self.cut(y, &mine, Backward::GatherSeq))
        } else {
            all_reduce_identity_backward(self.comm, Scope::Tensor, y)
        }
    }

    fn keys_values(&self, k: Tensor, v: Tensor) -> Result<(Tensor, Tensor)> {
        if self.comm.cp_size() == 1 {
            return Ok((k, v));
        }
        let gather = |x: &Tensor| -> Result<Tensor> {
            Ok(match &self.packed {
                Some(layout) => {
                    let all = layout.gather(self.comm, &x.detach())?;
                    self.cut(x, &all, Backward::ReduceScatterPacked(Rc::clone(layout)))
                }
                None => {
                    let all = seq::gather_context(self.comm, &x.detach())?;
                    self.cut(x, &all, Backward::ReduceScatterContext)
                }
            })
        };
        Ok((gather(&k)?, gather(&v)?))
    }
}

impl TpModel {
    /// This rank's shard of `full` (which is dropped once copied).
    pub fn new(full: CausalLM, comm: Comm, sequence_parallel: bool) -> Result<Self> {
        let (tp, rank) = (comm.tp_size(), comm.tp_rank());
        let config = full.config().clone();
        check_divisible(&config, tp)?;
        let options = ModelOptions {
            device: full.device(),
            kind: full.kind(),
            head: full.head(),
            seed: 0,
        };
        let local = CausalLM::zeroed(shard_config(&config, tp), &options)?;
        let mut splits = Vec::new();
        let shards: Vec<(String, Tensor)> = full
            .named_tensors()
            .into_iter()
            .map(|(name, tensor)| {
                let split = Split::of(&name, &config, tp);
                splits.push((name.clone(), split));
                (name, split.shard(&tensor, rank, tp))
            })
            .collect();
        local.load_named_tensors(&shards)?;
        drop((shards, full));
        let named = local.named_tensors();
        let find = |name: &str| {
            named
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, t)| t.shallow_clone())
        };
        let embed = find("model.embed_tokens.weight").expect("every model has an embedding");
        let (lm_head, value_head) = match options.head {
            Head::Lm => (
                Some(find("lm_head.weight").unwrap_or_else(|| embed.shallow_clone())),
                None,
            ),
            Head::Value => (None, find("score.weight").zip(find("score.bias"))),
        };
        Ok(Self {
            local,
            full: config,
            splits,
            embed,
            lm_head,
            value_head,
            comm,
            sequence_parallel,
            packed: false,
        })
    }

    /// Runs each micro-batch as one packed (THD) stream of its real tokens (verl's
    /// `use_remove_padding`), each sequence padded to [`Self::alignment`].
    pub fn set_remove_padding(&mut self, packed: bool) {
        self.packed = packed;
    }

    /// verl's rule for the length of each sequence (padded rows: the whole row; packed: every
    /// sequence): a multiple of `tp` with sequence parallelism, of `2·cp` with context
    /// parallelism (both: `tp·2·cp`), so that the slices and chunks are whole.
    pub fn alignment(&self) -> i64 {
        let (tp, cp) = (
            i64::from(self.comm.tp_size()),
            i64::from(self.comm.cp_size()),
        );
        let context = if cp > 1 { 2 * cp } else { 1 };
        context * if self.sequence_parallel { tp } else { 1 }
    }

    pub fn local(&self) -> &CausalLM {
        &self.local
    }

    pub fn local_mut(&mut self) -> &mut CausalLM {
        &mut self.local
    }

    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    /// The whole model's config.
    pub fn full_config(&self) -> &ModelConfig {
        &self.full
    }

    pub fn splits(&self) -> &[(String, Split)] {
        &self.splits
    }

    /// The first vocabulary row of this rank's shard.
    fn vocab_start(&self) -> i64 {
        i64::from(self.comm.tp_rank()) * self.embed.size()[0]
    }

    /// `ids` as rows of this rank's vocabulary shard (0 outside it) and the mask of those inside.
    fn local_ids(&self, ids: &Tensor) -> (Tensor, Tensor) {
        let rows = self.embed.size()[0];
        let local = ids - self.vocab_start();
        let inside = local.ge(0).logical_and(&local.lt(rows));
        (local.clamp(0, rows - 1), inside)
    }

    /// Final hidden states `[B, T, H]` of this rank's tokens — the whole sequence, or with
    /// context parallelism its two chunks, whose sequence positions come along — through the
    /// cut the head needs: the LM head's vocabulary shards each see part of the gradient
    /// (all-reduced), a replicated value head the whole of it. Sequences are padded on the
    /// right (masked, invisible to the real tokens) to a multiple of `2·cp` chunks of `tp`
    /// slices as the layout needs; positions past `ids`' own length are padding.
    fn hidden_states(
        &self,
        ids: &Tensor,
        mask: &Tensor,
        tape: Option<&Tape>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (b, s) = ids.size2()?;
        let cp = i64::from(self.comm.cp_size());
        let multiple = self.alignment();
        let pad = (multiple - s % multiple) % multiple;
        let (ids, mask) = if pad > 0 {
            let zeros = Tensor::zeros([b, pad], (Kind::Int64, ids.device()));
            (
                Tensor::cat(&[ids, &zeros], 1),
                Tensor::cat(
                    &[&mask.to_kind(Kind::Int64), &zeros.to_device(mask.device())],
                    1,
                ),
            )
        } else {
            (ids.shallow_clone(), mask.shallow_clone())
        };
        let vocab = self.full.vocab_size;
        let (context, tokens) = if cp > 1 {
            let tokens = seq::context_tokens(
                self.comm.cp_size(),
                self.comm.cp_rank(),
                s + pad,
                self.local.device(),
            );
            let context = self
                .local
                .block_context_for_tokens(&ids, &mask, vocab, &tokens)?;
            (context, Some(tokens))
        } else {
            let context = self.local.block_context_for_vocab(&ids, &mask, vocab)?;
            (context, None)
        };
        let hooks = self.hooks(tape, None);
        let whole = self.blocks(&context, &hooks)?;
        Ok(match tokens {
            Some(tokens) => (whole, Some(tokens)),
            None => (whole.narrow(1, 0, s), None),
        })
    }

    fn hooks<'a>(
        &'a self,
        tape: Option<&'a Tape>,
        packed: Option<Rc<seq::PackedContext>>,
    ) -> Hooks<'a> {
        Hooks {
            comm: &self.comm,
            tape,
            sequence_parallel: self.sequence_parallel,
            packed,
        }
    }

    /// The blocks of the model on the context's tokens, to the final hidden states every rank's
    /// head reads (see [`Self::hidden_states`]).
    fn blocks(&self, context: &BlockContext, hooks: &Hooks<'_>) -> Result<Tensor> {
        let (local, inside) = self.local_ids(context.input_ids());
        let embedded = Tensor::embedding(&self.embed, &local, -1, false, false)
            * inside.unsqueeze(-1).to_kind(self.local.kind());
        let mut x = hooks.exit(&embedded)?;
        for layer in 0..self.full.num_hidden_layers as usize {
            x = hooks.cut(&x, &x, Backward::Identity);
            x = self.local.attention_block(layer, &x, context, hooks)?;
            x = hooks.cut(&x, &x, Backward::Identity);
            x = self.local.mlp_block(layer, &x, hooks)?;
        }
        let hidden = self.local.norm_block(&x);
        let whole = match (self.sequence_parallel, self.lm_head.is_some()) {
            (true, lm) => {
                let full = seq::all_gather(&self.comm, &hidden.detach())?;
                let backward = if lm {
                    Backward::ReduceScatterSeq
                } else {
                    Backward::SliceSeq
                };
                hooks.cut(&hidden, &full, backward)
            }
            (false, true) => hooks.cut(&hidden, &hidden, Backward::AllReduce),
            (false, false) => hidden,
        };
        Ok(whole)
    }

    /// The predictors of the response tokens of a packed (THD) batch among this rank's final
    /// hidden states: every sequence padded to [`Self::alignment`], with context parallelism
    /// each rank holding two chunks of every sequence (see [`seq::PackedContext`]).
    fn packed_predictors(
        &self,
        ids: &Tensor,
        mask: &Tensor,
        response_len: i64,
        tape: Option<&Tape>,
    ) -> Result<Predictors> {
        let device = self.local.device();
        let packing = Packing::new(&mask.to_device(device), response_len, self.alignment())?;
        let layout = (self.comm.cp_size() > 1).then(|| {
            Rc::new(seq::PackedContext::new(
                &self.comm,
                packing.cu_seqlens(),
                device,
            ))
        });
        let (predictors, labels, targets, stream) = (
            packing.predictors().shallow_clone(),
            packing.labels(ids),
            packing.targets().shallow_clone(),
            packing.len(),
        );
        let rows = ids.size()[0];
        let context = self.local.packed_block_context_for(
            ids,
            packing,
            self.full.vocab_size,
            layout.as_ref().map(|l| &l.mine),
        )?;
        let hooks = self.hooks(tape, layout.clone());
        let hidden = self.blocks(&context, &hooks)?.squeeze_dim(0);
        Ok(match layout {
            None => Predictors {
                hidden: hidden.index_select(0, &predictors),
                labels,
                place: Place::Packed {
                    targets,
                    rows,
                    shared: false,
                },
            },
            Some(layout) => {
                // This rank's row of each slot it holds, -1 elsewhere.
                let held = layout.mine.size()[0];
                let row_of = Tensor::full([stream], -1, (Kind::Int64, device)).index_copy(
                    0,
                    &layout.mine,
                    &Tensor::arange(held, (Kind::Int64, device)),
                );
                let at = row_of.index_select(0, &predictors);
                let mine = at.ge(0).nonzero().squeeze_dim(-1);
                Predictors {
                    hidden: hidden.index_select(0, &at.index_select(0, &mine)),
                    labels: labels.index_select(0, &mine),
                    place: Place::Packed {
                        targets: targets.index_select(0, &mine),
                        rows,
                        shared: true,
                    },
                }
            }
        })
    }

    /// The response's predictors among this rank's final hidden states: their hidden states
    /// `[B, n, H]`, the tokens they predict `[B, n]` and their columns among the response's
    /// `response_len` (`None`: all of them, in order).
    fn predictors(
        &self,
        ids: &Tensor,
        mask: &Tensor,
        response_len: i64,
        tape: Option<&Tape>,
    ) -> Result<Predictors> {
        let seq = ids.size()[1];
        let ids = ids.to_device(self.local.device());
        if self.packed {
            return self.packed_predictors(&ids, mask, response_len, tape);
        }
        let (hidden, tokens) = self.hidden_states(&ids, mask, tape)?;
        // Position t predicts token t + 1: the predictors are positions seq − R − 1 .. seq − 2.
        let first = seq - response_len - 1;
        match tokens {
            None => Ok(Predictors {
                hidden: hidden.narrow(1, first, response_len),
                labels: ids.narrow(1, seq - response_len, response_len),
                place: Place::Columns(None),
            }),
            Some(tokens) => {
                let mine = tokens.ge(first).logical_and(&tokens.lt(seq - 1));
                let at = mine.nonzero().squeeze_dim(-1);
                let positions = tokens.index_select(0, &at);
                Ok(Predictors {
                    hidden: hidden.index_select(1, &at),
                    labels: ids.index_select(1, &(&positions + 1)),
                    place: Place::Columns(Some(positions - first)),
                })
            }
        }
    }

    /// Values of this rank's predictors as the response's `[B, R]`: with context parallelism
    /// each rank holds some of them, zero elsewhere, summed over the ranks (every rank then
    /// computes the same loss, so the gradient passes back unchanged).
    fn response_columns(&self, values: Tensor, place: &Place, response_len: i64) -> Result<Tensor> {
        match place {
            Place::Columns(None) => Ok(values),
            Place::Packed {
                targets,
                rows,
                shared,
            } => {
                let spread = Tensor::zeros([rows * response_len], (values.kind(), values.device()))
                    .index_copy(0, targets, &values)
                    .view([*rows, response_len]);
                if *shared {
                    all_reduce_identity_backward(&self.comm, Scope::Context, &spread)
                } else {
                    Ok(spread)
                }
            }
            Place::Columns(Some(columns)) => {
                let b = values.size()[0];
                let spread = Tensor::zeros([b, response_len], (values.kind(), values.device()))
                    .index_copy(1, columns, &values);
                all_reduce_identity_backward(&self.comm, Scope::Context, &spread)
            }
        }
    }

    /// Per-token log-probs (and the `outputs` asked for) of the last `response_len` tokens of
    /// each row, as [`CausalLM::response_scores`] computes them on the whole model, from the
    /// vocabulary shards. Differentiated through `tape` when given.
    pub fn response_scores(
        &self,
        ids: &Tensor,
        mask: &Tensor,
        response_len: i64,
        temperature: f64,
        outputs: ScoreOutputs,
        tape: Option<&Tape>,
    ) -> Result<ResponseScores> {
        let head = self
            .lm_head
            .as_ref()
            .ok_or_else(|| invalid("head", "log-probs need a model built with Head::Lm"))?;
        check_response(ids.size()[1], response_len, temperature)?;
        let Predictors {
            hidden,
            labels,
            place,
        } = self.predictors(ids, mask, response_len, tape)?;
        let logits =
            self.without_padding(hidden.linear(head, None::<&Tensor>).to_kind(Kind::Float));
        let logits = if temperature == 1.0 {
            logits
        } else {
            logits / temperature
        };
        // The row maximum over every shard only keeps exp() in range: no gradient needed.
        let mut max = logits.detach().amax([-1], true);
        self.comm
            .all_reduce(Scope::Tensor, &mut max, ReduceOp::Max)?;
        let shifted = logits - max;
        // Every shard's partial sums are all-reduced and only combined afterwards, so that
        // nothing computed on a shard depends on a reduced value: the reduction's backward is
        // then the identity (each rank's gradient of the replicated result is the whole one).
        let exp = shifted.exp();
        let sum_exp = all_reduce_identity_backward(
            &self.comm,
            Scope::Tensor,
            &exp.sum_dim_intlist(-1, false, Kind::Float),
        )?;
        let log_sum_exp = sum_exp.log();
        let (local, inside) = self.local_ids(&labels);
        let target = shifted
            .gather(-1, &local.unsqueeze(-1), false)
            .squeeze_dim(-1)
            * inside.to_kind(Kind::Float);
        let target = all_reduce_identity_backward(&self.comm, Scope::Tensor, &target)?;
        let seq = ids.size()[1];
        let response_mask = mask
            .to_device(self.local.device())
            .narrow(1, seq - response_len, response_len)
            .to_kind(Kind::Float);
        let log_probs = self.response_columns(target - &log_sum_exp, &place, response_len)?;
        let entropy = if outputs.entropy {
            // H = logsumexp(z) − Σ softmax(z)·z = log S − (Σ e^z·z) / S on the shifted logits.
            let weighted = all_reduce_identity_backward(
                &self.comm,
                Scope::Tensor,
                &(&exp * &shifted).sum_dim_intlist(-1, false, Kind::Float),
            )?;
            let entropy = &log_sum_exp - weighted / &sum_exp;
            Some(self.response_columns(entropy, &place, response_len)? * &response_mask)
        } else {
            None
        };
        let sum_pi_squared = if outputs.sum_pi_squared {
            // Σπ² = Σ e^{2z} / S² on the shifted logits (z ≤ 0: no overflow).
            let squares = all_reduce_identity_backward(
                &self.comm,
                Scope::Tensor,
                &(&exp * &exp).sum_dim_intlist(-1, false, Kind::Float),
            )?;
            let sum_pi_squared = squares / sum_exp.square();
            Some(self.response_columns(sum_pi_squared, &place, response_len)? * &response_mask)
        } else {
            None
        };
        Ok(ResponseScores {
            log_probs: log_probs * response_mask,
            entropy,
            sum_pi_squared,
        })
    }

    /// `logits` `[.., V/tp]` of this rank's vocabulary shard with the padding rows' (past the
    /// model's vocabulary) set so low that they never win a max and add exactly 0 to every sum
    /// of `e^z` and `e^z·z` (a finite value: `0 · -inf` would be NaN, in the entropy and in the
    /// gradients).
    fn without_padding(&self, logits: Tensor) -> Tensor {
        let rows = self.embed.size()[0];
        let real = (self.full.vocab_size - self.vocab_start()).clamp(0, rows);
        if real == rows {
            return logits;
        }
        let padding = Tensor::arange(rows, (Kind::Int64, logits.device())).ge(real);
        logits.masked_fill(&padding, PADDED_LOGIT)
    }

    /// Per-token values of the response tokens (a value-head model).
    pub fn response_values(
        &self,
        ids: &Tensor,
        mask: &Tensor,
        response_len: i64,
        tape: Option<&Tape>,
    ) -> Result<Tensor> {
        check_response(ids.size()[1], response_len, 1.0)?;
        let Predictors { hidden, place, .. } = self.predictors(ids, mask, response_len, tape)?;
        let (weight, bias) = self
            .value_head
            .as_ref()
            .ok_or_else(|| invalid("head", "values need a model built with Head::Value"))?;
        let values = hidden
            .linear(weight, Some(bias))
            .squeeze_dim(-1)
            .to_kind(Kind::Float);
        let seq = ids.size()[1];
        let response_mask = mask
            .to_device(self.local.device())
            .narrow(1, seq - response_len, response_len)
            .to_kind(Kind::Float);
        Ok(self.response_columns(values, &place, response_len)? * response_mask)
    }

    /// Makes the gradients of shards held by several ranks whole: key/value heads shared by
    /// ranks sum their parts, and with sequence parallelism the replicated norms and
    /// row-parallel biases (each rank saw its slice of the sequence) sum over every rank. A
    /// value head sees the whole sequence on every rank and is left alone. One all-reduce.
    pub fn reduce_shared_gradients(&self) -> Result<()> {
        let tp = self.comm.tp_size();
        if tp == 1 {
            return Ok(());
        }
        let rank = self.comm.tp_rank();
        let params = self.local.named_tensors();
        // (gradient, its slot in the buffer, parts)
        let mut shared = Vec::new();
        for ((name, split), (_, param)) in self.splits.iter().zip(&params) {
            let grad = param.grad();
            if !grad.defined() {
                continue;
            }
            let parts = match split {
                Split::Rows { parts } if *parts < tp => *parts,
                Split::Replicated if self.sequence_parallel && !name.starts_with("score.") => 1,
                _ => continue,
            };
            shared.push((grad, split.part_of(rank, tp), parts));
        }
        if shared.is_empty() {
            return Ok(());
        }
        // Each gradient in its part's slot, zeros in the other parts' slots.
        let slots: Vec<Tensor> = shared
            .iter()
            .map(|(grad, part, parts)| {
                let flat = grad.reshape([-1]);
                let n = flat.numel() as i64;
                let slots = Tensor::zeros([i64::from(*parts) * n], (flat.kind(), flat.device()));
                slots.narrow(0, i64::from(*part) * n, n).copy_(&flat);
                slots
            })
            .collect();
        let mut buffer = Tensor::cat(&slots, 0);
        self.comm
            .all_reduce(Scope::Tensor, &mut buffer, ReduceOp::Sum)?;
        let mut offset = 0;
        tch::no_grad(|| {
            for (grad, part, parts) in &mut shared {
                let n = grad.numel() as i64;
                let mine = buffer.narrow(0, offset + i64::from(*part) * n, n);
                grad.copy_(&mine.view_as(grad));
                offset += i64::from(*parts) * n;
            }
        });
        Ok(())
    }

    /// The squared L2 norm of the whole model's gradients (each shard counted once), the same
    /// on every tensor-parallel rank.
    pub fn grad_norm_squared(&self) -> Result<f64> {
        let tp = self.comm.tp_size();
        let params = self.local.named_tensors();
        let mut mine = 0.0;
        for ((_, split), (_, param)) in self.splits.iter().zip(&params) {
            let grad = param.grad();
            if grad.defined() {
                let sq = grad
                    .to_kind(Kind::Double)
                    .square()
                    .sum(Kind::Double)
                    .double_value(&[]);
                // A shard held by k ranks is counted 1/k times by each.
                mine += sq * f64::from(split.parts(tp)) / f64::from(tp);
            }
        }
        let mut total = Tensor::from_slice(&[mine]);
        self.comm
            .all_reduce(Scope::Tensor, &mut total, ReduceOp::Sum)?;
        Ok(total.double_value(&[0]))
    }

    /// The whole model's parameters, gathered from every tensor-parallel rank (in name order),
    /// or any tensors named like them (`prefix` + parameter name, shaped as the parameter):
    /// one all-gather.
    pub fn gather_full(&self, tensors: &[(String, Tensor)]) -> Result<Vec<(String, Tensor)>> {
        let flat: Vec<Tensor> = tensors
            .iter()
            .map(|(_, t)| t.detach().reshape([-1]))
            .collect();
        if flat.is_empty() {
            return Ok(Vec::new());
        }
        let tp = self.comm.tp_size();
        let stacked = self
            .comm
            .all_gather(Scope::Tensor, &Tensor::cat(&flat, 0))?;
        let mut offset = 0;
        let mut out = Vec::with_capacity(tensors.len());
        for (name, tensor) in tensors {
            let n = tensor.numel() as i64;
            let mut shape = vec![i64::from(tp)];
            shape.extend(tensor.size());
            let shards = stacked.narrow(1, offset, n).reshape(shape.as_slice());
            offset += n;
            let split = self.split_of_name(name)?;
            out.push((name.clone(), split.unshard(&shards, tp).contiguous()));
        }
        Ok(out)
    }

    /// The split of a parameter, or of an optimizer moment named `<prefix>.<parameter>`.
    pub fn split_of_name(&self, name: &str) -> Result<Split> {
        self.splits
            .iter()
            .find(|(param, _)| name == param || name.ends_with(&format!(".{param}")))
            .map(|(_, split)| *split)
            .ok_or_else(|| invalid("name", format!("`{name}` is no parameter of the model")))
    }
}

/// The response's predictors among a rank's final hidden states (`[B, n, H]` or, packed,
/// `[n, H]`), the tokens they predict, and where their values go.
struct Predictors {
    hidden: Tensor,
    labels: Tensor,
    place: Place,
}

/// Where a rank's predictor values go in the response `[B, R]`.
enum Place {
    /// Padded rows: all columns in order (`None`), or this context rank's columns.
    Columns(Option<Tensor>),
    /// A packed stream: the flattened `[B·R]` indices of this rank's predictors, `shared` over
    /// the context-parallel ranks (each holding some).
    Packed {
        targets: Tensor,
        rows: i64,
        shared: bool,
    },
}

fn check_response(seq: i64, response_len: i64, temperature: f64) -> Result<()> {
    if response_len < 1 || response_len >= seq {
        return Err(invalid(
            "response_len",
            format!("must lie in [1, {seq}) for sequences of length {seq}, got {response_len}"),
        ));
    }
    if !(temperature > 0.0 && temperature.is_finite()) {
        return Err(invalid(
            "temperature",
            format!("must be positive, got {temperature}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_reassemble_to_the_whole_tensor() {
        let full = Tensor::arange(8 * 4, (Kind::Float, tch::Device::Cpu)).view([8, 4]);
        for tp in [1u32, 2, 4] {
            for split in [
                Split::Replicated,
                Split::Rows { parts: tp },
                Split::Rows { parts: 1 },
                Split::Cols,
            ] {
                let shards: Vec<Tensor> = (0..tp).map(|r| split.shard(&full, r, tp)).collect();
                let stacked = Tensor::stack(&shards, 0);
                assert!(
                    split.unshard(&stacked, tp).equal(&full),
                    "{split:?} tp {tp}"
                );
            }
        }
        // A vocabulary of 7 rows over 2 and 4 ranks: shards of 4 and 2 rows, the last padded
        // with zeros; reassembled to the 7 rows.
        let vocab = Tensor::arange(7 * 3, (Kind::Float, tch::Device::Cpu)).view([7, 3]) + 1.0;
        for tp in [2u32, 4] {
            let split = Split::Vocab { parts: tp, rows: 7 };
            let shards: Vec<Tensor> = (0..tp).map(|r| split.shard(&vocab, r, tp)).collect();
            let n = 8 / i64::from(tp);
            assert!(shards.iter().all(|s| s.size() == [n, 3]), "tp {tp}");
            let last = &shards[tp as usize - 1];
            assert!(last.narrow(0, n - 1, 1).eq(0.0).all().int64_value(&[]) == 1);
            assert!(split.unshard(&Tensor::stack(&shards, 0), tp).equal(&vocab));
            assert_eq!(split.whole_shape(&[n, 3], tp), [7, 3]);
        }
        // Two key/value heads over four ranks: ranks 0, 1 hold head 0, ranks 2, 3 head 1.
        let kv = Split::Rows { parts: 2 };
        assert!(kv.shard(&full, 1, 4).equal(&full.narrow(0, 0, 4)));
        assert!(kv.shard(&full, 2, 4).equal(&full.narrow(0, 4, 4)));
    }
}
