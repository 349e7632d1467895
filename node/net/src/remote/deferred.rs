//! The book of deferred spot-checks, sans-IO (no threads, no clock): which steps of a
//! generation wait on a running check, which used a wrong answer, and which used a peer's
//! answers unchecked since that peer's last agreed check.
//!
//! [`RemoteExperts`](super::RemoteExperts) keeps one [`Book`] behind a mutex and runs the checks
//! it asks for on the runtime's blocking threads. The rules:
//! - A step is handed on ([`Settled::Pending`] past it, or [`Settled::Clear`]) only when no
//!   check of it or of an earlier step is running, and no peer whose answer it used unchecked
//!   is still unconfirmed: a peer's unchecked answers are confirmed by a checked answer of
//!   that peer that agrees, to a call sent after they were collected.
//! - A peer caught (a check disagreed, or could not be made) fails the earliest step that used
//!   any of its unconfirmed answers, not only the step of the failed check: the generation goes
//!   back to the liar's first unchecked result since its last agreed check.
//! - So that a peer with no later check does not hold the output back for long, the book asks
//!   for checks of that peer's latest answers (*forced* checks: each answer collected after
//!   the latest call was sent, which no later check would confirm) when its oldest
//!   unconfirmed step is [`FORCE_AFTER`] steps old, and at the end of a generation (`wait`).
//!
//! What this guarantees: a peer that computes wrong from some answer on (a corrupt copy, a
//! broken kernel, a liar that keeps lying) never changes a token handed on; a peer that lies
//! only now and then gets each wrong answer past the checks with probability at most `1 - p`
//! (`p` the spot-check share), unless a later check catches it before its next agreed one.
//! Unchecked answers are tracked only while the share is above zero: `--spot-check 0` checks
//! a peer's first answer and then trusts it.

use std::collections::{BTreeMap, HashMap, VecDeque};

use stormo_engine::moe::Settled;

/// Steps after which a peer's oldest unconfirmed answer has its peer's latest answer checked.
pub(super) const FORCE_AFTER: u64 = 4;

/// One step's checks.
#[derive(Debug, Default)]
struct StepChecks {
    running: u32,
    failed: bool,
}

/// A step that used answers of a peer unchecked.
#[derive(Debug)]
struct Used<A> {
    step: u64,
    /// The answer's number ([`Book::collected`] once it was recorded).
    seq: u64,
    /// What [`Book::collected`] read when its call was sent.
    sent_after: u64,
    /// The answer, kept so that it can be checked (a forced check) while no later answer's
    /// check would confirm it; taken when it is checked.
    answer: Option<A>,
}

/// A check to run: an answer of `peer`, used in `step`. Hand its verdict to
/// [`Book::ended`].
#[derive(Debug, PartialEq)]
pub(super) struct Due<A> {
    pub(super) peer: usize,
    /// The answers of the peer it confirms when it agrees: those collected before its call was
    /// sent (numbered up to this). A forced check confirms its own answer too ([`Due::own`]);
    /// the book forces a check of every answer no later answer's check would confirm.
    pub(super) seq: u64,
    /// A forced check's own answer number (confirmed when it agrees).
    pub(super) own: Option<u64>,
    pub(super) step: u64,
    pub(super) answer: A,
}

/// What [`Book::settle`] decided.
#[derive(Debug, PartialEq)]
pub(super) enum Next {
    /// The answer for the generation.
    Done(Settled),
    /// Checks are running (or were just asked for) and the caller waits for them.
    Wait,
}

/// See the module docs. `A` is a kept answer (what a forced check needs).
#[derive(Debug)]
pub(super) struct Book<A> {
    /// A generation asked for deferred checks.
    on: bool,
    /// Whether unchecked answers are tracked (the spot-check share is above zero).
    track: bool,
    /// The last step's id.
    current: u64,
    /// The last answer's sequence number.
    seq: u64,
    /// The steps not forgotten with checks running or failed.
    live: BTreeMap<u64, StepChecks>,
    /// Each peer's steps that used its answers unchecked since its last agreed check, oldest
    /// first.
    unconfirmed: HashMap<usize, VecDeque<Used<A>>>,
}

impl<A> Book<A> {
    /// A book that tracks unchecked answers when `track` (a spot-check share above zero).
    pub(super) fn new(track: bool) -> Self {
        Self {
            on: false,
            track,
            current: 0,
            seq: 0,
            live: BTreeMap::new(),
            unconfirmed: HashMap::new(),
        }
    }

