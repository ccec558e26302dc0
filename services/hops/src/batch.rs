//! Natural batching for a hop between two services.
//!
//! Callers hand in one request each and wait for their own answer. A driver
//! task sends whatever has queued up as one batch call, with at most
//! `max_in_flight` batch calls outstanding. A quiet hop therefore sends
//! batches of one, with no added wait; a busy hop sends fewer, larger calls,
//! so the per-call cost (HTTP/2 stream, headers, wake-ups) is paid once per
//! batch instead of once per message.
//!
//! A batch call answers each request as soon as it is done (a stream of
//! `(index, result)`), so no request waits for a slower one in its batch.

use std::{future::Future, pin::Pin, sync::Arc, time::Duration};

use futures_util::{Stream, StreamExt};
use tokio::sync::{Semaphore, mpsc, oneshot};

use imdedup_domain::{Error, ErrorKind};

/// Limits of one [`Batcher`].
#[derive(Debug, Clone, Copy)]
pub struct BatchLimits {
    /// Most requests in one batch call.
    pub max_batch: usize,
    /// Most batch calls outstanding at once.
    pub max_in_flight: usize,
    /// Most requests waiting for a batch; callers wait beyond that.
    pub queue: usize,
    /// Longest a batch call may take; what is unanswered by then fails with
    /// `deadline_exceeded` and its slot is freed.
    pub deadline: Duration,
}

impl Default for BatchLimits {
    fn default() -> Self {
        Self {
            max_batch: 256,
            max_in_flight: 16,
            queue: 16_384,
            deadline: Duration::from_secs(10),
        }
    }
}

/// The answers of one batch call: `Ok((index, result))` for the request at
/// `index`, in any order; an `Err` fails every request not answered yet.
pub type Answers<Resp> =
    Pin<Box<dyn Stream<Item = Result<(usize, Result<Resp, Error>), Error>> + Send>>;

struct Item<Req, Resp> {
    request: Req,
    reply: oneshot::Sender<Result<Resp, Error>>,
}

/// Sends requests in batches through a batch call; see the module docs.
pub struct Batcher<Req, Resp> {
    queue: mpsc::Sender<Item<Req, Resp>>,
}

impl<Req, Resp> Clone for Batcher<Req, Resp> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
        }
    }
}

