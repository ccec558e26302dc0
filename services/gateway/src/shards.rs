//! The ingest shards and the choice of one per conversation.

use std::time::Duration;

use futures_util::StreamExt;

use imdedup_core::{
    Error, ErrorKind, convert,
    model::{Ack, NewMessage},
    routing::ShardMap,
    stream_hop::{HopAnswers, HopCall, HopLimits, ReceiverStream, StreamHop},
    telemetry,
    tls::{self, InternalTls},
};
use imdedup_proto::v1::{self as pb, ingest_service_client::IngestServiceClient, send_response};
use tonic::transport::{Channel, Endpoint};

/// Opens `SendStream` on one shard for its [`StreamHop`].
struct SendStreamCall {
    client: IngestServiceClient<Channel>,
}

impl HopCall for SendStreamCall {
    type Req = pb::SendRequest;
    type Resp = pb::SendResponse;

    async fn open(
        &self,
        requests: ReceiverStream<pb::SendRequest>,
    ) -> Result<HopAnswers<pb::SendResponse>, Error> {
        let answers = self
            .client
            .clone()
            .send_stream(requests)
            .await
            .map_err(Error::from)?
            .into_inner()
            .map(|answer| answer.map_err(Error::from));
        Ok(Box::pin(answers))
    }

    fn set_tag(request: &mut pb::SendRequest, tag: u64) {
        request.tag = tag;
    }

    fn tag(answer: &pb::SendResponse) -> u64 {
        answer.tag
    }
}

/// The ingest shards of the shard map, each with a lazily connecting
/// client. Sends to one shard travel over one long-lived `SendStream` (see
/// [`imdedup_core::stream_hop`]).
#[derive(Clone)]
pub struct Shards {
    map: ShardMap,
    hops: Vec<StreamHop<SendStreamCall>>,
}

impl Shards {
    /// Clients for the shards of `map`; none connects until used (then over
    /// `tls`). Sends get `timeout` each; a shard's stream that answers
    /// nothing for twice that while sends wait is given up. Must be called
    /// inside a Tokio runtime.
    pub fn connect_lazy(
        map: ShardMap,
        timeout: Duration,
        tls: &InternalTls,
    ) -> Result<Self, Error> {
        let limits = HopLimits {
            stall: (timeout * 2).max(Duration::from_secs(2)),
            ..HopLimits::default()
        };
        let hops = map
            .shards()
            .iter()
            .map(|shard| {
                let url = &shard.url;
                let endpoint = Endpoint::from_shared(url.clone())
                    .map_err(|e| Error::invalid(format!("bad ingest shard url {url:?}: {e}")))?
                    .connect_timeout(Duration::from_secs(2))
                    .tcp_nodelay(true)
                    .http2_keep_alive_interval(Duration::from_secs(30));
                let client = IngestServiceClient::new(tls::channel(endpoint, tls)?);
                Ok(StreamHop::spawn(limits, SendStreamCall { client }))
            })
            .collect::<Result<_, Error>>()?;
        Ok(Self { map, hops })
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
            // The deadline travels with the send, through the stream.
            budget_ms: u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX),
        };
        let response = tokio::time::timeout(timeout, self.hops[index].call(request))
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
