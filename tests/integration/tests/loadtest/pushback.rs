//! The driver's phones honour a server's retry-after hint as gRPC's
//! "pushback": the next try comes once the wait is over, and a try answered
//! that way does not use up a step of the resend schedule, so a phone the
//! server keeps asking to wait still has its message stored.

use std::{num::NonZeroU32, sync::Arc, time::Duration};

use imdedup_client::Encoding;
use imdedup_cluster::{ClusterOptions, LocalCluster};
use imdedup_domain::clock::SystemClock;
use imdedup_loadtest::{
    link::{Link, Manners},
    phone::{Fate, Outgoing, ResendPolicy, TryCounts, deliver},
};
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_phone_told_to_wait_keeps_its_schedule_and_its_message_is_stored() {
    let dir = tempfile::tempdir().unwrap();
    let mut options = ClusterOptions::new(dir.path(), Arc::new(SystemClock));
    options.shards = 1;
    // One send per 100 ms for this user: six messages due at once are
    // mostly refused with `overloaded` and a retry-after hint.
    options.gateway_limits.user_sends_per_second = NonZeroU32::new(10).unwrap();
    options.gateway_limits.user_send_burst = NonZeroU32::new(1).unwrap();
    let cluster = LocalCluster::start(options).await.unwrap();
    let token = cluster.token("ana").unwrap();
    let link = Arc::new(
        Link::connect(
            &cluster.gateway_url(),
            &token,
            Encoding::Json,
            // The phone's own pushback, not the client's throttle.
            Manners {
                queue: false,
                throttle: 0.0,
            },
        )
        .await
        .unwrap(),
    );

    // The book's five steps played in 60 ms (0, 2, 6, 14, 30 ms): all of
    // them pass long before the bucket lets six sends through.
    let policy = ResendPolicy {
        give_up: Duration::from_secs(10),
        ..ResendPolicy::book(0.002)
    };
    let offsets = policy.offsets(&mut rand::rng());
    let fates = vec![
        Fate {
            send_lost: false,
            ack_lost: false,
        };
        offsets.len()
    ];
    let due = Instant::now();
    let sends = (0..6).map(|i| {
        let (link, offsets, fates) = (Arc::clone(&link), offsets.clone(), fates.clone());
        tokio::spawn(async move {
            let id = format!("pushed-{i}");
            let message = Outgoing {
                id: id.as_bytes(),
                conversation: "dm:ana:ben",
                body: "hello",
            };
            let counts = TryCounts::new(due, 60);
            deliver(
                &link,
                message,
                due,
                &offsets,
                &fates,
                policy.give_up,
                &counts,
            )
            .await
        })
    });
    let traces = futures_util::future::join_all(sends).await;

    let mut refused = 0;
    for trace in traces {
        let trace = trace.unwrap();
        let ack = trace
            .received
            .as_ref()
            .expect("every message is acknowledged");
        assert_eq!(ack.outcome, "stored", "{trace:?}");
        refused += trace.errors.iter().filter(|e| *e == "overloaded").count();
        assert_eq!(
            trace.tries as usize,
            1 + trace.errors.len(),
            "every try was answered: refusals, then the ACK ({trace:?})"
        );
    }
    // Six messages at 10/s with a burst of one: five had to wait, the last
    // about half a second, long after the schedule's last step (30 ms).
    assert!(refused >= 5, "refusals: {refused}");
    let latest = Instant::now().duration_since(due);
    assert!(latest >= Duration::from_millis(400), "{latest:?}");
    cluster.shutdown().await;
}
