//! A short `book` run through the real services: phones on a lossy network
//! end with nothing lost and nothing stored twice.

use std::time::Duration;

use imdedup_client::Encoding;
use imdedup_loadtest::{LoadConfig, Target, phone::ResendPolicy, run};
use imdedup_runtime::secret::Secret;

/// The runs below drive a cluster at 2,000 messages a second on a small
/// machine, with resend timers scaled to milliseconds: one at a time, so
/// their latency is the cluster's and not the other runs'.
static ONE_RUN_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn book(messages: u64) -> LoadConfig {
    LoadConfig {
        scenario: "book".into(),
        target: Target::Embedded { shards: 2 },
        messages,
        rate: 2000.0,
        ramp: Duration::from_millis(200),
        users: 20,
        group_share: 0.3,
        groups: 4,
        body_bytes: 40,
        loss_send: 0.1,
        loss_ack: 0.1,
        policy: ResendPolicy {
            jitter: 0.1,
            ..ResendPolicy::book(0.01)
        },
        concurrent_copies: 0.05,
        late_resends: 50,
        seed: 4,
        dedup_off: false,
        storm_window: Duration::ZERO,
        progress: false,
        events: None,
        followers: true,
        encoding: Encoding::Json,
        queue: true,
        throttle: 2.0,
        admin: Vec::new(),
        schedule: Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_book_run_loses_nothing_and_stores_nothing_twice() {
    let _alone = ONE_RUN_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let events = dir.path().join("events.tsv");
    let mut config = book(1000);
    config.events = Some(events.clone());
    let outcome = run(config).await.unwrap();
    let report = &outcome.report;
    let audit = &outcome.audit;
    assert!(audit.passed(), "{}", report.render());
    assert_eq!(audit.lost, 0);
    assert_eq!(audit.repeats, 0);
    assert_eq!(audit.ack_mismatches, 0);
    // Readers following every conversation with a cursor got every row,
    // in seq order.
    assert_eq!(audit.missed_by_followers, 0, "{}", report.render());
    assert_eq!(audit.delivered_out_of_order, 0);
    assert_eq!(audit.stored_out_of_send_order, 0);
    assert_eq!(audit.delivered_to_followers, audit.stored_rows);
    assert_eq!(
        report.outcomes.stored, audit.stored_rows,
        "one row per stored answer"
    );
    // At 10% ACK loss, roughly a tenth of the messages are resent after a
    // lost ACK, and the window recognises them.
    assert!(report.acks_lost > 50, "{}", report.render());
    assert!(report.outcomes.duplicate_window > 50, "{}", report.render());
    // The app killed and reopened an hour later: the unique key catches all.
    assert_eq!(
        report.late_resends_caught_by_unique_key,
        50,
        "{}",
        report.render()
    );
    // Every message that reached the server at least once is stored once.
    assert!(audit.stored_rows <= 1000);
    assert!(audit.stored_rows + audit.failed >= 1000);

    // `--events`: a line per message, in the order they were due, each
    // try with what came back; the ACKs lost on the way down among them.
    let events = std::fs::read_to_string(&events).unwrap();
    let lines: Vec<Vec<&str>> = events.lines().map(|l| l.split('\t').collect()).collect();
    assert_eq!(lines.len(), 1000);
    let due: Vec<u64> = lines.iter().map(|l| l[0].parse().unwrap()).collect();
    assert!(due.windows(2).all(|w| w[0] <= w[1]), "in the order due");
    let mut acks_lost = 0;
    for line in &lines {
        let steps: Vec<&str> = line[4].split(' ').filter(|s| !s.is_empty()).collect();
        let tries = steps.iter().filter(|s| !s.starts_with('H')).count();
        assert_eq!(line[2], tries.to_string(), "{line:?}");
        acks_lost += steps.iter().filter(|s| s.starts_with('a')).count() as u64;
        match line[1] {
            "-" => assert!(
                !steps.last().is_some_and(|s| s.starts_with('A')),
                "{line:?}"
            ),
            latency => {
                let latency: u64 = latency.parse().unwrap();
                let last = steps.last().and_then(|s| s.strip_prefix('A')).unwrap();
                assert!(latency.abs_diff(last.parse().unwrap()) <= 1, "{line:?}");
            }
        }
    }
    assert_eq!(acks_lost, report.acks_lost);

    // The HTML report carries its three plots, drawn from the run's data.
    let html = imdedup_loadtest::html::render(report);
    assert_eq!(html.matches("<svg").count(), 3);
    assert_eq!(html.matches("<polyline").count(), 3, "throughput, p50, p99");
    assert!(html.contains(&format!(">{}</text>", report.outcomes.duplicate_window)));
    let acked: u64 = report.timeline.iter().map(|s| s.acked).sum();
    assert_eq!(
        acked,
        1000 - audit.failed,
        "the timeline counts every ACK once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_dedup_receivers_see_about_one_repeat_per_ten_messages() {
    let _alone = ONE_RUN_AT_A_TIME.lock().await;
    let mut config = book(1000);
    config.dedup_off = true;
    config.late_resends = 0;
    config.concurrent_copies = 0.0;
    // These phones speak the binary frames.
    config.encoding = Encoding::Protobuf;
    let outcome = run(config).await.unwrap();
    let audit = &outcome.audit;
    // The book: at 10% loss per leg, about 11 extra copies per 100 messages.
    assert!(
        (60..=180).contains(&audit.repeats),
        "{}",
        outcome.report.render()
    );
    assert!(!audit.passed(), "repeats fail the audit");
    assert_eq!(audit.lost, 0);
    assert_eq!(outcome.report.outcomes.duplicate_window, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_storm_is_answered_from_the_window() {
    let _alone = ONE_RUN_AT_A_TIME.lock().await;
    let mut config = book(200);
    config.scenario = "storm".into();
    config.storm_window = Duration::from_millis(300);
    config.loss_send = 0.01;
    config.loss_ack = 0.01;
    config.late_resends = 0;
    config.concurrent_copies = 0.0;
    // These phones speak the binary frames.
    config.encoding = Encoding::Protobuf;
    let outcome = run(config).await.unwrap();
    let report = &outcome.report;
    assert!(outcome.audit.passed(), "{}", report.render());
    // Every first copy was stored and its ACK lost; every resend after the
    // reconnect is a repeat the window answers.
    assert_eq!(report.outcomes.stored, 200, "{}", report.render());
    assert!(
        report.outcomes.duplicate_window >= 200,
        "{}",
        report.render()
    );
    assert_eq!(outcome.audit.stored_rows, 200);
}

#[tokio::test]
async fn nonsense_settings_are_refused() {
    let mut config = book(10);
    config.loss_send = 1.5;
    assert!(run(config).await.is_err());
    let mut config = book(10);
    config.target = Target::Gateway {
        url: "ws://127.0.0.1:9/v1/ws".into(),
        token_secret: Secret::new("0123456789abcdef0123456789abcdef"),
        groups_file: None,
    };
    let err = run(config.clone()).await.err().unwrap().to_string();
    assert!(err.contains("--late-resends needs --embedded"), "{err}");
    config.late_resends = 0;
    config.dedup_off = true;
    let err = run(config.clone()).await.err().unwrap().to_string();
    assert!(err.contains("--no-dedup"), "{err}");
    // Groups need members the gateway knows.
    config.dedup_off = false;
    config.group_share = 0.5;
    let err = run(config).await.err().unwrap().to_string();
    assert!(err.contains("--groups-file"), "{err}");
}
