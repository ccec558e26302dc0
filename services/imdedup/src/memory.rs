//! Transparent huge pages off for the services' heaps.
//!
//! Under load a service's heap grows in bursts: a gateway holds tens of
//! thousands of sends in a surge (~1.4 KB each), an ingest's recent-ID
//! window fills. The allocator (mimalloc) asks the kernel for huge pages on
//! its arenas, so each fresh 2 MiB of heap is a huge page zeroed at its first
//! touch, all at once, on the thread that touched it. On a VM whose host
//! takes free memory back (free page reporting, as on the Firecracker VMs
//! these figures come from) that cost ~10 ms of CPU per MB against ~0.4 ms
//! for 4 KiB pages, and the kernel's zeroing was 15% of the gateway's CPU in
//! a 1.5x surge and whole stalled seconds in a 3x one (docs/overload-log.md,
//! "Huge pages off"). Redis, MongoDB and Cassandra advise turning them off
//! for the same reason: latency spikes at first touch and compaction, for
//! little gain on heaps of small objects.

use std::{ffi::OsString, io};

/// mimalloc's own switch: set, it decides, and the process keeps what the
/// system and mimalloc do (`MIMALLOC_ALLOW_THP=1` keeps huge pages).
pub const ALLOW_THP_VAR: &str = "MIMALLOC_ALLOW_THP";

/// Turn transparent huge pages off for this process
/// (`prctl(PR_SET_THP_DISABLE)`, inherited by its threads and children),
/// unless `allow_thp` (the value of [`ALLOW_THP_VAR`]) is set. `Ok(true)`
/// if turned off here; elsewhere than Linux, nothing to do.
pub fn no_huge_pages(allow_thp: Option<OsString>) -> io::Result<bool> {
    if allow_thp.is_some() {
        return Ok(false);
    }
    disable_thp()
}

#[cfg(target_os = "linux")]
fn disable_thp() -> io::Result<bool> {
    nix::sys::prctl::set_thp_disable(true)?;
    Ok(true)
}

#[cfg(not(target_os = "linux"))]
fn disable_thp() -> io::Result<bool> {
    Ok(false)
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The services' heaps grow without huge pages: after the call the
    /// kernel says so for the process; with mimalloc's switch set, the
    /// call leaves the process as it is.
    #[test]
    fn the_process_runs_without_huge_pages_unless_mimalloc_is_told_otherwise() {
        let before = nix::sys::prctl::get_thp_disable().expect("prctl");
        assert!(!no_huge_pages(Some("1".into())).expect("prctl"));
        assert_eq!(nix::sys::prctl::get_thp_disable().expect("prctl"), before);
        assert!(no_huge_pages(None).expect("prctl"));
        assert!(nix::sys::prctl::get_thp_disable().expect("prctl"));
        let status = std::fs::read_to_string("/proc/self/status").expect("status");
        if let Some(line) = status.lines().find(|l| l.starts_with("THP_enabled:")) {
            assert_eq!(line.split_whitespace().nth(1), Some("0"), "{line}");
        }
    }
}