    /// Turns deferral on or off; off forgets every step.
    pub(super) fn set_on(&mut self, on: bool) {
        self.on = on;
        if !on {
            self.live.clear();
            self.unconfirmed.clear();
        }
    }

    /// A step begins; its id.
    pub(super) fn begin_step(&mut self) -> u64 {
        self.current += 1;
        self.current
    }

    /// Answers recorded so far: what a call sent now reads as its `sent_after` for
    /// [`answered`](Self::answered).
    pub(super) fn collected(&self) -> u64 {
        self.seq
    }

    /// An answer of `peer` used in the current step, to a call sent when
    /// [`collected`](Self::collected) read `sent_after`. `checked`: it was drawn for a check,
    /// which the caller must now run: its `(sent_after, step)` is returned, counted as running
    /// until [`ended`](Self::ended); agreeing, it confirms only the peer's answers collected
    /// before the checked call was sent (a peer may answer calls sent together in any order,
    /// so an answer collected later may have been computed later). Otherwise the answer is
    /// recorded as unconfirmed (`keep` makes what a forced check of it needs) and `None` is
    /// returned. Off, nothing is recorded.
    pub(super) fn answered(
        &mut self,
        peer: usize,
        checked: bool,
        keep: impl FnOnce() -> A,
        sent_after: u64,
    ) -> Option<(u64, u64)> {
        if !self.on {
            return None;
        }
        self.seq += 1;
        let (seq, step) = (self.seq, self.current);
        if checked {
            self.live.entry(step).or_default().running += 1;
            return Some((sent_after.min(seq - 1), step));
        }
        if self.track {
            let q = self.unconfirmed.entry(peer).or_default();
            // A check of this answer would confirm those collected before its call was sent:
            // they need not be kept for checks of their own.
            for u in q.iter_mut().filter(|u| u.seq <= sent_after) {
                u.answer = None;
            }
            q.push_back(Used {
                step,
                seq,
                sent_after,
                answer: Some(keep()),
            });
        }
        None
    }

    /// A check of `peer`'s answer used in `step` ended: `agreed`, or it disagreed or could not
    /// be made. Agreed, it confirms the peer's unchecked answers numbered up to `seq` (see
    /// [`answered`](Self::answered) and [`Due::seq`]); not, it fails the earliest step that
    /// used any unconfirmed answer of the peer.
    /// `own`: the checked answer's own number, for a forced check (that answer is confirmed
    /// too).
    pub(super) fn ended(
        &mut self,
        peer: usize,
        seq: u64,
        own: Option<u64>,
        step: u64,
        agreed: bool,
    ) {
        if let Some(s) = self.live.get_mut(&step) {
            s.running = s.running.saturating_sub(1);
        }
        let q = self.unconfirmed.get_mut(&peer);
        if agreed {
            if let Some(q) = q {
                q.retain(|u| u.seq > seq && Some(u.seq) != own);
                if q.is_empty() {
                    self.unconfirmed.remove(&peer);
                }
            }
            return;
        }
        // The peer's first unconfirmed step, and the check's own step unless it was forgotten
        // (rolled back): the earlier fails.
        let first = q.and_then(|q| q.front()).map(|u| u.step);
        self.unconfirmed.remove(&peer);
        let own = self.live.contains_key(&step).then_some(step);
        if let Some(f) = first.into_iter().chain(own).min() {
            self.live.entry(f).or_default().failed = true;
        }
    }

    /// Where the generation stands. Forced checks it asks for go to `due` (counted as
    /// running); with `wait`, [`Next::Wait`] until no check is running or one has failed.
    pub(super) fn settle(&mut self, wait: bool, due: &mut Vec<Due<A>>) -> Next {
        while let Some(e) = self.live.first_entry() {
            if e.get().running > 0 || e.get().failed {
                break;
            }
            e.remove();
        }
        if let Some((&step, _)) = self.live.iter().find(|(_, c)| c.failed) {
            return Next::Done(Settled::Failed(step));
        }
        // Forced checks: a peer unconfirmed for long, or at the end of a generation.
        for (&peer, q) in &mut self.unconfirmed {
            let old = q
                .front()
                .is_some_and(|u| u.step.saturating_add(FORCE_AFTER) <= self.current);
            if !(wait || old) {
                continue;
            }
            // Every answer still kept: checked, they confirm the rest (see `answered`).
            for u in q.iter_mut() {
                if let Some(answer) = u.answer.take() {
                    self.live.entry(u.step).or_default().running += 1;
                    due.push(Due {
                        peer,
                        seq: u.sent_after,
                        own: Some(u.seq),
                        step: u.step,
                        answer,
                    });
                }
            }
        }
        let held = self
            .unconfirmed
            .values()
            .filter_map(|q| q.front().map(|u| u.step))
            .chain(self.live.keys().next().copied())
            .min();
        match held {
            None => Next::Done(Settled::Clear),
            Some(step) if !wait => Next::Done(Settled::Pending(step)),
            Some(_) => Next::Wait,
        }
    }

