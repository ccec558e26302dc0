//! Which ingest shard owns a conversation: rendezvous (highest random weight)
//! hashing over the shard map's names. Every gateway and ingest with the same
//! set of names picks the same shard, whatever URLs they use to reach it, and
//! removing a shard moves only its conversations.

use crate::{Error, model::ConversationId};

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

/// One ingest shard: its stable name (the identity that routing hashes, and
/// its `shard` metric label; in Kubernetes, the StatefulSet pod's name) and
/// the URL that reaches it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    pub name: String,
    pub url: String,
}

impl AsRef<str> for Shard {
    /// A shard is routed by its name.
    fn as_ref(&self) -> &str {
        &self.name
    }
}

/// The set of ingest shards, as every gateway and ingest must agree on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardMap {
    shards: Vec<Shard>,
}

impl ShardMap {
    /// Parse `--shards` entries: `NAME=URL` (`ingest-0=http://ingest-0.ingest:7200`),
    /// or a bare URL, named by the first DNS label of its host
    /// (`http://imdedup-ingest-0.imdedup-ingest:7200` is `imdedup-ingest-0`)
    /// or `host:port` for an IP address. Refuses an empty list, an entry
    /// without a name or URL, and a name given twice.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Self, Error> {
        let shards = entries
            .iter()
            .map(|entry| {
                let entry = entry.as_ref().trim();
                let (name, url) = match entry.split_once('=') {
                    Some((name, url)) => (name.trim().to_owned(), url.trim().to_owned()),
                    None => (url_name(entry), entry.to_owned()),
                };
                if name.is_empty() || url.is_empty() {
                    return Err(Error::invalid(format!(
                        "bad shard {entry:?}: give NAME=URL or a URL"
                    )));
                }
                Ok(Shard { name, url })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::new(shards)
    }

    /// A map of `shards`; refuses an empty list and a name given twice.
    pub fn new(shards: Vec<Shard>) -> Result<Self, Error> {
        if shards.is_empty() {
            return Err(Error::invalid("the ingest shard list is empty"));
        }
        for (index, shard) in shards.iter().enumerate() {
            if shards[..index].iter().any(|s| s.name == shard.name) {
                return Err(Error::invalid(format!(
                    "shard name {:?} is given twice; every shard needs its own name",
                    shard.name
                )));
            }
        }
        Ok(Self { shards })
    }

    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// The index of the shard that owns `conversation`.
    pub fn owner(&self, conversation: &ConversationId) -> usize {
        // `new` refuses an empty map, so there is always an owner.
        owner(&self.shards, conversation).unwrap_or(0)
    }

    /// The shards' names, in map order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.shards.iter().map(|shard| shard.name.as_str())
    }

    /// The map's version: a fingerprint of its set of names, which is all
    /// routing depends on (not their order, not their URLs). Two processes
    /// with the same version route every conversation alike. Logged at
    /// start and named in refusals, so a rollout's mixed maps show.
    pub fn version(&self) -> String {
        let mut names: Vec<&str> = self.names().collect();
        names.sort_unstable();
        let parts: Vec<&[u8]> = names.iter().map(|n| n.as_bytes()).collect();
        format!("{:08x}", stable_hash(&parts) >> 32)
    }

    /// The shard named `name`, if it is in the map.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.shards.iter().position(|shard| shard.name == name)
    }
}

/// The name of a shard given by URL alone: the first DNS label of its host,
/// or `host:port` for an IP address.
fn url_name(url: &str) -> String {
    let authority = url
        .split_once("://")
        .map_or(url, |(_, rest)| rest)
        .split(['/', '?'])
        .next()
        .unwrap_or_default();
    let host = match authority.rsplit_once(':') {
        Some((host, port)) if port.chars().all(|c| c.is_ascii_digit()) => host,
        _ => authority,
    };
    let is_ip = host
        .trim_matches(['[', ']'])
        .parse::<std::net::IpAddr>()
        .is_ok();
    if is_ip || host.is_empty() {
        authority.to_owned()
    } else {
        host.split('.').next().unwrap_or(host).to_owned()
    }
}

/// What an ingest shard owns: the conversations that `map` gives to `me`.
#[derive(Debug, Clone)]
pub struct Ownership {
    map: ShardMap,
    me: usize,
}

impl Ownership {
    /// Ownership of the shard named `me`, which must be in `map`.
    pub fn new(map: ShardMap, me: &str) -> Result<Self, Error> {
        let me = map.position(me).ok_or_else(|| {
            Error::invalid(format!(
                "this shard's name {me:?} is not in the shard list ({})",
                map.names().collect::<Vec<_>>().join(", ")
            ))
        })?;
        Ok(Self { map, me })
    }

