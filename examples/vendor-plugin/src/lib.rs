//! # verl-plugin-xpu — an out-of-tree verl-core device plugin
//!
//! Intel GPUs as PyTorch's `xpu` device, communicating through oneCCL (`ccl`). This crate is the
//! template a hardware vendor copies: it depends on `verl-plugin-api` only, implements
//! [`Device`], and exports itself with one `export_plugin!` call.
//!
//! ## What detection reads (all through the [`ProbeContext`], never `/` directly)
//! For every `/sys/class/drm/cardN` (connectors such as `card0-DP-1` are skipped):
//! - `device/vendor` must be `0x8086` (Intel);
//! - `device/uevent` gives the bound driver (`DRIVER=i915` or `DRIVER=xe`; other drivers, e.g.
//!   `vfio-pci`, or none, cannot compute here) and the PCI address (`PCI_SLOT_NAME`);
//! - `device/drm/renderD*` must exist: compute goes through the render node.
//!
//! Integrated or discrete: Intel places its integrated GPU at PCI `0000:00:02.0` on every
//! platform, and discrete cards sit behind PCIe ports on other buses. The kernel exports no
//! "integrated" flag in sysfs, so this convention is what the plugin goes by. Integrated GPUs share
//! system memory and are on nearly every Intel laptop; counting them would make the xpu platform
//! outrank the CPU on all of those, so they are reported but only counted when
//! `VERL_XPU_ALLOW_INTEGRATED=1`.
//!
//! ## Visible devices
//! `ZE_AFFINITY_MASK` ("0,2" or, with tiles, "0.0,1.1") selects devices by index in the order the
//! Level Zero runtime enumerates them, assumed here to be PCI order (the runtime guarantees it with
//! `ZE_ENABLE_PCI_ID_DEVICE_ORDER=1`). A `D.T` entry selects tile T of device D; for counting
//! devices it selects device D. On multi-tile cards with `ZE_FLAT_DEVICE_HIERARCHY=FLAT` the
//! runtime exposes one device per tile, which sysfs does not describe cheaply: this plugin counts
//! cards.

use verl_plugin_api::{Detection, Device, DeviceInfo, PluginBuilder, PluginError, ProbeContext};

pub const NAME: &str = "xpu";
/// Above CPU (0), below the in-tree accelerators (CUDA 100, ROCm 90, Ascend 80).
pub const PRIORITY: i32 = 70;
pub const AFFINITY_ENV: &str = "ZE_AFFINITY_MASK";
pub const ALLOW_INTEGRATED_ENV: &str = "VERL_XPU_ALLOW_INTEGRATED";

const DRM: &str = "/sys/class/drm";
const INTEL_VENDOR: &str = "0x8086";
const COMPUTE_DRIVERS: [&str; 2] = ["i915", "xe"];
const INTEGRATED_SLOT: &str = "0000:00:02.0";

verl_plugin_api::export_plugin!(
    PluginBuilder::new("xpu", env!("CARGO_PKG_VERSION"), "Intel GPUs (xpu device type, oneCCL)").device(
        NAME,
        PRIORITY,
        "Intel GPUs with an i915 or xe render node",
        || XpuDevice
    )
);

#[derive(Debug, Clone, Copy, Default)]
pub struct XpuDevice;

/// One Intel DRM card as sysfs describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntelCard {
    pub card: String,
    pub pci_slot: Option<String>,
    pub pci_device: Option<String>,
    pub driver: Option<String>,
    pub render_node: bool,
}

impl IntelCard {
    pub fn integrated(&self) -> bool {
        self.pci_slot.as_deref() == Some(INTEGRATED_SLOT)
    }

    /// Why this card cannot compute, if it cannot.
    pub fn unusable(&self) -> Option<String> {
        match self.driver.as_deref() {
            None => Some(format!("{}: no kernel driver bound", self.card)),
            Some(d) if !COMPUTE_DRIVERS.contains(&d) => Some(format!("{}: driver {d} (needs i915 or xe)", self.card)),
            Some(_) if !self.render_node => Some(format!("{}: no render node", self.card)),
            Some(_) => None,
        }
    }

    fn display_name(&self) -> String {
        let kind = if self.integrated() { "integrated" } else { "discrete" };
        let id = self.pci_device.as_deref().map(|d| format!(" [8086:{}]", d.trim_start_matches("0x"))).unwrap_or_default();
        format!("Intel GPU{id} ({kind}, {})", self.pci_slot.as_deref().unwrap_or(&self.card))
    }
}

impl Device for XpuDevice {
    fn info(&self) -> DeviceInfo {
        DeviceInfo::new(NAME, "intel", "xpu", "ccl").visible_devices_env([AFFINITY_ENV])
    }

