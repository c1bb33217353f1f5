//! A `[devices]` entry (`"cpu"`, `"cuda:1"`, `"metal"`) opened as a candle device.

use candle_core::Device;

/// A `[devices]` entry that names no device this build can open.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot open `{device}`: {message}")]
pub struct DeviceParseError {
    /// The entry as written.
    pub device: String,
    /// Why it cannot be opened.
    pub message: String,
}

/// Opens a `[devices]` entry as a candle device: `cpu`, or `cuda` / `metal` with an optional
/// `:<ordinal>` (0 when absent).
pub fn parse_device(name: &str) -> Result<Device, DeviceParseError> {
    let err = |message: String| DeviceParseError {
        device: name.to_string(),
        message,
    };
    if name == "cpu" {
        return Ok(Device::Cpu);
    }
    let (kind, idx) = name.split_once(':').unwrap_or((name, "0"));
    let idx: usize = idx
        .parse()
        .map_err(|_| err(format!("`{idx}` is not a device number")))?;
    match kind {
        "cuda" => Device::new_cuda(idx).map_err(|e| err(e.to_string())),
        "metal" => Device::new_metal(idx).map_err(|e| err(e.to_string())),
        _ => Err(err("unknown device kind".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_cpu_and_refuses_what_it_cannot_name() {
        assert!(matches!(parse_device("cpu"), Ok(Device::Cpu)));
        let e = parse_device("cuda:x").unwrap_err();
        assert_eq!(e.device, "cuda:x");
        assert_eq!(e.message, "`x` is not a device number");
        assert_eq!(
            parse_device("tpu:0").unwrap_err().message,
            "unknown device kind"
        );
    }
}
