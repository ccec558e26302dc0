//! A window whose backend connects in the background: an ingest starts, and
//! serves, while Redis is down. Until the connection is made every call
//! fails as `unavailable`, which the dedup counts as a bypass and answers
//! from the store's unique key.

use std::{
    sync::{Arc, OnceLock},
    time::Duration,
};

use async_trait::async_trait;
use imdedup_domain::{
    Error,
    model::{MessageKey, Remembered},
    window::{Claim, ClaimToken, RecentWindow},
};
use tokio::task::JoinHandle;

/// First and longest wait between two connection attempts.
const FIRST_RETRY: Duration = Duration::from_millis(500);
const LONGEST_RETRY: Duration = Duration::from_secs(15);

pub struct ConnectingWindow<W> {
    window: Arc<OnceLock<W>>,
    connecting: JoinHandle<()>,
}

impl<W: RecentWindow> ConnectingWindow<W> {
    /// Call `connect` until it succeeds, waiting longer after each failure
    /// (up to 15 s); serve through the window it makes from then on.
    pub fn spawn<F, Fut>(connect: F) -> Self
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: Future<Output = Result<W, Error>> + Send,
    {
        let window = Arc::new(OnceLock::new());
        let slot = Arc::clone(&window);
        let connecting = tokio::spawn(async move {
            let mut wait = FIRST_RETRY;
            for attempt in 1u64.. {
                match connect().await {
                    Ok(connected) => {
                        if attempt > 1 {
                            tracing::info!(attempt, "window connected; no longer bypassed");
                        }
                        let _ = slot.set(connected);
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, attempt, retry_in = ?wait, "window cannot connect; bypassed until it does");
                        tokio::time::sleep(wait).await;
                        wait = (wait * 2).min(LONGEST_RETRY);
                    }
                }
            }
        });
        Self { window, connecting }
    }

    /// Whether the connection is made.
    pub fn connected(&self) -> bool {
        self.window.get().is_some()
    }

    /// Wait up to `limit` for the connection; whether it is made.
    pub async fn connected_within(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        while !self.connected() {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }

    fn get(&self) -> Result<&W, Error> {
        self.window
            .get()
            .ok_or_else(|| Error::unavailable("the window is not connected yet"))
    }
}

impl<W> Drop for ConnectingWindow<W> {
    fn drop(&mut self) {
        self.connecting.abort();
    }
}

#[async_trait]
impl<W: RecentWindow> RecentWindow for ConnectingWindow<W> {
    async fn claim(&self, key: &MessageKey) -> Result<Claim, Error> {
        self.get()?.claim(key).await
    }

    async fn remember(
        &self,
        key: &MessageKey,
        token: &ClaimToken,
        remembered: Remembered,
    ) -> Result<(), Error> {
        self.get()?.remember(key, token, remembered).await
    }

    async fn release(&self, key: &MessageKey, token: &ClaimToken) -> Result<(), Error> {
        self.get()?.release(key, token).await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use imdedup_domain::model::{ClientMsgId, Sender};

    use super::*;
    use crate::window::{MemoryWindow, MemoryWindowOptions};

    fn key() -> MessageKey {
        MessageKey {
            sender: Sender::parse("ana").unwrap(),
            client_msg_id: ClientMsgId::parse(b"m1".to_vec()).unwrap(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn calls_fail_as_unavailable_until_the_backend_connects() {
        let attempts = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&attempts);
        let window = ConnectingWindow::spawn(move || {
            let attempt = counted.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                if attempt < 4 {
                    Err(Error::unavailable("connection refused"))
                } else {
                    Ok(MemoryWindow::new(MemoryWindowOptions::default()))
                }
            }
        });
        tokio::task::yield_now().await;
        let err = window.claim(&key()).await.unwrap_err();
        assert!(err.retryable(), "{err}");
        assert!(!window.connected());

        // 0.5 + 1 + 2 s of backoff later, the fourth attempt connects.
        tokio::time::sleep(Duration::from_millis(3_600)).await;
        assert!(window.connected());
        assert_eq!(attempts.load(Ordering::SeqCst), 4);
        assert!(matches!(window.claim(&key()).await, Ok(Claim::Owned(_))));
    }
}