    fn detect(&self, probe: &ProbeContext) -> Result<Detection, PluginError> {
        let allow_integrated = match probe.var(ALLOW_INTEGRATED_ENV).map(str::trim) {
            None | Some("" | "0") => false,
            Some("1") => true,
            Some(other) => {
                return Err(PluginError::invalid_config(format!("{ALLOW_INTEGRATED_ENV}={other}: expected 1 or 0")));
            }
        };
        let cards = intel_cards(probe);
        if cards.is_empty() {
            return Ok(Detection::unavailable(format!("no Intel GPU in {DRM}")));
        }
        let (usable, unusable): (Vec<&IntelCard>, Vec<&IntelCard>) = cards.iter().partition(|c| c.unusable().is_none());
        let mut notes: Vec<String> = unusable.iter().filter_map(|c| c.unusable()).collect();

        // The runtime numbers every usable GPU, integrated ones included; the mask indexes that list.
        let mask = probe.var(AFFINITY_ENV).filter(|m| !m.trim().is_empty());
        let selected: Vec<&IntelCard> = match mask {
            Some(mask) => affinity_devices(mask, usable.len()).into_iter().map(|i| usable[i]).collect(),
            None => usable.clone(),
        };
        let skipped_integrated = if allow_integrated { 0 } else { selected.iter().filter(|c| c.integrated()).count() };
        if skipped_integrated > 0 {
            notes.push(format!("{skipped_integrated} integrated GPU(s) not counted (set {ALLOW_INTEGRATED_ENV}=1 to use them)"));
        }
        let counted: Vec<&IntelCard> = selected.into_iter().filter(|c| allow_integrated || !c.integrated()).collect();

        let discrete = cards.iter().filter(|c| !c.integrated()).count();
        let mut reason = format!("{} Intel GPU(s) in {DRM} ({discrete} discrete, {} integrated)", cards.len(), cards.len() - discrete);
        if let Some(mask) = mask {
            reason.push_str(&format!(", {AFFINITY_ENV}={mask}"));
        }
        reason.push_str(&format!("; {} usable", counted.len()));
        if !notes.is_empty() {
            reason.push_str(&format!("; {}", notes.join("; ")));
        }
        let mut detection = Detection::available(counted.len() as u32, reason);
        detection.device_names = counted.iter().map(|c| c.display_name().into()).collect();
        Ok(detection)
    }
}

/// Intel cards under `/sys/class/drm`, in PCI order.
pub fn intel_cards(probe: &ProbeContext) -> Vec<IntelCard> {
    let mut cards: Vec<IntelCard> = probe
        .list_dir(DRM)
        .into_iter()
        .filter(|name| name.strip_prefix("card").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())))
        .filter(|card| probe.read_trimmed(&format!("{DRM}/{card}/device/vendor")).is_some_and(|v| v.eq_ignore_ascii_case(INTEL_VENDOR)))
        .map(|card| {
            let uevent = probe.read_trimmed(&format!("{DRM}/{card}/device/uevent")).unwrap_or_default();
            let field = |key: &str| uevent.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix('=').map(str::to_owned));
            let render_node = probe.list_dir(&format!("{DRM}/{card}/device/drm")).iter().any(|n| n.starts_with("renderD"));
            IntelCard {
                pci_slot: field("PCI_SLOT_NAME"),
                pci_device: probe.read_trimmed(&format!("{DRM}/{card}/device/device")),
                driver: field("DRIVER"),
                render_node,
                card,
            }
        })
        .collect();
    // Cards without a PCI address sort last, by card name.
    cards.sort_by(|a, b| (a.pci_slot.is_none(), &a.pci_slot, &a.card).cmp(&(b.pci_slot.is_none(), &b.pci_slot, &b.card)));
    cards
}

/// Device indices a `ZE_AFFINITY_MASK` selects among `count` devices, in mask order without
/// repeats. `D`, `D.T` and `D.T.S` all select device D; entries naming no device are skipped.
pub fn affinity_devices(mask: &str, count: usize) -> Vec<usize> {
    let mut selected = Vec::new();
    for entry in mask.split(',').map(str::trim) {
        let device = entry.split('.').next().and_then(|d| d.parse::<usize>().ok()).filter(|&d| d < count);
        if let Some(d) = device
            && !selected.contains(&d)
        {
            selected.push(d);
        }
    }
    selected
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn affinity_masks() {
        assert_eq!(affinity_devices("0,1", 2), [0, 1]);
        assert_eq!(affinity_devices("1.0,1.1,0.1", 2), [1, 0]);
        assert_eq!(affinity_devices("5,x,1", 2), [1]);
        assert_eq!(affinity_devices("", 2), Vec::<usize>::new());
    }
}
