//! The storage service, reached over gRPC, as a [`MessageStore`].

use std::time::Duration;

use crate::{
    Error, convert,
    model::{HistoryQuery, MessageKey, NewMessage, StoredMessage},
    store::{Insert, MessageStore},
};
use async_trait::async_trait;
use imdedup_proto::v1::{self as pb, storage_service_client::StorageServiceClient};
use tonic::transport::{Channel, Endpoint};

/// A lazily connecting gRPC client of `imdedup.v1.StorageService`.
#[derive(Clone)]
pub struct RemoteStore {
    client: StorageServiceClient<Channel>,
    timeout: Duration,
}

impl RemoteStore {
    /// A client for the storage service at `url` (`http://host:port`).
    /// Connects on first use and reconnects by itself.
    pub fn connect_lazy(url: &str, timeout: Duration) -> Result<Self, Error> {
        let endpoint = Endpoint::from_shared(url.to_owned())
            .map_err(|e| Error::invalid(format!("bad storage url {url:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(30));
        Ok(Self {
            client: StorageServiceClient::new(endpoint.connect_lazy()),
            timeout,
        })
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(self.timeout);
        request
    }
}

#[async_trait]
impl MessageStore for RemoteStore {
    async fn insert_once(&self, message: NewMessage) -> Result<Insert, Error> {
        let reply = self
            .client
            .clone()
            .insert_once(self.request(pb::InsertOnceRequest::from(message)))
            .await?
            .into_inner();
        let row = convert::stored_message(
            reply
                .message
                .ok_or_else(|| Error::internal("storage answered without a row"))?,
        )?;
        Ok(if reply.inserted {
            Insert::Stored(row)
        } else {
            Insert::AlreadyStored(row)
        })
    }

    async fn insert_copy(&self, message: NewMessage) -> Result<StoredMessage, Error> {
        let mut request = pb::InsertOnceRequest::from(message);
        request.store_copy = true;
        let reply = self
            .client
            .clone()
            .insert_once(self.request(request))
            .await?
            .into_inner();
        convert::stored_message(
            reply
                .message
                .ok_or_else(|| Error::internal("storage answered without a row"))?,
        )
    }

    async fn lookup(&self, key: &MessageKey) -> Result<Option<StoredMessage>, Error> {
        let reply = self
            .client
            .clone()
            .lookup(self.request(pb::LookupRequest {
                sender: key.sender.as_str().to_owned(),
                client_msg_id: key.client_msg_id.as_bytes().to_vec(),
            }))
            .await?
            .into_inner();
        reply.message.map(convert::stored_message).transpose()
    }

    async fn history(&self, query: &HistoryQuery) -> Result<Vec<StoredMessage>, Error> {
        self.client
            .clone()
            .history(self.request(pb::HistoryRequest::from(query)))
            .await?
            .into_inner()
            .messages
            .into_iter()
            .map(convert::stored_message)
            .collect()
    }
}
