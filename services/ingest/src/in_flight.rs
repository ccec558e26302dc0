//! One insert per key at a time in this ingest: a resend or a concurrent
//! copy of a key whose insert is running waits for that insert's outcome
//! instead of starting another LWT. With the window down (Redis gone) this
//! is what stands between a resend storm and the database.

use std::{
    collections::HashMap,
    future::Future,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
};

use futures_util::future::{BoxFuture, FutureExt, Shared};
use imdedup_domain::{Error, model::MessageKey, store::Insert};
use tracing::Instrument;

/// An insert's outcome, awaited by every caller of its key.
pub type Outcome = Shared<BoxFuture<'static, Result<Insert, Error>>>;

/// The inserts running, by key.
#[derive(Default)]
pub struct InFlight {
    running: Mutex<HashMap<MessageKey, Outcome>>,
}

impl InFlight {
    fn running(&self) -> MutexGuard<'_, HashMap<MessageKey, Outcome>> {
        // The map is consistent after every statement.
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The outcome of `key`'s insert, and whether this call started it: the
    /// one already running, or `insert` started in a task of its own, so a
    /// caller that gives up never cuts it off for the others.
    pub fn join<F>(self: &Arc<Self>, key: &MessageKey, insert: F) -> (bool, Outcome)
    where
        F: Future<Output = Result<Insert, Error>> + Send + 'static,
    {
        let mut running = self.running();
        if let Some(outcome) = running.get(key) {
            return (false, outcome.clone());
        }
        let (table, done) = (Arc::clone(self), key.clone());
        // The task cannot remove its entry before it is in the map: it
        // needs the lock this call holds.
        let task = tokio::spawn(
            async move {
                let result = insert.await;
                table.running().remove(&done);
                result
            }
            .in_current_span(),
        );
        let outcome = async move {
            task.await
                .unwrap_or_else(|e| Err(Error::internal(format!("insert task failed: {e}"))))
        }
        .boxed()
        .shared();
        running.insert(key.clone(), outcome.clone());
        (true, outcome)
    }

    /// Keys with an insert running.
    pub fn len(&self) -> usize {
        self.running().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
