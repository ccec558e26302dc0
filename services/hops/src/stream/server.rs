//! The serving side: [`answer_each`].

use std::future::Future;

use futures_util::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

/// Decide each request of `incoming` with `decide`, each in its own task (so
/// it runs to its end even if the caller goes away), and answer it as soon
/// as it is decided.
///
/// At most `in_flight` requests are undecided at once; beyond that the
/// stream is not read, so HTTP/2 flow control holds the caller back. When
/// `stop` is cancelled (the server shuts down) or the incoming stream ends
/// or breaks, nothing more is read; what was read is still answered, and
/// then the answers end, which tells the caller to open a new stream
/// (elsewhere, if this server is going away). A request never read is never
/// decided: its caller sees the stream end without its answer.
pub fn answer_each<Req, Resp, E, F, Fut>(
    mut incoming: impl Stream<Item = Result<Req, E>> + Send + Unpin + 'static,
    in_flight: usize,
    stop: CancellationToken,
    decide: F,
) -> ReceiverStream<Resp>
where
    Req: Send + 'static,
    Resp: Send + 'static,
    F: Fn(Req) -> Fut + Send + 'static,
    Fut: Future<Output = Resp> + Send + 'static,
{
    let (answers, out) = mpsc::channel(in_flight.max(1));
    tokio::spawn(async move {
        let decisions = TaskTracker::new();
        loop {
            // A place for the answer first: this bounds what is undecided.
            let slot = tokio::select! {
                biased;
                () = stop.cancelled() => break,
                slot = answers.clone().reserve_owned() => match slot {
                    Ok(slot) => slot,
                    // The caller went away.
                    Err(_) => break,
                },
            };
            let next = tokio::select! {
                biased;
                () = stop.cancelled() => break,
                next = incoming.next() => next,
            };
            let Some(Ok(request)) = next else { break };
            let decision = decide(request);
            decisions.spawn(async move {
                slot.send(decision.await);
            });
        }
        // The request half stays open until the last answer is out, so the
        // caller's sends after the stop are left unread rather than reset.
        decisions.close();
        decisions.wait().await;
        drop(incoming);
    });
    ReceiverStream::new(out)
}

#[cfg(test)]
mod tests {
    use std::{
        convert::Infallible,
        sync::{
            Arc, Mutex,
            atomic::{AtomicUsize, Ordering},
        },
        time::Duration,
    };

    use super::*;

    /// A request stream the test feeds by hand.
    fn incoming() -> (
        mpsc::UnboundedSender<u64>,
        impl Stream<Item = Result<u64, Infallible>> + Send + Unpin + 'static,
    ) {
        let (tx, rx) = mpsc::unbounded_channel();
        let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(Ok);
        (tx, stream)
    }

    /// Decides `n` after `n` ms, answering `n`.
    async fn slow(n: u64) -> u64 {
        tokio::time::sleep(Duration::from_millis(n)).await;
        n
    }

    #[tokio::test]
    async fn each_request_is_answered_as_soon_as_it_is_decided() {
        let (tx, requests) = incoming();
        let mut answers = answer_each(requests, 16, CancellationToken::new(), slow);
        for n in [300, 10, 100] {
            tx.send(n).unwrap();
        }
        drop(tx);
        let mut order = Vec::new();
        while let Some(n) = answers.next().await {
            order.push(n);
        }
        assert_eq!(order, [10, 100, 300]);
    }

    #[tokio::test]
    async fn at_most_in_flight_requests_are_undecided_at_once() {
        let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let decide = {
            let (now, most) = (Arc::clone(&now), Arc::clone(&most));
            move |n: u64| {
                let (now, most) = (Arc::clone(&now), Arc::clone(&most));
                async move {
                    most.fetch_max(now.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    now.fetch_sub(1, Ordering::SeqCst);
                    n
                }
            }
        };
        let (tx, requests) = incoming();
        let answers = answer_each(requests, 3, CancellationToken::new(), decide);
        for n in 0..30 {
            tx.send(n).unwrap();
        }
        drop(tx);
        let mut answered: Vec<u64> = answers.collect().await;
        answered.sort_unstable();
        assert_eq!(answered, (0..30).collect::<Vec<_>>());
        assert_eq!(most.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn on_stop_what_was_read_is_answered_then_the_answers_end_and_nothing_more_is_decided() {
        let decided = Arc::new(Mutex::new(Vec::new()));
        let decide = {
            let decided = Arc::clone(&decided);
            move |n: u64| {
                decided.lock().unwrap().push(n);
                slow(n)
            }
        };
        let stop = CancellationToken::new();
        let (tx, requests) = incoming();
        let mut answers = answer_each(requests, 16, stop.clone(), decide);
        tx.send(50).unwrap();
        tx.send(60).unwrap();
        // Both read and under way.
        tokio::time::sleep(Duration::from_millis(20)).await;
        stop.cancel();
        tokio::time::sleep(Duration::from_millis(10)).await;
        // Not read: it stays in the stream, undecided.
        tx.send(1).unwrap();
        let mut answered = Vec::new();
        while let Some(n) = tokio::time::timeout(Duration::from_secs(2), answers.next())
            .await
            .expect("the answers end after a stop, though the caller keeps its stream open")
        {
            answered.push(n);
        }
        assert_eq!(answered, [50, 60]);
        assert_eq!(*decided.lock().unwrap(), [50, 60]);
    }
}
