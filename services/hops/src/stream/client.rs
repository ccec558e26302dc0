//! The calling side: [`StreamHop`].
//!
//! The stream opens on the first request and again on the first request
//! after it ended. When it ends or breaks, every request still waiting for
//! its answer fails with `maybe_stored`: it was sent, so it may have been
//! done (the sender resends it; a repeat is recognised). So does every
//! request sent when the stream has answered nothing for `stall` while
//! requests wait. A request that never left (the stream did not open) fails
//! with the opening's error, `unavailable` when it took longer than `stall`.

use std::{
    collections::HashMap,
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use futures_util::{Stream, StreamExt};
use tokio::{
    sync::{mpsc, oneshot},
    time::Instant,
};
use tokio_stream::wrappers::ReceiverStream;

use imdedup_domain::{Error, ErrorKind};
use imdedup_proto::status::from_status;

use super::window::{Window, WindowLimits};

/// Limits of one [`StreamHop`].
#[derive(Debug, Clone, Copy)]
pub struct HopLimits {
    /// Most requests sent and not answered yet; callers wait beyond that
    /// (see [`super::window`]).
    pub window: WindowLimits,
    /// Most requests waiting for a place in the window.
    pub queue: usize,
    /// How long the stream may answer nothing while requests wait before it
    /// is given up (and its requests fail).
    pub stall: Duration,
}

impl Default for HopLimits {
    fn default() -> Self {
        Self {
            window: WindowLimits::fixed(1024),
            queue: 16_384,
            stall: Duration::from_secs(10),
        }
    }
}

/// The answers of one open stream; an `Err` or its end closes it.
pub type HopAnswers<Resp> = Pin<Box<dyn Stream<Item = Result<Resp, Error>> + Send>>;

/// A gRPC call's stream of answers as [`HopAnswers`], its statuses as our
/// errors.
pub fn grpc_answers<Resp: Send + 'static>(answers: tonic::Streaming<Resp>) -> HopAnswers<Resp> {
    Box::pin(answers.map(|answer| answer.map_err(from_status)))
}

/// How a [`StreamHop`] opens its stream and matches answers to requests.
pub trait HopCall: Send + Sync + 'static {
    type Req: Send + 'static;
    type Resp: Send + 'static;

    /// Open a stream sending `requests`; answers come back in any order.
    fn open(
        &self,
        requests: ReceiverStream<Self::Req>,
    ) -> impl Future<Output = Result<HopAnswers<Self::Resp>, Error>> + Send;

    /// Write `tag` into a request.
    fn set_tag(request: &mut Self::Req, tag: u64);

    /// The tag an answer carries.
    fn tag(answer: &Self::Resp) -> u64;

    /// Whether `answer` says the server has more than it can take (an
    /// adaptive window then shrinks); never, unless a hop says otherwise.
    fn is_pushback(_answer: &Self::Resp) -> bool {
        false
    }

    /// Whether `answer` shows the server doing its work (an adaptive window
    /// that is full may then grow); every answer, unless a hop says
    /// otherwise. An answer neither pushback nor success leaves it as it is.
    fn is_success(_answer: &Self::Resp) -> bool {
        true
    }
}

struct Item<Req, Resp> {
    request: Req,
    reply: oneshot::Sender<Result<Resp, Error>>,
}

/// Sends requests over one open stream; see the module docs.
pub struct StreamHop<C: HopCall> {
    queue: mpsc::Sender<Item<C::Req, C::Resp>>,
    /// The window's size now, as the stream's task last set it.
    window: Arc<AtomicUsize>,
}

impl<C: HopCall> Clone for StreamHop<C> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
            window: Arc::clone(&self.window),
        }
    }
}

