//! A history pull, and its page cut to the gateway's size.

use imdedup_domain::{
    Error,
    model::{ConversationId, HistoryQuery, Sender, StoredMessage},
};

use super::send::UNAVAILABLE_RETRY_AFTER;
use crate::{
    Gateway,
    frames::{HistoryCmd, Outbound, ReplyTo},
};

/// A backend's failure to serve a pull, as the phone sees it. A pull
/// changes nothing, so whatever went wrong behind the gateway (the
/// database down or slow, a pending row it could not settle) means the
/// same to the phone: `unavailable`, pull again after the backend's hint or
/// a second. The send-path words (`maybe_stored`, "resend with the same
/// id") do not apply.
fn pull_failed(error: Error) -> Error {
    tracing::warn!(error = %error, "history pull failed");
    let wait = error.retry_after().unwrap_or(UNAVAILABLE_RETRY_AFTER);
    Error::unavailable("history is unavailable right now; pull again").with_retry_after(wait)
}

pub(super) async fn history(gateway: &Gateway, sender: &Sender, cmd: HistoryCmd) -> Outbound {
    let to = ReplyTo::history(&cmd);
    let query = ConversationId::parse(cmd.conversation.clone())
        .and_then(|conversation| HistoryQuery::new(conversation, cmd.after_seq, cmd.limit));
    let result = match query {
        Ok(query) => match gateway
            .config
            .authz
            .check(sender, &query.conversation)
            .await
        {
            Ok(()) => gateway.history(&query).await.map_err(pull_failed),
            Err(e) => Err(e),
        },
        Err(e) => Err(e),
    };
    match result {
        Ok(mut messages) => {
            keep_within(&mut messages, gateway.config.limits.max_history_page_bytes);
            Outbound::History {
                reference: cmd.reference,
                conversation: cmd.conversation,
                messages,
            }
        }
        Err(error) => Outbound::Error { to, error },
    }
}

/// Cut a page after the messages whose bodies fit in `max_bytes` (keeping
/// at least one): the phone pages on from the last seq it got, and only an
/// empty page ends the history.
fn keep_within(messages: &mut Vec<StoredMessage>, max_bytes: usize) {
    let mut total = 0;
    let fits = messages
        .iter()
        .take_while(|m| {
            total += m.body.len();
            total <= max_bytes
        })
        .count();
    messages.truncate(fits.max(1));
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use imdedup_domain::ErrorKind;

    use super::*;

    #[test]
    fn a_failed_pull_is_unavailable_with_a_wait_and_tells_no_internals() {
        let cases = [
            Error::unavailable("cql history: connection refused by 10.1.2.3:9042"),
            Error::new(
                ErrorKind::MaybeStored,
                "cql history commit: keyspace f1 does not exist",
            ),
            Error::new(ErrorKind::DeadlineExceeded, "storage:7300 slow"),
            Error::internal("sqlite: /data/messages.db is locked"),
            Error::overloaded("storage busy", Duration::from_millis(300)),
        ];
        for error in cases {
            let kind = error.kind();
            let hint = error.retry_after();
            let phone = pull_failed(error);
            assert_eq!(phone.kind(), ErrorKind::Unavailable, "{kind:?}");
            assert!(phone.retryable());
            assert_eq!(
                phone.retry_after(),
                Some(hint.unwrap_or(UNAVAILABLE_RETRY_AFTER)),
                "{kind:?}: the backend's hint, else a second"
            );
            assert!(phone.message().contains("pull again"));
            for internal in ["10.1.2.3", "cql", "/data", "storage", "sqlite", "same id"] {
                assert!(!phone.message().contains(internal), "{internal}");
            }
        }
    }
}
