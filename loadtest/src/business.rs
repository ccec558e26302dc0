//! The `business` scenario: backend systems send notices through the
//! business API (`POST /v1/messages`), each with its own idempotency key,
//! under client timeouts short enough that many calls time out after the
//! gateway stored them; they retry with the same key, as a business system
//! does. Receivers' phones follow and then pull every conversation, and the
//! audit checks that each notice is stored exactly once (0 repeats) and
//! none that was answered is missing (0 lost), and counts the retries the
//! business key caught.
//!
//! Every system sends as its own account (`b<run>-<k>`, the only sender in
//! its service token's scope) into direct conversations with the run's
//! users, which need no group declaration.

use std::{
    collections::HashMap,
    num::NonZeroU32,
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, bail};
use imdedup_client::{
    AckReply,
    business::{BusinessHttp, RetryPolicy},
};
use imdedup_cluster::{ClusterOptions, LocalCluster};
use imdedup_domain::{
    clock::{Clock, ManualClock, SystemClock},
    model::{ClientMsgId, IdempotencyKey, Sender},
};
use imdedup_gateway::authz::{Authorizer, DirectConversations};
use imdedup_runtime::{secret::Secret, token::TokenKey};
use rand::{Rng, SeedableRng, rngs::StdRng};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{
    audit::{Sent, audit},
    config::{LoadConfig, Target},
    cpu::ProcessCpu,
    follow::{self, Delivered, Phones},
    names::Names,
    phone::{Trace, wait_until},
    report::{BusinessFigures, Report},
    run::{RunResult, connect_all, due_after, pull_histories},
};

/// What the business scenario adds to a load run. Of the load's loss
/// figures, `loss_ack` is used: the chance an answer is lost on the way
/// back, so the system retries as after a timeout. With long client
/// timeouts that makes every answer the gateway counted one the driver saw
/// (how the observability proof runs it).
#[derive(Debug, Clone)]
pub struct BusinessConfig {
    /// The run: target, messages (notices), rate, ramp, users (receivers),
    /// body size, seed, followers, the receivers' encoding.
    pub load: LoadConfig,
    /// Backend systems, each with its own account and service token.
    pub systems: usize,
    /// With a gateway target: the secret of its service tokens.
    pub service_token_secret: Option<Secret>,
    /// The client timeout of a call's first try; each later try gets twice
    /// the one before, up to `max_call_timeout`.
    pub call_timeout: Duration,
    pub max_call_timeout: Duration,
    /// Tries per notice before the system gives up.
    pub max_tries: u32,
}

/// Per notice: how its calls went, and when it was due.
type Results = Vec<Option<(Calls, Duration)>>;

struct Notice {
    system: usize,
    receiver: usize,
    key: String,
    conversation: String,
    /// Per try: whether its answer is lost on the way back (the system
    /// sees a timeout), drawn up front so a seed repeats a run.
    answer_lost: Vec<bool>,
}

/// How one notice's calls went.
#[derive(Debug, Clone, Default)]
struct Calls {
    /// Every answer the gateway sent, including those lost on the way.
    answers: Vec<imdedup_client::business::BusinessAck>,
    /// The answer the system finally got.
    received: Option<imdedup_client::business::BusinessAck>,
    /// Codes of the error answers.
    errors: Vec<String>,
    tries: u32,
    timed_out: u32,
    answers_lost: u32,
    latency: Option<Duration>,
}

