//! The ingest shards and the choice of one per conversation.

use std::time::Duration;

use imdedup_domain::{
    Error,
    model::{Ack, NewMessage},
    routing::ShardMap,
};
use imdedup_hops::ingest::IngestClient;
use imdedup_runtime::tls::InternalTls;

/// The ingest shards of the shard map, each with a lazily connecting
/// client ([`IngestClient`]: sends on one long-lived stream).
#[derive(Clone)]
pub struct Shards {
    map: ShardMap,
    clients: Vec<IngestClient>,
}

impl Shards {
    /// Clients for the shards of `map`; none connects until used (then over
    /// `tls`). A stream that answers nothing for twice `timeout` is given
    /// up. Must be called inside a Tokio runtime.
    pub fn connect_lazy(
        map: ShardMap,
        timeout: Duration,
        tls: &InternalTls,
    ) -> Result<Self, Error> {
        let clients = map
            .shards()
            .iter()
            .map(|shard| IngestClient::connect_lazy(&shard.url, timeout, tls))
            .collect::<Result<_, Error>>()?;
        Ok(Self { map, clients })
    }

    pub fn map(&self) -> &ShardMap {
        &self.map
    }

    /// Each shard's name and how many sends it may have unanswered now
    /// (its adaptive window).
    pub fn windows(&self) -> impl Iterator<Item = (&str, usize)> {
        (self.map.shards().iter())
            .zip(&self.clients)
            .map(|(shard, client)| (shard.name.as_str(), client.window()))
    }

    /// Send `message` to the shard that owns its conversation, within
    /// `timeout`. Also returns that shard's metric label.
    pub async fn send(&self, message: NewMessage, timeout: Duration) -> (&str, Result<Ack, Error>) {
        let index = self.map.owner(&message.conversation);
        (
            &self.map.shards()[index].name,
            self.clients[index].send(message, timeout).await,
        )
    }
}