    /// `Ok` when this shard owns `conversation`; otherwise a retryable
    /// error: the caller routed by another shard map (a change of the shard
    /// set is rolling out) and must not get an answer from a non-owner.
    pub fn check(&self, conversation: &ConversationId) -> Result<(), Error> {
        if self.map.owner(conversation) == self.me {
            Ok(())
        } else {
            Err(Error::unavailable(format!(
                "this ingest shard does not own the conversation under its shard map {} \
                 (the shard set is changing); retry",
                self.map.version()
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `stable_hash` decides which shard owns a conversation, which Redis
    /// bucket holds an ID and the fingerprint stored beside it: a change of
    /// these values would, in a rolling upgrade, route a conversation to two
    /// shards at once and answer resends with false `id_reused`. Pinned.
    #[test]
    fn stable_hash_gives_the_same_values_in_every_release() {
        let golden: [(&[&[u8]], u64); 7] = [
            (&[], 0xf52a_15e9_a9b5_e89b),
            (&[b""], 0x813f_0174_a236_7c13),
            (&[b"ingest-0", b"dm:ana:ben"], 0x485c_21e7_afdb_565d),
            (&[b"ingest-1", b"dm:ana:ben"], 0x3af8_543f_eed4_4ff7),
            (&[b"ab", b"c"], 0x482f_6f54_3bbc_5465),
            (&[b"a", b"bc"], 0x461d_2521_4179_d9fb),
            (&[b"ana\0m-1"], 0x9ddb_dc07_d0df_4dae),
        ];
        for (parts, value) in golden {
            assert_eq!(stable_hash(parts), value, "{parts:?}");
        }
    }

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
    fn the_version_names_the_set_of_shard_names() {
        let map = |entries: &[&str]| ShardMap::parse(entries).unwrap().version();
        let two = map(&["ingest-0=http://a:1", "ingest-1=http://b:1"]);
        assert_eq!(two, map(&["ingest-1=http://x:2", "ingest-0=http://y:2"]));
        assert_ne!(
            two,
            map(&[
                "ingest-0=http://a:1",
                "ingest-1=http://b:1",
                "ingest-2=http://c:1"
            ])
        );
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

    #[test]
    fn a_shard_is_named_like_the_pod_that_serves_it() {
        let map = ShardMap::parse(&[
            "http://imdedup-ingest-0.imdedup-ingest:7200",
            "http://imdedup-ingest-1.imdedup-ingest.chat.svc.cluster.local:7200/",
            "http://ingest-a:7200",
            "http://127.0.0.1:7200",
            "http://[::1]:7200",
            "custom = http://10.0.0.9:7200",
        ])
        .unwrap();
        assert_eq!(
            map.names().collect::<Vec<_>>(),
            [
                "imdedup-ingest-0",
                "imdedup-ingest-1",
                "ingest-a",
                "127.0.0.1:7200",
                "[::1]:7200",
                "custom"
            ]
        );
        assert_eq!(map.shards()[5].url, "http://10.0.0.9:7200");
    }

    #[test]
    fn routing_follows_names_not_spellings_of_urls() {
        let short = ShardMap::parse(&["a=http://a:7200", "b=http://b:7200"]).unwrap();
        let long = ShardMap::parse(&[
            "b=http://b.ingest.chat.svc.cluster.local:7200",
            "a=http://a.ingest.chat.svc.cluster.local:7200",
        ])
        .unwrap();
        for i in 0..200 {
            let c = conv(i);
            assert_eq!(
                short.shards()[short.owner(&c)].name,
                long.shards()[long.owner(&c)].name
            );
        }
    }

    #[test]
    fn a_bad_shard_list_is_refused() {
        let empty: [&str; 0] = [];
        assert!(ShardMap::parse(&empty).is_err());
        assert!(ShardMap::parse(&["=http://a:7200"]).is_err());
        assert!(ShardMap::parse(&["a="]).is_err());
        let twice = ShardMap::parse(&["a=http://x:1", "a=http://y:1"]).unwrap_err();
        assert!(twice.message().contains("twice"), "{twice}");
    }

    #[test]
    fn an_ingest_answers_only_for_its_own_conversations() {
        let map = ShardMap::parse(&["a=http://a:1", "b=http://b:1", "c=http://c:1"]).unwrap();
        let owners: Vec<_> = ["a", "b", "c"]
            .iter()
            .map(|me| Ownership::new(map.clone(), me).unwrap())
            .collect();
        for i in 0..300 {
            let c = conv(i);
            let accepted: Vec<_> = owners.iter().filter(|o| o.check(&c).is_ok()).collect();
            assert_eq!(accepted.len(), 1, "conversation {i}: exactly one owner");
        }
        let refused = owners.iter().find_map(|o| o.check(&conv(0)).err()).unwrap();
        assert!(refused.retryable());
        assert!(
            Ownership::new(map, "d").is_err(),
            "a shard must be in the map"
        );
    }
}
