//! Property tests of the edge validation in `imdedup-runtime`: the validated
//! model types (`Sender`, `ConversationId`, `ClientMsgId`, `Body`,
//! `HistoryQuery`, `MessageKey`) and token parsing and verification
//! (`TokenKey`, `TokenVerifier`).
//!
//! Each property says what the docs (docs/protocol.md) and the doc comments promise: any
//! input is answered without a panic; what is accepted keeps the documented
//! limits and is kept byte for byte; what is refused is refused with the
//! documented kind (`invalid_argument` for fields, `unauthenticated` for
//! tokens), final, and with a message that says why.
//!
//! The number of cases is proptest's (256), or `PROPTEST_CASES`.

use std::time::Duration;

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use imdedup_domain::{
    Error, ErrorKind,
    model::{
        Body, ClientMsgId, ConversationId, HistoryQuery, MAX_CLIENT_MSG_ID_BYTES,
        MAX_CONVERSATION_BYTES, MAX_HISTORY_LIMIT, MAX_SENDER_BYTES, MessageKey, Sender,
    },
};
use imdedup_runtime::token::{MIN_SECRET_BYTES, TokenKey, TokenPolicy, TokenVerifier};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use proptest::prelude::*;
use serde_json::{Value, json};

// ---------------------------------------------------------------------------
// Strategies

/// The Unicode control characters (general category Cc): U+0000–U+001F and
/// U+007F–U+009F. Written out here rather than taken from `char::is_control`
/// so the oracle does not share the implementation's definition.
fn is_cc(c: char) -> bool {
    matches!(c, '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{9f}')
}

fn control_char() -> impl Strategy<Value = char> {
    prop_oneof![
        (0u32..=0x1f).prop_map(|c| char::from_u32(c).unwrap()),
        (0x7fu32..=0x9f).prop_map(|c| char::from_u32(c).unwrap()),
    ]
}

/// Characters that are easy to get wrong: multi-byte ones, separators,
/// format characters that are not Cc (U+200B, U+FEFF, U+2028), spaces.
fn tricky_char() -> impl Strategy<Value = char> {
    prop_oneof![
        Just(':'),
        Just(' '),
        Just('é'),
        Just('€'),
        Just('😀'),
        Just('\u{200b}'),
        Just('\u{feff}'),
        Just('\u{2028}'),
        Just('\u{a0}'),
        Just('\u{ad}'),
    ]
}

/// Strings of every kind, biased to the edges of the name rules: empty,
/// around 128 bytes with characters of 1 to 4 bytes, with and without
/// control characters.
fn any_text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[a-z0-9:._-]{0,8}",
        // Lengths around the limits, in bytes.
        (MAX_SENDER_BYTES - 3..=MAX_SENDER_BYTES + 3).prop_map(|n| "x".repeat(n)),
        prop::collection::vec(
            prop_oneof![
                4 => prop::char::range('a', 'z'),
                2 => tricky_char(),
                1 => control_char(),
                1 => any::<char>(),
            ],
            0..80,
        )
        .prop_map(|chars| chars.into_iter().collect()),
        // Around 128 bytes of multi-byte characters: the limit is in bytes,
        // not characters.
        (prop::sample::select(vec!['é', '€', '😀']), 28usize..70)
            .prop_map(|(c, n)| std::iter::repeat_n(c, n).collect()),
    ]
}

/// A name the model accepts: 1 to 128 bytes, no control character.
fn valid_name() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z][a-z0-9._-]{0,11}",
        any::<String>(),
        prop::collection::vec(
            prop_oneof![prop::char::range('a', 'z'), tricky_char()],
            1..40
        )
        .prop_map(|chars| chars.into_iter().collect()),
    ]
    .prop_map(|s: String| {
        let mut name: String = s.chars().filter(|c| !is_cc(*c)).collect();
        while name.len() > MAX_SENDER_BYTES {
            name.pop();
        }
        if name.is_empty() {
            name.push('u');
        }
        name
    })
}

