//! One load run: start or reach the target, drive phones open-loop while
//! followers read every conversation with a cursor, resend late, pull every
//! history, audit.

use std::{
    collections::{HashMap, HashSet},
    num::NonZeroU32,
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, bail};
use futures_util::StreamExt;
use imdedup_client::{AckReply, Client, Encoding, HistoryMessage};
use imdedup_cluster::{ClusterOptions, LocalCluster};
use imdedup_domain::{
    clock::{Clock, ManualClock, SystemClock},
    model::Sender,
};
use imdedup_gateway::authz::{Authorizer, DirectConversations, GroupsFile, groups::Groups};
use imdedup_runtime::token::TokenKey;
use rand::{Rng, SeedableRng, rngs::StdRng};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use crate::config::{LoadConfig, Target};
use crate::{
    audit::{Audit, Sent, audit},
    cpu::{self, AdminTarget, ProcessCpu},
    follow::{self, Delivered, Phones},
    link::{Link, Manners},
    names::Names,
    overload::{CpuSample, MessageFate, Recorded, schedule_dues},
    phone::{Fate, Outgoing, Trace, TryCounts, deliver, wait_until},
    report::Report,
};

/// History pulls the audit keeps in flight at once.
pub(crate) const AUDIT_PULLS_IN_FLIGHT: usize = 64;
/// How long followers behind the end of a history after the load may take
/// to reach it: longer than the stores' default pending fence (30 s), after
/// which any reader settles a row whose writer is gone.
const CATCH_UP: Duration = Duration::from_secs(60);

/// The result of a run.
pub struct RunResult {
    pub report: Report,
    pub audit: Audit,
    /// With a schedule: what happened per second and per message.
    pub seconds: Option<Recorded>,
}

/// The sending phase's running totals, for the progress lines and the CPU
/// per acknowledged message.
#[derive(Default)]
struct Progress {
    due: AtomicU64,
    done: AtomicU64,
    acked: AtomicU64,
    resends: AtomicU64,
    errors: AtomicU64,
}

/// One message of the plan: who sends it where, and how its sends go.
struct Planned {
    sender: usize,
    /// The other member of a direct conversation.
    other: Option<usize>,
    id: String,
    conversation: String,
    offsets: Vec<Duration>,
    fates: Vec<Fate>,
    concurrent_copy: bool,
}

/// Every conversation's stored history, each read by `(conversation,
/// phone)` on that phone's link, a few at a time.
pub(crate) async fn pull_histories(
    phones: &[(Link, Option<Client>)],
    readers: Vec<(String, usize)>,
) -> anyhow::Result<HashMap<String, Vec<HistoryMessage>>> {
    let mut pulls = futures_util::stream::iter(readers)
        .map(|(conversation, reader)| async move {
            let pulled = match phones[reader].0.client().await {
                Ok((_, client)) => client.full_history(&conversation).await,
                Err(e) => Err(e),
            };
            (conversation, pulled)
        })
        .buffer_unordered(AUDIT_PULLS_IN_FLIGHT);
    let mut histories = HashMap::new();
    while let Some((conversation, pulled)) = pulls.next().await {
        let rows = match pulled? {
            Ok(rows) => rows,
            Err(e) => bail!("history of {conversation}: {} ({})", e.code, e.message),
        };
        histories.insert(conversation, rows);
    }
    Ok(histories)
}

/// Connect every phone at once (and a second connection each, if asked).
pub(crate) async fn connect_all(
    url: &str,
    tokens: &[String],
    second: bool,
    encoding: Encoding,
    manners: Manners,
) -> anyhow::Result<Vec<(Link, Option<Client>)>> {
    let mut connecting = tokio::task::JoinSet::new();
    for (u, token) in tokens.iter().enumerate() {
        let (url, token) = (url.to_owned(), token.clone());
        connecting.spawn(async move {
            let context = || format!("cannot connect phone {u} to {url}");
            let first = Link::connect(&url, &token, encoding, manners)
                .await
                .with_context(context)?;
            let other = if second {
                Some(
                    Client::connect(&url, &token, encoding)
                        .await
                        .with_context(context)?,
                )
            } else {
                None
            };
            anyhow::Ok((u, (first, other)))
        });
    }
    let mut phones: Vec<Option<(Link, Option<Client>)>> = (0..tokens.len()).map(|_| None).collect();
    while let Some(done) = connecting.join_next().await {
        let (u, phone) = done??;
        phones[u] = Some(phone);
    }
    phones
        .into_iter()
        .map(|p| p.ok_or_else(|| anyhow::anyhow!("a phone did not connect")))
        .collect()
}

