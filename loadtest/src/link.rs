//! A phone's connection that comes back: when the gateway closes it (a
//! restart, a rolling update), the next use dials again, as an app does.

use std::sync::Arc;

use imdedup_client::{Client, ClientError, Encoding};

/// How a phone's client treats a gateway past its capacity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Manners {
    /// Sends ask the gateway to hold them when it is full (`queued`).
    pub queue: bool,
    /// Client-side adaptive throttling factor (0: off); see
    /// [`Client::with_throttle`].
    pub throttle: f64,
}

impl Manners {
    fn apply(self, client: Client) -> Client {
        client.with_queue(self.queue).with_throttle(self.throttle)
    }
}

/// A reconnecting connection to the gateway.
pub struct Link {
    url: String,
    token: String,
    encoding: Encoding,
    manners: Manners,
    /// The connection in use and its number (1 for the first).
    current: tokio::sync::Mutex<(u64, Arc<Client>)>,
}

impl Link {
    pub async fn connect(
        url: &str,
        token: &str,
        encoding: Encoding,
        manners: Manners,
    ) -> Result<Self, ClientError> {
        let client = manners.apply(Client::connect(url, token, encoding).await?);
        Ok(Self {
            url: url.to_owned(),
            token: token.to_owned(),
            encoding,
            manners,
            current: tokio::sync::Mutex::new((1, Arc::new(client))),
        })
    }

    /// The open connection and its number, dialling again (once) if the
    /// last one closed.
    pub async fn client(&self) -> Result<(u64, Arc<Client>), ClientError> {
        let mut current = self.current.lock().await;
        if current.1.is_closed() {
            // Boxed: this future is part of every message's task, and the
            // dial's state (a few KB) would be in each of them.
            let dial = Box::pin(Client::connect(&self.url, &self.token, self.encoding));
            let client = self.manners.apply(dial.await?);
            *current = (current.0 + 1, Arc::new(client));
        }
        Ok((current.0, Arc::clone(&current.1)))
    }
}