/// Call until the system gets an answer or a final error, with the same
/// key every time: each try under its client timeout, pausing between
/// tries as the gateway asks.
async fn call(
    client: &BusinessHttp,
    notice: &Notice,
    account: &str,
    body: &str,
    policy: &RetryPolicy,
) -> Calls {
    let started = Instant::now();
    let mut calls = Calls::default();
    while calls.tries < policy.max_tries {
        let timeout = policy
            .timeouts
            .get(calls.tries as usize)
            .or(policy.timeouts.last())
            .copied()
            .unwrap_or(Duration::from_secs(5));
        let lost = notice
            .answer_lost
            .get(calls.tries as usize)
            .copied()
            .unwrap_or(false);
        calls.tries += 1;
        // Back off as the timeouts grow (up to a second), so retries do
        // not pile up on a slow gateway: each timed-out call still runs
        // there.
        let mut pause = policy.pause.max(timeout.min(Duration::from_secs(1)));
        let sent = client.send(&notice.key, account, &notice.conversation, body);
        match tokio::time::timeout(timeout, sent).await {
            Err(_) => calls.timed_out += 1,
            // The connection failed: as a timeout, retried.
            Ok(Err(_)) => {}
            Ok(Ok(Ok(ack))) => {
                calls.answers.push(ack.clone());
                if lost {
                    calls.answers_lost += 1;
                } else {
                    calls.received = Some(ack);
                    calls.latency = Some(started.elapsed());
                    break;
                }
            }
            Ok(Ok(Err(error))) => {
                calls.errors.push(error.code.clone());
                if !error.retryable {
                    break;
                }
                pause = pause.max(error.retry_after.unwrap_or_default());
            }
        }
        tokio::time::sleep(pause).await;
    }
    calls
}

/// The retry schedule's client timeouts: `first`, doubling up to `max`.
fn timeouts(first: Duration, max: Duration, tries: u32) -> Vec<Duration> {
    let mut out = Vec::new();
    let mut next = first.max(Duration::from_micros(100));
    for _ in 0..tries.max(1) {
        out.push(next.min(max));
        next = next.saturating_mul(2);
    }
    out
}

/// The business scenario: check the configuration, start or reach the
/// target, connect the receivers and the systems, plan the notices, drive
/// the calls with their retries while the followers read, pull every
/// history and audit it, then add up the figures and report.
pub async fn run(config: BusinessConfig) -> anyhow::Result<RunResult> {
    check(&config)?;
    let clock = ManualClock::new();
    let dir = tempfile::tempdir()?;
    let names = Names::new();
    let target = reach(&config, dir.path(), &clock).await?;
    let phones = connect_receivers(&config.load, &names, &target).await?;
    let systems = business_clients(&config, &names, &target)?;
    let notices = Arc::new(plan(&config, &names));
    let readers = readers(&notices);
    let driven = drive(&config, &names, &phones, &systems, &notices, &readers).await?;

    // What the receivers see.
    let histories = pull_histories(&phones, readers).await?;

    let (figures, sent) = tally(&config, &names, &notices, &driven.results)?;
    let mut result = audit(&sent, &histories);
    if let Some(delivered) = &driven.delivered {
        result.add_followers(&histories, delivered);
    }
    let mut report = Report::new(&config.load, &sent, driven.sending, 0, result.clone());
    report.business = Some(figures.clone());
    report.cpu = driven.cpu;
    drop(phones);
    if let Some(cluster) = target.cluster {
        cluster.shutdown().await;
    }
    if figures.key_reused > 0 {
        // Not in the audit's counts: the key was refused, nothing stored;
        // but a run that sees one has found a bug.
        eprintln!(
            "business: {} calls refused as a reused key",
            figures.key_reused
        );
    }
    Ok(RunResult {
        seconds: None,
        report,
        audit: result,
    })
}

/// Refuse a configuration the scenario cannot run: no systems or no
/// receivers, a rate that is not positive, a chance of a lost answer
/// outside 0..=1.
fn check(config: &BusinessConfig) -> anyhow::Result<()> {
    let load = &config.load;
    if config.systems == 0 || load.users == 0 {
        bail!("--systems and --users must be at least 1");
    }
    if !(load.rate > 0.0 && load.rate.is_finite()) {
        bail!("--rate must be positive");
    }
    if !(0.0..=1.0).contains(&load.loss_ack) {
        bail!("--loss-ack must be between 0 and 1, got {}", load.loss_ack);
    }
    Ok(())
}

/// The target, started or reached: the cluster if the run started one,
/// the gateway's URL and the keys that mint the receivers' and the
/// systems' tokens.
struct Reached {
    cluster: Option<LocalCluster>,
    url: String,
    phone_key: TokenKey,
    service_key: TokenKey,
    /// When the tokens expire: an hour after the target's now.
    exp: u64,
}

