//! Processes a test starts itself (a service binary, a `redis-server` it
//! may kill): free loopback ports, waiting until one listens, and a child
//! that never outlives its test.

use std::{
    net::{SocketAddr, TcpStream},
    process::{Child, Command, ExitStatus},
    sync::atomic::{AtomicU16, Ordering},
    time::{Duration, Instant},
};

/// A loopback address nothing listens on right now, below the kernel's
/// ephemeral range (32768 and up): a port from that range can be taken by
/// any outgoing connection between this check and the process's bind.
/// Test binaries run side by side: each picks from its own stretch of 120
/// ports, by its pid.
///
/// The check is a refused connection, not a probe listener: a listener
/// closed again can live on for a moment in a child that another test
/// forks at that instant (until its exec closes the descriptor), and the
/// port is then still taken when the caller binds it.
pub fn free_addr() -> SocketAddr {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 20_000 + u16::try_from(std::process::id() % 100).unwrap_or(0) * 120;
    loop {
        let port = base + NEXT.fetch_add(1, Ordering::Relaxed) % 120;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            return addr;
        }
    }
}

/// Wait up to `limit` until something accepts connections on `addr`;
/// panics (the test fails) if nothing does.
pub fn wait_listening(addr: SocketAddr, limit: Duration) {
    let deadline = Instant::now() + limit;
    while TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "nothing listens on {addr}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A child process, killed when dropped (a failing test leaves none
/// behind).
pub struct Process(Child);

impl Process {
    /// Start `command`; panics if it cannot be started.
    pub fn spawn(mut command: Command) -> Self {
        let program = command.get_program().to_string_lossy().into_owned();
        Self(
            command
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {program}: {e}")),
        )
    }

    /// A child started elsewhere (to read its output first).
    pub fn from_child(child: Child) -> Self {
        Self(child)
    }

    /// SIGTERM, then its exit status, which must come within `grace`.
    pub fn terminate(mut self, grace: Duration) -> ExitStatus {
        let pid = self.0.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status();
        assert!(
            sent.is_ok_and(|status| status.success()),
            "cannot signal {pid}"
        );
        let deadline = Instant::now() + grace;
        loop {
            if let Ok(Some(status)) = self.0.try_wait() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "process {pid} ignored SIGTERM for {grace:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, and wait for it to be gone.
    pub fn kill(self) {
        drop(self);
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    #[test]
    fn a_free_address_can_be_bound_and_a_dropped_child_is_gone() {
        let addr = free_addr();
        let listener = TcpListener::bind(addr).expect("the address is free");
        wait_listening(addr, Duration::from_secs(1));
        drop(listener);

        let mut sleep = Command::new("sleep");
        sleep.arg("30");
        let child = Process::spawn(sleep);
        let pid = child.0.id();
        drop(child);
        let alive = Command::new("kill")
            .args(["-0", &pid.to_string()])
            .status()
            .is_ok_and(|status| status.success());
        assert!(!alive, "the child outlived its Process");
    }

    #[test]
    fn terminate_returns_the_exit_status_after_sigterm() {
        let mut sleep = Command::new("sleep");
        sleep.arg("30");
        let status = Process::spawn(sleep).terminate(Duration::from_secs(5));
        assert!(!status.success(), "killed by SIGTERM, not exited 0");
    }
}