/// Every conversation of the plan and the phone that reads it: a member
/// (the first of a direct conversation's two, phone 0 for groups, which
/// every phone of the run belongs to).
fn readers(plan: &[Planned]) -> Vec<(String, usize)> {
    let mut readers: HashMap<&str, usize> = HashMap::new();
    for m in plan {
        let reader = m.other.map_or(0, |other| m.sender.min(other));
        readers.entry(&m.conversation).or_insert(reader);
    }
    readers
        .into_iter()
        .map(|(c, reader)| (c.to_owned(), reader))
        .collect()
}

/// Add `groups` to the JSON groups file at `path` (keeping the groups
/// already there), then give the gateway time to read it again.
async fn add_groups(path: &Path, groups: Groups) -> anyhow::Result<()> {
    let mut all: Groups = match std::fs::read(path) {
        Ok(bytes) if !bytes.is_empty() => serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not a groups file", path.display()))?,
        Ok(_) => Groups::new(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Groups::new(),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    all.extend(groups);
    let fresh = path.with_extension("json.new");
    std::fs::write(&fresh, serde_json::to_vec(&all)?)
        .with_context(|| format!("cannot write {}", fresh.display()))?;
    std::fs::rename(&fresh, path).with_context(|| format!("cannot replace {}", path.display()))?;
    // The gateway looks for a change once a second.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    Ok(())
}

/// When message `n` is due: a linear ramp up to `rate` over `ramp`, then
/// constant, whatever the answers.
pub(crate) fn due_after(n: u64, rate: f64, ramp: Duration) -> Duration {
    let ramp_s = ramp.as_secs_f64();
    let during_ramp = rate * ramp_s / 2.0;
    let n = n as f64;
    let t = if ramp_s > 0.0 && n < during_ramp {
        (2.0 * ramp_s * n / rate).sqrt()
    } else {
        ramp_s + (n - during_ramp.min(n)) / rate
    };
    Duration::from_secs_f64(t)
}

/// Refuse a configuration the run cannot honour, before anything starts.
fn check(config: &LoadConfig) -> anyhow::Result<()> {
    for (name, p) in [
        ("loss-send", config.loss_send),
        ("loss-ack", config.loss_ack),
        ("group-share", config.group_share),
        ("concurrent-copies", config.concurrent_copies),
    ] {
        if !(0.0..=1.0).contains(&p) {
            bail!("--{name} must be between 0 and 1, got {p}");
        }
    }
    if config
        .schedule
        .iter()
        .any(|p| !(p.rate > 0.0 && p.rate.is_finite()))
    {
        bail!("every phase needs a positive rate");
    }
    if !(config.rate > 0.0 && config.rate.is_finite()) {
        bail!("--rate must be positive");
    }
    if config.users < 2 {
        bail!("--users must be at least 2");
    }
    if config.dedup_off && !matches!(config.target, Target::Embedded { .. }) {
        bail!("--no-dedup exists for demonstrations and needs --embedded (local mode)");
    }
    if config.late_resends > 0 && !matches!(config.target, Target::Embedded { .. }) {
        bail!("--late-resends needs --embedded: the driver must move the cluster's clock");
    }
    if !config.admin.is_empty() && matches!(config.target, Target::Embedded { .. }) {
        bail!("--admin needs --url: with --embedded the services run in the driver's process");
    }
    Ok(())
}

/// One load run, phase by phase: check the configuration; start the
/// embedded cluster or reach the gateway; connect the phones and plan every
/// message; drive the phones open-loop (after a storm's first copies, if
/// asked) while followers read along and the CPU is sampled; resend late;
/// pull every history and audit it; report.
pub async fn run(config: LoadConfig) -> anyhow::Result<RunResult> {
    check(&config)?;
    let clock = ManualClock::new();
    let dir = tempfile::tempdir()?;
    let names = Names::new();
    let Reached {
        cluster,
        url,
        token_key,
        now,
    } = reach_target(&config, &clock, dir.path(), &names).await?;
    let mut load = Load::connect_and_plan(&config, &names, url, &token_key, now).await?;
    let reporter = config
        .progress
        .then(|| report_progress(Arc::clone(&load.progress)));

    let mut dues = load.dues();
    let mut storm_acks = vec![Vec::new(); load.plan.len()];
    // CPU from here (the phones are connected, the plan is made) to the last
    // answer of the sending phase: per acknowledged message.
    let cpu_baseline = cpu::baseline(&config.admin).await?;
    if config.storm_window > Duration::ZERO {
        load.storm(&mut dues, &mut storm_acks).await?;
    }
    let order = load.due_order(&dues);
    let followers = Followers::start(&load);
    let Sending {
        counts,
        cpu_samples,
        took: sending,
        started_at_unix_ms,
    } = load.send_open_loop(&dues, order).await?;
    let cpu = cpu_per_message(
        &cpu_baseline,
        load.progress.acked.load(Ordering::Relaxed),
        &config.target,
    )
    .await?;
    if let Some(reporter) = reporter {
        reporter.abort();
    }
    let mut traces = load.take_traces(storm_acks)?;

    let late_caught = load.resend_late(&clock, &mut traces).await?;
    if let Some(path) = &config.events {
        write_events(path, &traces)?;
    }
    let delivered = followers.stop().await?;

    let seconds = recorded(&config, &counts, cpu_samples, &traces);
    let sent = load.sent(&names, traces);
    let result = load.audit_histories(&sent, delivered).await?;
    let mut report = Report::new(&config, &sent, sending, late_caught, result.clone());
    report.started_at_unix_ms = started_at_unix_ms;
    report.cpu = cpu;
    drop(load);
    if let Some(cluster) = cluster {
        cluster.shutdown().await;
    }
    Ok(RunResult {
        report,
        audit: result,
        seconds,
    })
}

/// What the run reached: the cluster it started (with `--embedded`), the
/// gateway's URL, the key that mints the phones' tokens and the moment
/// (Unix seconds) their validity counts from.
struct Reached {
    cluster: Option<LocalCluster>,
    url: String,
    token_key: TokenKey,
    now: u64,
}

/// The run's groups: with a group share, every phone of the run is a member
/// of every group of the run; direct conversations need no declaration.
fn run_groups(config: &LoadConfig, names: &Names) -> Groups {
    if config.group_share > 0.0 {
        let members: HashSet<String> = (0..config.users).map(|u| names.user(u)).collect();
        (0..config.groups.max(1))
            .map(|g| (names.group(g), members.clone()))
            .collect()
    } else {
        Groups::new()
    }
}

/// Start the embedded cluster (on the run's clock, in `dir`, its gateway
/// knowing the run's groups), or reach the running gateway, adding the
/// run's groups to the file it reads.
async fn reach_target(
    config: &LoadConfig,
    clock: &ManualClock,
    dir: &Path,
    names: &Names,
) -> anyhow::Result<Reached> {
    let groups = run_groups(config, names);
    match &config.target {
        Target::Embedded { shards } => {
            let mut options = ClusterOptions::new(dir, Arc::new(clock.clone()));
            options.shards = *shards;
            if config.dedup_off {
                options.backends = imdedup_cluster::Backends::WithoutDedup;
            }
            options.authz = Authorizer::members(GroupsFile::fixed(groups)?);
            // The driver's phones are machines: each sends far faster than
            // a person, so the per-user send rate must not be what is
            // measured.
            let unlimited = NonZeroU32::new(1_000_000).context("non-zero")?;
            options.gateway_limits.user_sends_per_second = unlimited;
            options.gateway_limits.user_send_burst = unlimited;
            let cluster = LocalCluster::start(options).await?;
            let url = cluster.gateway_url();
            let token_key = TokenKey::new(imdedup_cluster::DEV_TOKEN_SECRET)?;
            Ok(Reached {
                cluster: Some(cluster),
                url,
                token_key,
                now: clock.unix_seconds(),
            })
        }
        Target::Gateway {
            url,
            token_secret,
            groups_file,
        } => {
            if !groups.is_empty() {
                let path = groups_file.as_ref().context(
                    "group conversations need members the gateway knows: give --groups-file \
                     (the file the gateway reads) or --group-share 0",
                )?;
                add_groups(path, groups).await?;
            }
            Ok(Reached {
                cluster: None,
                url: url.clone(),
                token_key: TokenKey::new(token_secret.expose())?,
                now: SystemClock.unix_seconds(),
            })
        }
    }
}

/// Plan every message of the run: its sender, its conversation (a group, or
/// a direct one with another phone), its ID, when its resends go, which of
/// its sends and ACKs are lost, and whether a copy also goes at the same
/// moment over the sender's second connection.
fn plan_messages(config: &LoadConfig, names: &Names, rng: &mut StdRng) -> Vec<Planned> {
    (0..config.messages)
        .map(|_| {
            let sender = rng.random_range(0..config.users);
            let (conversation, other) = if rng.random_bool(config.group_share) {
                (names.group(rng.random_range(0..config.groups.max(1))), None)
            } else {
                let mut other = rng.random_range(0..config.users - 1);
                if other >= sender {
                    other += 1;
                }
                let name = DirectConversations::name(
                    &Sender::parse(names.user(sender)).expect("a valid name"),
                    &Sender::parse(names.user(other)).expect("a valid name"),
                );
                (name, Some(other))
            };
            let offsets = config.policy.offsets(rng);
            let fates = offsets
                .iter()
                .map(|_| Fate {
                    send_lost: rng.random_bool(config.loss_send),
                    ack_lost: rng.random_bool(config.loss_ack),
                })
                .collect();
            let bytes: [u8; 16] = rng.random();
            Planned {
                sender,
                other,
                id: uuid::Builder::from_random_bytes(bytes)
                    .into_uuid()
                    .to_string(),
                conversation,
                offsets,
                fates,
                concurrent_copy: rng.random_bool(config.concurrent_copies),
            }
        })
        .collect()
}

/// Once a second until aborted (`--progress`): how many messages were
/// acknowledged in that second, how many are due, in flight and acked so
/// far, and the resends and errors so far.
fn report_progress(progress: Arc<Progress>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let started = Instant::now();
        let mut last_acked = 0;
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let acked = progress.acked.load(Ordering::Relaxed);
            let due = progress.due.load(Ordering::Relaxed);
            let done = progress.done.load(Ordering::Relaxed);
            eprintln!(
                "t={:>5.1}s  rate {:>6}/s  due {due}  in flight {}  acked {acked}  resends {}  errors {}",
                started.elapsed().as_secs_f64(),
                acked - last_acked,
                due - done,
                progress.resends.load(Ordering::Relaxed),
                progress.errors.load(Ordering::Relaxed),
            );
            last_acked = acked;
        }
    })
}

