//! The error kinds of imdedup and the `retryable` flag that phones see. The
//! gRPC status code of each kind, and the codec between an [`Error`] and a
//! gRPC status, are the wire's (`imdedup_proto::status`).
//!
//! Four kinds are final for the phone: a malformed request, a bad token, a
//! conversation the sender does not belong to, and a client message ID
//! reused for another message. The others ask for a
//! resend with the same ID, which is always safe because a resend is
//! recognised; they say whether the send is surely not stored
//! (`Unavailable`, `Overloaded`) or may be (`MaybeStored`,
//! `DeadlineExceeded`, `Internal`), where only the resend settles it.

use std::{fmt, time::Duration};

use crate::receipt::Receipt;

/// What went wrong, at the granularity a caller can act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The request is malformed or breaks a documented limit. Final.
    InvalidArgument,
    /// The token is missing, forged or expired. Final for this token.
    Unauthenticated,
    /// The sender may not send to or read the conversation (or it does not
    /// exist; the answer does not say which). Final.
    PermissionDenied,
    /// A backend (ingest, storage) cannot be reached, or refused before
    /// storing anything: surely not stored. Retry.
    Unavailable,
    /// The send reached a backend that failed midway: it may be stored (the
    /// insert's outcome is unknown, or the message is stored but its history
    /// row is not written yet). The resend with the same ID settles it.
    MaybeStored,
    /// A backend did not answer within the deadline. Retry.
    DeadlineExceeded,
    /// Too much work in flight; shed before doing any. Retry later.
    Overloaded,
    /// Anything else; nothing was acknowledged. Retry.
    Internal,
    /// The client message ID is stored with another conversation or body:
    /// not a resend but a new message under a used ID. Final.
    IdReused,
}

impl ErrorKind {
    /// Every kind, for tables and metrics.
    pub const ALL: [Self; 9] = [
        Self::InvalidArgument,
        Self::Unauthenticated,
        Self::PermissionDenied,
        Self::Unavailable,
        Self::MaybeStored,
        Self::DeadlineExceeded,
        Self::Overloaded,
        Self::Internal,
        Self::IdReused,
    ];

    /// Whether the phone should resend the same message (same ID) later.
    pub fn retryable(self) -> bool {
        !matches!(
            self,
            Self::InvalidArgument | Self::Unauthenticated | Self::PermissionDenied | Self::IdReused
        )
    }

    /// The stable name used in JSON client frames and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidArgument => "invalid_argument",
            Self::Unauthenticated => "unauthenticated",
            Self::PermissionDenied => "permission_denied",
            Self::Unavailable => "unavailable",
            Self::MaybeStored => "maybe_stored",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::Overloaded => "overloaded",
            Self::Internal => "internal",
            Self::IdReused => "id_reused",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error with its kind and a message meant for the person reading it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct Error {
    kind: ErrorKind,
    message: String,
    /// For `IdReused`: the receipt of the message stored under the ID.
    original: Option<Receipt>,
    /// For `Overloaded` and `Unavailable`: how long the caller should wait
    /// before trying again, in ms (0: no hint). Kept small: errors travel
    /// in every `Result` of the hot path.
    retry_after_ms: u32,
}

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            original: None,
            retry_after_ms: 0,
        }
    }

    /// `id` is already stored as another message, whose receipt is
    /// `original`.
    pub fn id_reused(original: Receipt) -> Self {
        Self {
            original: Some(original),
            ..Self::new(
                ErrorKind::IdReused,
                format!(
                    "this client message id was already used for another message \
                     (server id {}, seq {}), with another conversation or body; \
                     give every new message a new id",
                    original.server_id, original.seq
                ),
            )
        }
    }

    /// The same error, carrying the receipt of the original message.
    pub fn with_original(mut self, original: Option<Receipt>) -> Self {
        self.original = original;
        self
    }

    /// For `IdReused`: the receipt of the message stored under the ID.
    pub fn original(&self) -> Option<Receipt> {
        self.original
    }

    /// The same error, telling the caller to wait `after` before retrying.
    /// (Whole ms, at least 1.)
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after_ms = u32::try_from(after.as_millis()).unwrap_or(u32::MAX).max(1);
        self
    }

    /// How long to wait before retrying, when the server said.
    pub fn retry_after(&self) -> Option<Duration> {
        (self.retry_after_ms > 0).then(|| Duration::from_millis(u64::from(self.retry_after_ms)))
    }

    /// `Overloaded`, with a hint of when to try again.
    pub fn overloaded(message: impl Into<String>, retry_after: Duration) -> Self {
        Self::new(ErrorKind::Overloaded, message).with_retry_after(retry_after)
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }

    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unauthenticated, message)
    }

    pub fn permission_denied(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::PermissionDenied, message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unavailable, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    pub fn retryable(&self) -> bool {
        self.kind.retryable()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bad_requests_tokens_conversations_and_reused_ids_are_final() {
        let final_kinds: Vec<_> = ErrorKind::ALL
            .into_iter()
            .filter(|k| !k.retryable())
            .collect();
        assert_eq!(
            final_kinds,
            [
                ErrorKind::InvalidArgument,
                ErrorKind::Unauthenticated,
                ErrorKind::PermissionDenied,
                ErrorKind::IdReused
            ]
        );
    }
}
