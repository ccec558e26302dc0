//! Which ingest shard owns a conversation: rendezvous (highest random weight)
//! hashing over the configured shard list. Every gateway with the same list
//! picks the same shard, and removing a shard moves only its conversations.

use crate::model::ConversationId;

/// A stable 64-bit hash: FNV-1a over the bytes, then a SplitMix64 finaliser
/// for avalanche. Stable across builds and platforms, unlike std's hasher.
pub fn stable_hash(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        // The length keeps ("ab", "c") and ("a", "bc") apart.
        for byte in (part.len() as u64).to_le_bytes().iter().chain(part.iter()) {
            h ^= u64::from(*byte);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The index, in `shards`, of the shard that owns `conversation`, or `None`
/// when there are no shards. Shards are named by a stable identity (their
/// address in the shard list).
pub fn owner<S: AsRef<str>>(shards: &[S], conversation: &ConversationId) -> Option<usize> {
    shards
        .iter()
        .enumerate()
        .max_by_key(|(_, shard)| {
            stable_hash(&[shard.as_ref().as_bytes(), conversation.as_str().as_bytes()])
        })
        .map(|(index, _)| index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(i: usize) -> ConversationId {
        ConversationId::parse(format!("conversation-{i}")).unwrap()
    }

    #[test]
    fn spreads_conversations_over_shards() {
        let shards = ["http://a:7200", "http://b:7200", "http://c:7200"];
        let mut counts = [0usize; 3];
        for i in 0..3000 {
            counts[owner(&shards, &conv(i)).unwrap()] += 1;
        }
        for count in counts {
            assert!((800..1200).contains(&count), "uneven spread: {counts:?}");
        }
    }

    #[test]
    fn removing_a_shard_moves_only_its_conversations() {
        let three = ["a", "b", "c"];
        let two = ["a", "c"];
        for i in 0..1000 {
            let before = three[owner(&three, &conv(i)).unwrap()];
            let after = two[owner(&two, &conv(i)).unwrap()];
            if before != "b" {
                assert_eq!(before, after, "conversation {i} moved needlessly");
            }
        }
    }

    #[test]
    fn no_shards_means_no_owner() {
        let none: [&str; 0] = [];
        assert_eq!(owner(&none, &conv(1)), None);
    }
}
