//! Byte sizes for people: the one formatter the CLI, the planner's messages and the studio
//! share, so the same size reads the same everywhere. (Parsing sizes such as `80GiB` is the
//! planner's, [`crate::plan::parse_bytes`].)

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const GIB: u64 = 1024 * MIB;

/// Bytes for people: GiB with two decimals under 10 GiB and one above, whole MiB below
/// 1 GiB, whole KiB below that, then bytes: `"67.5 GiB"`, `"1.50 GiB"`, `"812 MiB"`,
/// `"2 KiB"`, `"0 B"`.
pub fn format_bytes(bytes: u64) -> String {
    let b = bytes as f64;
    if bytes >= 10 * GIB {
        format!("{:.1} GiB", b / GIB as f64)
    } else if bytes >= GIB {
        format!("{:.2} GiB", b / GIB as f64)
    } else if bytes >= MIB {
        format!("{:.0} MiB", b / MIB as f64)
    } else if bytes >= KIB {
        format!("{:.0} KiB", b / KIB as f64)
    } else {
        format!("{bytes} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_each_range() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(2048), "2 KiB");
        assert_eq!(format_bytes(300 * MIB), "300 MiB");
        assert_eq!(format_bytes(812 * MIB), "812 MiB");
        assert_eq!(format_bytes(GIB + GIB / 2), "1.50 GiB");
        assert_eq!(format_bytes(67 * GIB + GIB / 2), "67.5 GiB");
        assert_eq!(format_bytes(80 * GIB), "80.0 GiB");
    }
}