impl<C: HopCall> StreamHop<C> {
    /// Start the task that owns the stream. It stops when every clone is
    /// dropped. Must be called inside a Tokio runtime.
    pub fn spawn(limits: HopLimits, call: C) -> Self {
        let (queue, incoming) = mpsc::channel(limits.queue.max(1));
        let window = Window::new(limits.window);
        let size = Arc::new(AtomicUsize::new(window.places()));
        tokio::spawn(drive(limits, window, incoming, call, Arc::clone(&size)));
        Self {
            queue,
            window: size,
        }
    }

    /// How many requests may be unanswered now (the adaptive window's size;
    /// requests beyond it wait).
    pub fn window(&self) -> usize {
        self.window.load(Ordering::Relaxed)
    }

    /// Send `request` and wait for its answer.
    ///
    /// Dropping the returned future does not take the request back: once
    /// queued it is sent, and its answer is dropped.
    pub async fn call(&self, request: C::Req) -> Result<C::Resp, Error> {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(Item { request, reply })
            .await
            .map_err(|_| Error::unavailable("the stream task has stopped"))?;
        answer
            .await
            .map_err(|_| Error::internal("the stream ended without answering a request"))?
    }
}

type Waiting<Resp> = HashMap<u64, oneshot::Sender<Result<Resp, Error>>>;