/// The run's shared state from the moment its phones are connected: the
/// phones, the plan and what the send tasks share, and what the storm
/// needs to connect the phones again.
struct Load<'a> {
    config: &'a LoadConfig,
    url: String,
    tokens: Vec<String>,
    /// Each phone has a second connection (for concurrent copies).
    second: bool,
    phones: Phones,
    plan: Arc<Vec<Planned>>,
    /// The one body every message carries.
    body: Arc<str>,
    progress: Arc<Progress>,
    /// Each message's trace, in plan order, once its send task is done.
    traces: Arc<Mutex<Vec<Option<Trace>>>>,
    /// The plan's random numbers (from `--seed`), which the storm goes on
    /// drawing from.
    rng: StdRng,
}

/// What the sending phase leaves besides the traces.
struct Sending {
    /// Tries and refusals per second.
    counts: Arc<TryCounts>,
    /// With a schedule: the CPU seconds sampled once a second.
    cpu_samples: Vec<CpuSample>,
    /// From the start of the sending phase to its last send task done.
    took: Duration,
    started_at_unix_ms: u64,
}

impl<'a> Load<'a> {
    /// Mint every phone's token, connect every phone to `url` at once, and
    /// plan every message.
    async fn connect_and_plan(
        config: &'a LoadConfig,
        names: &Names,
        url: String,
        token_key: &TokenKey,
        now: u64,
    ) -> anyhow::Result<Self> {
        let token = |u: usize| -> anyhow::Result<String> {
            Ok(token_key.mint(&Sender::parse(names.user(u))?, now + 86_400))
        };
        let second = config.concurrent_copies > 0.0;
        let tokens: Vec<String> = (0..config.users)
            .map(token)
            .collect::<anyhow::Result<_>>()?;
        let phones =
            Arc::new(connect_all(&url, &tokens, second, config.encoding, config.manners()).await?);
        let mut rng = StdRng::seed_from_u64(config.seed);
        let plan = plan_messages(config, names, &mut rng);
        let body: Arc<str> = "x".repeat(config.body_bytes.max(1)).into();
        let progress = Arc::new(Progress::default());
        let traces = Arc::new(Mutex::new(vec![None; plan.len()]));
        Ok(Self {
            config,
            url,
            tokens,
            second,
            phones,
            plan: Arc::new(plan),
            body,
            progress,
            traces,
            rng,
        })
    }

