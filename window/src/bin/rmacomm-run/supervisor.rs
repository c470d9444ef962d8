//! The launcher's policy, sans-IO: which ranks to signal and what to exit
//! with, given exits and signals as events. The driver in `main.rs` turns the
//! actions into `kill(2)` calls and timers.

/// A signal the supervisor sends (numbers as on Linux).
pub(crate) type Sig = i32;
pub(crate) const SIGKILL: Sig = 9;
pub(crate) const SIGTERM: Sig = 15;

/// Something that happened to the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// A rank ended; `code` is its exit code, or 128 + the signal that killed it.
    Exited { rank: usize, code: i32 },
    /// The launcher received a signal (SIGINT, SIGTERM).
    Signal(Sig),
    /// The grace period after asking the ranks to stop has passed.
    GraceExpired,
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Action {
    /// Send `signal` to these ranks.
    Kill { ranks: Vec<usize>, signal: Sig },
    /// Start the grace timer (ignored if it is already running).
    StartGrace,
    /// Every rank has ended: exit the launcher with this code.
    Exit(i32),
}

/// Tracks the ranks of one job.
#[derive(Debug)]
pub(crate) struct Supervisor {
    running: Vec<bool>,
    /// The first rank that failed, and its code.
    failure: Option<(usize, i32)>,
    /// The first signal the launcher received.
    interrupted: Option<Sig>,
}

impl Supervisor {
    pub(crate) fn new(ranks: usize) -> Self {
        Supervisor { running: vec![true; ranks], failure: None, interrupted: None }
    }

    /// The rank whose failure decides the exit code, if any failed.
    pub(crate) fn failure(&self) -> Option<(usize, i32)> {
        self.failure
    }

    /// The first signal the launcher received, if any.
    pub(crate) fn interrupted(&self) -> Option<Sig> {
        self.interrupted
    }

    fn running(&self) -> Vec<usize> {
        (0..self.running.len()).filter(|&r| self.running[r]).collect()
    }

    pub(crate) fn handle(&mut self, event: Event) -> Vec<Action> {
        let mut actions = Vec::new();
        match event {
            Event::Exited { rank, code } => {
                if !std::mem::replace(&mut self.running[rank], false) {
                    return actions;
                }
                if code != 0 && self.failure.is_none() {
                    self.failure = Some((rank, code));
                    let others = self.running();
                    if !others.is_empty() {
                        actions.push(Action::Kill { ranks: others, signal: SIGTERM });
                        actions.push(Action::StartGrace);
                    }
                }
            }
            Event::Signal(sig) => {
                self.interrupted.get_or_insert(sig);
                let ranks = self.running();
                if !ranks.is_empty() {
                    actions.push(Action::Kill { ranks, signal: sig });
                    actions.push(Action::StartGrace);
                }
            }
            Event::GraceExpired => {
                let ranks = self.running();
                if !ranks.is_empty() {
                    actions.push(Action::Kill { ranks, signal: SIGKILL });
                }
            }
        }
        if self.running.iter().all(|r| !r) {
            let code = match (self.failure, self.interrupted) {
                (Some((_, code)), _) => code,
                (None, Some(sig)) => 128 + sig,
                (None, None) => 0,
            };
            actions.push(Action::Exit(code));
        }
        actions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_succeed_exits_zero() {
        let mut s = Supervisor::new(2);
        assert_eq!(s.handle(Event::Exited { rank: 1, code: 0 }), vec![]);
        assert_eq!(s.handle(Event::Exited { rank: 0, code: 0 }), vec![Action::Exit(0)]);
    }

    #[test]
    fn first_failure_stops_the_others_and_decides_the_code() {
        let mut s = Supervisor::new(3);
        assert_eq!(
            s.handle(Event::Exited { rank: 1, code: 3 }),
            vec![Action::Kill { ranks: vec![0, 2], signal: SIGTERM }, Action::StartGrace]
        );
        // The others die of our SIGTERM: 128 + 15; the exit code stays rank 1's.
        assert_eq!(s.handle(Event::Exited { rank: 0, code: 143 }), vec![]);
        assert_eq!(s.handle(Event::GraceExpired), vec![Action::Kill { ranks: vec![2], signal: SIGKILL }]);
        assert_eq!(s.handle(Event::Exited { rank: 2, code: 137 }), vec![Action::Exit(3)]);
        assert_eq!(s.failure(), Some((1, 3)));
    }

    #[test]
    fn a_rank_killed_by_a_signal_reports_128_plus_signal() {
        let mut s = Supervisor::new(1);
        assert_eq!(s.handle(Event::Exited { rank: 0, code: 128 + 6 }), vec![Action::Exit(134)]);
    }

    #[test]
    fn signals_are_forwarded_and_an_interrupted_clean_job_exits_128_plus_signal() {
        let mut s = Supervisor::new(2);
        assert_eq!(s.handle(Event::Signal(2)), vec![Action::Kill { ranks: vec![0, 1], signal: 2 }, Action::StartGrace]);
        s.handle(Event::Exited { rank: 0, code: 0 });
        assert_eq!(s.handle(Event::Exited { rank: 1, code: 0 }), vec![Action::Exit(130)]);
    }

    #[test]
    fn duplicate_exit_events_are_ignored() {
        let mut s = Supervisor::new(2);
        s.handle(Event::Exited { rank: 0, code: 0 });
        assert_eq!(s.handle(Event::Exited { rank: 0, code: 1 }), vec![]);
        assert_eq!(s.failure(), None);
    }
}
