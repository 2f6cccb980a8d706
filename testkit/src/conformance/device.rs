//! The device suite: static facts, detection on fake machines of the declared family, the
//! visible-devices filters, and odd environments.

use verl_plugin_api::{DeviceInfo, ProbeContext};
use verl_plugin_host::DeviceHandle;

use super::{DeviceLayout, Outcome, Suite, call, ensure, no_panic};
use crate::{FakeEnv, FakeRoot};

pub const CHECKS: &[&str] = &[
    "info",
    "no_hardware",
    "detects_declared_hardware",
    "visible_devices_filter",
    "odd_environment",
];

fn detect(device: &DeviceHandle, probe: &ProbeContext) -> Result<(bool, u32, String), String> {
    let d = call("detect", device.detect(probe))?;
    Ok((d.available, d.count, d.reason))
}

pub fn run(suite: &mut Suite) {
    let device = match suite.component.create_device() {
        Ok(device) => device,
        Err(e) => {
            let reason = e.to_string();
            suite.check("info", || Err(reason.clone()));
            return;
        }
    };
    let mut info: Option<DeviceInfo> = None;
    let name = suite.component.name.clone();
    suite.check("info", || {
        let i = call("info", device.info())?;
        ensure(i.name == name, || {
            format!(
                "info names the platform `{}`, but the component is `{name}`",
                i.name
            )
        })?;
        ensure(
            !i.device_type.is_empty() && !i.comm_backend.is_empty(),
            || {
                format!(
                    "device_type `{}` and comm_backend `{}` must both be set",
                    i.device_type, i.comm_backend
                )
            },
        )?;
        info = Some(i);
        Ok(Outcome::Pass)
    });
    let Some(info) = info else {
        for check in &CHECKS[1..] {
            suite.skip(check, "needs `info`, which failed");
        }
        return;
    };
    let cpu = info.device_type == "cpu" && info.vendor == "cpu";
    suite.check("no_hardware", || {
        if cpu {
            return Ok(Outcome::Skipped("a cpu platform is available on every machine".into()));
        }
        let root = FakeRoot::new();
        let (available, count, reason) = detect(&device, &root.probe())?;
        ensure(!available && count == 0, || {
            format!("an empty machine (no /sys, /proc, /dev) reads as available with {count} device(s): {reason}")
        })?;
        Ok(Outcome::Pass)
    });
    let layout: Option<DeviceLayout> = [&suite.component.name, &info.vendor, &info.device_type]
        .into_iter()
        .find_map(|key| suite.options.device_layouts.get(key.as_str()).copied());
    let no_layout = format!(
        "no fake machine for device `{}` or vendor `{}` (known: {}); add one with Options::device_layout",
        suite.component.name,
        info.vendor,
        suite
            .options
            .device_layouts
            .keys()
            .cloned()
            .collect::<Vec<_>>()
            .join(", ")
    );
    suite.check("detects_declared_hardware", || {
        let Some(layout) = layout else {
            return Ok(Outcome::Skipped(no_layout.clone()));
        };
        for n in [1, 2, 4] {
            let root = layout(n);
            let (available, count, reason) = detect(&device, &root.probe())?;
            ensure(available && count == n, || {
                format!("on a machine with {n} {} device(s) detection reports available={available}, count={count}: {reason}", info.vendor)
            })?;
        }
        Ok(Outcome::Pass)
    });
    suite.check("visible_devices_filter", || {
        let Some(layout) = layout else {
            return Ok(Outcome::Skipped(no_layout.clone()));
        };
        if info.visible_devices_env.is_empty() {
            return Ok(Outcome::Skipped("the device declares no visible-devices variable".into()));
        }
        let root = layout(4);
        for var in &info.visible_devices_env {
            for (value, want) in [("1,3", 2), ("0", 1)] {
                let probe = root.probe_with(&FakeEnv::new().set(var, value));
                let (available, count, reason) = detect(&device, &probe)?;
                ensure(available && count == want, || {
                    format!("4 devices with {var}={value}: detection reports available={available}, count={count} (want {want}): {reason}")
                })?;
            }
        }
        Ok(Outcome::Pass)
    });
    suite.check("odd_environment", || {
        let root = layout.map_or_else(FakeRoot::new, |l| l(2));
        let mut vars = info.visible_devices_env.clone();
        vars.push("VERL_PLATFORM".into());
        for value in [
            "",
            "garbage",
            "-1",
            "99999999999999999999",
            "0,0,0",
            ",",
            "GPU-x,MIG-y",
        ] {
            let env = vars
                .iter()
                .fold(FakeEnv::new(), |env, var| env.set(var, value));
            no_panic(
                &format!("detect with every variable = {value:?}"),
                device.detect(&root.probe_with(&env)),
            )?;
        }
        let missing = ProbeContext::new(
            "/nonexistent/verl-certify-root",
            Vec::<(String, String)>::new(),
        );
        no_panic("detect on a missing root", device.detect(&missing))?;
        Ok(Outcome::Pass)
    });
}