    /// When each message is due, from the start of the sending: on a linear
    /// ramp up to `--rate`, or by the schedule's phases.
    fn dues(&self) -> Vec<Duration> {
        let config = self.config;
        if config.schedule.is_empty() {
            (0..self.plan.len() as u64)
                .map(|n| due_after(n, config.rate, config.ramp))
                .collect()
        } else {
            schedule_dues(&config.schedule)
        }
    }

    /// The storm (`--storm-window`): every message is sent once when due and
    /// its ACK lost (kept in `storm_acks`), the connections drop, and every
    /// phone connects again, its whole outbox due again at random moments
    /// within the window (the new `dues`).
    async fn storm(
        &mut self,
        dues: &mut Vec<Duration>,
        storm_acks: &mut [Vec<AckReply>],
    ) -> anyhow::Result<()> {
        // Every message reaches the server once, and every ACK is lost: the
        // connections drop.
        let started = Instant::now();
        let mut first_copies = tokio::task::JoinSet::new();
        for (index, due) in dues.iter().enumerate() {
            wait_until(started + *due).await;
            let (phones, plan, body) = (
                Arc::clone(&self.phones),
                Arc::clone(&self.plan),
                Arc::clone(&self.body),
            );
            first_copies.spawn(async move {
                let message = &plan[index];
                let ack = match phones[message.sender].0.client().await {
                    Ok((_, phone)) => phone
                        .send(message.id.as_bytes(), &message.conversation, &body)
                        .await
                        .ok()
                        .and_then(Result::ok),
                    Err(_) => None,
                };
                (index, ack)
            });
        }
        while let Some(done) = first_copies.join_next().await {
            let (index, ack) = done?;
            storm_acks[index].extend(ack);
        }
        // The last reference to the phones goes: every connection closes.
        drop(std::mem::take(&mut self.phones));
        // Everyone reconnects at once and resends the whole outbox.
        let window = self.config.storm_window.as_secs_f64();
        *dues = (0..self.plan.len())
            .map(|_| Duration::from_secs_f64(self.rng.random_range(0.0..window)))
            .collect();
        let config = self.config;
        self.phones = Arc::new(
            connect_all(
                &self.url,
                &self.tokens,
                self.second,
                config.encoding,
                config.manners(),
            )
            .await?,
        );
        Ok(())
    }

