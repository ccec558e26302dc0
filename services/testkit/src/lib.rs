//! What imdedup's tests and test tools share: the policy for real backends
//! ([`backends`]) and the reader of the services' metrics text ([`prom`]).
//! Never a dependency of a service.

pub mod backends;
pub mod prom;
