//! The recent-ID window: a fast path in front of the store that answers most
//! repeats without touching the database. It is never the guarantee: the
//! store's unique key has the last word.

use async_trait::async_trait;

use crate::{
    Error,
    model::{MessageKey, Remembered},
};

/// Proof that one copy of a message holds the claim on its key, so only that
/// copy may turn the claim into a remembered receipt or release it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClaimToken(pub String);

/// What the window knows about a key at claim time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// Nothing known: this copy now holds a short-lived claim.
    Owned(ClaimToken),
    /// A repeat of a stored message: answer with its receipt (after checking
    /// its fingerprint).
    Seen(Remembered),
    /// Another copy holds the claim and has not finished; let the store
    /// decide.
    InFlight,
}

/// A window of recently stored (sender, client message ID) keys.
///
/// A key is remembered only after its insert really succeeded: `remember`
/// follows a successful insert, `release` follows a failed one, so the next
/// resend of a failed send is stored, not taken for "seen".
#[async_trait]
pub trait RecentWindow: Send + Sync + 'static {
    async fn claim(&self, key: &MessageKey) -> Result<Claim, Error>;

    /// Replace this copy's claim with the stored receipt and fingerprint,
    /// for the window TTL.
    async fn remember(
        &self,
        key: &MessageKey,
        token: &ClaimToken,
        remembered: Remembered,
    ) -> Result<(), Error>;

    /// Drop the claim, if it is still this copy's.
    async fn release(&self, key: &MessageKey, token: &ClaimToken) -> Result<(), Error>;
}
