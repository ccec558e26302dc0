//! A resend of a message still in flight joins it.
//!
//! A phone resends when no ACK came within a second; under load the first
//! copy is often still on its way through ingest and storage. Sending the
//! copy too would double the work exactly when there is least to spare (and
//! a slow service would be slowed further by its own slowness). So while a
//! send of (sender, message ID) is in flight in this gateway, a copy of it
//! from any connection of that sender waits for the same answer instead,
//! without taking a place of the gateway's limit or a token of the user's
//! rate.
//!
//! Only a true copy joins: same sender, ID, conversation and body (compared
//! by two independent 64-bit hashes, so a false join needs a 128-bit
//! collision). A send that reuses an ID for other content goes through as
//! its own send, and the ingest answers it `id_reused`.

use std::{
    collections::HashMap,
    hash::{BuildHasher, RandomState},
    sync::{Arc, Mutex, PoisonError},
};

use imdedup_domain::{
    Error,
    model::{Ack, Outcome},
};
use tokio::sync::oneshot;

type Answer = Result<Ack, Error>;

/// The sends in flight in this gateway, by (sender, message ID).
pub struct InFlightSends {
    sends: Mutex<HashMap<u64, Entry>>,
    keys: RandomState,
    contents: RandomState,
}

/// A send in flight. Tens of thousands are, in a surge, most with no copy
/// joined: an entry allocates nothing until one joins (a `watch` channel
/// per send was ~390 bytes of every held send: 1,784 bytes a held send
/// then, 1,391 now).
struct Entry {
    content: u64,
    copies: Vec<oneshot::Sender<Answer>>,
}

/// What identifies one send: its key and a fingerprint of all of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendKey {
    key: u64,
    content: u64,
}

/// The first copy in flight; its answer goes to every copy that joined.
/// Dropped without an answer, the copies are told to resend. While it
/// lives, its entry is the key's: only its own end removes it.
pub struct Leader {
    sends: Arc<InFlightSends>,
    key: u64,
    ended: bool,
}

/// A copy waiting for the first one's answer.
pub struct Follower {
    answer: oneshot::Receiver<Answer>,
}

