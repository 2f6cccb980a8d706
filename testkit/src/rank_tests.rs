//! The runner of multi-process test binaries (`harness = false`): such a binary re-runs itself
//! once per rank, and its `main` tells the two roles apart before calling [`run_rank_tests`];
//! a test waits for its rank processes with [`join_ranks`].

use std::io::Read;
use std::process::Child;

/// Runs `tests` as libtest does (filters, `--skip`, `--list`, exit status), one test at a time
/// unless `--test-threads` says otherwise: each test starts several rank processes.
pub fn run_rank_tests(tests: &[(&'static str, fn())]) -> ! {
    let mut args = libtest_mimic::Arguments::from_args();
    args.test_threads.get_or_insert(1);
    let trials = tests
        .iter()
        .map(|&(name, test)| {
            libtest_mimic::Trial::test(name, move || {
                test();
                Ok(())
            })
        })
        .collect();
    libtest_mimic::run(&args, trials).exit()
}

/// Waits for the rank processes of one test (`children[r]` is rank `r`, its stderr piped), prints
/// the line each successful rank wrote starting with `report`, and fails naming every rank that
/// failed, with its stderr. `label` says which test case ran.
pub fn join_ranks(label: &str, children: Vec<Child>, report: &str) {
    let mut failures = Vec::new();
    for (rank, mut child) in children.into_iter().enumerate() {
        let mut stderr = String::new();
        if let Some(mut pipe) = child.stderr.take() {
            let _ = pipe.read_to_string(&mut stderr);
        }
        let status = child.wait().expect("waiting for a rank process");
        if !status.success() {
            failures.push(format!("rank {rank} ({status}):\n{stderr}"));
        } else if let Some(line) = stderr.lines().find(|l| l.starts_with(report)) {
            eprintln!("  {label}: {line}");
        }
    }
    assert!(failures.is_empty(), "{label}:\n{}", failures.join("\n"));
}
