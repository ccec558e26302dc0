//! The ingest shards and the choice of one per conversation.

use std::time::Duration;

use imdedup_core::{
    Error, ErrorKind, convert,
    model::{Ack, ConversationId, NewMessage},
    routing,
};
use imdedup_proto::v1::{self as pb, ingest_service_client::IngestServiceClient, send_response};
use tonic::transport::{Channel, Endpoint};

/// The configured ingest shards, each with a lazily connecting client.
#[derive(Clone)]
pub struct Shards {
    urls: Vec<String>,
    clients: Vec<IngestServiceClient<Channel>>,
}

impl Shards {
    /// Clients for `urls` (`http://host:port`); none connects until used.
    pub fn connect_lazy(urls: &[String]) -> Result<Self, Error> {
        if urls.is_empty() {
            return Err(Error::invalid("the ingest shard list is empty"));
        }
        let clients = urls
            .iter()
            .map(|url| {
                let endpoint = Endpoint::from_shared(url.clone())
                    .map_err(|e| Error::invalid(format!("bad ingest shard url {url:?}: {e}")))?
                    .connect_timeout(Duration::from_secs(2))
                    .tcp_nodelay(true)
                    .http2_keep_alive_interval(Duration::from_secs(30));
                Ok(IngestServiceClient::new(endpoint.connect_lazy()))
            })
            .collect::<Result<_, Error>>()?;
        Ok(Self {
            urls: urls.to_vec(),
            clients,
        })
    }

    pub fn urls(&self) -> &[String] {
        &self.urls
    }

    /// Send `message` to the shard that owns its conversation, within
    /// `timeout`.
    pub async fn send(&self, message: NewMessage, timeout: Duration) -> Result<Ack, Error> {
        let index = self.owner(&message.conversation);
        let mut request = tonic::Request::new(pb::SendRequest {
            sender: message.key.sender.as_str().to_owned(),
            client_msg_id: message.key.client_msg_id.into_bytes(),
            conversation: message.conversation.as_str().to_owned(),
            body: message.body.into_string(),
            tag: 0,
        });
        request.set_timeout(timeout);
        let mut client = self.clients[index].clone();
        let response = tokio::time::timeout(timeout, client.send(request))
            .await
            .map_err(|_| {
                Error::new(
                    ErrorKind::DeadlineExceeded,
                    format!("ingest shard did not answer within {timeout:?}"),
                )
            })??
            .into_inner();
        match response.result {
            Some(send_response::Result::Ack(ack)) => convert::ack(ack),
            Some(send_response::Result::Error(e)) => Err(e.into()),
            None => Err(Error::internal(
                "ingest answered with neither ack nor error",
            )),
        }
    }

    fn owner(&self, conversation: &ConversationId) -> usize {
        // `connect_lazy` refuses an empty list, so there is always an owner.
        routing::owner(&self.urls, conversation).unwrap_or(0)
    }
}
