//! The book's scenario (chapter 4, "Duplicates") on a real local cluster:
//! Ana sends 8 messages to Ben over a lossy network, her phone resends on
//! the 0, 1, 3, 7, 15 s schedule and gives up at 31 s, and an hour later the
//! app, killed before an ACK came back, resends message 3 from its outbox.
//! Then Ben pulls the conversation and we count what he sees.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use clap::Args;
use imdedup_client::{AckReply, Client, Encoding, HistoryMessage};
use imdedup_cluster::{Backends, ClusterOptions, LocalCluster};
use imdedup_domain::{
    clock::ManualClock,
    model::{ClientMsgId, MessageKey, Sender},
};
use imdedup_gateway::authz::{Authorizer, GroupsFile};
use imdedup_ingest::{RedisWindow, RedisWindowOptions};

use crate::backends::LocalBackendArgs;
use rand::{Rng, SeedableRng, rngs::StdRng};
use tempfile::TempDir;

const BODIES: [&str; 8] = [
    "Hi Ben",
    "Are you home?",
    "On my way",
    "Traffic is bad",
    "20 more minutes",
    "Parking now",
    "I'm downstairs",
    "Open the door?",
];
/// A seed whose draws lose a send and an ACK, so the run shows both.
const DEFAULT_SEED: u64 = 17;

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Messages Ana sends.
    #[arg(long, default_value_t = 8)]
    messages: usize,
    /// Chance that a send is lost on the way to the gateway.
    #[arg(long, default_value_t = 0.10)]
    loss_send: f64,
    /// Chance that an ACK is lost on the way back to the phone.
    #[arg(long, default_value_t = 0.10)]
    loss_ack: f64,
    /// When the phone sends, in seconds after the first try.
    #[arg(long, value_delimiter = ',', default_value = "0,1,3,7,15")]
    schedule: Vec<f64>,
    /// When the phone gives up and shows the message as failed, in seconds.
    #[arg(long, default_value_t = 31.0)]
    give_up: f64,
    /// Time compression: 10 plays the 31 s schedule in 3.1 s; 1 is real time.
    #[arg(long, default_value_t = 10.0)]
    speed: f64,
    /// Seed of the loss draws; the same seed gives the same run.
    #[arg(long, default_value_t = DEFAULT_SEED)]
    seed: u64,
    /// Leave out the resend of message 3 an hour later.
    #[arg(long)]
    no_late_resend: bool,
    #[command(flatten)]
    backends: LocalBackendArgs,
}

impl DemoArgs {
    fn check(&self) -> anyhow::Result<()> {
        for (name, p) in [
            ("--loss-send", self.loss_send),
            ("--loss-ack", self.loss_ack),
        ] {
            if !(0.0..=1.0).contains(&p) {
                bail!("{name} must be between 0 and 1, got {p}");
            }
        }
        if !(self.speed > 0.0 && self.speed.is_finite()) {
            bail!("--speed must be a positive number, got {}", self.speed);
        }
        if self.schedule.is_empty()
            || self.schedule.windows(2).any(|w| w[0] > w[1])
            || self.schedule.iter().any(|s| *s < 0.0)
        {
            bail!("--schedule must be non-negative times in increasing order");
        }
        if self.give_up < self.schedule[self.schedule.len() - 1] {
            bail!("--give-up must come after the last resend");
        }
        if self.messages == 0 || self.messages > 10_000 {
            bail!("--messages must be between 1 and 10000");
        }
        Ok(())
    }
}

/// The network's fate for one try of one message.
#[derive(Debug, Clone, Copy)]
struct Fate {
    send_lost: bool,
    ack_lost: bool,
}

struct Outbox {
    number: usize,
    id: String,
    body: String,
    fates: Vec<Fate>,
}

/// What the phone ended up knowing about a message.
#[derive(Debug, Clone)]
enum Delivery {
    Acked(AckReply),
    Failed,
}