/// Start the embedded cluster (its data in `dir`, its time from `clock`)
/// or, with `--url`, reach the running gateway, whose service-token secret
/// the run must be given.
async fn reach(
    config: &BusinessConfig,
    dir: &Path,
    clock: &ManualClock,
) -> anyhow::Result<Reached> {
    let (cluster, url, phone_key, service_key, now) = match &config.load.target {
        Target::Embedded { shards } => {
            let mut options = ClusterOptions::new(dir, Arc::new(clock.clone()));
            options.shards = *shards;
            // Direct conversations only: each system talks to receivers
            // one to one, which needs no groups.
            options.authz = Authorizer::direct_only();
            // The systems are machines: the per-account rate is not what
            // is measured.
            let unlimited = NonZeroU32::new(1_000_000).context("non-zero")?;
            options.gateway_limits.user_sends_per_second = unlimited;
            options.gateway_limits.user_send_burst = unlimited;
            let cluster = LocalCluster::start(options).await?;
            let url = cluster.gateway_url();
            (
                Some(cluster),
                url,
                TokenKey::new(imdedup_cluster::DEV_TOKEN_SECRET)?,
                TokenKey::new(imdedup_cluster::DEV_SERVICE_TOKEN_SECRET)?,
                clock.unix_seconds(),
            )
        }
        Target::Gateway {
            url, token_secret, ..
        } => {
            let service_secret = config.service_token_secret.as_ref().context(
                "the business scenario with --url needs --service-token-secret \
                 (or IMDEDUP_SERVICE_TOKEN_SECRET), the gateway's",
            )?;
            (
                None,
                url.clone(),
                TokenKey::new(token_secret.expose())?,
                TokenKey::new(service_secret.expose())?,
                SystemClock.unix_seconds(),
            )
        }
    };
    Ok(Reached {
        cluster,
        url,
        phone_key,
        service_key,
        exp: now + 3600,
    })
}

/// Connect every receiver's phone: the receivers read (follow, then pull)
/// over the phone protocol.
async fn connect_receivers(
    load: &LoadConfig,
    names: &Names,
    target: &Reached,
) -> anyhow::Result<Phones> {
    let tokens: Vec<String> = (0..load.users)
        .map(|u| {
            Ok(target
                .phone_key
                .mint(&Sender::parse(names.user(u))?, target.exp))
        })
        .collect::<anyhow::Result<_>>()?;
    let phones = connect_all(&target.url, &tokens, false, load.encoding, load.manners()).await?;
    Ok(Arc::new(phones))
}

/// A business API client per system, its service token scoped to the
/// system's account alone.
fn business_clients(
    config: &BusinessConfig,
    names: &Names,
    target: &Reached,
) -> anyhow::Result<Vec<Arc<BusinessHttp>>> {
    (0..config.systems)
        .map(|k| {
            let account = names.system(k);
            let token = target.service_key.mint_service(
                &Sender::parse(names.service(k))?,
                std::slice::from_ref(&account),
                target.exp,
            );
            Ok(Arc::new(BusinessHttp::new(&target.url, token)))
        })
        .collect()
}

/// Plan every notice from the seed: the system that sends it, the
/// receiver it goes to, its idempotency key and which of its tries lose
/// their answer.
fn plan(config: &BusinessConfig, names: &Names) -> Vec<Notice> {
    let load = &config.load;
    let mut rng = StdRng::seed_from_u64(load.seed);
    (0..load.messages)
        .map(|_| {
            let system = rng.random_range(0..config.systems);
            let receiver = rng.random_range(0..load.users);
            let bytes: [u8; 16] = rng.random();
            let conversation = DirectConversations::name(
                &Sender::parse(names.system(system)).expect("a valid name"),
                &Sender::parse(names.user(receiver)).expect("a valid name"),
            );
            let answer_lost = (0..config.max_tries.max(1))
                .map(|_| rng.random_bool(load.loss_ack))
                .collect();
            Notice {
                system,
                receiver,
                answer_lost,
                key: format!(
                    "notice-{}",
                    uuid::Builder::from_random_bytes(bytes).into_uuid()
                ),
                conversation,
            }
        })
        .collect()
}

