//! `imdedup-load`: drive a gateway like a crowd of phones, then audit.

use std::{path::PathBuf, time::Duration};

use clap::{Args, Parser, Subcommand};
use imdedup_client::Encoding;
use imdedup_loadtest::{
    LoadConfig,
    config::Target,
    cpu::AdminTarget,
    phone::ResendPolicy,
    run,
    search::{Search, Step},
};
use imdedup_runtime::secret::Secret;

// Many small allocations on many threads: glibc's arenas contend under load.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "imdedup-load", version, about)]
struct Cli {
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Subcommand)]
enum Scenario {
    /// The book's chapter 4: 10,000 messages at 10% loss per leg, resends at
    /// 0, 1, 3, 7, 15 s (compressed by --time-scale), late resends an hour on.
    Book(Common),
    /// Rated load with realistic loss, for the given duration.
    Steady(Common),
    /// Every phone's outbox goes out once and every ACK is lost; then all
    /// phones reconnect at once and resend their outboxes, jittered over
    /// --storm-window.
    Storm(Common),
    /// The highest rate sustained with p99 ACK latency under --p99: steady
    /// steps of --duration each, bisecting between --min-rate and --max-rate.
    Search(SearchArgs),
    /// Past capacity: the capacity C measured first (the highest rate with
    /// p99 ACK latency under --p99, or --capacity), then 0.5 C, 1.5 C for
    /// --surge, 0.5 C, 3 C for --surge, 0.5 C; per second goodput, tries
    /// and refusals, per phase give-ups, tries per message and CPU.
    Overload(OverloadArgs),
    /// Backend systems send notices through the business API
    /// (POST /v1/messages) with client timeouts short enough that many
    /// calls time out after being stored, and retry with the same
    /// idempotency key; receivers audit what was stored [default rate 300].
    Business(BusinessArgs),
}

#[derive(Args)]
struct BusinessArgs {
    #[command(flatten)]
    common: Common,
    /// Backend systems, each sending as its own account with its own
    /// service token.
    #[arg(long, default_value_t = 8)]
    systems: usize,
    /// With --url: the gateway's service-token secret.
    #[arg(long, env = "IMDEDUP_SERVICE_TOKEN_SECRET", hide_env_values = true)]
    service_token_secret: Option<Secret>,
    /// Client timeout of a call's first try; each retry waits twice as long
    /// as the try before, up to --max-call-timeout, and pauses as long as
    /// its timeout before the next.
    #[arg(long, default_value = "5ms", value_parser = humantime::parse_duration)]
    call_timeout: Duration,
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    max_call_timeout: Duration,
    /// Tries per notice before its system gives up.
    #[arg(long, default_value_t = 12)]
    max_tries: u32,
}

#[derive(Args)]
struct OverloadArgs {
    #[command(flatten)]
    common: Common,
    /// The capacity to overload, instead of measuring it.
    #[arg(long)]
    capacity: Option<f64>,
    /// The p99 ACK latency the capacity must stay under.
    #[arg(long, default_value = "250ms", value_parser = humantime::parse_duration)]
    p99: Duration,
    /// How long each surge lasts.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    surge: Duration,
    /// The load before and between the surges, as a share of the capacity.
    #[arg(long, default_value_t = 0.5, value_parser = calm_share)]
    calm: f64,
    /// Where the capacity search starts and ends.
    #[arg(long, default_value_t = 500.0)]
    min_rate: f64,
    #[arg(long, default_value_t = 30_000.0)]
    max_rate: f64,
}

#[derive(Args)]
struct SearchArgs {
    #[command(flatten)]
    common: Common,
    /// The p99 ACK latency a sustained rate must stay under.
    #[arg(long, default_value = "25ms", value_parser = humantime::parse_duration)]
    p99: Duration,
    #[arg(long, default_value_t = 1000.0)]
    min_rate: f64,
    #[arg(long, default_value_t = 30_000.0)]
    max_rate: f64,
    /// Stop when the bracket around the answer is this narrow (a fraction).
    #[arg(long, default_value_t = 0.05)]
    precision: f64,
}

