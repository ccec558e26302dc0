//! The accounts and groups of one run. Each name carries the run's tag (a
//! fresh one per run), so runs against one gateway never share an account
//! or a conversation.

/// The names of one run.
pub(crate) struct Names {
    tag: String,
}

impl Names {
    /// Names under a fresh tag.
    pub(crate) fn new() -> Self {
        Self {
            tag: uuid::Uuid::new_v4().simple().to_string()[..8].to_owned(),
        }
    }

    fn name(&self, kind: &str, n: usize) -> String {
        format!("{kind}{}-{n}", self.tag)
    }

    /// Phone (or receiver) `u`'s account.
    pub(crate) fn user(&self, u: usize) -> String {
        self.name("u", u)
    }

    /// Group `g`.
    pub(crate) fn group(&self, g: usize) -> String {
        self.name("g", g)
    }

    /// Business system `k`'s account, the only sender in its service
    /// token's scope.
    pub(crate) fn system(&self, k: usize) -> String {
        self.name("b", k)
    }

    /// The service business system `k`'s token is issued to.
    pub(crate) fn service(&self, k: usize) -> String {
        self.name("svc", k)
    }
}