/// Every conversation of the notices and the phone that reads it: the
/// receiver's.
fn readers(notices: &[Notice]) -> Vec<(String, usize)> {
    let mut readers: HashMap<String, usize> = HashMap::new();
    for notice in notices {
        readers
            .entry(notice.conversation.clone())
            .or_insert(notice.receiver);
    }
    readers.into_iter().collect()
}

/// What driving the calls leaves for the audit and the report.
struct Driven {
    results: Arc<Mutex<Results>>,
    /// From the first notice due to the last one answered or given up.
    sending: Duration,
    /// CPU per answered notice over the sending.
    cpu: Vec<ProcessCpu>,
    /// What the followers received, if they ran.
    delivered: Option<Delivered>,
}

/// Drive the business calls: while the followers read (unless turned off)
/// and a progress line counts the answers (unless quiet), each system
/// sends its notices when they are due and retries them with their keys.
/// Then the CPU per answered notice is read, and the progress line and the
/// followers stop.
async fn drive(
    config: &BusinessConfig,
    names: &Names,
    phones: &Phones,
    systems: &[Arc<BusinessHttp>],
    notices: &Arc<Vec<Notice>>,
    readers: &[(String, usize)],
) -> anyhow::Result<Driven> {
    let load = &config.load;
    let stop_following = CancellationToken::new();
    let following = load.followers.then(|| {
        tokio::spawn(follow::follow(
            Arc::clone(phones),
            readers.to_vec(),
            stop_following.clone(),
        ))
    });
    let calling = Calling {
        notices: Arc::clone(notices),
        systems: systems.to_vec(),
        policy: Arc::new(retry_policy(config)),
        body: "n".repeat(load.body_bytes.max(1)).into(),
        results: Arc::new(Mutex::new((0..notices.len()).map(|_| None).collect())),
        answered: Arc::new(AtomicU64::new(0)),
    };
    let reporter = load
        .progress
        .then(|| report_progress(Arc::clone(&calling.answered), notices.len()));
    let cpu_baseline = crate::cpu::baseline(&load.admin).await?;
    let started = Instant::now();
    send_all(load, names, &calling, started).await?;
    let sending = started.elapsed();
    let cpu = crate::run::cpu_per_message(
        &cpu_baseline,
        calling.answered.load(Ordering::Relaxed),
        &load.target,
    )
    .await?;
    if let Some(reporter) = reporter {
        reporter.abort();
    }
    stop_following.cancel();
    let delivered = match following {
        Some(following) => Some(following.await?),
        None => None,
    };
    Ok(Driven {
        results: calling.results,
        sending,
        cpu,
        delivered,
    })
}

/// The systems' retry policy: client timeouts from `--call-timeout`
/// doubling up to `--max-call-timeout`, at least 10 ms between tries, at
/// most `--max-tries` tries.
fn retry_policy(config: &BusinessConfig) -> RetryPolicy {
    RetryPolicy {
        timeouts: timeouts(
            config.call_timeout,
            config.max_call_timeout,
            config.max_tries,
        ),
        pause: Duration::from_millis(10),
        max_tries: config.max_tries.max(1),
    }
}

/// Print how many of the `total` notices are answered, once a second,
/// until aborted.
fn report_progress(answered: Arc<AtomicU64>, total: usize) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let started = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            eprintln!(
                "t={:>5.1}s  answered {}/{total}",
                started.elapsed().as_secs_f64(),
                answered.load(Ordering::Relaxed)
            );
        }
    })
}

/// What every notice's task shares: the notices, the systems' clients,
/// the retry policy and the body, where each notice's results go and the
/// count of answered notices.
#[derive(Clone)]
struct Calling {
    notices: Arc<Vec<Notice>>,
    systems: Vec<Arc<BusinessHttp>>,
    policy: Arc<RetryPolicy>,
    body: Arc<str>,
    results: Arc<Mutex<Results>>,
    answered: Arc<AtomicU64>,
}