#[derive(Args)]
struct Common {
    /// Start a local cluster on the embedded backends in this process.
    #[arg(long, conflicts_with = "url")]
    embedded: bool,
    /// A running gateway's WebSocket URL (`ws://host:port/v1/ws`).
    #[arg(long, env = "IMDEDUP_LOAD_URL")]
    url: Option<String>,
    /// The gateway's token secret, to mint the phones' tokens.
    #[arg(long, env = "IMDEDUP_TOKEN_SECRET", hide_env_values = true)]
    token_secret: Option<Secret>,
    /// With --url: a service's admin port, `NAME=http://HOST:PORT`
    /// (repeatable). Its `process_cpu_seconds_total` is read before and
    /// after sending, and the report gives its CPU per acknowledged message,
    /// the services' sum and the driver's own.
    #[arg(long = "admin", value_name = "NAME=URL", requires = "url", value_parser = AdminTarget::parse)]
    admin: Vec<AdminTarget>,
    /// With --url: the gateway's groups file (its --groups-file), where the
    /// run's group conversations and members are added.
    #[arg(long, env = "IMDEDUP_GROUPS_FILE", requires = "url")]
    groups_file: Option<PathBuf>,
    /// Messages to send [default: book 10000; steady rate x duration].
    #[arg(long)]
    messages: Option<u64>,
    /// Offered messages per second [default: book 2000, steady 13900].
    #[arg(long)]
    rate: Option<f64>,
    /// Steady only: how long to offer the rate.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Time to ramp up to the rate.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    ramp: Duration,
    /// Phones (each with its own connection).
    #[arg(long, default_value_t = 200)]
    users: usize,
    /// Share of messages to group conversations.
    #[arg(long, default_value_t = 0.3)]
    group_share: f64,
    #[arg(long, default_value_t = 20)]
    groups: usize,
    #[arg(long, default_value_t = 60)]
    body_bytes: usize,
    /// Chance a send is lost on the way up [default: book 0.1, steady 0.001].
    #[arg(long)]
    loss_send: Option<f64>,
    /// Chance an ACK is lost on the way down [default: book 0.1, steady 0.001].
    #[arg(long)]
    loss_ack: Option<f64>,
    /// Scales the 0, 1, 3, 7, 15 s / 31 s resend schedule [default: book
    /// 0.01, steady 1].
    #[arg(long)]
    time_scale: Option<f64>,
    /// Jitter of each resend delay, as a fraction.
    #[arg(long, default_value_t = 0.1)]
    jitter: f64,
    /// Share of messages also sent at the same moment over a second
    /// connection of the sender.
    #[arg(long, default_value_t = 0.0)]
    concurrent_copies: f64,
    /// Messages resent an hour later, after the window (embedded only)
    /// [default: book 100 with --embedded, else 0].
    #[arg(long)]
    late_resends: Option<usize>,
    /// Ingest shards of the embedded cluster.
    #[arg(long, default_value_t = 2)]
    shards: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Run the embedded cluster with dedup off, to count the repeats dedup
    /// prevents (local mode only).
    #[arg(long)]
    no_dedup: bool,
    /// Write the report as JSON here too.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Storm only: the window over which reconnected phones resend.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    storm_window: Duration,
    /// Write a self-contained HTML report with plots here.
    #[arg(long)]
    html: Option<PathBuf>,
    /// Write every message's tries and answers here, one tab-separated
    /// line each (when it was due, its latency, tries, sends held back,
    /// then each try: what came back and when); to read what a second's
    /// messages waited for.
    #[arg(long)]
    events: Option<PathBuf>,
    /// No progress line.
    #[arg(long)]
    quiet: bool,
    /// Do not follow the conversations with a cursor while the load runs
    /// (followers are on by default; their pulls cost some driver CPU).
    #[arg(long)]
    no_followers: bool,
    /// The phones' frames: `json` (text) or `protobuf` (binary); the
    /// gateway speaks both.
    #[arg(long, default_value = "json", value_parser = ["json", "protobuf"])]
    encoding: String,
    /// Phones that do not ask the gateway to hold their sends when it is
    /// full: every deferred send is refused and tried again, as clients
    /// that predate the `queued` answer do.
    #[arg(long)]
    no_queue: bool,
    /// Client-side adaptive throttling factor (the Google SRE book's `K`):
    /// a phone the gateway refuses (`overloaded`) holds back new sends
    /// itself, so that the gateway reads about K times what it accepts.
    /// 0 turns it off.
    #[arg(long, default_value_t = 2.0)]
    throttle: f64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let (name, args) = match cli.scenario {
        Scenario::Book(args) => ("book", args),
        Scenario::Steady(args) => ("steady", args),
        Scenario::Storm(args) => ("storm", args),
        Scenario::Search(search) => return run_search(search).await,
        Scenario::Business(business) => return run_business(business).await,
        Scenario::Overload(overload) => return run_overload(overload).await,
    };
    let config = load_config(name, &args, args.rate)?;
    let outcome = run(config).await?;
    print!("{}", outcome.report.render());
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&outcome.report)?)?;
        eprintln!("report written to {}", path.display());
    }
    if let Some(path) = &args.html {
        std::fs::write(path, imdedup_loadtest::html::render(&outcome.report))?;
        eprintln!("HTML report written to {}", path.display());
    }
    if !outcome.audit.passed() {
        std::process::exit(1);
    }
    Ok(())
}