struct Timeline {
    started: Instant,
    speed: f64,
}

impl Timeline {
    fn at(&self, scenario_seconds: f64) -> Instant {
        self.started + Duration::from_secs_f64(scenario_seconds / self.speed)
    }

    fn log(&self, number: usize, text: &str) {
        let t = self.started.elapsed().as_secs_f64() * self.speed;
        println!("  t={t:>5.1}s  #{number}  {text}");
    }
}

fn describe(ack: &AckReply) -> String {
    let how = match ack.outcome.as_str() {
        "stored" => "stored",
        "duplicate_window" => "repeat, caught by the window",
        "duplicate_unique_key" => "repeat, caught by the unique key",
        other => other,
    };
    format!("{how} (server id {}, seq {})", ack.server_id, ack.seq)
}

async fn deliver(
    phone: &Client,
    conversation: &str,
    message: &Outbox,
    schedule: &[f64],
    give_up: f64,
    timeline: &Timeline,
) -> Delivery {
    let start = (message.number - 1) as f64 * 0.5;
    for (attempt, (offset, fate)) in schedule.iter().zip(&message.fates).enumerate() {
        tokio::time::sleep_until(timeline.at(start + offset).into()).await;
        let verb = if attempt == 0 { "send" } else { "resend" };
        if fate.send_lost {
            timeline.log(
                message.number,
                &format!("{verb}: lost on the way to the gateway"),
            );
            continue;
        }
        match phone
            .send(message.id.as_bytes(), conversation, &message.body)
            .await
        {
            Ok(Ok(ack)) if fate.ack_lost => {
                timeline.log(
                    message.number,
                    &format!(
                        "{verb}: {}, but the ACK is lost on the way back",
                        describe(&ack)
                    ),
                );
            }
            Ok(Ok(ack)) => {
                timeline.log(
                    message.number,
                    &format!("{verb}: {} -> ACK received", describe(&ack)),
                );
                return Delivery::Acked(ack);
            }
            Ok(Err(e)) => {
                timeline.log(
                    message.number,
                    &format!("{verb}: error {} ({})", e.code, e.message),
                );
                if !e.retryable {
                    return Delivery::Failed;
                }
            }
            Err(e) => {
                timeline.log(message.number, &format!("{verb}: connection problem: {e}"));
            }
        }
    }
    tokio::time::sleep_until(timeline.at(start + give_up).into()).await;
    timeline.log(
        message.number,
        "no ACK: the phone gives up and shows it as failed",
    );
    Delivery::Failed
}

/// Play the scenario on a fresh local cluster and print what happens. With
/// dedup on, a run in which Ben sees a repeat or misses a message is an error.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    args.check()?;
    let demo = Demo::start(args).await?;
    demo.print_intro();
    let outbox = Arc::new(demo.fill_outbox());
    let ana = Arc::new(demo.connect("ana").await?);
    let deliveries = demo.send_all(&ana, &outbox).await?;
    let late = demo.resend_third_an_hour_later(&ana, &outbox).await?;
    let ben = demo.connect("ben").await?;
    let seen = demo.show_history(&ben, &outbox).await?;
    let tally = Tally::count(&seen, &outbox, &deliveries);
    demo.print_summary(seen.len(), &tally);
    print_late_ack(late.as_ref(), &deliveries);
    drop((ana, ben));
    demo.finish(tally).await
}

/// The demo's cluster and what every step of the scenario needs from it.
struct Demo {
    args: DemoArgs,
    /// The cluster's clock, which the late resend moves an hour ahead.
    clock: ManualClock,
    /// The window's Redis on the real backends; `None` on the embedded ones.
    redis: Option<RedisWindowOptions>,
    /// Where Ana writes to Ben.
    conversation: String,
    cluster: LocalCluster,
    /// The cluster's data directory: declared after the cluster, so it is
    /// deleted only once the cluster has let go of it.
    _data_dir: TempDir,
}

