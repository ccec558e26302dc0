//! The recent-ID window contract, for every `RecentWindow`: one owner per
//! claim, copies in flight told so, release only by the owner's token, the
//! receipt echoed once remembered and never forgotten by a stale release,
//! and keys that are (sender, ID), injective.

use std::sync::Arc;

use imdedup_domain::{
    model::{Fingerprint, Receipt, Remembered},
    window::{Claim, ClaimToken, RecentWindow},
};

use crate::fixtures::{key, tag};

/// The receipt the checks remember.
pub const RECEIPT: Remembered = Remembered {
    receipt: Receipt {
        server_id: 9_000_000_001,
        seq: 77,
    },
    fingerprint: Some(Fingerprint(0x5eed_cafe_f00d_1234)),
};

/// Claim, echo, in-flight, compare-and-delete: the same on every backend.
pub async fn conforms(window: Arc<dyn RecentWindow>) {
    let t = tag();
    let m1 = key("ana", &format!("{t}-1"));
    let Claim::Owned(token) = window.claim(&m1).await.unwrap() else {
        panic!("the first copy owns the claim")
    };
    // A second copy while the first is in flight is told so, not "seen".
    assert_eq!(window.claim(&m1).await.unwrap(), Claim::InFlight);
    // Release by someone else's token does nothing; by the owner's, frees it.
    window
        .release(&m1, &ClaimToken("not-the-owner".into()))
        .await
        .unwrap();
    assert_eq!(window.claim(&m1).await.unwrap(), Claim::InFlight);
    window.release(&m1, &token).await.unwrap();
    let Claim::Owned(token) = window.claim(&m1).await.unwrap() else {
        panic!("a released claim can be taken again")
    };
    // After a successful insert the window echoes the receipt.
    window.remember(&m1, &token, RECEIPT).await.unwrap();
    assert_eq!(window.claim(&m1).await.unwrap(), Claim::Seen(RECEIPT));
    // A stale release after remember never forgets the receipt.
    window.release(&m1, &token).await.unwrap();
    assert_eq!(window.claim(&m1).await.unwrap(), Claim::Seen(RECEIPT));

    // Keys are (sender, id), injective.
    for other in [
        key("ben", &format!("{t}-1")),
        key(&format!("ana:{t}-1"), "x"),
    ] {
        assert!(matches!(
            window.claim(&other).await.unwrap(),
            Claim::Owned(_)
        ));
    }
    let a = key("a:b", &format!("c{t}"));
    let b = key("a", &format!("b:c{t}"));
    let Claim::Owned(ta) = window.claim(&a).await.unwrap() else {
        panic!()
    };
    window.remember(&a, &ta, RECEIPT).await.unwrap();
    assert!(matches!(window.claim(&b).await.unwrap(), Claim::Owned(_)));
}
