//! Where a publish runs: its route's home, and when a home moves.
//!
//! The pool queues a publish to one worker, and `TaskPerSubscriber` to one
//! lane: the *place* of its route's [`Home`] (`registry/route.rs`). So one
//! topic's publishes run one after another in one place, and handlers
//! that share state do not fight over it between cores. Homes are handed
//! out in turn, so the first two topics of a bus get two places; but any
//! two busy topics may share one (the first and the third, a topic whose
//! route the cache evicted and built again with a new home), and then both
//! publishers' work runs in that place while the other place has nothing
//! to do: two publishers at one core's speed (measured: half of `Inline`'s
//! two-publisher rate, in both modes).
//!
//! # Contract
//! Each place has a *resident*: the route last placed there while the
//! place was not taken. [`Placement::place`] gives a publish its home's
//! place, except when that place is *taken*: another route is resident
//! there, and the place is busy (work of its own running or queued). Then,
//! if some other place is idle (no work of its own), the home moves there
//! for good and the route becomes resident there; if none is, the publish
//! stays as a guest, and the resident stays resident.
//! - One busy topic never moves: it is resident at its own place, and a
//!   guest (a light topic that published while every place was busy, a
//!   handler's publish) does not change that. Its deliveries stay on one
//!   core, publish after publish.
//! - Two busy topics sharing a place part at the first publish of the
//!   guest that finds another place idle, and then stay apart: each is
//!   resident at its own place, so neither looks elsewhere again.
//! - A home moves only to a place that was idle when it looked, so moves
//!   do not chase each other: more busy topics than places stay where
//!   they are while no place runs dry, and where one does for a moment,
//!   a topic that shares a place moves there.
//! - A pool worker that helps another's publish, or takes over from a
//!   stalled one, has no work of its own: it counts as idle. Otherwise a
//!   guest would never find it idle while the two topics' publishes keep
//!   it helping at their shared place.
//! - Nothing here is timed, and nothing waits: a look is a few loads, and
//!   a publish at its own place loads one word. A look that is out of date
//!   by the time the publish is queued costs at most one publish run in a
//!   worse place; the next publish looks again. Where a publish runs never
//!   changes what runs: placement is a hint, and every place runs any job.
//!
//! A home's move is kept twice: in the home (a cached route's, kept when
//! the route is rebuilt for its topic) and by the place, whose resident the
//! route becomes. A bus without a route cache builds a route (with its
//! topic's hash for an id) for every publish; such a route that finds
//! itself resident at another place than its home says goes there, so that
//! bus keeps its moves too. A cached route never looks (its home has its
//! moves): the look reads every place. A route built for one delivery of another kind (a request to
//! a filter, a bridge's delivery to one filter's subscribers) goes to the
//! place its topic's hash gives and takes no part: as a resident it would
//! displace a topic that lasts.
//!
//! The publishes a moved route left queued in its old place still run
//! there, beside its new ones for a moment; ordered handlers keep their
//! order wherever their publishes run (their positions are taken at
//! publish, see `ordered_sink.rs`).

use crossbeam_utils::CachePadded;

use crate::registry::route::Home;
use crate::sync::{AtomicUsize, Ordering};

/// The resident route of each place (see the module docs).
pub(crate) struct Placement {
    resident: Box<[CachePadded<AtomicUsize>]>,
}

impl Placement {
    /// For `places` places (at least one).
    pub(crate) fn new(places: usize) -> Self {
        Self {
            resident: (0..places.max(1))
                .map(|_| CachePadded::new(AtomicUsize::new(usize::MAX)))
                .collect(),
        }
    }

    /// The place a publish of the route with `home` goes to, moving the
    /// home when its place is taken and another is idle (see the module
    /// docs). `busy(place)`: whether that place runs or has queued work of
    /// its own.
    pub(crate) fn place(&self, home: &Home, busy: impl Fn(usize) -> bool) -> usize {
        let places = self.resident.len();
        let at = home.place() % places;
        if !home.lasts() {
            return at;
        }
        let resident = self.resident[at].load(Ordering::Relaxed);
        if resident == home.id() {
            return at;
        }
        // Resident elsewhere, though its home says `at`: a move made on a
        // route since rebuilt (a bus without a route cache builds one per
        // publish) is remembered by the place. A cached route's home keeps
        // its moves, so only such a route looks (a look at every place).
        if home.forgets_moves() {
            if let Some(own) = (0..places).find(|&place| {
                place != at && self.resident[place].load(Ordering::Relaxed) == home.id()
            }) {
                home.move_to(own);
                return own;
            }
        }
        let place = if busy(at) {
            match (0..places).find(|&other| other != at && !busy(other)) {
                Some(idle) => {
                    home.move_to(idle);
                    idle
                }
                // A guest: the resident keeps its place.
                None => return at,
            }
        } else {
            at
        };
        self.resident[place].store(home.id(), Ordering::Relaxed);
        place
    }
}