impl Demo {
    /// Start a cluster of two ingest shards on a temporary data directory and
    /// the backends the flags choose, and pick Ana and Ben's conversation.
    async fn start(args: DemoArgs) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir().context("cannot create a temporary data directory")?;
        let clock = ManualClock::new();
        let mut options = ClusterOptions::new(dir.path(), Arc::new(clock.clone()));
        options.shards = 2;
        args.backends.apply(&mut options)?;
        let redis = match &options.backends {
            Backends::Real { redis, .. } => Some(redis.clone()),
            Backends::Embedded | Backends::WithoutDedup => None,
        };
        // A database that outlives the run gets a conversation of this run's
        // own: a group of Ana and Ben. Otherwise, their direct conversation.
        let conversation = if redis.is_some() {
            add_group_of_this_run(&mut options)?
        } else {
            "dm:ana:ben".to_owned()
        };
        let cluster = LocalCluster::start(options).await?;
        Ok(Self {
            args,
            clock,
            redis,
            conversation,
            cluster,
            _data_dir: dir,
        })
    }

    /// Whether the cluster runs on Redis and ScyllaDB, whose data outlives
    /// the run.
    fn real(&self) -> bool {
        self.redis.is_some()
    }

    /// Say where the cluster runs and on which backends, and how lossy the
    /// network and how patient the phone will be.
    fn print_intro(&self) {
        let backends = if self.real() {
            "Redis window, ScyllaDB/CQL store"
        } else {
            "in-process window, embedded SQLite"
        };
        let (cluster, args) = (&self.cluster, &self.args);
        println!(
            "imdedup demo ({backends}): gateway {}, ingest shards {}, storage {}",
            cluster.gateway_url(),
            cluster.ingest_urls().join(" "),
            cluster.storage_url()
        );
        println!(
            "Ana sends {} messages to Ben; {:.0}% of sends and {:.0}% of ACKs are lost; resends at {:?} s, \
             gives up at {} s; time runs {}x; seed {}.\n",
            args.messages,
            args.loss_send * 100.0,
            args.loss_ack * 100.0,
            args.schedule,
            args.give_up,
            args.speed,
            args.seed
        );
    }

    /// Fill Ana's outbox: each message with its ID, its body, and the
    /// network's fate for each of its tries, drawn from the seed.
    fn fill_outbox(&self) -> Vec<Outbox> {
        let args = &self.args;
        let real = self.real();
        let mut rng = StdRng::seed_from_u64(args.seed);
        (1..=args.messages)
            .map(|number| {
                let bytes: [u8; 16] = rng.random();
                // A database that outlives the run must not see this run's IDs
                // again: the seed draws the losses, the IDs are fresh.
                let id = if real {
                    uuid::Uuid::new_v4().to_string()
                } else {
                    uuid::Builder::from_random_bytes(bytes)
                        .into_uuid()
                        .to_string()
                };
                let fates = args
                    .schedule
                    .iter()
                    .map(|_| Fate {
                        send_lost: rng.random_bool(args.loss_send),
                        ack_lost: rng.random_bool(args.loss_ack),
                    })
                    .collect();
                let body = BODIES
                    .get(number - 1)
                    .map_or_else(|| format!("message {number}"), |b| (*b).to_owned());
                Outbox {
                    number,
                    id,
                    body,
                    fates,
                }
            })
            .collect()
    }

    /// Connect `user`'s phone to the gateway.
    async fn connect(&self, user: &str) -> anyhow::Result<Client> {
        let cluster = &self.cluster;
        Ok(Client::connect(
            &cluster.gateway_url(),
            &cluster.token(user)?,
            Encoding::Json,
        )
        .await?)
    }

    /// Deliver every message of the outbox at once, each in a task of its
    /// own on a timeline that starts now, and return what the phone ended
    /// up knowing about each, in the outbox's order.
    async fn send_all(
        &self,
        ana: &Arc<Client>,
        outbox: &Arc<Vec<Outbox>>,
    ) -> anyhow::Result<Vec<Delivery>> {
        let timeline = Arc::new(Timeline {
            started: Instant::now(),
            speed: self.args.speed,
        });
        let schedule = Arc::new(self.args.schedule.clone());
        let mut tasks = Vec::new();
        for index in 0..outbox.len() {
            let (ana, outbox, schedule, timeline) = (
                Arc::clone(ana),
                Arc::clone(outbox),
                Arc::clone(&schedule),
                Arc::clone(&timeline),
            );
            let give_up = self.args.give_up;
            let conversation = self.conversation.clone();
            tasks.push(tokio::spawn(async move {
                deliver(
                    &ana,
                    &conversation,
                    &outbox[index],
                    &schedule,
                    give_up,
                    &timeline,
                )
                .await
            }));
        }
        let mut deliveries = Vec::new();
        for task in tasks {
            deliveries.push(task.await?);
        }
        Ok(deliveries)
    }

    /// An hour later, past the window, the app that was killed before #3's
    /// ACK reached it resends #3 from its outbox; return the server's ACK.
    /// Nothing happens with --no-late-resend or fewer than 3 messages.
    async fn resend_third_an_hour_later(
        &self,
        ana: &Client,
        outbox: &[Outbox],
    ) -> anyhow::Result<Option<AckReply>> {
        if self.args.no_late_resend || outbox.len() < 3 {
            return Ok(None);
        }
        let third = &outbox[2];
        self.clock.advance(Duration::from_secs(3600));
        if let Some(redis) = &self.redis {
            // Redis keeps its own time: forget the key, as an hour would.
            let key = MessageKey {
                sender: Sender::parse("ana")?,
                client_msg_id: ClientMsgId::parse(third.id.as_bytes().to_vec())?,
            };
            RedisWindow::connect(redis.clone())
                .await?
                .forget(&key)
                .await?;
        }
        println!(
            "\n  one hour later: the app, killed before #3's ACK reached it, reopens and resends #3 from its outbox"
        );
        match ana
            .send(third.id.as_bytes(), &self.conversation, &third.body)
            .await?
        {
            Ok(ack) => {
                println!("  t=+1h     #3  resend: {}", describe(&ack));
                Ok(Some(ack))
            }
            Err(e) => {
                println!("  t=+1h     #3  resend: error {} ({})", e.code, e.message);
                Ok(None)
            }
        }
    }

    /// Pull the whole conversation as Ben, print it with each message's
    /// number in Ana's outbox (#0 for one that is not from this run), and
    /// return it.
    async fn show_history(
        &self,
        ben: &Client,
        outbox: &[Outbox],
    ) -> anyhow::Result<Vec<HistoryMessage>> {
        let seen = match ben.full_history(&self.conversation).await? {
            Ok(rows) => rows,
            Err(e) => bail!("history pull failed: {} ({})", e.code, e.message),
        };
        let number_of: HashMap<&[u8], usize> =
            outbox.iter().map(|m| (m.id.as_bytes(), m.number)).collect();
        println!("\nWhat Ben sees in {}:", self.conversation);
        for row in &seen {
            let number = number_of.get(row.id.as_slice()).copied().unwrap_or(0);
            println!(
                "  seq {:>2}  #{number}  {}: {}",
                row.seq, row.sender, row.body
            );
        }
        Ok(seen)
    }

    /// Print the summary: how many messages Ben sees, the repeats each
    /// layer of dedup caught, the repeats and losses that got through, and
    /// the messages the phone shows as failed.
    fn print_summary(&self, stored: usize, tally: &Tally) {
        let Tally {
            repeats,
            lost,
            failed,
        } = *tally;
        let counts = self.cluster.dedup_counts();
        println!("\nSummary");
        println!("  stored (Ben sees)            {stored:>3}");
        println!(
            "  caught by the window         {:>3}   repeats answered from memory with the first ACK",
            counts.duplicate_window
        );
        println!(
            "  caught by the unique key     {:>3}   repeats past the window, answered from the database",
            counts.duplicate_unique_key
        );
        println!("  repeats Ben sees             {repeats:>3}");
        println!("  lost                         {lost:>3}");
        if failed > 0 {
            println!(
                "  shown as failed on the phone {failed:>3}   (never ACKed within {} s; the outbox keeps them)",
                self.args.give_up
            );
        }
    }

    /// Stop the cluster and judge the run: without dedup anything goes;
    /// with it, a repeat or a lost message is an error.
    async fn finish(self, tally: Tally) -> anyhow::Result<()> {
        let Tally { repeats, lost, .. } = tally;
        self.cluster.shutdown().await;
        if self.args.backends.no_dedup {
            println!("\nDedup was off (--no-dedup): every copy that arrived was stored.");
            return Ok(());
        }
        if repeats > 0 || lost > 0 {
            bail!("the receiver saw {repeats} repeats and {lost} lost messages");
        }
        Ok(())
    }
}

