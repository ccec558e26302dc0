//! The storage service, reached over gRPC, as a [`MessageStore`].
//!
//! Inserts travel over one long-lived `InsertStream` (see
//! [`crate::stream_hop`]); lookups and history pages are single calls.

use std::{sync::OnceLock, time::Duration};

use crate::{
    Error, ErrorKind, convert,
    model::{HistoryQuery, MessageKey, NewMessage, StoredMessage},
    store::{Insert, MessageStore},
    stream_hop::{HopAnswers, HopCall, HopLimits, ReceiverStream, StreamHop},
    tls::{self, InternalTls},
};
use async_trait::async_trait;
use futures_util::StreamExt;
use imdedup_proto::v1::{self as pb, insert_result, storage_service_client::StorageServiceClient};
use tonic::transport::{Channel, Endpoint};

/// Opens `InsertStream` for the [`StreamHop`] of inserts.
struct InsertStreamCall {
    client: StorageServiceClient<Channel>,
}

impl HopCall for InsertStreamCall {
    type Req = pb::InsertOnceRequest;
    type Resp = pb::InsertResult;

    async fn open(
        &self,
        requests: ReceiverStream<pb::InsertOnceRequest>,
    ) -> Result<HopAnswers<pb::InsertResult>, Error> {
        let answers = self
            .client
            .clone()
            .insert_stream(requests)
            .await?
            .into_inner()
            .map(|answer| answer.map_err(Error::from));
        Ok(Box::pin(answers))
    }

    fn set_tag(request: &mut pb::InsertOnceRequest, tag: u64) {
        request.tag = tag;
    }

    fn tag(answer: &pb::InsertResult) -> u64 {
        answer.tag
    }
}

/// A lazily connecting gRPC client of `imdedup.v1.StorageService`.
#[derive(Clone)]
pub struct RemoteStore {
    client: StorageServiceClient<Channel>,
    timeout: Duration,
    /// Started on first insert, inside the caller's runtime.
    inserts: std::sync::Arc<OnceLock<StreamHop<InsertStreamCall>>>,
}

impl RemoteStore {
    /// A client for the storage service at `url` (`http://host:port`, or
    /// `https://` with mutual TLS). Connects on first use (over `tls`) and
    /// reconnects by itself.
    pub fn connect_lazy(url: &str, timeout: Duration, tls: &InternalTls) -> Result<Self, Error> {
        let endpoint = Endpoint::from_shared(url.to_owned())
            .map_err(|e| Error::invalid(format!("bad storage url {url:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(30));
        Ok(Self {
            client: StorageServiceClient::new(tls::channel(endpoint, tls)?),
            timeout,
            inserts: std::sync::Arc::default(),
        })
    }

    /// Insert over the stream, within the call timeout; a stream that
    /// answers nothing for twice that while inserts wait is given up.
    async fn insert(
        &self,
        request: pb::InsertOnceRequest,
    ) -> Result<pb::InsertOnceResponse, Error> {
        let hop = self.inserts.get_or_init(|| {
            let limits = HopLimits {
                stall: (self.timeout * 2).max(Duration::from_secs(2)),
                ..HopLimits::default()
            };
            StreamHop::spawn(
                limits,
                InsertStreamCall {
                    client: self.client.clone(),
                },
            )
        });
        let answer = tokio::time::timeout(self.timeout, hop.call(request))
            .await
            .map_err(|_| {
                Error::new(
                    ErrorKind::DeadlineExceeded,
                    format!("storage did not answer within {:?}", self.timeout),
                )
            })??;
        match answer.result {
            Some(insert_result::Result::Ok(ok)) => Ok(ok),
            Some(insert_result::Result::Error(e)) => Err(e.into()),
            None => Err(Error::internal("storage answered an insert with nothing")),
        }
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(self.timeout);
        crate::telemetry::inject_metadata(request.metadata_mut());
        request
    }
}

#[async_trait]
impl MessageStore for RemoteStore {
    async fn insert_once(&self, message: NewMessage) -> Result<Insert, Error> {
        let mut request = pb::InsertOnceRequest::from(message);
        request.trace_context = crate::telemetry::trace_context();
        let reply = self.insert(request).await?;
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
