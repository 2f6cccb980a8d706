//! The runner of multi-process test binaries (`harness = false`): such a binary re-runs itself
//! once per rank, and its `main` tells the two roles apart before calling [`run_rank_tests`].

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
