//! The storage service, reached over gRPC, as a [`MessageStore`].
//!
//! Inserts travel over one long-lived `InsertStream` (see
//! [`crate::stream`]); lookups and history pages are single calls.
//! A storage of an earlier version (in a rolling upgrade) answers
//! `InsertStream` with UNIMPLEMENTED: inserts then go as single
//! `InsertOnce` calls for [`UNARY_FOR`] before the stream is tried again.

use std::{
    sync::{
        Arc, OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use imdedup_runtime::tls::{self, InternalTls};

use crate::stream::{HopAnswers, HopCall, HopLimits, ReceiverStream, StreamHop, grpc_answers};

use imdedup_domain::{
    Error, ErrorKind,
    model::{HistoryQuery, MessageKey, NewMessage, StoredMessage},
    store::{Insert, MessageStore},
};

use async_trait::async_trait;
use imdedup_proto::convert;
use imdedup_proto::status::from_status;
use imdedup_proto::v1::{self as pb, insert_result, storage_service_client::StorageServiceClient};
use tonic::transport::{Channel, Endpoint};

/// How long inserts go as single calls after storage said it does not
/// serve `InsertStream`.
pub const UNARY_FOR: Duration = Duration::from_secs(60);

/// Until when (ms since `since`; 0: not at all) inserts go as single calls.
#[derive(Clone)]
struct UnaryUntil {
    since: Instant,
    until_ms: Arc<AtomicU64>,
}

impl UnaryUntil {
    fn new() -> Self {
        Self {
            since: Instant::now(),
            until_ms: Arc::default(),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn active(&self) -> bool {
        self.now_ms() < self.until_ms.load(Ordering::Relaxed)
    }

    fn start(&self) {
        let until = self.now_ms().saturating_add(UNARY_FOR.as_millis() as u64);
        self.until_ms.store(until, Ordering::Relaxed);
    }
}

/// Opens `InsertStream` for the [`StreamHop`] of inserts.
struct InsertStreamCall {
    client: StorageServiceClient<Channel>,
    unary: UnaryUntil,
}

impl HopCall for InsertStreamCall {
    type Req = pb::InsertOnceRequest;
    type Resp = pb::InsertResult;

    async fn open(
        &self,
        requests: ReceiverStream<pb::InsertOnceRequest>,
    ) -> Result<HopAnswers<pb::InsertResult>, Error> {
        let answers = match self.client.clone().insert_stream(requests).await {
            Ok(answers) => answers.into_inner(),
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                // It read nothing: what waited for this stream is surely
                // not stored, and its resend goes as a single call.
                self.unary.start();
                tracing::warn!(
                    "storage does not serve InsertStream (an earlier version): \
                     inserting with single calls for {UNARY_FOR:?}"
                );
                return Err(Error::unavailable(
                    "storage does not serve InsertStream yet; retry",
                ));
            }
            Err(status) => return Err(from_status(status)),
        };
        Ok(grpc_answers(answers))
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
    inserts: Arc<OnceLock<StreamHop<InsertStreamCall>>>,
    unary: UnaryUntil,
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
            inserts: Arc::default(),
            unary: UnaryUntil::new(),
        })
    }

    /// Insert over the stream, within the call timeout; a stream that
    /// answers nothing for twice that while inserts wait is given up.
    async fn insert(
        &self,
        request: pb::InsertOnceRequest,
    ) -> Result<pb::InsertOnceResponse, Error> {
        if self.unary.active() {
            let reply = self
                .client
                .clone()
                .insert_once(self.request(request))
                .await
                .map_err(from_status)?;
            return Ok(reply.into_inner());
        }
        let hop = self.inserts.get_or_init(|| {
            let limits = HopLimits {
                stall: (self.timeout * 2).max(Duration::from_secs(2)),
                ..HopLimits::default()
            };
            StreamHop::spawn(
                limits,
                InsertStreamCall {
                    client: self.client.clone(),
                    unary: self.unary.clone(),
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
        imdedup_runtime::telemetry::inject_metadata(request.metadata_mut());
        request
    }
}

#[async_trait]
impl MessageStore for RemoteStore {
    async fn insert_once(&self, message: NewMessage) -> Result<Insert, Error> {
        let mut request = pb::InsertOnceRequest::from(message);
        request.trace_context = imdedup_runtime::telemetry::trace_context();
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
            .await
            .map_err(from_status)?
            .into_inner();
        reply.message.map(convert::stored_message).transpose()
    }

    async fn history(&self, query: &HistoryQuery) -> Result<Vec<StoredMessage>, Error> {
        self.client
            .clone()
            .history(self.request(pb::HistoryRequest::from(query)))
            .await
            .map_err(from_status)?
            .into_inner()
            .messages
            .into_iter()
            .map(convert::stored_message)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::{pin::Pin, sync::atomic::AtomicUsize};

    use futures_util::Stream;
    use imdedup_proto::v1::storage_service_server::{StorageService, StorageServiceServer};
    use tokio_stream::wrappers::TcpListenerStream;
    use tonic::{Request, Response, Status, Streaming};

    use super::*;
    use imdedup_domain::model::{Body, ClientMsgId, ConversationId, Sender};

    type Answers = Pin<Box<dyn Stream<Item = Result<pb::InsertResult, Status>> + Send>>;

    /// A storage of an earlier version: no `InsertStream`; counts the
    /// `InsertOnce` calls it answers.
    #[derive(Default)]
    struct EarlierStorage {
        insert_once_calls: Arc<AtomicUsize>,
    }

    #[tonic::async_trait]
    impl StorageService for EarlierStorage {
        async fn insert_once(
            &self,
            request: Request<pb::InsertOnceRequest>,
        ) -> Result<Response<pb::InsertOnceResponse>, Status> {
            let n = self.insert_once_calls.fetch_add(1, Ordering::SeqCst) as u64 + 1;
            let request = request.into_inner();
            Ok(Response::new(pb::InsertOnceResponse {
                inserted: true,
                message: Some(pb::StoredMessage {
                    sender: request.sender,
                    client_msg_id: request.client_msg_id,
                    conversation: request.conversation,
                    body: request.body,
                    server_id: n,
                    seq: n,
                    ..Default::default()
                }),
            }))
        }

        type InsertBatchStream = Answers;

        async fn insert_batch(
            &self,
            _: Request<pb::InsertBatchRequest>,
        ) -> Result<Response<Answers>, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        type InsertStreamStream = Answers;

        async fn insert_stream(
            &self,
            _: Request<Streaming<pb::InsertOnceRequest>>,
        ) -> Result<Response<Answers>, Status> {
            Err(Status::unimplemented(
                "imdedup.v1.StorageService/InsertStream",
            ))
        }

        async fn lookup(
            &self,
            _: Request<pb::LookupRequest>,
        ) -> Result<Response<pb::LookupResponse>, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        async fn history(
            &self,
            _: Request<pb::HistoryRequest>,
        ) -> Result<Response<pb::HistoryResponse>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
    }

    fn message(id: &str) -> NewMessage {
        NewMessage {
            key: MessageKey {
                sender: Sender::parse("ana".to_owned()).unwrap(),
                client_msg_id: ClientMsgId::parse(id.as_bytes().to_vec()).unwrap(),
            },
            conversation: ConversationId::parse("c".to_owned()).unwrap(),
            body: Body::parse("hi".to_owned(), 1024).unwrap(),
        }
    }

    #[tokio::test]
    async fn an_earlier_storage_without_the_stream_gets_single_inserts() {
        let storage = EarlierStorage::default();
        let calls = Arc::clone(&storage.insert_once_calls);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(StorageServiceServer::new(storage))
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        let store =
            RemoteStore::connect_lazy(&url, Duration::from_secs(2), &InternalTls::Plaintext)
                .unwrap();

        // The stream is refused before anything is read: retryable, and
        // surely not stored.
        let refused = store.insert_once(message("m-1")).await.unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::Unavailable);
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        // The resend goes as a single call, and so do the next ones.
        for id in ["m-1", "m-2"] {
            match store.insert_once(message(id)).await.unwrap() {
                Insert::Stored(row) => assert_eq!(row.key.client_msg_id.as_bytes(), id.as_bytes()),
                other => panic!("expected a stored row, got {other:?}"),
            }
        }
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }
}
