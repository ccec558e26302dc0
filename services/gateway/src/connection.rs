//! One phone connection: frames in, ACKs and pages out, several sends in
//! flight at once.

use std::sync::Arc;

use axum::extract::ws::{Message, WebSocket};
use futures_util::{SinkExt, StreamExt};
use imdedup_core::{
    Error, convert,
    model::{ConversationId, HistoryQuery, Sender},
};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use crate::{
    Gateway,
    frames::{self, Encoded, Encoding, HistoryCmd, Inbound, Outbound, ReplyTo, SendCmd},
};

/// What the token said about this connection.
pub struct Session {
    pub sender: Sender,
    pub expires_at_unix: u64,
}

/// Serve one connection until the phone leaves, the token expires, or the
/// gateway shuts down; then finish the sends in flight and close.
pub async fn run(
    socket: WebSocket,
    gateway: Arc<Gateway>,
    session: Session,
    shutdown: CancellationToken,
) {
    let (mut sink, mut stream) = socket.split();
    let (out, mut outgoing) =
        mpsc::channel::<Message>(gateway.config.max_in_flight_per_connection * 2);
    let writer = tokio::spawn(async move {
        while let Some(message) = outgoing.recv().await {
            if sink.send(message).await.is_err() {
                break;
            }
        }
        let _ = sink.close().await;
    });

    let in_flight = Arc::new(Semaphore::new(gateway.config.max_in_flight_per_connection));
    let tasks = TaskTracker::new();
    loop {
        let next = tokio::select! {
            () = shutdown.cancelled() => break,
            next = stream.next() => next,
        };
        let (encoding, bytes) = match next {
            Some(Ok(Message::Text(text))) => (Encoding::Json, text.as_bytes().to_vec()),
            Some(Ok(Message::Binary(bytes))) => (Encoding::Protobuf, bytes.to_vec()),
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
            Some(Ok(Message::Close(_))) | None => break,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "websocket read failed");
                break;
            }
        };
        if gateway.config.clock.unix_seconds() >= session.expires_at_unix {
            let reply = frames::encode(
                encoding,
                Outbound::Error {
                    to: ReplyTo::default(),
                    error: Error::unauthenticated("token has expired; reconnect with a new one"),
                },
            );
            let _ = out.send(message(reply)).await;
            break;
        }
        let inbound = match frames::decode(encoding, &bytes) {
            Ok(inbound) => inbound,
            Err((to, error)) => {
                let _ = out
                    .send(message(frames::encode(
                        encoding,
                        Outbound::Error { to, error },
                    )))
                    .await;
                continue;
            }
        };
        // Waiting here stops reading: a phone cannot queue unbounded work.
        let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else {
            break;
        };
        let gateway = Arc::clone(&gateway);
        let sender = session.sender.clone();
        let out = out.clone();
        tasks.spawn(async move {
            let reply = match inbound {
                Inbound::Send(cmd) => send(&gateway, sender, cmd).await,
                Inbound::History(cmd) => history(&gateway, cmd).await,
            };
            let _ = out.send(message(frames::encode(encoding, reply))).await;
            drop(permit);
        });
    }
    tasks.close();
    tasks.wait().await;
    drop(out);
    let _ = writer.await;
}

fn message(encoded: Encoded) -> Message {
    match encoded {
        Encoded::Text(text) => Message::Text(text.into()),
        Encoded::Binary(bytes) => Message::Binary(bytes.into()),
    }
}

async fn send(gateway: &Gateway, sender: Sender, cmd: SendCmd) -> Outbound {
    let to = ReplyTo::send(&cmd);
    let id_b64 = cmd.id_b64;
    let validated = convert::new_message(
        sender.as_str().to_owned(),
        cmd.id,
        cmd.conversation,
        cmd.body,
        gateway.config.max_body_bytes,
    );
    let result = match validated {
        Ok(message) => {
            gateway
                .shards
                .send(message, gateway.config.send_timeout)
                .await
        }
        Err(e) => Err(e),
    };
    match result {
        Ok(ack) => Outbound::Ack { ack, id_b64 },
        Err(error) => {
            if error.retryable() {
                tracing::warn!(error = %error, "send failed");
            }
            Outbound::Error { to, error }
        }
    }
}

async fn history(gateway: &Gateway, cmd: HistoryCmd) -> Outbound {
    let to = ReplyTo::history(&cmd);
    let query = ConversationId::parse(cmd.conversation.clone())
        .and_then(|conversation| HistoryQuery::new(conversation, cmd.after_seq, cmd.limit));
    let result = match query {
        Ok(query) => gateway.history(&query).await,
        Err(e) => Err(e),
    };
    match result {
        Ok(messages) => Outbound::History {
            reference: cmd.reference,
            conversation: cmd.conversation,
            messages,
        },
        Err(error) => Outbound::Error { to, error },
    }
}