    /// The plan's messages in the order they fall due.
    fn due_order(&self, dues: &[Duration]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.plan.len()).collect();
        order.sort_by_key(|&i| dues[i]);
        order
    }

    /// Send every message when it is due, in `order`, whatever the answers
    /// (open loop), each on a task of its own; wait for every task. With a
    /// schedule, sample the CPU once a second meanwhile.
    async fn send_open_loop(
        &self,
        dues: &[Duration],
        order: Vec<usize>,
    ) -> anyhow::Result<Sending> {
        let config = self.config;
        let started = Instant::now();
        // Room for the schedule, the phones' give-up time after it and the audit.
        let span = dues.last().copied().unwrap_or_default() + config.policy.give_up;
        let counts = Arc::new(TryCounts::new(started, span.as_secs() as usize + 60));
        let stop_sampling = CancellationToken::new();
        let sampler = (!config.schedule.is_empty()).then(|| {
            tokio::spawn(sample_cpu(
                config.admin.clone(),
                started,
                stop_sampling.clone(),
            ))
        });
        let started_at_unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let mut tasks = tokio::task::JoinSet::new();
        for index in order {
            // A finished task keeps its memory (sized for the whole send's
            // future) until joined: reap as we go, or the heap grows by the
            // whole run and every new task faults in fresh pages.
            while tasks.try_join_next().is_some() {}
            let due = started + dues[index];
            wait_until(due).await;
            self.progress.due.fetch_add(1, Ordering::Relaxed);
            let task = SendTask {
                phones: Arc::clone(&self.phones),
                plan: Arc::clone(&self.plan),
                body: Arc::clone(&self.body),
                traces: Arc::clone(&self.traces),
                progress: Arc::clone(&self.progress),
                counts: Arc::clone(&counts),
            };
            tasks.spawn(task.send(index, due, started, config.policy.give_up));
        }
        while tasks.join_next().await.is_some() {}
        let took = started.elapsed();
        stop_sampling.cancel();
        let cpu_samples = match sampler {
            Some(sampler) => sampler.await??,
            None => Vec::new(),
        };
        Ok(Sending {
            counts,
            cpu_samples,
            took,
            started_at_unix_ms,
        })
    }

    /// Every message's trace, in plan order (an empty one for a message
    /// whose task left none), a storm's first-copy ACKs ahead of the rest.
    fn take_traces(&self, storm_acks: Vec<Vec<AckReply>>) -> anyhow::Result<Vec<Trace>> {
        let mut traces: Vec<Trace> = std::mem::take(
            &mut *self
                .traces
                .lock()
                .map_err(|_| anyhow::anyhow!("poisoned"))?,
        )
        .into_iter()
        .map(Option::unwrap_or_default)
        .collect();
        for (trace, acks) in traces.iter_mut().zip(storm_acks) {
            trace.server_acks.splice(0..0, acks);
        }
        Ok(traces)
    }

    /// The late resends (`--late-resends`): the app was killed and resends
    /// the first messages of the plan from its outbox an hour later (the
    /// cluster's clock moves ahead), after the window has forgotten them.
    /// Their ACKs go in `traces`; returns how many the unique key caught.
    async fn resend_late(&self, clock: &ManualClock, traces: &mut [Trace]) -> anyhow::Result<u64> {
        let mut late_caught = 0;
        if self.config.late_resends > 0 {
            clock.advance(Duration::from_secs(3600));
            for (index, message) in self.plan.iter().enumerate().take(self.config.late_resends) {
                let (phone, _) = &self.phones[message.sender];
                let (_, phone) = phone.client().await?;
                if let Ok(Ok(ack)) = phone
                    .send(message.id.as_bytes(), &message.conversation, &self.body)
                    .await
                {
                    late_caught += u64::from(ack.outcome == "duplicate_unique_key");
                    traces[index].server_acks.push(ack);
                }
            }
        }
        Ok(late_caught)
    }

    /// What was sent, message by message, for the audit: who sent it, its
    /// ID, its conversation and its trace.
    fn sent(&self, names: &Names, traces: Vec<Trace>) -> Vec<Sent> {
        self.plan
            .iter()
            .zip(traces)
            .map(|(m, trace)| Sent {
                sender: names.user(m.sender),
                id: m.id.as_bytes().to_vec(),
                conversation: m.conversation.clone(),
                trace,
            })
            .collect()
    }

    /// The receivers' view: pull every conversation's stored history and
    /// audit it against what was `sent`, again until every ACKed message
    /// shows or CATCH_UP has passed; then let followers still behind the
    /// end of a history catch up, and audit what they received.
    async fn audit_histories(
        &self,
        sent: &[Sent],
        delivered: Option<Delivered>,
    ) -> anyhow::Result<Audit> {
        // Each conversation is read by one of its members, on that phone's link.
        let readers = readers(&self.plan);
        let mut histories = pull_histories(&self.phones, readers.clone()).await?;
        let mut result = audit(sent, &histories);
        // A stored row behind a pending one (a write whose outcome is not yet
        // known) shows once a reader settles that row, at the latest after the
        // store's pending fence: pull again until every ACKed message shows, or
        // CATCH_UP has passed. What is still missing then is lost.
        let settled_by = tokio::time::Instant::now() + CATCH_UP;
        while result.lost > 0 && tokio::time::Instant::now() < settled_by {
            tokio::time::sleep(Duration::from_secs(2)).await;
            histories = pull_histories(&self.phones, readers.clone()).await?;
            result = audit(sent, &histories);
        }
        // Followers still behind the end of a history (stopped before a row
        // that was being settled) keep following until they reach it.
        let delivered = match delivered {
            Some(mut delivered) => {
                let ends = histories
                    .iter()
                    .filter_map(|(c, rows)| Some((c.clone(), rows.last()?.seq)))
                    .collect();
                follow::catch_up(&self.phones, &readers, &mut delivered, &ends, CATCH_UP).await;
                Some(delivered)
            }
            None => None,
        };
        if let Some(delivered) = &delivered {
            result.add_followers(&histories, delivered);
        }
        Ok(result)
    }
}

