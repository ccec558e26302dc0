//! The standard process metrics (`process_cpu_seconds_total`,
//! `process_resident_memory_bytes`, `process_open_fds`, `process_max_fds`,
//! `process_start_time_seconds`), read from `/proc/self` at each scrape, as
//! every Prometheus client library serves them: the CPU a service spends per
//! message is the figure that decides what a deployment costs.
//! On systems without `/proc` the collector serves nothing.

use std::fs;

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
    registry::{Registry, Unit},
};

/// Clock ticks per second of `/proc/*/stat` times: USER_HZ, which Linux
/// fixes at 100 for user space on every mainstream architecture.
const TICKS_PER_SECOND: f64 = 100.0;

/// Register the process metrics in `registry`.
pub fn register(registry: &mut Registry) {
    registry.register_collector(Box::new(ProcessCollector));
}

#[derive(Debug)]
struct ProcessCollector;

/// What `/proc/self` says now.
#[derive(Debug, Default, PartialEq)]
pub struct ProcessStats {
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub open_fds: u64,
    pub max_fds: Option<u64>,
    pub start_time_seconds: Option<f64>,
}

impl ProcessStats {
    /// Read `/proc/self`; `None` where there is no `/proc`.
    pub fn read() -> Option<Self> {
        let stat = fs::read_to_string("/proc/self/stat").ok()?;
        let (cpu_ticks, start_ticks) = parse_stat(&stat)?;
        let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
        let boot = fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| parse_boot_time(&s));
        Some(Self {
            cpu_seconds: cpu_ticks as f64 / TICKS_PER_SECOND,
            resident_bytes: parse_vm_rss_kb(&status).unwrap_or(0) * 1024,
            open_fds: fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64),
            max_fds: fs::read_to_string("/proc/self/limits")
                .ok()
                .and_then(|s| parse_max_open_files(&s)),
            start_time_seconds: boot.map(|b| b as f64 + start_ticks as f64 / TICKS_PER_SECOND),
        })
    }
}

/// utime + stime, and starttime, in ticks: fields 14, 15 and 22 of
/// `/proc/self/stat`, counted after the command name (which may hold
/// spaces and parentheses, so the split is at its last `)`).
fn parse_stat(stat: &str) -> Option<(u64, u64)> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // `fields[0]` is field 3 (state).
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some((field(14)? + field(15)?, field(22)?))
}

fn parse_vm_rss_kb(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn parse_boot_time(stat: &str) -> Option<u64> {
    stat.lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

fn parse_max_open_files(limits: &str) -> Option<u64> {
    limits
        .lines()
        .find(|l| l.starts_with("Max open files"))?
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(stats) = ProcessStats::read() else {
            return Ok(());
        };
        ConstCounter::new(stats.cpu_seconds).encode(encoder.encode_descriptor(
            "process_cpu",
            "Total user and system CPU time spent in seconds",
            Some(&Unit::Seconds),
            prometheus_client::metrics::MetricType::Counter,
        )?)?;
        ConstGauge::new(stats.resident_bytes as i64).encode(encoder.encode_descriptor(
            "process_resident_memory",
            "Resident memory size in bytes",
            Some(&Unit::Bytes),
            prometheus_client::metrics::MetricType::Gauge,
        )?)?;
        ConstGauge::new(stats.open_fds as i64).encode(encoder.encode_descriptor(
            "process_open_fds",
            "Number of open file descriptors",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?)?;
        if let Some(max) = stats.max_fds {
            ConstGauge::new(max as i64).encode(encoder.encode_descriptor(
                "process_max_fds",
                "Maximum number of open file descriptors",
                None,
                prometheus_client::metrics::MetricType::Gauge,
            )?)?;
        }
        if let Some(start) = stats.start_time_seconds {
            ConstGauge::new(start).encode(encoder.encode_descriptor(
                "process_start_time",
                "Start time of the process since unix epoch in seconds",
                Some(&Unit::Seconds),
                prometheus_client::metrics::MetricType::Gauge,
            )?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stat_line_is_read_past_a_command_name_with_spaces_and_parentheses() {
        let stat = "4242 (imdedup (x) y) S 1 4242 4242 0 -1 4194560 1000 0 0 0 \
                    250 130 0 0 20 0 9 0 123456 1000000 2000 18446744073709551615";
        assert_eq!(parse_stat(stat), Some((380, 123456)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn rss_limits_and_boot_time_are_found_in_their_files() {
        assert_eq!(
            parse_vm_rss_kb("Name:\timdedup\nVmRSS:\t   12345 kB\n"),
            Some(12345)
        );
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            20000                20000                files\n";
        assert_eq!(parse_max_open_files(limits), Some(20000));
        assert_eq!(
            parse_boot_time("cpu  1 2 3\nbtime 1764500000\n"),
            Some(1_764_500_000)
        );
    }

    #[test]
    fn this_process_has_spent_cpu_and_holds_memory_and_files() {
        let Some(stats) = ProcessStats::read() else {
            return; // no /proc here
        };
        // Spend a little CPU so the counter cannot be zero by rounding.
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let after = ProcessStats::read().unwrap();
        assert!(after.cpu_seconds >= stats.cpu_seconds);
        assert!(after.resident_bytes > 1 << 20, "{after:?}");
        assert!(after.open_fds >= 3, "{after:?}");
        assert!(after.start_time_seconds.unwrap_or_default() > 1.6e9);
        let mut registry = Registry::default();
        register(&mut registry);
        let text = crate::metrics::render(&registry);
        for name in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_start_time_seconds",
        ] {
            assert!(text.contains(name), "{name} missing:\n{text}");
        }
    }
}