fn id_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..=MAX_CLIENT_MSG_ID_BYTES + 16)
}

// ---------------------------------------------------------------------------
// Checks of a refusal

/// A field refused at the edge: `invalid_argument`, final, naming the field.
fn assert_invalid(error: &Error, field: &str) -> Result<(), TestCaseError> {
    prop_assert_eq!(error.kind(), ErrorKind::InvalidArgument, "{}", error);
    prop_assert!(!error.retryable(), "{}", error);
    prop_assert!(
        error.message().contains(field),
        "{:?} should name {}",
        error.message(),
        field
    );
    Ok(())
}

/// The documented name rule, for `what` ("sender" or "conversation"):
/// accepted exactly when 1 to `max` bytes without a control character, kept
/// byte for byte; refused with a message that says which rule it broke.
fn check_name<T>(
    what: &str,
    raw: &str,
    max: usize,
    parsed: Result<T, Error>,
    as_str: impl Fn(&T) -> &str,
) -> Result<(), TestCaseError> {
    let valid = !raw.is_empty() && raw.len() <= max && !raw.chars().any(is_cc);
    match parsed {
        Ok(value) => {
            prop_assert!(valid, "{} {:?} accepted", what, raw);
            prop_assert_eq!(as_str(&value), raw, "kept as given");
        }
        Err(error) => {
            prop_assert!(!valid, "{} {:?} refused: {}", what, raw, error);
            assert_invalid(&error, what)?;
            let message = error.message();
            if raw.is_empty() {
                prop_assert!(message.contains("empty"), "{}", message);
            } else if raw.len() > max {
                prop_assert!(
                    message.contains(&format!("{} bytes", raw.len()))
                        && message.contains(&max.to_string()),
                    "{}",
                    message
                );
            } else {
                prop_assert!(message.contains("control character"), "{}", message);
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The model

proptest! {
    #[test]
    fn senders_are_1_to_128_bytes_without_control_characters(raw in any_text()) {
        let parsed = Sender::parse(raw.clone());
        if let Ok(sender) = &parsed {
            prop_assert_eq!(sender.to_string(), raw.clone());
        }
        check_name("sender", &raw, MAX_SENDER_BYTES, parsed, Sender::as_str)?;
    }

    #[test]
    fn conversations_are_1_to_128_bytes_without_control_characters(raw in any_text()) {
        let parsed = ConversationId::parse(raw.clone());
        if let Ok(conversation) = &parsed {
            prop_assert_eq!(conversation.to_string(), raw.clone());
        }
        check_name("conversation", &raw, MAX_CONVERSATION_BYTES, parsed, ConversationId::as_str)?;
    }

    #[test]
    fn client_msg_ids_are_1_to_64_opaque_bytes(raw in id_bytes()) {
        match ClientMsgId::parse(raw.clone()) {
            Ok(id) => {
                prop_assert!((1..=MAX_CLIENT_MSG_ID_BYTES).contains(&raw.len()));
                prop_assert_eq!(id.as_bytes(), &raw[..]);
                // Debug shows any bytes, UTF-8 or not, without panicking.
                let shown = format!("{id:?}");
                prop_assert!(shown.starts_with("ClientMsgId("), "{}", shown);
                prop_assert_eq!(id.into_bytes(), raw);
            }
            Err(error) => {
                prop_assert!(raw.is_empty() || raw.len() > MAX_CLIENT_MSG_ID_BYTES);
                assert_invalid(&error, "client message id")?;
                if !raw.is_empty() {
                    let size = format!("{} bytes", raw.len());
                    prop_assert!(error.message().contains(&size), "{}", error);
                }
            }
        }
    }

    /// IDs are compared exactly: no case folding, trimming or re-encoding
    /// ever merges two different IDs (that would swallow a message).
    #[test]
    fn ids_are_equal_exactly_when_their_bytes_are(
        a in prop::collection::vec(any::<u8>(), 1..=MAX_CLIENT_MSG_ID_BYTES),
        edit in 0usize..5,
        other in prop::collection::vec(any::<u8>(), 1..=MAX_CLIENT_MSG_ID_BYTES),
    ) {
        let b = match edit {
            0 => a.clone(),
            1 => a.to_ascii_uppercase(),
            2 => {
                let mut b = a.clone();
                b.truncate(MAX_CLIENT_MSG_ID_BYTES - 1);
                b.push(b' ');
                b
            }
            3 if a.len() > 1 => a[..a.len() - 1].to_vec(),
            _ => other,
        };
        let (x, y) = (ClientMsgId::parse(a.clone()).unwrap(), ClientMsgId::parse(b.clone()).unwrap());
        prop_assert_eq!(x == y, a == b);
    }

    #[test]
    fn bodies_are_1_byte_to_the_limit(raw in any_text(), max in prop_oneof![0usize..200, Just(16 * 1024)]) {
        match Body::parse(raw.clone(), max) {
            Ok(body) => {
                prop_assert!(!raw.is_empty() && raw.len() <= max);
                prop_assert_eq!(body.as_str(), raw.as_str());
            }
            Err(error) => {
                prop_assert!(raw.is_empty() || raw.len() > max, "{:?} refused under {}", raw, max);
                assert_invalid(&error, "body")?;
                if !raw.is_empty() {
                    let size = format!("{} bytes", raw.len());
                    prop_assert!(error.message().contains(&size), "{}", error);
                    prop_assert!(error.message().contains(&max.to_string()));
                }
            }
        }
    }

    #[test]
    fn history_limits_are_1_to_1000(
        after_seq in any::<u64>(),
        limit in prop_oneof![Just(0u32), 1u32..=MAX_HISTORY_LIMIT + 2, any::<u32>()],
    ) {
        let conversation = ConversationId::parse("c").unwrap();
        match HistoryQuery::new(conversation.clone(), after_seq, limit) {
            Ok(query) => {
                prop_assert!((1..=MAX_HISTORY_LIMIT).contains(&limit));
                prop_assert_eq!(query, HistoryQuery { conversation, after_seq, limit });
            }
            Err(error) => {
                prop_assert!(limit == 0 || limit > MAX_HISTORY_LIMIT);
                assert_invalid(&error, "limit")?;
                prop_assert!(error.message().contains(&limit.to_string()));
            }
        }
    }

    /// The byte key of the Redis window names one (sender, id) and no other,
    /// whatever separators the names and IDs contain.
    #[test]
    fn message_key_bytes_are_injective(
        s1 in "[a:b]{1,4}", id1 in prop::collection::vec(prop::sample::select(b"a:b\0".to_vec()), 1..5),
        s2 in "[a:b]{1,4}", id2 in prop::collection::vec(prop::sample::select(b"a:b\0".to_vec()), 1..5),
    ) {
        let key = |s: &str, id: &[u8]| MessageKey {
            sender: Sender::parse(s).unwrap(),
            client_msg_id: ClientMsgId::parse(id).unwrap(),
        };
        let (k1, k2) = (key(&s1, &id1), key(&s2, &id2));
        let bytes = k1.to_bytes();
        prop_assert_eq!(&bytes[..2], &(s1.len() as u16).to_be_bytes()[..]);
        prop_assert_eq!(bytes == k2.to_bytes(), k1 == k2);
    }
}

// ---------------------------------------------------------------------------
// Tokens

const NOW: u64 = 1_800_000_000;
const SECRET: &[u8] = b"a-property-test-secret-of-32-bytes-or-more";
const LEEWAY: u64 = 30;
const MAX_LIFETIME: u64 = 24 * 3600;

fn key() -> TokenKey {
    TokenKey::new(SECRET).unwrap()
}

fn verifier() -> TokenVerifier {
    TokenVerifier::hs256(key())
}

/// `claims` signed, HS256, with `secret`.
fn sign(claims: &Value, secret: &[u8]) -> String {
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        claims,
        &EncodingKey::from_secret(secret).unwrap(),
    )
    .unwrap()
}

/// A token refused: `unauthenticated`, final, with a reason.
fn assert_refused<T: std::fmt::Debug>(result: Result<T, Error>) -> Result<Error, TestCaseError> {
    let error = match result {
        Ok(accepted) => return Err(TestCaseError::fail(format!("accepted: {accepted:?}"))),
        Err(error) => error,
    };
    prop_assert_eq!(error.kind(), ErrorKind::Unauthenticated, "{}", error);
    prop_assert!(!error.retryable());
    prop_assert!(!error.message().is_empty());
    Ok(error)
}

/// A claim value of any JSON shape, mostly numbers near `NOW`.
fn time_claim() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        4 => (0u64..3 * MAX_LIFETIME).prop_map(|d| Some(json!(NOW - MAX_LIFETIME + d))),
        1 => Just(Some(json!(NOW))),
        // The edges of the leeway and of the longest lifetime.
        1 => prop::sample::select(vec![
            NOW - LEEWAY - 1,
            NOW - LEEWAY,
            NOW - LEEWAY + 1,
            NOW + LEEWAY,
            NOW + LEEWAY + 1,
            NOW + MAX_LIFETIME,
            NOW + MAX_LIFETIME + 1,
            NOW + MAX_LIFETIME + LEEWAY,
            NOW + MAX_LIFETIME + LEEWAY + 1,
            NOW + MAX_LIFETIME + 2 * LEEWAY + 1,
        ])
        .prop_map(|t| Some(json!(t))),
        1 => Just(None),
        1 => any::<u64>().prop_map(|n| Some(json!(n))),
        1 => prop_oneof![
            Just(json!(-1)),
            Just(json!(1.5e9)),
            Just(json!("1800000000")),
            Just(Value::Null),
            Just(json!(u64::MAX)),
            Just(json!(1e30)),
        ]
        .prop_map(Some),
    ]
}

fn subject() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        6 => any_text().prop_map(|s| Some(json!(s))),
        1 => Just(None),
        1 => prop_oneof![Just(json!(7)), Just(Value::Null), Just(json!(["ana"]))].prop_map(Some),
    ]
}

