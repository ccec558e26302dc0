//! The backends' contracts as test suites, run by every implementation: the
//! store's ([`store`]) and the recent-ID window's ([`window`]).

pub mod store;
pub mod window;