impl Calling {
    /// Make notice `index`'s calls as `account`, count it if answered and
    /// keep how its calls went with when it was `due`.
    async fn send(&self, index: usize, account: &str, due: Duration) {
        let notice = &self.notices[index];
        let calls = call(
            &self.systems[notice.system],
            notice,
            account,
            &self.body,
            &self.policy,
        )
        .await;
        if calls.received.is_some() {
            self.answered.fetch_add(1, Ordering::Relaxed);
        }
        if let Ok(mut results) = self.results.lock() {
            results[index] = Some((calls, due));
        }
    }
}

/// Open loop: start each notice's calls in a task of its own when the
/// notice is due (counted from `started`), whatever the answers so far,
/// then wait for every task to finish.
async fn send_all(
    load: &LoadConfig,
    names: &Names,
    calling: &Calling,
    started: Instant,
) -> anyhow::Result<()> {
    let mut tasks = tokio::task::JoinSet::new();
    for index in 0..calling.notices.len() {
        let due = due_after(index as u64, load.rate, load.ramp);
        wait_until(started + due).await;
        let calling = calling.clone();
        let account = names.system(calling.notices[index].system);
        tasks.spawn(async move { calling.send(index, &account, due).await });
    }
    while let Some(done) = tasks.join_next().await {
        done?;
    }
    Ok(())
}

/// Add up the business figures and turn each notice into what the audit
/// checks: its system's account, its conversation, its message ID (the one
/// the gateway derives from its key) and its trace: the answers the
/// gateway sent, the one the system got, its tries and errors.
fn tally(
    config: &BusinessConfig,
    names: &Names,
    notices: &[Notice],
    results: &Mutex<Results>,
) -> anyhow::Result<(BusinessFigures, Vec<Sent>)> {
    let results = std::mem::take(&mut *results.lock().map_err(|_| anyhow::anyhow!("poisoned"))?);
    let mut figures = BusinessFigures {
        systems: config.systems as u64,
        call_timeout_ms: config.call_timeout.as_secs_f64() * 1000.0,
        ..BusinessFigures::default()
    };
    let mut sent = Vec::with_capacity(notices.len());
    for (notice, result) in notices.iter().zip(results) {
        let (calls, due) = result.unwrap_or_default();
        let id = ClientMsgId::for_business_key(&IdempotencyKey::parse(notice.key.as_bytes())?)
            .into_bytes();
        figures.calls += u64::from(calls.tries);
        figures.retries += u64::from(calls.tries.saturating_sub(1));
        figures.timed_out += u64::from(calls.timed_out);
        figures.answers_lost += u64::from(calls.answers_lost);
        figures.key_reused += calls
            .errors
            .iter()
            .filter(|code| *code == "idempotency_key_reused")
            .count() as u64;
        let ack = |a: &imdedup_client::business::BusinessAck| AckReply {
            id: id.clone(),
            server_id: a.server_id,
            seq: a.seq,
            duplicate: a.duplicate,
            outcome: a.outcome.clone(),
        };
        let acks: Vec<AckReply> = calls.answers.iter().map(ack).collect();
        figures.retries_caught_by_business_key +=
            acks.iter().filter(|a| a.duplicate).count() as u64;
        match &calls.received {
            Some(_) => figures.answered += 1,
            None => figures.gave_up += 1,
        }
        sent.push(Sent {
            sender: names.system(notice.system),
            conversation: notice.conversation.clone(),
            trace: Trace {
                received: calls.received.as_ref().map(ack),
                server_acks: acks,
                latency: calls.latency,
                tries: calls.tries,
                acks_lost: calls.answers_lost,
                errors: calls.errors,
                due_offset: due,
                ..Trace::default()
            },
            id,
        });
    }
    Ok((figures, sent))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_timeouts_double_up_to_the_ceiling() {
        let ms = Duration::from_millis;
        assert_eq!(
            timeouts(ms(2), ms(10), 5),
            [ms(2), ms(4), ms(8), ms(10), ms(10)]
        );
        assert_eq!(timeouts(ms(2), ms(10), 0), [ms(2)]);
    }
}
