//! The MFU metrics' FLOP estimate and device peaks against verl's own `flops_counter.py` on the
//! same inputs (`data/verl_flops_reference.json`, made by `scripts/reference/flops_reference.py`
//! from a verl checkout; the commit is in the file).

use serde_json::Value;
use verl_trainer::trainer::perf::{FlopsCounter, device_peak_flops};

const JSON: &str = include_str!("data/verl_flops_reference.json");

fn float(v: &Value) -> f64 {
    match v {
        Value::String(s) if s == "inf" => f64::INFINITY,
        v => v.as_f64().expect("a number"),
    }
}

#[test]
fn flop_estimates_and_device_peaks_match_verl() {
    let reference: Value = serde_json::from_str(JSON).expect("reference JSON");
    let (mut dense, mut unknown) = (0, 0);
    for (i, case) in reference["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .enumerate()
    {
        let counter = FlopsCounter::from_config(&case["config"]).expect("a config");
        let seqlens: Vec<u64> = case["seqlens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_u64().unwrap())
            .collect();
        let (ours, verl) = (counter.flops(&seqlens), float(&case["flops"]));
        if counter.knows_model() {
            dense += 1;
        } else {
            unknown += 1;
        }
        assert!(
            (ours - verl).abs() <= 1e-12 * verl.abs(),
            "case {i} ({}): {ours} vs verl {verl}",
            case["config"]
        );
    }
    assert!(dense >= 150 && unknown >= 5, "{dense} {unknown}");
    for device in reference["devices"].as_array().expect("devices") {
        let name = device["name"].as_str().unwrap();
        assert_eq!(device_peak_flops(name), float(&device["flops"]), "{name}");
    }
}
