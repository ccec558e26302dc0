//! Natural batching for a hop between two services.
//!
//! Callers hand in one request each and wait for their own answer. A driver
//! task sends whatever has queued up as one batch call, with at most
//! `max_in_flight` batch calls outstanding. A quiet hop therefore sends
//! batches of one, with no added wait; a busy hop sends fewer, larger calls,
//! so the per-call cost (HTTP/2 stream, headers, wake-ups) is paid once per
//! batch instead of once per message.

use std::{future::Future, sync::Arc};

use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::{Error, ErrorKind};

/// Largest batch message a server or client decodes: a full default batch
/// (256) of the largest frames the gateway reads (256 KiB) and then some.
pub const MAX_BATCH_MESSAGE_BYTES: usize = 80 << 20;

/// Limits of one [`Batcher`].
#[derive(Debug, Clone, Copy)]
pub struct BatchLimits {
    /// Most requests in one batch call.
    pub max_batch: usize,
    /// Most batch calls outstanding at once.
    pub max_in_flight: usize,
    /// Most requests waiting for a batch; callers wait beyond that.
    pub queue: usize,
}

impl Default for BatchLimits {
    fn default() -> Self {
        Self {
            max_batch: 256,
            max_in_flight: 8,
            queue: 16_384,
        }
    }
}

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
    /// Start the driver task. `call` sends one batch and answers with one
    /// result per request, in order; an `Err` fails the whole batch. The
    /// driver stops when every `Batcher` clone is dropped.
    ///
    /// Must be called inside a Tokio runtime.
    pub fn spawn<F, Fut>(limits: BatchLimits, call: F) -> Self
    where
        F: Fn(Vec<Req>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<Result<Resp, Error>>, Error>> + Send + 'static,
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
    Fut: Future<Output = Result<Vec<Result<Resp, Error>>, Error>> + Send + 'static,
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
            .map(|item| (item.request, item.reply))
            .unzip();
        let sent = call(requests);
        tokio::spawn(async move {
            answer(replies, sent.await);
            drop(slot);
        });
    }
}

fn answer<Resp>(
    replies: Vec<oneshot::Sender<Result<Resp, Error>>>,
    results: Result<Vec<Result<Resp, Error>>, Error>,
) {
    let results = match results {
        Ok(results) if results.len() == replies.len() => results,
        Ok(results) => {
            let e = Error::new(
                ErrorKind::Internal,
                format!(
                    "a batch of {} was answered with {} results",
                    replies.len(),
                    results.len()
                ),
            );
            drop(results);
            replies.iter().map(|_| Err(e.clone())).collect()
        }
        Err(e) => replies.iter().map(|_| Err(e.clone())).collect(),
    };
    for (reply, result) in replies.into_iter().zip(results) {
        // The caller may have given up waiting; nothing to do then.
        let _ = reply.send(result);
    }
}

#[cfg(test)]
mod tests {
    use std::{
        sync::Mutex,
        time::Duration,
    };

    use super::*;

    fn limits(max_batch: usize, max_in_flight: usize) -> BatchLimits {
        BatchLimits {
            max_batch,
            max_in_flight,
            queue: 1024,
        }
    }

    #[tokio::test]
    async fn each_caller_gets_its_own_answer() {
        let batcher = Batcher::spawn(limits(8, 2), |requests: Vec<u32>| async move {
            Ok(requests.into_iter().map(|r| Ok(r * 10)).collect())
        });
        let answers =
            futures_util::future::join_all((0..100).map(|i| batcher.call(i))).await;
        for (i, answer) in answers.into_iter().enumerate() {
            assert_eq!(answer, Ok(i as u32 * 10));
        }
    }

    #[tokio::test]
    async fn requests_queued_behind_a_busy_hop_share_one_call() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&sizes);
        let batcher = Batcher::spawn(limits(64, 1), move |requests: Vec<u32>| {
            seen.lock().unwrap().push(requests.len());
            async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok(requests.into_iter().map(Ok).collect())
            }
        });
        let answers = futures_util::future::join_all((0..50).map(|i| batcher.call(i))).await;
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
            async move { Ok(requests.into_iter().map(Ok).collect()) }
        });
        let answers = futures_util::future::join_all((0..100).map(|i| batcher.call(i))).await;
        assert!(answers.iter().all(Result::is_ok));
        assert!(sizes.lock().unwrap().iter().all(|&n| (1..=7).contains(&n)));
    }

    #[tokio::test]
    async fn a_failed_call_fails_every_request_in_it() {
        let batcher = Batcher::spawn(limits(8, 1), |_: Vec<u32>| async {
            Err::<Vec<Result<u32, Error>>, _>(Error::unavailable("shard down"))
        });
        let answers = futures_util::future::join_all((0..5).map(|i| batcher.call(i))).await;
        for answer in answers {
            assert_eq!(answer.unwrap_err().kind(), ErrorKind::Unavailable);
        }
    }

    #[tokio::test]
    async fn a_short_answer_is_an_error_not_a_mixup() {
        let batcher = Batcher::spawn(limits(8, 1), |requests: Vec<u32>| async move {
            Ok(requests.into_iter().skip(1).map(Ok).collect())
        });
        let answers = futures_util::future::join_all((0..3).map(|i| batcher.call(i))).await;
        for answer in answers {
            assert_eq!(answer.unwrap_err().kind(), ErrorKind::Internal);
        }
    }

    #[tokio::test]
    async fn per_request_errors_stay_with_their_request() {
        let batcher = Batcher::spawn(limits(8, 1), |requests: Vec<u32>| async move {
            Ok(requests
                .into_iter()
                .map(|r| {
                    if r % 2 == 0 {
                        Ok(r)
                    } else {
                        Err(Error::invalid(format!("odd {r}")))
                    }
                })
                .collect())
        });
        let answers = futures_util::future::join_all((0..6).map(|i| batcher.call(i))).await;
        for (i, answer) in answers.into_iter().enumerate() {
            if i % 2 == 0 {
                assert_eq!(answer, Ok(i as u32));
            } else {
                assert_eq!(answer.unwrap_err().message(), format!("odd {i}"));
            }
        }
    }
}