/// One message's send task, holding its own reference to each piece of the
/// run's shared state.
struct SendTask {
    phones: Phones,
    plan: Arc<Vec<Planned>>,
    body: Arc<str>,
    traces: Arc<Mutex<Vec<Option<Trace>>>>,
    progress: Arc<Progress>,
    counts: Arc<TryCounts>,
}

impl SendTask {
    /// Deliver message `index`, due at `due`, from its sender's phone
    /// (resending until ACKed or `give_up` has passed) and, if planned, a
    /// copy at the same moment over the sender's second connection; then
    /// count it and keep its trace.
    async fn send(self, index: usize, due: Instant, started: Instant, give_up: Duration) {
        let message = &self.plan[index];
        let (phone, other) = &self.phones[message.sender];
        let copy = async {
            match (message.concurrent_copy, other) {
                // Boxed: most messages have no copy, and every message's
                // task would carry room for its send.
                (true, Some(other)) => {
                    Box::pin(other.send(message.id.as_bytes(), &message.conversation, &self.body))
                        .await
                        .ok()
                        .and_then(Result::ok)
                }
                _ => None,
            }
        };
        let (mut trace, copy_ack) = tokio::join!(
            deliver(
                phone,
                Outgoing {
                    id: message.id.as_bytes(),
                    conversation: &message.conversation,
                    body: &self.body,
                },
                due,
                &message.offsets,
                &message.fates,
                give_up,
                &self.counts,
            ),
            copy
        );
        trace.server_acks.extend(copy_ack);
        trace.due_offset = due.duration_since(started);
        let progress = &self.progress;
        progress
            .resends
            .fetch_add(u64::from(trace.tries.saturating_sub(1)), Ordering::Relaxed);
        progress
            .errors
            .fetch_add(trace.errors.len() as u64, Ordering::Relaxed);
        if trace.received.is_some() {
            progress.acked.fetch_add(1, Ordering::Relaxed);
        }
        progress.done.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut traces) = self.traces.lock() {
            traces[index] = Some(trace);
        }
    }
}

