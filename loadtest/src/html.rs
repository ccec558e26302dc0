//! A self-contained HTML report with inline SVG plots: throughput over time,
//! ACK latency percentiles over time, and the split of outcomes.

use std::fmt::Write as _;

use crate::report::Report;

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 220.0;
const PAD: f64 = 48.0;

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// One line of a chart: name, colour, points as (x, y).
type Series<'a> = (&'a str, &'a str, Vec<(f64, f64)>);

/// A line chart of `series`.
fn line_chart(title: &str, y_label: &str, series: &[Series<'_>]) -> String {
    let points = series.iter().flat_map(|(_, _, p)| p.iter());
    let x_max = points.clone().map(|p| p.0).fold(1.0, f64::max);
    let y_max = points.map(|p| p.1).fold(1e-9, f64::max) * 1.1;
    let x = |v: f64| PAD + v / x_max * (WIDTH - 2.0 * PAD);
    let y = |v: f64| HEIGHT - PAD + -(v / y_max) * (HEIGHT - 2.0 * PAD);
    let mut svg = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="11">
<text x="{PAD}" y="18" font-size="13" font-weight="bold">{}</text>
<line x1="{PAD}" y1="{b}" x2="{r}" y2="{b}" stroke="#333"/><line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{b}" stroke="#333"/>
<text x="{PAD}" y="{lx}">0</text><text x="{r}" y="{lx}" text-anchor="end">{x_max:.0} s</text>
<text x="4" y="{ty}">{y_max:.1}</text><text x="4" y="{b}">0</text><text x="4" y="{ly}">{}</text>
"##,
        escape(title),
        escape(y_label),
        b = HEIGHT - PAD,
        r = WIDTH - PAD,
        lx = HEIGHT - PAD + 16.0,
        ty = PAD + 4.0,
        ly = HEIGHT / 2.0,
    );
    for (i, (name, colour, points)) in series.iter().enumerate() {
        let path: Vec<String> = points
            .iter()
            .map(|(px, py)| format!("{:.1},{:.1}", x(*px), y(*py)))
            .collect();
        let _ = writeln!(
            svg,
            r##"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/><text x="{}" y="{}" fill="{colour}">{}</text>"##,
            path.join(" "),
            WIDTH - PAD - 140.0,
            PAD + 14.0 * i as f64,
            escape(name)
        );
    }
    svg.push_str("</svg>");
    svg
}

/// Horizontal bars for the outcome split.
fn bar_chart(title: &str, bars: &[(&str, &str, u64)]) -> String {
    let max = bars.iter().map(|b| b.2).max().unwrap_or(1).max(1) as f64;
    let height = 40.0 + 26.0 * bars.len() as f64;
    let mut svg = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" font-size="11">
<text x="8" y="18" font-size="13" font-weight="bold">{}</text>
"##,
        escape(title)
    );
    for (i, (name, colour, value)) in bars.iter().enumerate() {
        let top = 30.0 + 26.0 * i as f64;
        let w = (*value as f64 / max) * (WIDTH - 260.0);
        let _ = writeln!(
            svg,
            r##"<text x="8" y="{}">{}</text><rect x="200" y="{top}" width="{w:.1}" height="18" fill="{colour}"/><text x="{}" y="{}">{value}</text>"##,
            top + 13.0,
            escape(name),
            205.0 + w,
            top + 13.0
        );
    }
    svg.push_str("</svg>");
    svg
}

/// CPU per acknowledged message, per process (empty without figures).
fn cpu_table(report: &Report) -> String {
    if report.cpu.is_empty() {
        return String::new();
    }
    let mut html = format!(
        "<h2>CPU per message</h2>\n<p>Over the sending phase, per acknowledged message ({}).</p>\n\
         <table><tr><th>process</th><th>µs per message</th><th>CPU seconds</th></tr>\n",
        report.acknowledged()
    );
    for process in &report.cpu {
        let _ = writeln!(
            html,
            "<tr><td>{}</td><td>{:.1}</td><td>{:.2}</td></tr>",
            escape(&process.name),
            process.us_per_message,
            process.cpu_seconds
        );
    }
    html.push_str("</table>\n");
    if report
        .cpu
        .iter()
        .any(|p| p.name == crate::cpu::EMBEDDED_PROCESS)
    {
        html.push_str(
            "<p>--embedded: the services run in the driver's process; the figure is the whole process.</p>\n",
        );
    }
    html
}

/// The whole report as one HTML page with no external resources.
pub fn render(report: &Report) -> String {
    let throughput: Vec<(f64, f64)> = report
        .timeline
        .iter()
        .map(|s| (s.second as f64, s.acked as f64))
        .collect();
    let p50: Vec<(f64, f64)> = report
        .timeline
        .iter()
        .map(|s| (s.second as f64, s.p50_ms))
        .collect();
    let p99: Vec<(f64, f64)> = report
        .timeline
        .iter()
        .map(|s| (s.second as f64, s.p99_ms))
        .collect();
    let o = &report.outcomes;
    let errors: u64 = o.errors.values().sum();
    let summary = escape(&report.render());
    let cpu = cpu_table(report);
    format!(
        r##"<!doctype html>
<html><head><meta charset="utf-8"><title>imdedup load report: {scenario}</title>
<style>body{{font-family:sans-serif;margin:24px;max-width:780px}} pre{{background:#f4f4f4;padding:12px}} td,th{{padding:2px 12px}} td{{text-align:right}} td:first-child{{text-align:left}}</style></head>
<body><h1>imdedup load report: {scenario}</h1>
{throughput}
{latency}
{outcomes}
{cpu}
<h2>Summary</h2><pre>{summary}</pre>
</body></html>
"##,
        scenario = escape(&report.scenario),
        throughput = line_chart(
            "Throughput (ACKs received per second)",
            "msgs/s",
            &[("acked", "#1f77b4", throughput)]
        ),
        latency = line_chart(
            "ACK latency percentiles",
            "ms",
            &[("p50", "#2ca02c", p50), ("p99", "#d62728", p99)]
        ),
        outcomes = bar_chart(
            "Outcomes of the copies that reached the server",
            &[
                ("new (stored)", "#1f77b4", o.stored),
                ("caught by the window", "#2ca02c", o.duplicate_window),
                (
                    "caught by the unique key",
                    "#ff7f0e",
                    o.duplicate_unique_key
                ),
                ("errors", "#d62728", errors),
            ]
        ),
    )
}
