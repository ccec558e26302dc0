//! The ingest shards and the choice of one per conversation.

use std::time::Duration;

use futures_util::StreamExt;

use imdedup_core::{
    batch::{Answers, BatchLimits, Batcher, MAX_BATCH_MESSAGE_BYTES},
    telemetry,
    tls::{self, InternalTls},
};

use imdedup_domain::{
    Error, ErrorKind,
    model::{Ack, NewMessage},
    routing::ShardMap,
};

use imdedup_proto::convert;
use imdedup_proto::status::from_status;
use imdedup_proto::v1::{self as pb, ingest_service_client::IngestServiceClient, send_response};
use tonic::transport::{Channel, Endpoint};

type SendBatcher = Batcher<pb::SendRequest, pb::SendResponse>;

/// The ingest shards of the shard map, each with a lazily connecting
/// client. Sends to one shard travel in batches (`SendBatch`, see
/// [`imdedup_core::batch`]).
#[derive(Clone)]
pub struct Shards {
    map: ShardMap,
    batchers: Vec<SendBatcher>,
}

impl Shards {
    /// Clients for the shards of `map`; none connects until used (then over
    /// `tls`). A batch gets `timeout` as its deadline. Must be called inside
    /// a Tokio runtime.
    pub fn connect_lazy(
        map: ShardMap,
        timeout: Duration,
        tls: &InternalTls,
    ) -> Result<Self, Error> {
        let batchers = map
            .shards()
            .iter()
            .map(|shard| {
                let url = &shard.url;
                let endpoint = Endpoint::from_shared(url.clone())
                    .map_err(|e| Error::invalid(format!("bad ingest shard url {url:?}: {e}")))?
                    .connect_timeout(Duration::from_secs(2))
                    .tcp_nodelay(true)
                    .http2_keep_alive_interval(Duration::from_secs(30));
                let client = IngestServiceClient::new(tls::channel(endpoint, tls)?)
                    .max_decoding_message_size(MAX_BATCH_MESSAGE_BYTES);
                Ok(Batcher::spawn(BatchLimits::default(), move |sends| {
                    send_batch(client.clone(), timeout, sends)
                }))
            })
            .collect::<Result<_, Error>>()?;
        Ok(Self { map, batchers })
    }

    pub fn map(&self) -> &ShardMap {
        &self.map
    }

    /// Send `message` to the shard that owns its conversation, within
    /// `timeout`. Also returns that shard's metric label.
    pub async fn send(&self, message: NewMessage, timeout: Duration) -> (&str, Result<Ack, Error>) {
        let index = self.map.owner(&message.conversation);
        (
            &self.map.shards()[index].name,
            self.send_to(index, message, timeout).await,
        )
    }

    async fn send_to(
        &self,
        index: usize,
        message: NewMessage,
        timeout: Duration,
    ) -> Result<Ack, Error> {
        let request = pb::SendRequest {
            sender: message.key.sender.as_str().to_owned(),
            client_msg_id: message.key.client_msg_id.into_bytes(),
            conversation: message.conversation.as_str().to_owned(),
            body: message.body.into_string(),
            trace_context: telemetry::trace_context(),
            tag: 0,
            // The deadline travels with the send, through the batch.
            budget_ms: u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX),
        };
        let response = tokio::time::timeout(timeout, self.batchers[index].call(request))
            .await
            .map_err(|_| {
                Error::new(
                    ErrorKind::DeadlineExceeded,
                    format!("ingest shard did not answer within {timeout:?}"),
                )
            })??;
        match response.result {
            Some(send_response::Result::Ack(ack)) => convert::ack(ack),
            Some(send_response::Result::Error(e)) => Err(e.into()),
            None => Err(Error::internal(
                "ingest answered with neither ack nor error",
            )),
        }
    }
}

/// One `SendBatch` call; each send is answered as soon as it is decided,
/// matched by its tag (its index in the batch).
async fn send_batch(
    mut client: IngestServiceClient<Channel>,
    timeout: Duration,
    mut sends: Vec<pb::SendRequest>,
) -> Result<Answers<pb::SendResponse>, Error> {
    for (index, send) in sends.iter_mut().enumerate() {
        send.tag = index as u64;
    }
    let mut request = tonic::Request::new(pb::SendBatchRequest { sends });
    request.set_timeout(timeout);
    let answers = tokio::time::timeout(timeout, client.send_batch(request))
        .await
        .map_err(|_| {
            Error::new(
                ErrorKind::DeadlineExceeded,
                format!("ingest shard did not answer within {timeout:?}"),
            )
        })?
        .map_err(from_status)?
        .into_inner()
        .map(|answer| {
            let answer = answer.map_err(from_status)?;
            let index = usize::try_from(answer.tag).unwrap_or(usize::MAX);
            Ok((index, Ok(answer)))
        });
    Ok(Box::pin(answers))
}