impl InFlightSends {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            sends: Mutex::default(),
            keys: RandomState::new(),
            contents: RandomState::new(),
        })
    }

    pub fn key(&self, sender: &str, id: &[u8], conversation: &str, body: &str) -> SendKey {
        SendKey {
            key: self.keys.hash_one((sender, id)),
            content: self.contents.hash_one((sender, id, conversation, body)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Entry>> {
        self.sends.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Join the copy of `key` in flight, if there is one.
    pub fn join(&self, key: SendKey) -> Option<Follower> {
        let mut sends = self.lock();
        let entry = sends.get_mut(&key.key)?;
        (entry.content == key.content).then(|| entry.follow())
    }

    /// Lead the send of `key`; if a copy got there first meanwhile, join it
    /// instead (`Err`). A send with the same ID but other content leads
    /// without being joinable.
    pub fn lead(self: &Arc<Self>, key: SendKey) -> Result<Option<Leader>, Follower> {
        match self.lock().entry(key.key) {
            std::collections::hash_map::Entry::Occupied(mut entry) => {
                let entry = entry.get_mut();
                if entry.content == key.content {
                    Err(entry.follow())
                } else {
                    Ok(None)
                }
            }
            std::collections::hash_map::Entry::Vacant(vacant) => {
                vacant.insert(Entry {
                    content: key.content,
                    copies: Vec::new(),
                });
                Ok(Some(Leader {
                    sends: Arc::clone(self),
                    key: key.key,
                    ended: false,
                }))
            }
        }
    }

    /// Sends in flight that copies could join.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Entry {
    fn follow(&mut self) -> Follower {
        let (copy, answer) = oneshot::channel();
        self.copies.push(copy);
        Follower { answer }
    }
}

impl Leader {
    /// Its entry, out of the map (once): a copy arriving from now on is a
    /// resend of an ended send, and goes through on its own.
    fn end(&mut self) -> Option<Entry> {
        if std::mem::replace(&mut self.ended, true) {
            return None;
        }
        self.sends.lock().remove(&self.key)
    }

    /// Give every joined copy this answer.
    pub fn answer(mut self, answer: &Answer) {
        if let Some(entry) = self.end() {
            for copy in entry.copies {
                let _ = copy.send(answer.clone());
            }
        }
    }
}

impl Drop for Leader {
    /// Unanswered, the copies' channels close: they are told to resend.
    fn drop(&mut self) {
        self.end();
    }
}

impl Follower {
    /// The first copy's answer, as a repeat: the same receipt, but a copy
    /// that joined stored nothing itself, so where the first copy was
    /// `stored` the copy is a duplicate recognised before storage (as the
    /// recent-ID window would have recognised it a moment later). A phone
    /// that sent two copies thus sees one `stored` ACK, like any resend.
    pub async fn answer(self) -> Result<Ack, Error> {
        let answer = self.answer.await.unwrap_or_else(|_| Err(resend()));
        answer.map(|ack| Ack {
            outcome: match ack.outcome {
                Outcome::Stored => Outcome::DuplicateWindow,
                repeat => repeat,
            },
            ..ack
        })
    }
}

fn resend() -> Error {
    Error::unavailable("the first copy of this send was not answered; resend with the same id")
}

#[cfg(test)]
mod tests {
    use imdedup_domain::model::{ClientMsgId, Receipt};

    use super::*;

    fn ack() -> Ack {
        Ack {
            client_msg_id: ClientMsgId::parse(b"m-1".to_vec()).unwrap(),
            receipt: Receipt {
                server_id: 7,
                seq: 3,
            },
            outcome: Outcome::Stored,
        }
    }

    #[tokio::test]
    async fn a_copy_in_flight_gets_the_first_ones_answer() {
        let sends = InFlightSends::new();
        let key = sends.key("ana", b"m-1", "dm:ana:ben", "hi");
        let leader = sends.lead(key).ok().flatten().unwrap();
        let copy = sends.join(key).expect("joins the send in flight");
        let racing = sends.lead(key).err().expect("a second lead joins instead");
        leader.answer(&Ok(ack()));
        let repeat = Ack {
            outcome: Outcome::DuplicateWindow,
            ..ack()
        };
        assert_eq!(
            copy.answer().await.unwrap(),
            repeat,
            "the same receipt; only the first copy is `stored`"
        );
        assert_eq!(racing.answer().await.unwrap(), repeat);
        assert!(sends.is_empty(), "an answered send is no longer joinable");
        assert!(sends.join(key).is_none());
    }

    #[tokio::test]
    async fn other_content_under_the_same_id_does_not_join() {
        let sends = InFlightSends::new();
        let first = sends.key("ana", b"m-1", "dm:ana:ben", "hi");
        let _leader = sends.lead(first).ok().flatten().unwrap();
        for other in [
            sends.key("ana", b"m-1", "dm:ana:ben", "bye"),
            sends.key("ana", b"m-1", "dm:ana:carl", "hi"),
            sends.key("ben", b"m-1", "dm:ana:ben", "hi"),
        ] {
            assert!(sends.join(other).is_none());
        }
        let reused = sends.key("ana", b"m-1", "dm:ana:ben", "bye");
        assert!(
            matches!(sends.lead(reused), Ok(None)),
            "goes through on its own, not joinable"
        );
    }

    #[tokio::test]
    async fn a_lead_that_ended_leaves_the_next_lead_of_its_key_joinable() {
        let sends = InFlightSends::new();
        let key = sends.key("ana", b"m-1", "dm:ana:ben", "hi");
        let first = sends.lead(key).ok().flatten().unwrap();
        first.answer(&Ok(ack()));
        // A resend after the answer goes through and leads again; the
        // first lead, gone, must not take the second's entry with it.
        let second = sends.lead(key).ok().flatten().expect("leads again");
        let copy = sends.join(key).expect("joins the second lead");
        second.answer(&Ok(ack()));
        assert_eq!(copy.answer().await.unwrap().receipt, ack().receipt);
        assert!(sends.is_empty());
    }

    #[tokio::test]
    async fn copies_of_a_send_that_ended_unanswered_are_told_to_resend() {
        let sends = InFlightSends::new();
        let key = sends.key("ana", b"m-1", "dm:ana:ben", "hi");
        let leader = sends.lead(key).ok().flatten().unwrap();
        let copy = sends.join(key).unwrap();
        drop(leader);
        let error = copy.answer().await.unwrap_err();
        assert!(error.retryable());
        assert!(sends.is_empty());
    }
}