    /// The steps from `step` on were rolled back: forgotten, with the unchecked answers they
    /// used.
    pub(super) fn forget(&mut self, step: u64) {
        self.live.retain(|&s, _| s < step);
        self.unconfirmed.retain(|_, q| {
            while q.back().is_some_and(|u| u.step >= step) {
                q.pop_back();
            }
            !q.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A book deferring checks, tracking unchecked answers; answers are kept as their step.
    fn book() -> Book<u64> {
        let mut b = Book::new(true);
        b.set_on(true);
        b
    }

    /// Begins steps until `step`.
    fn to(b: &mut Book<u64>, step: u64) {
        while b.current < step {
            b.begin_step();
        }
    }

    /// An unchecked answer of `peer` in the current step.
    fn unchecked(b: &mut Book<u64>, peer: usize) {
        let step = b.current;
        assert_eq!(b.answered(peer, false, || step, b.collected()), None);
    }

    fn settle(b: &mut Book<u64>, wait: bool) -> (Next, Vec<Due<u64>>) {
        let mut due = Vec::new();
        (b.settle(wait, &mut due), due)
    }

    /// Issue 58 (2): a peer that answered unchecked in steps 2 and 3 and is caught in step 5
    /// fails step 2, its first unchecked answer, not step 5; until then steps 2 on are held.
    #[test]
    fn a_caught_peer_fails_its_first_unconfirmed_step() {
        let mut b = book();
        to(&mut b, 1);
        unchecked(&mut b, 1); // another peer, confirmed below
        to(&mut b, 2);
        unchecked(&mut b, 0);
        to(&mut b, 3);
        unchecked(&mut b, 0);
        let (seq1, _) = b
            .answered(1, true, || 3, b.collected())
            .expect("a check of peer 1");
        b.ended(1, seq1, None, 3, true);
        to(&mut b, 5);
        let (seq, step) = b.answered(0, true, || 5, b.collected()).expect("a check");
        assert_eq!(step, 5);
        assert_eq!(settle(&mut b, false).0, Next::Done(Settled::Pending(2)));
        b.ended(0, seq, None, step, false);
        assert_eq!(settle(&mut b, false).0, Next::Done(Settled::Failed(2)));
        b.forget(2);
        assert_eq!(settle(&mut b, false).0, Next::Done(Settled::Clear));
    }

    /// A later check that agrees confirms a peer's earlier unchecked answers, not later ones.
    #[test]
    fn an_agreed_check_confirms_the_answers_before_it() {
        let mut b = book();
        to(&mut b, 1);
        unchecked(&mut b, 0);
        to(&mut b, 2);
        let (seq, step) = b.answered(0, true, || 2, b.collected()).expect("a check");
        to(&mut b, 3);
        unchecked(&mut b, 0);
        assert_eq!(settle(&mut b, false).0, Next::Done(Settled::Pending(1)));
        b.ended(0, seq, None, step, true);
        assert_eq!(settle(&mut b, false).0, Next::Done(Settled::Pending(3)));
        // A failed check now goes back to step 3, the first answer after the agreed one.
        let (seq, step) = b.answered(0, true, || 3, b.collected()).expect("a check");
        b.ended(0, seq, None, step, false);
        assert_eq!(settle(&mut b, false).0, Next::Done(Settled::Failed(3)));
    }

    /// A checked call sent before an unchecked answer of its peer was collected does not
    /// confirm it (the peer may have computed that answer later, and begun lying between).
    #[test]
    fn a_check_confirms_only_answers_collected_before_its_call_was_sent() {
        let mut b = book();
        to(&mut b, 1);
        let sent = b.collected();
        unchecked(&mut b, 0);
        let (seq, step) = b.answered(0, true, || 1, sent).expect("a check");
        b.ended(0, seq, None, step, true);
        assert_eq!(settle(&mut b, false).0, Next::Done(Settled::Pending(1)));
    }

    /// Answers to calls sent together (a block's) may have been computed in any order, so
    /// the end of a generation checks each of them, not only the last collected: one
    /// disagreeing fails the step, both agreeing settle it.
    #[test]
    fn answers_to_calls_sent_together_are_each_checked() {
        for wrong in [0usize, 1] {
            let mut b = book();
            to(&mut b, 1);
            let sent = b.collected();
            assert_eq!(b.answered(0, false, || 10, sent), None);
            assert_eq!(b.answered(0, false, || 11, sent), None);
            let (next, due) = settle(&mut b, true);
            assert_eq!(next, Next::Wait);
            assert_eq!(due.iter().map(|d| d.answer).collect::<Vec<_>>(), [10, 11]);
            b.ended(0, due[wrong].seq, due[wrong].own, 1, false);
            let other = 1 - wrong;
            b.ended(0, due[other].seq, due[other].own, 1, true);
            assert_eq!(settle(&mut b, true).0, Next::Done(Settled::Failed(1)));
        }
        let mut b = book();
        to(&mut b, 1);
        let sent = b.collected();
        assert_eq!(b.answered(0, false, || 10, sent), None);
        assert_eq!(b.answered(0, false, || 11, sent), None);
        let (_, due) = settle(&mut b, true);
        for d in &due {
            b.ended(0, d.seq, d.own, 1, true);
        }
        assert_eq!(settle(&mut b, true).0, Next::Done(Settled::Clear));
    }

    /// A peer unconfirmed for FORCE_AFTER steps has its latest unchecked answer checked; so
    /// does every unconfirmed peer at the end of a generation (`wait`), which waits for it.
    #[test]
    fn unconfirmed_answers_are_checked_when_old_and_at_the_end() {
        let mut b = book();
        to(&mut b, 1);
        unchecked(&mut b, 0);
        to(&mut b, 2);
        unchecked(&mut b, 0);
        to(&mut b, 1 + FORCE_AFTER - 1);
        assert_eq!(
            settle(&mut b, false),
            (Next::Done(Settled::Pending(1)), vec![])
        );
        to(&mut b, 1 + FORCE_AFTER);
        let (next, due) = settle(&mut b, false);
        assert_eq!(next, Next::Done(Settled::Pending(1)));
        assert_eq!(
            due.iter()
                .map(|d| (d.peer, d.step, d.answer))
                .collect::<Vec<_>>(),
            vec![(0, 2, 2)],
            "the latest answer, once"
        );
        assert!(settle(&mut b, false).1.is_empty(), "asked for once");
        b.ended(0, due[0].seq, due[0].own, due[0].step, true);
        assert_eq!(settle(&mut b, false).0, Next::Done(Settled::Clear));
        // At the end of a generation, at once.
        unchecked(&mut b, 1);
        let (next, due) = settle(&mut b, true);
        assert_eq!((next, due.len()), (Next::Wait, 1));
        assert_eq!(settle(&mut b, true), (Next::Wait, vec![]));
        b.ended(1, due[0].seq, due[0].own, due[0].step, false);
        assert_eq!(
            settle(&mut b, true).0,
            Next::Done(Settled::Failed(1 + FORCE_AFTER))
        );
    }

    /// Rolled back steps take their unchecked answers with them; a failed check of a step
    /// forgotten, with nothing of its peer unconfirmed, fails nothing.
    #[test]
    fn forgotten_steps_are_dropped() {
        let mut b = book();
        to(&mut b, 1);
        let (seq, step) = b.answered(0, true, || 1, b.collected()).expect("a check");
        to(&mut b, 2);
        unchecked(&mut b, 1);
        b.forget(1);
        assert_eq!(settle(&mut b, false).0, Next::Done(Settled::Clear));
        b.ended(0, seq, None, step, false);
        assert_eq!(settle(&mut b, true).0, Next::Done(Settled::Clear));
    }

    /// Without tracking (a spot-check share of 0) unchecked answers hold nothing; off, no
    /// answer is recorded at all.
    #[test]
    fn untracked_or_off_records_no_unchecked_answer() {
        let mut b = Book::new(false);
        b.set_on(true);
        b.begin_step();
        assert_eq!(b.answered(0, false, || 0, 0), None);
        assert_eq!(settle(&mut b, true).0, Next::Done(Settled::Clear));
        let mut b = book();
        b.set_on(false);
        b.begin_step();
        assert_eq!(
            b.answered(0, true, || 0, 0),
            None,
            "no check is deferred when off"
        );
        assert_eq!(b.answered(0, false, || 0, 0), None);
        assert!(b.unconfirmed.is_empty() && b.live.is_empty());
    }
}