async fn run_business(args: BusinessArgs) -> anyhow::Result<()> {
    let config = imdedup_loadtest::business::BusinessConfig {
        load: load_config("business", &args.common, args.common.rate.or(Some(300.0)))?,
        systems: args.systems,
        service_token_secret: args.service_token_secret,
        call_timeout: args.call_timeout,
        max_call_timeout: args.max_call_timeout,
        max_tries: args.max_tries,
    };
    let outcome = imdedup_loadtest::business::run(config).await?;
    print!("{}", outcome.report.render());
    if let Some(path) = &args.common.json {
        std::fs::write(path, serde_json::to_vec_pretty(&outcome.report)?)?;
        eprintln!("report written to {}", path.display());
    }
    if let Some(path) = &args.common.html {
        std::fs::write(path, imdedup_loadtest::html::render(&outcome.report))?;
        eprintln!("HTML report written to {}", path.display());
    }
    let key_reused = outcome.report.business.as_ref().map_or(0, |b| b.key_reused);
    if !outcome.audit.passed() || key_reused > 0 {
        std::process::exit(1);
    }
    Ok(())
}

async fn run_overload(args: OverloadArgs) -> anyhow::Result<()> {
    // The services' CPU per ACK at the highest sustained rate.
    let mut at_capacity_us = None;
    let capacity = match args.capacity {
        Some(capacity) => capacity,
        None => {
            let mut search = Search::new(
                args.min_rate,
                args.max_rate,
                0.1,
                args.p99.as_secs_f64() * 1000.0,
            );
            while let Some(rate) = search.next_rate() {
                let mut config = load_config("steady", &args.common, Some(rate))?;
                config.users = users_for(rate).max(args.common.users);
                let outcome = run(config).await?;
                let step =
                    Step::judge(&outcome.report, outcome.audit.passed(), search.p99_bound_ms);
                eprintln!(
                    "overload: capacity search {rate:.0}/s -> p99 {:.0} ms, {}",
                    step.p99_ms,
                    step.verdict()
                );
                if !step.audit_passed {
                    print!("{}", outcome.report.render());
                    anyhow::bail!("the audit failed during the capacity search");
                }
                if step.sustained && search.sustained.is_none_or(|s| rate > s) {
                    at_capacity_us = outcome
                        .report
                        .cpu
                        .iter()
                        .find(|p| p.name == "services")
                        .map(|p| p.us_per_message);
                }
                search.record(step);
            }
            print!("{}", search.render());
            search
                .sustained
                .ok_or_else(|| anyhow::anyhow!("no rate sustained p99 <= {:?}", args.p99))?
        }
    };
    let schedule = imdedup_loadtest::overload::phases(capacity, args.surge, args.calm);
    let mut config = load_config("steady", &args.common, Some(capacity))?;
    config.messages = imdedup_loadtest::overload::schedule_messages(&schedule);
    config.scenario = "overload".to_owned();
    // Each phone sends at most 25 messages a second, at the highest rate.
    config.users = users_for(3.0 * capacity).max(args.common.users);
    config.schedule = schedule.clone();
    config.ramp = Duration::ZERO;
    let give_up = config.policy.give_up;
    let outcome = run(config).await?;
    let recorded = outcome
        .seconds
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("the run recorded no seconds"))?;
    let mut figures =
        imdedup_loadtest::overload::Figures::new(capacity, &schedule, recorded, give_up);
    figures.services_us_at_capacity = at_capacity_us;
    print!("{}", outcome.report.render());
    if let Some(path) = &args.common.json {
        std::fs::write(path, serde_json::to_vec_pretty(&figures)?)?;
        eprintln!("figures written to {}", path.display());
    }
    print!("{}", figures.render());
    if !outcome.audit.passed() {
        std::process::exit(1);
    }
    Ok(())
}

/// `--calm`: a share of the capacity above 0 and below 1 (the load the
/// service is to recover at must be one it can serve).
fn calm_share(text: &str) -> Result<f64, String> {
    let share: f64 = text.parse().map_err(|e| format!("not a number: {e}"))?;
    if share > 0.0 && share < 1.0 {
        Ok(share)
    } else {
        Err(format!(
            "{share} is not a share of the capacity between 0 and 1"
        ))
    }
}

