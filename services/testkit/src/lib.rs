//! What imdedup's tests and test tools share: the policy for real backends
//! ([`backends`]), domain values built from strings ([`fixtures`]), the
//! store and window contracts as suites every backend runs
//! ([`conformance`]), and the reader of the services' metrics text
//! ([`prom`]). Never a dependency of a service.

pub mod backends;
pub mod conformance;
pub mod fixtures;
pub mod prom;