async fn drive<C: HopCall>(
    limits: HopLimits,
    mut window: Window,
    mut incoming: mpsc::Receiver<Item<C::Req, C::Resp>>,
    call: C,
    size: Arc<AtomicUsize>,
) {
    let mut next_tag = 0_u64;
    let mut waiting: Waiting<C::Resp> = HashMap::new();
    // A stream opens for the first request after none was open.
    while let Some(first) = incoming.recv().await {
        // Every request sent and unanswered holds a place in the window, so
        // the channel to the stream never fills.
        let (to_stream, requests) = mpsc::channel(limits.window.max.max(1));
        let opened = tokio::time::timeout(limits.stall, call.open(ReceiverStream::new(requests)));
        let opened = match opened.await {
            Ok(opened) => opened,
            Err(_) => Err(Error::new(
                ErrorKind::Unavailable,
                format!("the stream did not open within {:?}", limits.stall),
            )),
        };
        let mut answers = match opened {
            Ok(answers) => answers,
            Err(e) => {
                // Whatever queued up meanwhile would wait for the same
                // answer: it gets it now.
                let _ = first.reply.send(Err(e.clone()));
                while let Ok(item) = incoming.try_recv() {
                    let _ = item.reply.send(Err(e.clone()));
                }
                continue;
            }
        };
        let send =
            |item: Item<C::Req, C::Resp>, waiting: &mut Waiting<C::Resp>, next_tag: &mut u64| {
                let Item { mut request, reply } = item;
                if reply.is_closed() {
                    // Its caller gave up while it waited for a place: no one
                    // would read the answer.
                    return;
                }
                *next_tag = next_tag.wrapping_add(1);
                C::set_tag(&mut request, *next_tag);
                match to_stream.try_send(request) {
                    Ok(()) => {
                        waiting.insert(*next_tag, reply);
                    }
                    Err(_) => {
                        let _ = reply.send(Err(Error::unavailable("the stream closed")));
                    }
                }
            };
        send(first, &mut waiting, &mut next_tag);
        let mut last_answer = Instant::now();
        let mut open = true;
        // Armed only after a pushback at the window's floor.
        let rest = tokio::time::sleep(std::time::Duration::ZERO);
        tokio::pin!(rest);
        let mut resting = false;
        // Checked a few times per `stall`, not armed per request.
        let mut check = tokio::time::interval(limits.stall / 4);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let ended = loop {
            tokio::select! {
                biased;
                answer = answers.next() => match answer {
                    Some(Ok(answer)) => {
                        last_answer = Instant::now();
                        let tag = C::tag(&answer);
                        if C::is_pushback(&answer) {
                            if let Some(pause) = window.pushed_back(tag, next_tag) {
                                rest.as_mut().reset(Instant::now() + pause);
                                resting = true;
                            }
                        } else if C::is_success(&answer) {
                            window.answered(waiting.len());
                        }
                        size.store(window.places(), Ordering::Relaxed);
                        match waiting.remove(&tag) {
                            // The caller may have given up waiting.
                            Some(reply) => drop(reply.send(Ok(answer))),
                            None => tracing::warn!(tag, "a stream answered an unknown tag"),
                        }
                    }
                    Some(Err(e)) => break e,
                    None => break Error::unavailable("the stream ended"),
                },
                () = &mut rest, if resting => resting = false,
                item = incoming.recv(), if open && !resting && window.has_room(waiting.len()) => match item {
                    Some(item) => {
                        if waiting.is_empty() {
                            last_answer = Instant::now();
                        }
                        send(item, &mut waiting, &mut next_tag);
                    }
                    None if waiting.is_empty() => return,
                    // Every clone dropped: answer what is in flight, then stop.
                    None => open = false,
                },
                _ = check.tick(), if !waiting.is_empty() => {
                    if last_answer.elapsed() >= limits.stall {
                        break Error::new(
                            ErrorKind::Unavailable,
                            format!("the stream answered nothing for {:?}", limits.stall),
                        );
                    }
                }
            }
        };
        if !waiting.is_empty() {
            tracing::debug!(error = %ended, unanswered = waiting.len(), "a stream hop closed");
        }
        // Sent, so perhaps done: the request's outcome is unknown.
        for (_, reply) in waiting.drain() {
            let _ = reply.send(Err(Error::new(
                ErrorKind::MaybeStored,
                format!("the stream closed before answering: {}", ended.message()),
            )));
        }
        if !open {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };

    use futures_util::future::join_all;

    use super::*;

    /// A request the fake server sees: a number and its tag.
    struct Req {
        value: u64,
        tag: u64,
    }

    /// The fake server's answer: `value * 10`, with the request's tag, or a
    /// refusal (pushback).
    #[derive(Debug, PartialEq)]
    struct Resp {
        value: u64,
        tag: u64,
        refused: bool,
    }

    /// What the fake server does with a stream's requests.
    #[derive(Clone, Copy)]
    enum Behaviour {
        /// Answer each after `value % 4` ms, so answers come out of order.
        Answer,
        /// Read `n` requests, answer none, then break the stream.
        BreakAfter(usize),
        /// Read every request, answer none, never end.
        Silent,
        /// Refuse each after 1 ms.
        Refuse,
    }

    /// An in-process server behind [`HopCall`]: counts the streams opened
    /// and the most requests it held unanswered at once.
    struct Fake {
        behaviour: Behaviour,
        /// Opens that fail before the first success.
        failing_opens: AtomicUsize,
        opens: Arc<AtomicUsize>,
        read: Arc<AtomicUsize>,
        unanswered: Arc<AtomicUsize>,
        most_unanswered: Arc<AtomicUsize>,
        /// The most unanswered at once from the 21st request read on.
        most_unanswered_late: Arc<AtomicUsize>,
    }

    impl Fake {
        fn new(behaviour: Behaviour) -> Self {
            Self {
                behaviour,
                failing_opens: AtomicUsize::new(0),
                opens: Arc::default(),
                read: Arc::default(),
                unanswered: Arc::default(),
                most_unanswered: Arc::default(),
                most_unanswered_late: Arc::default(),
            }
        }
    }

    impl HopCall for Fake {
        type Req = Req;
        type Resp = Resp;

        async fn open(&self, mut requests: ReceiverStream<Req>) -> Result<HopAnswers<Resp>, Error> {
            if self
                .failing_opens
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(Error::unavailable("connection refused"));
            }
            self.opens.fetch_add(1, Ordering::SeqCst);
            let (answers, out) = mpsc::channel(1024);
            let behaviour = self.behaviour;
            let (total_read, unanswered, most, most_late) = (
                Arc::clone(&self.read),
                Arc::clone(&self.unanswered),
                Arc::clone(&self.most_unanswered),
                Arc::clone(&self.most_unanswered_late),
            );
            tokio::spawn(async move {
                let mut read = 0;
                while let Some(request) = requests.next().await {
                    read += 1;
                    let now = unanswered.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    if total_read.fetch_add(1, Ordering::SeqCst) >= 20 {
                        most_late.fetch_max(now, Ordering::SeqCst);
                    }
                    match behaviour {
                        Behaviour::Answer | Behaviour::Refuse => {
                            let refused = matches!(behaviour, Behaviour::Refuse);
                            let (answers, unanswered) = (answers.clone(), Arc::clone(&unanswered));
                            tokio::spawn(async move {
                                let pause = if refused { 1 } else { request.value % 4 };
                                tokio::time::sleep(Duration::from_millis(pause)).await;
                                unanswered.fetch_sub(1, Ordering::SeqCst);
                                let answer = Resp {
                                    value: request.value * 10,
                                    tag: request.tag,
                                    refused,
                                };
                                let _ = answers.send(Ok(answer)).await;
                            });
                        }
                        Behaviour::BreakAfter(n) if read == n => {
                            let _ = answers
                                .send(Err(Error::unavailable("connection reset")))
                                .await;
                            return;
                        }
                        Behaviour::BreakAfter(_) | Behaviour::Silent => {}
                    }
                }
                std::future::pending::<()>().await;
            });
            Ok(Box::pin(ReceiverStream::new(out)))
        }

        fn set_tag(request: &mut Req, tag: u64) {
            request.tag = tag;
        }

        fn tag(answer: &Resp) -> u64 {
            answer.tag
        }

        fn is_pushback(answer: &Resp) -> bool {
            answer.refused
        }
    }

    fn req(value: u64) -> Req {
        Req { value, tag: 0 }
    }

    fn limits(window: usize) -> HopLimits {
        HopLimits {
            window: WindowLimits::fixed(window),
            queue: 1024,
            stall: Duration::from_secs(5),
        }
    }

    #[tokio::test]
    async fn each_caller_gets_its_own_answer_over_one_stream() {
        let fake = Fake::new(Behaviour::Answer);
        let opens = Arc::clone(&fake.opens);
        let hop = StreamHop::spawn(limits(1024), fake);
        let answers = join_all((0..200).map(|i| hop.call(req(i)))).await;
        for (i, answer) in answers.into_iter().enumerate() {
            assert_eq!(answer.unwrap().value, i as u64 * 10);
        }
        // And later requests still go over the same stream.
        assert_eq!(hop.call(req(7)).await.unwrap().value, 70);
        assert_eq!(opens.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn no_more_than_the_window_is_unanswered_at_once() {
        let fake = Fake::new(Behaviour::Answer);
        let most = Arc::clone(&fake.most_unanswered);
        let hop = StreamHop::spawn(limits(4), fake);
        let answers = join_all((0..60).map(|i| hop.call(req(i)))).await;
        assert!(answers.iter().all(Result::is_ok));
        let most = most.load(Ordering::SeqCst);
        assert!((1..=4).contains(&most), "{most} unanswered at once");
    }

    #[tokio::test]
    async fn refusals_shrink_an_adaptive_window_to_its_floor() {
        let fake = Fake::new(Behaviour::Refuse);
        let (most, late) = (
            Arc::clone(&fake.most_unanswered),
            Arc::clone(&fake.most_unanswered_late),
        );
        let limits = HopLimits {
            window: WindowLimits {
                initial: 8,
                min: 2,
                max: 8,
                rest: Duration::ZERO,
            },
            ..limits(8)
        };
        let hop = StreamHop::spawn(limits, fake);
        assert_eq!(hop.window(), 8, "the window reports its start");
        let answers = join_all((0..100).map(|i| hop.call(req(i)))).await;
        assert!(answers.iter().all(|a| a.as_ref().is_ok_and(|a| a.refused)));
        assert_eq!(most.load(Ordering::SeqCst), 8, "the window starts at 8");
        assert_eq!(hop.window(), 2, "and reports its floor");
        let late = late.load(Ordering::SeqCst);
        assert!(
            (1..=2).contains(&late),
            "{late} unanswered at once after the refusals"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn refusals_at_the_floor_pause_new_requests_for_the_rest() {
        let limits = |rest| HopLimits {
            window: WindowLimits {
                initial: 8,
                min: 2,
                max: 8,
                rest,
            },
            ..limits(8)
        };
        let took = |rest| async move {
            let hop = StreamHop::spawn(limits(rest), Fake::new(Behaviour::Refuse));
            let started = Instant::now();
            let answers = join_all((0..100).map(|i| hop.call(req(i)))).await;
            assert!(answers.iter().all(|a| a.as_ref().is_ok_and(|a| a.refused)));
            started.elapsed()
        };
        // Refused in 1 ms each, two at a time once at the floor: quick
        // without a rest; with one of 50 ms, some forty rests.
        let without = took(Duration::ZERO).await;
        let with = took(Duration::from_millis(50)).await;
        assert!(
            without < Duration::from_millis(100),
            "{without:?} without a rest"
        );
        assert!(
            with > Duration::from_secs(1),
            "{with:?} with a rest of 50 ms"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_whose_caller_gave_up_while_it_waited_for_a_place_is_not_sent() {
        let fake = Fake::new(Behaviour::Answer);
        let read = Arc::clone(&fake.read);
        let hop = StreamHop::spawn(limits(1), fake);
        // 3 is answered after 3 ms, holding the only place meanwhile.
        let first = tokio::spawn({
            let hop = hop.clone();
            async move { hop.call(req(3)).await }
        });
        tokio::time::sleep(Duration::from_millis(1)).await;
        let gave_up = tokio::time::timeout(Duration::from_micros(100), hop.call(req(5))).await;
        assert!(gave_up.is_err(), "the second waited for the place");
        assert_eq!(first.await.unwrap().unwrap().value, 30);
        assert_eq!(hop.call(req(2)).await.unwrap().value, 20);
        assert_eq!(
            read.load(Ordering::SeqCst),
            2,
            "the abandoned request went out"
        );
    }

    #[tokio::test]
    async fn a_broken_stream_fails_what_it_carried_as_maybe_stored_and_the_next_request_reopens() {
        let fake = Fake::new(Behaviour::BreakAfter(3));
        let opens = Arc::clone(&fake.opens);
        let hop = StreamHop::spawn(limits(64), fake);
        let answers = join_all((0..3).map(|i| hop.call(req(i)))).await;
        for answer in answers {
            // They were sent: whether they were done is unknown.
            assert_eq!(answer.unwrap_err().kind(), ErrorKind::MaybeStored);
        }
        // A new stream for the next request (which this fake also breaks
        // after three; one is enough to see it open).
        let next = tokio::time::timeout(Duration::from_millis(200), hop.call(req(9))).await;
        assert!(next.is_err(), "the second stream answers nothing");
        assert_eq!(opens.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_that_answers_nothing_is_given_up_after_the_stall_time() {
        let hop = StreamHop::spawn(limits(64), Fake::new(Behaviour::Silent));
        let started = Instant::now();
        let answer = hop.call(req(1)).await;
        assert_eq!(answer.unwrap_err().kind(), ErrorKind::MaybeStored);
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_secs(5) && waited < Duration::from_secs(7),
            "gave up after {waited:?}"
        );
    }

    #[tokio::test]
    async fn a_stream_that_does_not_open_fails_its_request_as_not_sent_and_the_next_one_retries() {
        let fake = Fake::new(Behaviour::Answer);
        fake.failing_opens.store(1, Ordering::SeqCst);
        let hop = StreamHop::spawn(limits(64), fake);
        let refused = hop.call(req(1)).await.unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::Unavailable);
        assert_eq!(hop.call(req(2)).await.unwrap().value, 20);
    }
}
