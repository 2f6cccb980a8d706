//! The checkpoint-engine (weight sync) suite: `send_weights` of a versioned [`WeightSource`]
//! returns the [`Handover`] the capabilities declare, a rollout reading it finds the sent tensors
//! bit for bit (and, in files, the version as `global_steps`), the next version replaces the
//! last, and `finalize` releases it.

use std::path::Path;

use serde_json::json;
use verl_plugin_api::{
    CheckpointCapabilities, ComponentInit, Handover, NamedTensor, RunContext, Tensor, WeightSource,
    WeightSourceKind,
};
use verl_plugin_host::CheckpointHandle;

use super::fixture::read_safetensors_dir;
use super::{Outcome, Suite, call, ensure, tempdir};

pub const CHECKS: &[&str] = &[
    "init",
    "handover_as_declared",
    "round_trip",
    "next_version",
    "finalize_releases",
];

/// Metadata key a file handover records the version under (verl's trainer `global_steps`).
pub const VERSION_KEY: &str = "global_steps";

fn weights(scale: f32) -> Vec<NamedTensor> {
    let floats: Vec<f32> = (0..24).map(|i| (i as f32 - 7.5) * scale).collect();
    vec![
        NamedTensor::new(
            "model.layers.0.mlp.up_proj.weight",
            Tensor::from_slice(&[4, 6], &floats).expect("shape"),
        ),
        NamedTensor::new(
            "model.norm.weight",
            Tensor::from_slice(&[3], &[1.0f32, scale, -scale]).expect("shape"),
        ),
        NamedTensor::new(
            "model.rotary.inv_freq_steps",
            Tensor::from_slice(&[2], &[3i64, -(scale as i64) - 1]).expect("shape"),
        ),
    ]
}

/// What a rollout would receive from `handover`: the tensors and, for files, their metadata.
fn receive(
    handover: &Handover,
    sent: &[NamedTensor],
    version: u64,
) -> Result<Vec<NamedTensor>, String> {
    let views: Vec<_> = sent.iter().map(NamedTensor::as_ref).collect();
    let json = WeightSource::encode_handover(handover);
    let source = WeightSource::from_handover(version, &views, &json);
    ensure(source.version == version, || "version lost".into())?;
    match handover.kind {
        WeightSourceKind::Memory => {
            let mut got: Vec<NamedTensor> = source.tensors.iter().map(|t| t.to_named()).collect();
            got.sort_by(|a, b| a.name.cmp(&b.name));
            Ok(got)
        }
        WeightSourceKind::File => {
            let (got, metadata) = read_safetensors_dir(Path::new(&handover.path))?;
            let recorded = metadata.get(VERSION_KEY);
            ensure(
                recorded.map(String::as_str) == Some(version.to_string().as_str()),
                || {
                    format!(
                        "the files at {} record {VERSION_KEY} = {recorded:?}, sent version {version}",
                        handover.path
                    )
                },
            )?;
            Ok(got)
        }
        other => Err(format!("cannot read a {} handover offline", other.as_str())),
    }
}

fn sorted(mut t: Vec<NamedTensor>) -> Vec<NamedTensor> {
    t.sort_by(|a, b| a.name.cmp(&b.name));
    t
}

fn send(
    sync: &mut CheckpointHandle,
    tensors: &[NamedTensor],
    version: u64,
) -> Result<Handover, String> {
    let views: Vec<_> = tensors.iter().map(NamedTensor::as_ref).collect();
    call(
        "send_weights",
        sync.send_weights(&WeightSource::memory(version, &views)),
    )
}

pub fn run(suite: &mut Suite) {
    let caps: CheckpointCapabilities = suite.component.capabilities();
    let dir = match tempdir() {
        Ok(d) => d,
        Err(e) => {
            suite.check("init", || Err(e.clone()));
            return;
        }
    };
    let mut sync = None;
    let component = suite.component.clone();
    if !suite.check("init", || {
        let mut s = component.create_checkpoint().map_err(|e| e.to_string())?;
        let mut run = RunContext::default();
        run.run_dir = dir.path().to_string_lossy().into_owned();
        call("init", s.init(&ComponentInit::new(json!({}), run)))?;
        sync = Some(s);
        Ok(Outcome::Pass)
    }) {
        for check in &CHECKS[1..] {
            suite.skip(check, "needs `init`, which failed");
        }
        return;
    }
    let mut sync = sync.expect("init passed");
    let offline = matches!(
        caps.handover,
        WeightSourceKind::Memory | WeightSourceKind::File
    );
    let not_offline = format!(
        "a {} handover needs a peer to receive it; only memory and file handovers are certified offline",
        caps.handover.as_str()
    );
    let first = weights(0.25);
    let mut handover: Option<Handover> = None;

    suite.check("handover_as_declared", || {
        let h = send(&mut sync, &first, 3)?;
        ensure(h.kind == caps.handover, || {
            format!(
                "send_weights handed over `{}`, the capabilities declare `{}`",
                h.kind.as_str(),
                caps.handover.as_str()
            )
        })?;
        if h.kind == WeightSourceKind::File {
            ensure(Path::new(&h.path).is_dir(), || {
                format!("file handover path `{}` is not a directory", h.path)
            })?;
        }
        handover = Some(h);
        Ok(Outcome::Pass)
    });
    suite.check("round_trip", || {
        if !offline {
            return Ok(Outcome::Skipped(not_offline.clone()));
        }
        let h = handover
            .as_ref()
            .ok_or("needs `handover_as_declared`, which failed")?;
        let got = receive(h, &first, 3)?;
        ensure(got == sorted(first.clone()), || {
            format!(
                "the rollout would read other tensors than were sent: {:?}",
                got.iter().map(|t| t.name.as_str()).collect::<Vec<_>>()
            )
        })?;
        Ok(Outcome::Pass)
    });
    suite.check("next_version", || {
        if !offline {
            return Ok(Outcome::Skipped(not_offline.clone()));
        }
        call("finalize", sync.finalize())?;
        let second = weights(-2.0);
        let h = send(&mut sync, &second, 4)?;
        let got = receive(&h, &second, 4)?;
        ensure(got == sorted(second.clone()), || {
            "version 4 reads back other tensors than were sent".into()
        })?;
        handover = Some(h);
        Ok(Outcome::Pass)
    });
    suite.check("finalize_releases", || {
        let h = handover.take();
        call("finalize", sync.finalize())?;
        if let Some(h) = h.filter(|h| h.kind == WeightSourceKind::File) {
            ensure(!Path::new(&h.path).exists(), || {
                format!(
                    "after finalize the handover directory {} still exists",
                    h.path
                )
            })?;
        }
        call("a second finalize", sync.finalize())?;
        Ok(Outcome::Pass)
    });
}
