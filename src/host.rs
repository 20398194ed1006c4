//! Queries of the host's memory, in one place for the engine (whether
//! frozen parameters fit in host memory) and `zero doctor` (its `ram` and
//! `hugepages` lines).

/// `/proc/meminfo`'s text; the error names the file.
pub(crate) fn meminfo() -> Result<String, String> {
    let path = "/proc/meminfo";
    std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))
}

/// The value of `key` in `/proc/meminfo`'s text `text`, as a number
/// (`kB` stripped: KiB for sizes, a count for `HugePages_*`), if present.
pub(crate) fn meminfo_field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        if k.trim() != key {
            return None;
        }
        v.trim().trim_end_matches("kB").trim().parse().ok()
    })
}

/// The host's available memory in bytes (`MemAvailable` of
/// `/proc/meminfo`), if it can be read.
pub(crate) fn mem_available() -> Option<u64> {
    meminfo_field(&meminfo().ok()?, "MemAvailable").map(|k| k * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_fields_in_kib_and_counts() {
        let t = "MemTotal:       65536 kB\nMemAvailable:   1024 kB\nHugePages_Total:       4\n";
        assert_eq!(meminfo_field(t, "MemTotal"), Some(65536));
        assert_eq!(meminfo_field(t, "MemAvailable"), Some(1024));
        assert_eq!(meminfo_field(t, "HugePages_Total"), Some(4));
        assert_eq!(meminfo_field(t, "HugePages_Free"), None);
        assert_eq!(meminfo_field("MemTotal: lots kB\n", "MemTotal"), None);
    }
}
