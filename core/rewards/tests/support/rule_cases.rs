//! The verdict of a rule-reward parity test: per rule, how many cases ran and which differ from
//! verl. Shared by `rewards_parity.rs` and `rewards2_parity.rs` through `#[path]`.

use std::collections::BTreeMap;

/// Per rule: the number of cases, and a description of each that differs from verl.
pub type Tally<'a> = BTreeMap<&'a str, (usize, Vec<String>)>;

/// Every rule in `rules` ran at least 300 cases and no case of any rule differs (the first 40
/// differences of `total` cases are shown).
pub fn assert_every_rule_matches(tally: &Tally<'_>, rules: &[&str], total: usize) {
    for rule in rules {
        let count = tally.get(rule).map_or(0, |(count, _)| *count);
        assert!(count >= 300, "{rule}: only {count} cases");
    }
    let failures: Vec<&str> = tally
        .values()
        .flat_map(|(_, f)| f)
        .map(String::as_str)
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {total} cases differ from verl:\n{}",
        failures.len(),
        failures[..failures.len().min(40)].join("\n")
    );
}