/// The followers (`--followers`): a task reading every conversation with a
/// cursor while the load runs, and the token that stops it.
struct Followers {
    following: Option<tokio::task::JoinHandle<Delivered>>,
    stop: CancellationToken,
}

impl Followers {
    /// Start following every conversation of the plan, each through its
    /// reader's phone (nothing without `--followers`).
    fn start(load: &Load) -> Self {
        let stop = CancellationToken::new();
        let following = if load.config.followers {
            Some(tokio::spawn(follow::follow(
                Arc::clone(&load.phones),
                readers(&load.plan),
                stop.clone(),
            )))
        } else {
            None
        };
        Self { following, stop }
    }

    /// Stop the followers: they sweep once more, then hand back what they
    /// delivered.
    async fn stop(self) -> anyhow::Result<Option<Delivered>> {
        self.stop.cancel();
        Ok(match self.following {
            Some(following) => Some(following.await?),
            None => None,
        })
    }
}

/// `--events`: one line per message, in the order they were due.
fn write_events(path: &std::path::Path, traces: &[Trace]) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut order: Vec<&Trace> = traces.iter().collect();
    order.sort_by_key(|t| t.due_offset);
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    for trace in order {
        writeln!(out, "{}", trace.events_line())?;
    }
    out.flush()?;
    Ok(())
}