/// A base64url segment: of real JSON, of garbage, or not base64 at all.
fn segment() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(URL_SAFE_NO_PAD.encode(br#"{"alg":"HS256","typ":"JWT"}"#)),
        Just(URL_SAFE_NO_PAD.encode(br#"{"alg":"none"}"#)),
        Just(URL_SAFE_NO_PAD.encode(br#"{"alg":"RS256","kid":"k"}"#)),
        Just(URL_SAFE_NO_PAD.encode(br#"{"sub":"ana","exp":1800000600}"#)),
        prop::collection::vec(any::<u8>(), 0..48).prop_map(|b| URL_SAFE_NO_PAD.encode(b)),
        "[A-Za-z0-9_=+/!-]{0,24}",
    ]
}

proptest! {
    #[test]
    fn secrets_shorter_than_32_bytes_are_refused(secret in prop::collection::vec(any::<u8>(), 0..80)) {
        match TokenKey::new(secret.clone()) {
            Ok(key) => {
                prop_assert!(secret.len() >= MIN_SECRET_BYTES);
                // A working key: what it mints, it verifies.
                let ana = Sender::parse("ana").unwrap();
                prop_assert_eq!(key.verify(&key.mint(&ana, NOW + 60), NOW).unwrap(), (ana, NOW + 60));
            }
            Err(error) => {
                prop_assert!(secret.len() < MIN_SECRET_BYTES);
                assert_invalid(&error, "32 bytes")?;
            }
        }
    }

    /// What a key mints names the sender and expiry, and is accepted from
    /// now until its expiry plus the leeway, and not after.
    #[test]
    fn minted_tokens_verify_until_expiry_plus_leeway(
        sender in valid_name(),
        lifetime in 1u64..=MAX_LIFETIME,
        later in prop_oneof![
            (0u64..=MAX_LIFETIME + 2 * LEEWAY).prop_map(Ok),
            // Around the last second of the leeway.
            (-2i64..=2).prop_map(Err),
        ],
    ) {
        let sender = Sender::parse(sender).unwrap();
        let exp = NOW + lifetime;
        let token = key().mint(&sender, exp);
        prop_assert_eq!(key().verify(&token, NOW).unwrap(), (sender.clone(), exp));
        let at = match later {
            Ok(later) => NOW + later,
            Err(near) => (exp + LEEWAY).saturating_add_signed(near),
        };
        let verified = verifier().verify(&token, at);
        if at < exp + LEEWAY {
            let verified = verified.unwrap();
            prop_assert_eq!(verified.sender, sender);
            prop_assert_eq!(verified.expires_at_unix, exp);
        } else {
            let error = assert_refused(verified)?;
            prop_assert!(error.message().contains("expired"), "{}", error);
        }
    }

    /// Any change to a genuine token (one character replaced, removed or
    /// added, or the token cut short) makes it a token nobody signed.
    #[test]
    fn a_token_changed_anywhere_is_refused(
        sender in valid_name(),
        edit in 0usize..4,
        at in any::<prop::sample::Index>(),
        replacement in prop_oneof![
            prop::sample::select(b"ABCXYZabcxyz0189-_.=+/ ".to_vec()),
            0u8..0x80,
        ],
    ) {
        let token = key().mint(&Sender::parse(sender).unwrap(), NOW + 600);
        let mut bytes = token.clone().into_bytes();
        let i = at.index(bytes.len());
        match edit {
            0 => {
                prop_assume!(bytes[i] != replacement);
                bytes[i] = replacement;
            }
            1 => { bytes.remove(i); }
            2 => bytes.insert(i, replacement),
            _ => bytes.truncate(i),
        }
        let changed = String::from_utf8(bytes).unwrap();
        prop_assert_ne!(&changed, &token);
        assert_refused(verifier().verify(&changed, NOW))?;
    }

    #[test]
    fn arbitrary_strings_are_not_tokens(
        token in prop_oneof![
            any::<String>(),
            (segment(), segment(), segment()).prop_map(|(h, c, s)| format!("{h}.{c}.{s}")),
            (segment(), segment()).prop_map(|(h, c)| format!("{h}.{c}.")),
            prop::collection::vec(segment(), 0..6).prop_map(|parts| parts.join(".")),
        ],
        now in any::<u64>(),
    ) {
        assert_refused(verifier().verify(&token, now))?;
    }

    #[test]
    fn a_token_signed_with_another_secret_is_refused(
        other in prop::collection::vec(any::<u8>(), MIN_SECRET_BYTES..64),
        sender in valid_name(),
    ) {
        prop_assume!(other != SECRET);
        let forged = TokenKey::new(other).unwrap().mint(&Sender::parse(sender).unwrap(), NOW + 600);
        assert_refused(verifier().verify(&forged, NOW))?;
    }

    /// Genuinely signed claims of any shape: accepted only when the subject
    /// is a valid sender and the times keep the documented policy (exp and
    /// nbf with the 30 s leeway, at most 24 h of life); and every clearly
    /// good token is accepted.
    #[test]
    fn signed_claims_are_accepted_only_within_the_policy(
        sub in subject(),
        exp in time_claim(),
        nbf in time_claim(),
        iat in time_claim(),
        now in prop_oneof![4 => Just(NOW), 1 => any::<u64>()],
    ) {
        let mut claims = serde_json::Map::new();
        for (name, value) in [("sub", &sub), ("exp", &exp), ("nbf", &nbf), ("iat", &iat)] {
            if let Some(value) = value {
                claims.insert(name.to_owned(), value.clone());
            }
        }
        let token = sign(&Value::Object(claims), SECRET);
        let result = verifier().verify(&token, now);

        let sub_str = sub.as_ref().and_then(Value::as_str);
        // `null` is no claim (serde reads it as absent), and so no constraint.
        let (nbf, iat) = (nbf.filter(|v| !v.is_null()), iat.filter(|v| !v.is_null()));
        let as_u64 = |v: &Option<Value>| v.as_ref().and_then(Value::as_u64);
        let (exp_n, nbf_n, iat_n) = (as_u64(&exp), as_u64(&nbf), as_u64(&iat));
        let clearly_good = sub_str.is_some_and(|s| Sender::parse(s).is_ok())
            && exp_n.is_some_and(|e| e > now && e - now <= MAX_LIFETIME)
            && nbf.as_ref().is_none_or(|_| nbf_n.is_some_and(|n| n <= now))
            && iat.as_ref().is_none_or(|_| iat_n.is_some_and(|i| i == now));
        match result {
            Ok(verified) => {
                let sub = sub_str.expect("accepted without a string sub");
                prop_assert_eq!(verified.sender.as_str(), sub);
                let exp = exp_n.expect("accepted without a numeric exp");
                prop_assert_eq!(verified.expires_at_unix, exp);
                prop_assert!(exp.saturating_add(LEEWAY) > now, "expired token accepted");
                if nbf.is_some() {
                    let nbf = nbf_n.expect("accepted with a non-numeric nbf");
                    prop_assert!(nbf <= now.saturating_add(LEEWAY), "token not yet valid accepted");
                }
                prop_assert!(
                    exp.saturating_sub(now) <= MAX_LIFETIME + 2 * LEEWAY,
                    "token living {} s accepted", exp.saturating_sub(now)
                );
                if iat.is_some() {
                    let iat = iat_n.expect("accepted with a non-numeric iat");
                    let from = iat.min(now.saturating_add(LEEWAY));
                    prop_assert!(exp.saturating_sub(from) <= MAX_LIFETIME + LEEWAY);
                }
            }
            Err(error) => {
                prop_assert!(!clearly_good, "a good token refused: {}", error);
                assert_refused::<()>(Err(error))?;
            }
        }
    }

    /// With an issuer and audience configured, a token is accepted only
    /// when it names both.
    #[test]
    fn issuer_and_audience_are_required_when_configured(
        iss in prop_oneof![Just(None), Just(Some(json!("https://id.example"))), any_text().prop_map(|s| Some(json!(s))), Just(Some(json!(7)))],
        aud in prop_oneof![
            Just(None),
            Just(Some(json!("imdedup"))),
            Just(Some(json!(["other", "imdedup"]))),
            any_text().prop_map(|s| Some(json!(s))),
            prop::collection::vec(any_text(), 0..3).prop_map(|v| Some(json!(v))),
        ],
    ) {
        let policy = TokenPolicy {
            issuer: Some("https://id.example".into()),
            audience: Some("imdedup".into()),
            leeway: Duration::from_secs(LEEWAY),
            ..TokenPolicy::default()
        };
        let verifier = TokenVerifier::new(Some(key()), None, policy).unwrap();
        let mut claims = json!({"sub": "ana", "exp": NOW + 60});
        if let Some(iss) = &iss {
            claims["iss"] = iss.clone();
        }
        if let Some(aud) = &aud {
            claims["aud"] = aud.clone();
        }
        let names_issuer = iss.as_ref().and_then(Value::as_str) == Some("https://id.example");
        let names_audience = match &aud {
            Some(Value::String(a)) => a == "imdedup",
            Some(Value::Array(all)) => all.iter().any(|a| a.as_str() == Some("imdedup")),
            _ => false,
        };
        let result = verifier.verify(&sign(&claims, SECRET), NOW);
        if names_issuer && names_audience {
            let verified = result.unwrap();
            prop_assert_eq!(verified.sender.as_str(), "ana");
        } else {
            assert_refused(result)?;
        }
    }
}