// Plain unit tests: under `--cfg loom` the atomics are loom's, usable only
// inside a model.
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_route_alone_at_its_busy_place_stays_there() {
        let placement = Placement::new(2);
        let home = Home::new(0);
        assert_eq!(placement.place(&home, |_| false), 0);
        for _ in 0..10 {
            assert_eq!(placement.place(&home, |_| true), 0);
            assert_eq!(placement.place(&home, |place| place == 0), 0);
        }
        assert_eq!(home.place(), 0);
    }

    #[test]
    fn two_routes_sharing_a_busy_place_part_and_stay_apart() {
        let placement = Placement::new(2);
        let (a, b) = (Home::new(0), Home::new(2));
        assert_eq!(placement.place(&a, |_| false), 0);
        // `a` runs at 0, 1 is idle: `b` moves there.
        assert_eq!(placement.place(&b, |place| place == 0), 1);
        assert_eq!(b.place(), 1);
        // Both busy now: each stays where it is resident.
        for _ in 0..10 {
            assert_eq!(placement.place(&a, |_| true), 0);
            assert_eq!(placement.place(&b, |_| true), 1);
        }
    }

    #[test]
    fn a_route_stays_when_no_other_place_is_idle_or_its_own_is_idle() {
        let placement = Placement::new(2);
        let (a, b, c) = (Home::new(0), Home::new(1), Home::new(2));
        assert_eq!(placement.place(&a, |_| false), 0);
        assert_eq!(placement.place(&b, |_| false), 1);
        // Both places busy: `c` (home 0) stays at 0 with `a`, as a guest.
        assert_eq!(placement.place(&c, |_| true), 0);
        assert_eq!(c.place(), 2);
        // Its own place idle: it stays, and is resident there now.
        assert_eq!(placement.place(&c, |place| place == 1), 0);
        assert_eq!(placement.place(&c, |_| true), 0);
    }

    #[test]
    fn a_route_built_per_publish_finds_the_place_its_move_went_to() {
        let placement = Placement::new(2);
        let a = Home::new(0);
        assert_eq!(placement.place(&a, |_| false), 0);
        // The first route of `b`'s topic finds 0 taken and 1 idle: it moves.
        let b = Home::per_publish(2);
        assert_eq!(placement.place(&b, |place| place == 0), 1);
        // The next publish's route starts at its hash's place again, and
        // goes where the place remembers it, busy or not.
        let rebuilt = Home::per_publish(2);
        assert_eq!(placement.place(&rebuilt, |_| true), 1);
        assert_eq!(rebuilt.place(), 1);
    }

    #[test]
    fn a_transient_route_neither_moves_nor_becomes_resident() {
        let placement = Placement::new(2);
        let (a, b) = (Home::new(0), Home::new(1));
        assert_eq!(placement.place(&a, |_| false), 0);
        assert_eq!(placement.place(&b, |_| false), 1);
        // Place 0 busy, 1 idle: a lasting route would move to 1.
        let transient = Home::transient(2);
        assert_eq!(placement.place(&transient, |place| place == 0), 0);
        assert_eq!(transient.place(), 2);
        // Neither place's resident changed.
        assert_eq!(placement.place(&a, |_| true), 0);
        assert_eq!(placement.place(&b, |_| true), 1);
    }

    #[test]
    fn a_guest_does_not_move_the_route_resident_where_it_stays() {
        let placement = Placement::new(2);
        let (h, x, l) = (Home::new(0), Home::new(1), Home::new(2));
        assert_eq!(placement.place(&h, |_| false), 0);
        assert_eq!(placement.place(&x, |_| false), 1);
        // Every place busy: `l` (home 0) stays at 0 beside `h`.
        assert_eq!(placement.place(&l, |_| true), 0);
        // 1 turns idle while `h` keeps 0 busy: `h` stays home, `l` moves.
        assert_eq!(placement.place(&h, |place| place == 0), 0);
        assert_eq!(h.place(), 0);
        assert_eq!(placement.place(&l, |place| place == 0), 1);
        assert_eq!(l.place(), 1);
    }
}