/// Make the conversation of a run on a database that outlives it: a group
/// of Ana and Ben with a fresh name, the only group the cluster knows.
fn add_group_of_this_run(options: &mut ClusterOptions) -> anyhow::Result<String> {
    let group = format!(
        "ana-ben-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let members = ["ana", "ben"].map(str::to_owned).into();
    options.authz = Authorizer::members(GroupsFile::fixed([(group.clone(), members)].into())?);
    Ok(group)
}

/// What Ben's view of the conversation says about the delivery.
#[derive(Debug, Clone, Copy)]
struct Tally {
    /// Extra copies of a message Ben sees.
    repeats: usize,
    /// Messages the server stored (whether or not the ACK reached the
    /// phone) that Ben cannot see.
    lost: usize,
    /// Messages the phone shows as failed.
    failed: usize,
}

impl Tally {
    /// Compare what Ben sees with what the phone knows about each message.
    fn count(seen: &[HistoryMessage], outbox: &[Outbox], deliveries: &[Delivery]) -> Self {
        let mut copies: HashMap<&[u8], usize> = HashMap::new();
        for row in seen {
            *copies.entry(row.id.as_slice()).or_default() += 1;
        }
        let repeats: usize = copies.values().map(|n| n - 1).sum();
        // Lost: the server said "stored" (an ACK reached the phone, or was
        // dropped on the way back) but Ben cannot see the message.
        let acked: Vec<&Outbox> = outbox
            .iter()
            .zip(deliveries)
            .filter(|(_, d)| matches!(d, Delivery::Acked(_)))
            .map(|(m, _)| m)
            .collect();
        let lost = acked
            .iter()
            .filter(|m| !copies.contains_key(m.id.as_bytes()))
            .count();
        let failed = deliveries
            .iter()
            .filter(|d| matches!(d, Delivery::Failed))
            .count();
        Self {
            repeats,
            lost,
            failed,
        }
    }
}

/// Say whether the late resend of #3 got the same ACK as the first send
/// (dedup's promise), when there was a late resend and #3 was ACKed.
fn print_late_ack(late: Option<&AckReply>, deliveries: &[Delivery]) {
    // `get`: with --messages 1 or 2 there is no #3 (and no late resend).
    if let (Some(ack), Some(Delivery::Acked(first))) = (late, deliveries.get(2)) {
        let same = (ack.server_id, ack.seq) == (first.server_id, first.seq);
        println!(
            "\nThe late resend of #3 got {} ACK: server id {} seq {} (first: {} / {}).",
            if same { "the same" } else { "a different" },
            ack.server_id,
            ack.seq,
            first.server_id,
            first.seq
        );
    }
}
