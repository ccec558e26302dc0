//! The receipt of a stored message: a module of its own so that both the
//! model and the errors (a reused ID names the original's receipt) can use
//! it without depending on each other.

/// What storage assigned to a message when it first stored it; every ACK for
/// the message carries the same receipt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Receipt {
    pub server_id: u64,
    pub seq: u64,
}
