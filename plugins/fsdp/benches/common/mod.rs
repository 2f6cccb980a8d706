//! What the fsdp plugin's benches share: thread count, load, medians.

/// Intra-op threads; `VERL_BENCH_THREADS` overrides the documented 2.
pub fn threads() -> i32 {
    std::env::var("VERL_BENCH_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(2)
}

/// The machine's 1/5/15-minute load: on a shared machine, a load above the core count distorts
/// every figure.
pub fn load_average() -> String {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    load.split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}