impl<Req, Resp> Batcher<Req, Resp>
where
    Req: Send + 'static,
    Resp: Send + 'static,
{
    /// Start the driver task. `call` sends one batch and answers with a
    /// stream of per-request results; an `Err` fails the whole batch. The
    /// driver stops when every `Batcher` clone is dropped.
    ///
    /// Must be called inside a Tokio runtime.
    pub fn spawn<F, Fut>(limits: BatchLimits, call: F) -> Self
    where
        F: Fn(Vec<Req>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Answers<Resp>, Error>> + Send + 'static,
    {
        let (queue, incoming) = mpsc::channel(limits.queue.max(1));
        tokio::spawn(drive(limits, incoming, call));
        Self { queue }
    }

    /// Send `request` in the next batch and wait for its answer.
    ///
    /// Dropping the returned future does not take the request back: once
    /// queued it is sent, and its answer is dropped.
    pub async fn call(&self, request: Req) -> Result<Resp, Error> {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(Item { request, reply })
            .await
            .map_err(|_| Error::unavailable("the batching task has stopped"))?;
        answer
            .await
            .map_err(|_| Error::internal("a batch ended without answering a request"))?
    }
}

async fn drive<Req, Resp, F, Fut>(
    limits: BatchLimits,
    mut incoming: mpsc::Receiver<Item<Req, Resp>>,
    call: F,
) where
    Req: Send + 'static,
    Resp: Send + 'static,
    F: Fn(Vec<Req>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Answers<Resp>, Error>> + Send + 'static,
{
    let max_batch = limits.max_batch.max(1);
    let slots = Arc::new(Semaphore::new(limits.max_in_flight.max(1)));
    loop {
        // Wait for a free slot first: whatever arrives meanwhile joins the
        // next batch instead of paying for a call of its own.
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let Some(first) = incoming.recv().await else {
            return;
        };
        let mut batch = Vec::with_capacity(max_batch.min(64));
        batch.push(first);
        while batch.len() < max_batch {
            match incoming.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        let (requests, replies): (Vec<_>, Vec<_>) = batch
            .into_iter()
            .map(|item| (item.request, Some(item.reply)))
            .unzip();
        let sent = call(requests);
        let deadline = limits.deadline;
        tokio::spawn(async move {
            answer(replies, sent, deadline).await;
            drop(slot);
        });
    }
}

type Reply<Resp> = Option<oneshot::Sender<Result<Resp, Error>>>;

async fn answer<Resp>(
    mut replies: Vec<Reply<Resp>>,
    sent: impl Future<Output = Result<Answers<Resp>, Error>>,
    deadline: Duration,
) {
    let forward = async {
        let mut answers = sent.await?;
        while let Some(next) = answers.next().await {
            let (index, result) = next?;
            match replies.get_mut(index).and_then(Option::take) {
                // The caller may have given up waiting; nothing to do then.
                Some(reply) => drop(reply.send(result)),
                None => tracing::warn!(index, "a batch answered an unknown or answered request"),
            }
        }
        Err::<std::convert::Infallible, _>(Error::internal(
            "the batch ended without answering this request",
        ))
    };
    let unanswered = match tokio::time::timeout(deadline, forward).await {
        Ok(Err(e)) => e,
        Ok(Ok(never)) => match never {},
        Err(_) => Error::new(
            ErrorKind::DeadlineExceeded,
            format!("the batch was not answered within {deadline:?}"),
        ),
    };
    for reply in replies.into_iter().flatten() {
        let _ = reply.send(Err(unanswered.clone()));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use futures_util::{future::join_all, stream};

    use super::*;

    fn limits(max_batch: usize, max_in_flight: usize) -> BatchLimits {
        BatchLimits {
            max_batch,
            max_in_flight,
            queue: 1024,
            deadline: Duration::from_secs(5),
        }
    }

    /// Answers in request order, each request's result from `f`.
    fn answers<Resp: Send + 'static>(
        results: impl IntoIterator<Item = Result<Resp, Error>>,
    ) -> Result<Answers<Resp>, Error> {
        let answers: Vec<_> = results.into_iter().enumerate().map(Ok).collect();
        Ok(Box::pin(stream::iter(answers)))
    }

    #[tokio::test]
    async fn each_caller_gets_its_own_answer() {
        let batcher = Batcher::spawn(limits(8, 2), |requests: Vec<u32>| async move {
            answers(requests.into_iter().map(|r| Ok(r * 10)))
        });
        let answers = join_all((0..100).map(|i| batcher.call(i))).await;
        for (i, answer) in answers.into_iter().enumerate() {
            assert_eq!(answer, Ok(i as u32 * 10));
        }
    }

    #[tokio::test]
    async fn answers_in_any_order_reach_their_callers() {
        let batcher = Batcher::spawn(limits(64, 1), |requests: Vec<u32>| async move {
            let reversed: Vec<_> = requests
                .into_iter()
                .enumerate()
                .rev()
                .map(|(i, r)| Ok((i, Ok(r + 1))))
                .collect();
            Ok(Box::pin(stream::iter(reversed)) as Answers<u32>)
        });
        let answers = join_all((0..40).map(|i| batcher.call(i))).await;
        for (i, answer) in answers.into_iter().enumerate() {
            assert_eq!(answer, Ok(i as u32 + 1));
        }
    }

    #[tokio::test]
    async fn a_fast_answer_does_not_wait_for_a_slow_one_in_its_batch() {
        let batcher = Batcher::spawn(limits(64, 1), |requests: Vec<u64>| async move {
            let answers =
                stream::iter(requests.into_iter().enumerate()).then(|(i, delay_ms)| async move {
                    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                    Ok((i, Ok(delay_ms)))
                });
            Ok(Box::pin(answers) as Answers<u64>)
        });
        let started = tokio::time::Instant::now();
        let (fast, slow) = tokio::join!(
            async {
                let answer = batcher.call(0).await;
                (answer, started.elapsed())
            },
            batcher.call(300),
        );
        assert_eq!(fast.0, Ok(0));
        assert_eq!(slow, Ok(300));
        assert!(
            fast.1 < Duration::from_millis(200),
            "the fast one took {:?}",
            fast.1
        );
    }

    #[tokio::test]
    async fn requests_queued_behind_a_busy_hop_share_one_call() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&sizes);
        let batcher = Batcher::spawn(limits(64, 1), move |requests: Vec<u32>| {
            seen.lock().unwrap().push(requests.len());
            async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                answers(requests.into_iter().map(Ok))
            }
        });
        let answers = join_all((0..50).map(|i| batcher.call(i))).await;
        assert!(answers.iter().all(Result::is_ok));
        let sizes = sizes.lock().unwrap().clone();
        assert_eq!(sizes.iter().sum::<usize>(), 50);
        // One slot: the first call goes alone, the rest queue behind it.
        assert!(sizes.len() <= 3, "expected few calls, got {sizes:?}");
    }

    #[tokio::test]
    async fn no_batch_exceeds_its_limit() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&sizes);
        let batcher = Batcher::spawn(limits(7, 1), move |requests: Vec<u32>| {
            seen.lock().unwrap().push(requests.len());
            async move { answers(requests.into_iter().map(Ok)) }
        });
        let answers = join_all((0..100).map(|i| batcher.call(i))).await;
        assert!(answers.iter().all(Result::is_ok));
        assert!(sizes.lock().unwrap().iter().all(|&n| (1..=7).contains(&n)));
    }

    #[tokio::test]
    async fn a_failed_call_fails_every_request_in_it() {
        let batcher = Batcher::spawn(limits(8, 1), |_: Vec<u32>| async {
            Err::<Answers<u32>, _>(Error::unavailable("shard down"))
        });
        let answers = join_all((0..5).map(|i| batcher.call(i))).await;
        for answer in answers {
            assert_eq!(answer.unwrap_err().kind(), ErrorKind::Unavailable);
        }
    }

    #[tokio::test]
    async fn a_stream_that_breaks_fails_only_the_unanswered() {
        let batcher = Batcher::spawn(limits(8, 1), |requests: Vec<u32>| async move {
            let first = requests[0];
            let items = vec![
                Ok((0_usize, Ok(first))),
                Err(Error::unavailable("connection reset")),
            ];
            Ok(Box::pin(stream::iter(items)) as Answers<u32>)
        });
        // Queue both before the driver runs, so they share one batch.
        let (a, b) = tokio::join!(batcher.call(7), batcher.call(8));
        assert_eq!(a, Ok(7));
        assert_eq!(b.unwrap_err().kind(), ErrorKind::Unavailable);
    }

    #[tokio::test]
    async fn a_request_left_unanswered_gets_an_error() {
        let batcher = Batcher::spawn(limits(8, 1), |requests: Vec<u32>| async move {
            answers(requests.into_iter().skip(1).map(Ok))
        });
        let answers = join_all((0..3).map(|i| batcher.call(i))).await;
        // The call answered indexes 0 and 1 only: the third caller must not
        // wait forever.
        assert_eq!(answers[2].clone().unwrap_err().kind(), ErrorKind::Internal);
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_that_never_answers_times_out() {
        let batcher = Batcher::spawn(limits(8, 1), |_: Vec<u32>| async {
            Ok(Box::pin(stream::pending()) as Answers<u32>)
        });
        let answer = batcher.call(1).await;
        assert_eq!(answer.unwrap_err().kind(), ErrorKind::DeadlineExceeded);
    }

    #[tokio::test]
    async fn per_request_errors_stay_with_their_request() {
        let batcher = Batcher::spawn(limits(8, 1), |requests: Vec<u32>| async move {
            answers(requests.into_iter().map(|r| {
                if r % 2 == 0 {
                    Ok(r)
                } else {
                    Err(Error::invalid(format!("odd {r}")))
                }
            }))
        });
        let answers = join_all((0..6).map(|i| batcher.call(i))).await;
        for (i, answer) in answers.into_iter().enumerate() {
            if i % 2 == 0 {
                assert_eq!(answer, Ok(i as u32));
            } else {
                assert_eq!(answer.unwrap_err().message(), format!("odd {i}"));
            }
        }
    }
}