/// Phones for `rate` messages a second at 25 each (a busy person's phone
/// sends far less; a bot account, about this).
fn users_for(rate: f64) -> usize {
    ((rate / 25.0).ceil() as usize).max(2)
}

async fn run_search(args: SearchArgs) -> anyhow::Result<()> {
    let mut search = Search::new(
        args.min_rate,
        args.max_rate,
        args.precision,
        args.p99.as_secs_f64() * 1000.0,
    );
    while let Some(rate) = search.next_rate() {
        eprintln!(
            "search: offering {rate:.0} messages/s for {:?}",
            args.common.duration
        );
        let outcome = run(load_config("steady", &args.common, Some(rate))?).await?;
        let step = Step::judge(&outcome.report, outcome.audit.passed(), search.p99_bound_ms);
        eprintln!(
            "search: {rate:.0}/s -> p99 {:.2} ms, {}",
            step.p99_ms,
            step.verdict()
        );
        if !step.audit_passed {
            print!("{}", outcome.report.render());
        }
        search.record(step);
    }
    print!("{}", search.render());
    if let Some(path) = &args.common.json {
        std::fs::write(path, serde_json::to_vec_pretty(&search)?)?;
        eprintln!("search written to {}", path.display());
    }
    // A failed audit is a failure whatever the rate; no answer is one too.
    if search.steps.iter().any(|s| !s.audit_passed) || search.sustained.is_none() {
        std::process::exit(1);
    }
    Ok(())
}

/// The run a scenario stands for, with its defaults filled in.
fn load_config(name: &str, args: &Common, rate: Option<f64>) -> anyhow::Result<LoadConfig> {
    let book = name == "book";
    let storm = name == "storm";
    let target = match (&args.url, args.embedded) {
        (Some(url), false) => Target::Gateway {
            url: url.clone(),
            token_secret: args.token_secret.clone().ok_or_else(|| {
                anyhow::anyhow!("--url needs --token-secret (or IMDEDUP_TOKEN_SECRET)")
            })?,
            groups_file: args.groups_file.clone(),
        },
        (None, true) => Target::Embedded {
            shards: args.shards,
        },
        _ => anyhow::bail!("give --embedded or --url"),
    };
    let rate = rate.unwrap_or(match name {
        "book" => 2000.0,
        "storm" => 5000.0,
        _ => 13_900.0,
    });
    let loss = match name {
        "book" => 0.1,
        "storm" => 0.01,
        // Its systems lose answers to their own short timeouts.
        "business" => 0.0,
        _ => 0.001,
    };
    let time_scale = args.time_scale.unwrap_or(match name {
        "book" => 0.01,
        "storm" => 0.1,
        _ => 1.0,
    });
    let embedded = matches!(target, Target::Embedded { .. });
    Ok(LoadConfig {
        scenario: name.to_owned(),
        target,
        messages: args.messages.unwrap_or(match name {
            "book" => 10_000,
            // Ten messages in every phone's outbox.
            "storm" => args.users as u64 * 10,
            _ => (rate * args.duration.as_secs_f64()) as u64,
        }),
        rate,
        ramp: args.ramp,
        users: args.users,
        group_share: args.group_share,
        groups: args.groups,
        body_bytes: args.body_bytes,
        loss_send: args.loss_send.unwrap_or(loss),
        loss_ack: args.loss_ack.unwrap_or(loss),
        policy: ResendPolicy {
            jitter: args.jitter,
            ..ResendPolicy::book(time_scale)
        },
        concurrent_copies: args.concurrent_copies,
        late_resends: args
            .late_resends
            .unwrap_or(if book && embedded && !args.no_dedup {
                100
            } else {
                0
            }),
        seed: args.seed,
        dedup_off: args.no_dedup,
        storm_window: if storm {
            args.storm_window
        } else {
            Duration::ZERO
        },
        progress: !args.quiet,
        events: args.events.clone(),
        followers: !args.no_followers,
        encoding: if args.encoding == "protobuf" {
            Encoding::Protobuf
        } else {
            Encoding::Json
        },
        queue: !args.no_queue,
        throttle: args.throttle,
        admin: args.admin.clone(),
        schedule: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--calm` takes a share of the capacity the service can recover at,
    /// and says why it refuses anything else.
    #[test]
    fn calm_is_a_share_below_the_capacity() {
        assert_eq!(calm_share("0.8"), Ok(0.8));
        for bad in ["0", "1", "1.2", "-0.5", "NaN"] {
            let error = calm_share(bad).expect_err(bad);
            assert!(error.contains("between 0 and 1"), "{bad}: {error}");
        }
        let error = calm_share("half").expect_err("not a number");
        assert!(error.starts_with("not a number"), "{error}");
    }
}
