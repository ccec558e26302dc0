//! Membership: which writer processes are alive, so a conversation's seqs
//! are only ever written by one of them.
//!
//! Each process registers an instance (`name#random`) in the `members`
//! table and renews it with a heartbeat; the row says until when the
//! process may write. A conversation's seq lease names the instance that
//! owns it (see [`super::leases`]); another process takes a conversation
//! over only once that instance is gone: relinquished at a clean shutdown,
//! or its heartbeat ran out and the handover grace passed, by which time
//! every write it started has landed or failed.
//!
//! A process that restarts under the same name (a StatefulSet pod keeps its
//! name; names are unique, as the shard map requires) is its own
//! predecessor's successor: once it has been up for the handover grace, the
//! predecessor's writes have all ended, and it takes the conversations back
//! without waiting for the old heartbeat to run out.
//!
//! The owner fences itself: it starts a write only while its last
//! successful heartbeat is fresh enough that the write ends before the row
//! runs out. Once that lapses, its cached seq blocks are void (the epoch
//! moves on) and it must lease again, which fails if someone took over.
//! A failed heartbeat is tried again within a quarter second, so a process
//! whose membership lapsed while the database stalled writes again as soon
//! as the database answers.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering},
    },
    time::Duration,
};

use imdedup_domain::Error;
use scylla::client::session::Session;

use super::requests::{Counted, RequestKind};
use tokio::task::JoinHandle;

use super::{
    ScyllaOptions,
    rows::{db_error, rows},
    unix_millis,
};

/// How soon a failed heartbeat is tried again.
const HEARTBEAT_RETRY: Duration = Duration::from_millis(250);

/// The retry-after hint of a write refused while the membership has lapsed:
/// the time since it lapsed, within these bounds, so a phone's tries thin
/// out the way its own backoff would while the database stays away.
const LAPSED_RETRY_AFTER: (Duration, Duration) =
    (Duration::from_millis(250), Duration::from_secs(4));

/// This process's membership and the statements it needs.
pub(super) struct Membership {
    instance: String,
    name: String,
    joined: std::time::Instant,
    session: Arc<Session>,
    heartbeat: Counted,
    alive: Counted,
    ttl: Duration,
    /// Writes may start until then (unix ms).
    writable_until: AtomicI64,
    /// Relinquished: no more writes, no more heartbeats.
    left: AtomicBool,
    /// Moves on each time the membership lapses: seq blocks leased in an
    /// earlier epoch may have been taken over.
    epoch: AtomicU64,
    request_timeout: Duration,
    grace: Duration,
    renewals: std::sync::Mutex<Option<JoinHandle<()>>>,
}

impl Membership {
    /// Register this process and start renewing in the background.
    pub(super) async fn join(
        session: Arc<Session>,
        options: &ScyllaOptions,
    ) -> Result<Arc<Self>, Error> {
        let ks = &options.keyspace;
        let mut heartbeat = session
            .prepare(format!(
                "INSERT INTO {ks}.members (instance, name, until_ms) VALUES (?, ?, ?) USING TTL ?"
            ))
            .await
            .map_err(|e| db_error("prepare", e))?;
        heartbeat.set_consistency(options.consistency);
        heartbeat.set_request_timeout(Some(options.request_timeout));
        heartbeat.set_is_idempotent(true);
        let mut alive = session
            .prepare(format!(
                "SELECT until_ms FROM {ks}.members WHERE instance = ?"
            ))
            .await
            .map_err(|e| db_error("prepare", e))?;
        alive.set_consistency(options.consistency);
        alive.set_request_timeout(Some(options.request_timeout));
        alive.set_is_idempotent(true);
        let member = Arc::new(Self {
            instance: format!("{}#{:016x}", options.member_name, rand::random::<u64>()),
            name: options.member_name.clone(),
            joined: std::time::Instant::now(),
            session,
            heartbeat: Counted::new(heartbeat, RequestKind::Write, &options.metrics),
            alive: Counted::new(alive, RequestKind::Read, &options.metrics),
            ttl: options.member_ttl,
            writable_until: AtomicI64::new(0),
            left: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            request_timeout: options.request_timeout,
            grace: options.handover_grace(),
            renewals: std::sync::Mutex::new(None),
        });
        member.renew().await?;
        tracing::info!(instance = %member.instance, "joined as a writer");
        let weak = Arc::downgrade(&member);
        let every = options.member_ttl / 4;
        let task = tokio::spawn(async move {
            let mut next = every;
            loop {
                tokio::time::sleep(next).await;
                let Some(member) = weak.upgrade() else { return };
                if member.left.load(Ordering::SeqCst) {
                    return;
                }
                next = match member.renew().await {
                    Ok(()) => every,
                    Err(e) => {
                        tracing::warn!(error = %e, instance = %member.instance, "membership heartbeat failed");
                        // Soon again: once the database answers, writes
                        // resume with the next heartbeat, not a period later.
                        every.min(HEARTBEAT_RETRY)
                    }
                };
            }
        });
        *member.renewals.lock().unwrap_or_else(|e| e.into_inner()) = Some(task);
        Ok(member)
    }

