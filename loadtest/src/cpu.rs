//! CPU spent per message, per process: the services' (read from the
//! standard `process_cpu_seconds_total` on their admin ports before and
//! after a run) and the driver's own (from `/proc/self`). On a shared box
//! wall-clock rates are noisy; CPU seconds per message are not.

use std::time::Duration;

use anyhow::Context;
use imdedup_runtime::process::ProcessStats;
use imdedup_testkit::prom::sum_samples;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A service's admin port, by name: `gateway=http://127.0.0.1:9100`.
#[derive(Debug, Clone)]
pub struct AdminTarget {
    pub name: String,
    /// `host:port` of its admin HTTP server.
    pub addr: String,
}

impl AdminTarget {
    /// `NAME=http://HOST:PORT` (or `NAME=HOST:PORT`).
    pub fn parse(raw: &str) -> anyhow::Result<Self> {
        let (name, url) = raw
            .split_once('=')
            .with_context(|| format!("{raw:?}: expected NAME=http://HOST:PORT"))?;
        let addr = url
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .trim_end_matches("/metrics")
            .to_owned();
        anyhow::ensure!(
            !name.is_empty() && addr.contains(':'),
            "{raw:?}: expected NAME=http://HOST:PORT"
        );
        Ok(Self {
            name: name.to_owned(),
            addr,
        })
    }
}

/// One process's CPU over a run.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessCpu {
    pub name: String,
    pub cpu_seconds: f64,
    /// CPU microseconds per acknowledged message.
    pub us_per_message: f64,
}

/// CPU readings taken before a run.
pub struct CpuBaseline {
    services: Vec<(AdminTarget, f64)>,
    driver: Option<f64>,
}

/// Read every target's CPU counter, and the driver's, now.
pub async fn baseline(targets: &[AdminTarget]) -> anyhow::Result<CpuBaseline> {
    let mut services = Vec::with_capacity(targets.len());
    for target in targets {
        services.push((target.clone(), read(target).await?));
    }
    Ok(CpuBaseline {
        services,
        driver: ProcessStats::read().map(|s| s.cpu_seconds),
    })
}

impl CpuBaseline {
    /// The readings: the services' sum (if any were given) and the
    /// driver's own, in CPU seconds.
    pub fn totals(&self) -> (Option<f64>, Option<f64>) {
        let services = (!self.services.is_empty())
            .then(|| self.services.iter().map(|(_, seconds)| seconds).sum());
        (services, self.driver)
    }

    /// The CPU spent since the baseline, per process and per one of
    /// `messages`; the services' sum last, as `services`, then `driver`.
    pub async fn since(&self, messages: u64) -> anyhow::Result<Vec<ProcessCpu>> {
        let per = |seconds: f64| seconds * 1e6 / messages.max(1) as f64;
        let mut out = Vec::new();
        let mut total = 0.0;
        for (target, before) in &self.services {
            let spent = (read(target).await? - before).max(0.0);
            total += spent;
            out.push(ProcessCpu {
                name: target.name.clone(),
                cpu_seconds: spent,
                us_per_message: per(spent),
            });
        }
        if !self.services.is_empty() {
            out.push(ProcessCpu {
                name: "services".to_owned(),
                cpu_seconds: total,
                us_per_message: per(total),
            });
        }
        if let (Some(before), Some(now)) = (self.driver, ProcessStats::read()) {
            let spent = (now.cpu_seconds - before).max(0.0);
            out.push(ProcessCpu {
                name: "driver".to_owned(),
                cpu_seconds: spent,
                us_per_message: per(spent),
            });
        }
        Ok(out)
    }
}

/// `process_cpu_seconds_total` of `target`, by a plain HTTP GET.
async fn read(target: &AdminTarget) -> anyhow::Result<f64> {
    let text = tokio::time::timeout(Duration::from_secs(5), get_metrics(&target.addr))
        .await
        .with_context(|| format!("{}: no answer from {}", target.name, target.addr))??;
    sum_samples(&text, "process_cpu_seconds_total", &[]).with_context(|| {
        format!(
            "{}: {} serves no process_cpu_seconds_total",
            target.name, target.addr
        )
    })
}

async fn get_metrics(addr: &str) -> anyhow::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("cannot connect to {addr}"))?;
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await?;
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .with_context(|| format!("{addr}: not an HTTP answer"))?;
    anyhow::ensure!(
        head.starts_with("HTTP/1.1 200"),
        "{addr}: {}",
        head.lines().next().unwrap_or_default()
    );
    Ok(body.to_owned())
}

/// The name of the one CPU figure of an embedded run (the driver and the
/// services in one process).
pub const EMBEDDED_PROCESS: &str = "driver+services";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_name_and_address() {
        let t = AdminTarget::parse("gateway=http://127.0.0.1:9100/metrics").unwrap();
        assert_eq!(
            (t.name.as_str(), t.addr.as_str()),
            ("gateway", "127.0.0.1:9100")
        );
        assert!(AdminTarget::parse("127.0.0.1:9100").is_err());
        assert!(AdminTarget::parse("x=nohost").is_err());
    }

    #[tokio::test]
    async fn the_driver_measures_its_own_cpu_per_message() {
        let base = baseline(&[]).await.unwrap();
        let mut x = 0u64;
        for i in 0..30_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let cpu = base.since(1000).await.unwrap();
        if let Some(driver) = cpu.iter().find(|c| c.name == "driver") {
            assert!(driver.cpu_seconds >= 0.0);
            assert!((driver.us_per_message - driver.cpu_seconds * 1e3).abs() < 1e-6);
        }
    }
}
