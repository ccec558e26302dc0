//! A phone's connection that comes back: when the gateway closes it (a
//! restart, a rolling update), the next use dials again, as an app does.

use std::sync::Arc;

use imdedup_client::{Client, ClientError, Encoding};

/// A reconnecting connection to the gateway.
pub struct Link {
    url: String,
    token: String,
    encoding: Encoding,
    /// Sends ask the gateway to hold them when it is full.
    queue: bool,
    /// The connection in use and its number (1 for the first).
    current: tokio::sync::Mutex<(u64, Arc<Client>)>,
}

impl Link {
    pub async fn connect(
        url: &str,
        token: &str,
        encoding: Encoding,
        queue: bool,
    ) -> Result<Self, ClientError> {
        let client = Client::connect(url, token, encoding)
            .await?
            .with_queue(queue);
        Ok(Self {
            url: url.to_owned(),
            token: token.to_owned(),
            encoding,
            queue,
            current: tokio::sync::Mutex::new((1, Arc::new(client))),
        })
    }

    /// The open connection and its number, dialling again (once) if the
    /// last one closed.
    pub async fn client(&self) -> Result<(u64, Arc<Client>), ClientError> {
        let mut current = self.current.lock().await;
        if current.1.is_closed() {
            let client = Client::connect(&self.url, &self.token, self.encoding)
                .await?
                .with_queue(self.queue);
            *current = (current.0 + 1, Arc::new(client));
        }
        Ok((current.0, Arc::clone(&current.1)))
    }
}
