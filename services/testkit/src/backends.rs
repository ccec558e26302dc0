//! The one policy for tests that need the real Redis and CQL database: their
//! endpoints come from the environment `tests/run.sh` sets up
//! (`tests/services/services.sh up` prints it). A missing endpoint fails the
//! test, so a suite cannot pass by skipping them unnoticed, unless
//! `IMDEDUP_SKIP_REAL_BACKENDS=1` says to skip on purpose.

/// Redis, as a URL (`redis://127.0.0.1:6390`).
pub const REDIS_URL: &str = "IMDEDUP_TEST_REDIS_URL";
/// The CQL node, as `host:port`.
pub const SCYLLA: &str = "IMDEDUP_TEST_SCYLLA";
/// `1`: skip the tests that need a real backend.
pub const SKIP: &str = "IMDEDUP_SKIP_REAL_BACKENDS";

/// The endpoint in `var`; `None` when the tests are to skip real backends.
///
/// # Panics
///
/// When `var` is not set and skipping was not asked for.
pub fn real(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(value) => Some(value),
        Err(_) if skipping() => {
            eprintln!("skipping a real-backend test: {SKIP}=1");
            None
        }
        Err(_) => panic!(
            "{var} is not set: run the tests with tests/run.sh, or start the \
             services with `eval \"$(tests/services/services.sh up)\"` ({SKIP}=1 skips them)"
        ),
    }
}

/// Redis and the CQL node, or `None` when skipping (see [`real`]).
pub fn redis_and_scylla() -> Option<(String, String)> {
    Some((real(REDIS_URL)?, real(SCYLLA)?))
}

fn skipping() -> bool {
    std::env::var(SKIP).as_deref() == Ok("1")
}
