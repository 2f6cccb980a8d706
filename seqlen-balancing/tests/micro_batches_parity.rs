//! verl's `use_dynamic_bsz` micro-batches against verl's own `rearrange_micro_batches` on the same
//! inputs (`data/verl_micro_batches_reference.json`, made by
//! `scripts/reference/micro_batches_reference.py` from a verl checkout; the commit is in the file):
//! the count, the rows of every micro-batch and their order, to the index; verl's error when the
//! budget is smaller than the padded width; and the inverse order that restores the input rows.

use serde_json::Value;
use verl_seqlen_balancing::{BalanceError, inverse_permutation, micro_batch_count, micro_batches};

const JSON: &str = include_str!("data/verl_micro_batches_reference.json");

fn numbers(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("a list")
        .iter()
        .map(|n| n.as_u64().expect("a non-negative integer"))
        .collect()
}

#[test]
fn micro_batches_match_verl() {
    let reference: Value = serde_json::from_str(JSON).expect("reference JSON");
    let cases = reference["cases"].as_array().expect("cases");
    let (mut split, mut refused, mut several) = (0, 0, 0);
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let seqlens = numbers(&case["seqlens"]);
        let width = case["width"].as_u64().expect("width");
        let budget = case["max_token_len"].as_u64().expect("max_token_len");
        let ours = micro_batch_count(&seqlens, width, budget)
            .and_then(|count| micro_batches(&seqlens, count));
        match (&case["partitions"], ours) {
            (Value::Array(verl), Ok(ours)) => {
                split += 1;
                several += usize::from(verl.len() > 1);
                let verl: Vec<Vec<usize>> = verl
                    .iter()
                    .map(|p| numbers(p).into_iter().map(|n| n as usize).collect())
                    .collect();
                if ours != verl {
                    failures.push(format!("case {i}: {ours:?}, verl {verl:?}"));
                }
                let order = ours.concat();
                let inverse = inverse_permutation(&order);
                let restored: Vec<usize> = inverse.iter().map(|&p| order[p]).collect();
                assert_eq!(restored, (0..seqlens.len()).collect::<Vec<_>>(), "case {i}");
            }
            (
                Value::Null,
                Err(BalanceError::TokenBudget {
                    max_token_len,
                    max_seq_len,
                }),
            ) => {
                refused += 1;
                assert_eq!((max_token_len, max_seq_len), (budget, width), "case {i}");
                assert!(
                    case["error"]
                        .as_str()
                        .unwrap()
                        .contains("max_token_len must be greater"),
                    "case {i}: verl's error {}",
                    case["error"]
                );
            }
            (verl, ours) => failures.push(format!("case {i}: verl {verl}, ours {ours:?}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        split >= 200 && refused >= 20 && several >= 100,
        "{split} {refused} {several}"
    );
    eprintln!(
        "{split} splits ({several} into several micro-batches) and {refused} refusals as verl's"
    );
}
