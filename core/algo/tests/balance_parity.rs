//! `trainer.balance_batch` against verl's own `seqlen_balancing.py` on the same inputs
//! (`data/verl_balance_reference.json`, made by `scripts/reference/balance_reference.py`; the verl
//! commit is in the file): Karmarkar–Karp partitions to the index, ties included, and the order
//! and `global_seqlen/*` metrics of `RayPPOTrainer._balance_batch`.

use serde_json::Value;
use verl_algo::{balance_batch, balanced_partitions};

const JSON: &str = include_str!("data/verl_balance_reference.json");

fn numbers<T: TryFrom<u64>>(v: &Value) -> Vec<T> {
    v.as_array()
        .expect("a list")
        .iter()
        .map(|n| {
            T::try_from(n.as_u64().expect("a non-negative integer"))
                .unwrap_or_else(|_| panic!("{n} out of range"))
        })
        .collect()
}

fn partitions(v: &Value) -> Vec<Vec<usize>> {
    v.as_array()
        .expect("partitions")
        .iter()
        .map(numbers)
        .collect()
}

#[test]
fn partitions_and_balanced_batches_match_verl() {
    let reference: Value = serde_json::from_str(JSON).expect("reference JSON");
    let cases = reference["cases"].as_array().expect("cases");
    let (mut partition_cases, mut batch_cases) = (0, 0);
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let k = case["k"].as_u64().expect("k") as usize;
        match case["kind"].as_str().expect("kind") {
            "partitions" => {
                partition_cases += 1;
                let values: Vec<u64> = numbers(&case["values"]);
                let equal = case["equal_size"].as_bool().expect("equal_size");
                let ours = balanced_partitions(&values, k, equal)
                    .unwrap_or_else(|e| panic!("case {i}: {e}"));
                let verl = partitions(&case["partitions"]);
                if ours != verl {
                    failures.push(format!(
                        "case {i} (k={k}, equal_size={equal}, values {values:?}): {ours:?}, verl {verl:?}"
                    ));
                }
            }
            "balance_batch" => {
                batch_cases += 1;
                let seqlens: Vec<u64> = numbers(&case["seqlens"]);
                let ours = balance_batch(&seqlens, k).unwrap_or_else(|e| panic!("case {i}: {e}"));
                let order: Vec<usize> = numbers(&case["order"]);
                if ours.order != order {
                    failures.push(format!(
                        "case {i} (k={k}, seqlens {seqlens:?}): order {:?}, verl {order:?}",
                        ours.order
                    ));
                }
                let metrics = case["metrics"].as_object().expect("metrics");
                assert_eq!(ours.metrics.len(), metrics.len(), "case {i}: metric names");
                for (key, value) in metrics {
                    let expected = value.as_f64().expect("a number");
                    match ours.metrics.get(key) {
                        Some(&got) if got == expected => {}
                        got => failures.push(format!("case {i}: {key} = {got:?}, verl {expected}")),
                    }
                }
            }
            other => panic!("case {i}: unknown kind {other}"),
        }
    }
    assert!(
        partition_cases >= 150 && batch_cases >= 100,
        "too few cases"
    );
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from verl:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