/// With a schedule: what happened per second (tries and refusals, the CPU
/// samples) and per message (when it was due, its latency, its tries).
fn recorded(
    config: &LoadConfig,
    counts: &TryCounts,
    cpu_samples: Vec<CpuSample>,
    traces: &[Trace],
) -> Option<Recorded> {
    (!config.schedule.is_empty()).then(|| Recorded {
        tries: counts.per_second(),
        cpu: cpu_samples,
        messages: traces
            .iter()
            .map(|t| MessageFate {
                due: t.due_offset,
                latency: t.latency,
                tries: t.tries,
            })
            .collect(),
    })
}

/// Once a second until stopped: the CPU seconds of the services (summed)
/// and of the driver so far.
async fn sample_cpu(
    admin: Vec<AdminTarget>,
    started: Instant,
    stop: CancellationToken,
) -> anyhow::Result<Vec<CpuSample>> {
    let mut samples = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        // A service too busy to answer its admin port in time (the old
        // builds under overload) costs this sample, not the run.
        let Ok(now) = cpu::baseline(&admin).await else {
            continue;
        };
        let (services, driver) = now.totals();
        samples.push(CpuSample {
            at: started.elapsed(),
            services,
            driver,
        });
    }
    Ok(samples)
}

/// The CPU spent since `baseline` per one of `acked` messages. With the
/// embedded target the services run in the driver's process, so the one
/// figure is the whole process's, named so.
pub(crate) async fn cpu_per_message(
    baseline: &cpu::CpuBaseline,
    acked: u64,
    target: &Target,
) -> anyhow::Result<Vec<ProcessCpu>> {
    let mut cpu = baseline.since(acked).await?;
    if matches!(target, Target::Embedded { .. }) {
        for process in &mut cpu {
            if process.name == "driver" {
                process.name = cpu::EMBEDDED_PROCESS.to_owned();
            }
        }
    }
    Ok(cpu)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ramp_reaches_the_rate_and_then_holds_it() {
        let ramp = Duration::from_secs(2);
        // 1000/s over a 2 s ramp: 1000 messages during the ramp.
        assert!((due_after(1000, 1000.0, ramp).as_secs_f64() - 2.0).abs() < 1e-9);
        assert!((due_after(2000, 1000.0, ramp).as_secs_f64() - 3.0).abs() < 1e-9);
        assert!((due_after(10, 100.0, Duration::ZERO).as_secs_f64() - 0.1).abs() < 1e-9);
    }
}