    pub(super) fn instance(&self) -> &str {
        &self.instance
    }

    /// One heartbeat: the row says until when others must keep off.
    async fn renew(&self) -> Result<(), Error> {
        let started = unix_millis();
        let until = started + millis(self.ttl);
        let row_ttl = i32::try_from((self.ttl + self.grace).as_secs() * 2 + 1).unwrap_or(i32::MAX);
        self.heartbeat
            .execute(&self.session, (&self.instance, &self.name, until, row_ttl))
            .await
            .map_err(|e| db_error("heartbeat", e))?;
        // A write started before `until - request_timeout` has ended
        // (landed or failed) by `until`.
        let writable = until - millis(self.request_timeout);
        let before = self.writable_until.load(Ordering::SeqCst);
        if before < started {
            // Lapsed (or never held): what was leased before is void.
            self.epoch.fetch_add(1, Ordering::SeqCst);
        }
        self.writable_until.fetch_max(writable, Ordering::SeqCst);
        Ok(())
    }

    /// The epoch writes may start in now, or `unavailable` while the
    /// membership has lapsed.
    pub(super) fn writable(&self) -> Result<u64, Error> {
        let until = self.writable_until.load(Ordering::SeqCst);
        if unix_millis() < until && !self.left.load(Ordering::SeqCst) {
            return Ok(self.epoch.load(Ordering::SeqCst));
        }
        let lapsed_for = Duration::from_millis(u64::try_from(unix_millis() - until).unwrap_or(0));
        Err(Error::unavailable(
            "this writer's membership has lapsed (is the database reachable?); retry",
        )
        .with_retry_after(lapsed_for.clamp(LAPSED_RETRY_AFTER.0, LAPSED_RETRY_AFTER.1)))
    }

    /// Whether `instance` may still be writing.
    pub(super) async fn is_alive(&self, instance: &str) -> Result<bool, Error> {
        if instance == self.instance {
            return Ok(true);
        }
        let name = instance.rsplit_once('#').map_or(instance, |(name, _)| name);
        if name == self.name && self.joined.elapsed() >= self.grace {
            // Our predecessor under this name: gone, and its writes ended.
            return Ok(false);
        }
        let result = self
            .alive
            .execute(&self.session, (instance,))
            .await
            .map_err(|e| db_error("membership", e))?;
        let until = rows::<(Option<i64>,)>(result)?
            .into_iter()
            .next()
            .and_then(|(until,)| until);
        Ok(until.is_some_and(|until| unix_millis() <= until + millis(self.grace)))
    }

    /// Leave at a clean shutdown, after the last write: others may take
    /// this process's conversations at once.
    pub(super) async fn relinquish(&self) {
        self.left.store(true, Ordering::SeqCst);
        if let Some(task) = self
            .renewals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            task.abort();
        }
        let row_ttl = i32::try_from(self.grace.as_secs() * 2 + 1).unwrap_or(i32::MAX);
        match self
            .heartbeat
            .execute(&self.session, (&self.instance, &self.name, 0_i64, row_ttl))
            .await
        {
            Ok(_) => tracing::info!(instance = %self.instance, "relinquished membership"),
            Err(e) => tracing::warn!(
                error = %e,
                instance = %self.instance,
                "could not relinquish membership; others wait for it to run out"
            ),
        }
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        if let Some(task) = self
            .renewals
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            task.abort();
        }
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
