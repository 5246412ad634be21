//! Backoff and jitter: exact values without jitter, bounds over many seeded draws, the
//! defaults and their validation.

use std::time::Duration;

use retrysafe_core::backoff::{Backoff, Jitter, RetryRng, RngSource};

use super::ms;

#[test]
fn no_jitter_is_exact_and_capped() {
    let b = Backoff::new(ms(50), Duration::from_secs(20), Jitter::None);
    let mut rng = RetryRng::seeded(1);
    let expected = [
        50, 100, 200, 400, 800, 1600, 3200, 6400, 12_800, 20_000, 20_000,
    ];
    for (n, want) in expected.iter().enumerate() {
        assert_eq!(
            b.delay(n as u32, Duration::ZERO, false, &mut rng),
            ms(*want),
            "n={n}"
        );
        assert_eq!(b.exponential(n as u32, false), ms(*want));
    }
    // Huge retry counts saturate at the cap.
    assert_eq!(
        b.delay(31, Duration::ZERO, false, &mut rng),
        Duration::from_secs(20)
    );
    assert_eq!(
        b.delay(u32::MAX, Duration::ZERO, false, &mut rng),
        Duration::from_secs(20)
    );

    // The throttle base: max(base, 1 s) by default, capped.
    assert_eq!(b.throttle_base(), Duration::from_secs(1));
    assert_eq!(
        b.delay(0, Duration::ZERO, true, &mut rng),
        Duration::from_secs(1)
    );
    assert_eq!(
        b.delay(2, Duration::ZERO, true, &mut rng),
        Duration::from_secs(4)
    );
    assert_eq!(
        b.delay(5, Duration::ZERO, true, &mut rng),
        Duration::from_secs(20)
    );
    let small_cap = Backoff::new(ms(10), ms(300), Jitter::None);
    assert_eq!(small_cap.throttle_base(), ms(300));
    let b = b.with_throttle_base(ms(250));
    assert_eq!(b.delay(1, Duration::ZERO, true, &mut rng), ms(500));
    assert!(
        b.with_throttle_base(Duration::from_secs(21))
            .build()
            .is_err()
    );
}

#[test]
fn the_defaults() {
    let b = Backoff::default();
    assert_eq!(b.base(), ms(50));
    assert_eq!(b.throttle_base(), Duration::from_secs(1));
    assert_eq!(b.cap(), Duration::from_secs(20));
    assert_eq!(b.jitter(), Jitter::Full);
}

#[test]
fn backoff_configuration_is_validated() {
    assert_eq!(
        Backoff::new(ms(1), Duration::ZERO, Jitter::Full)
            .build()
            .unwrap_err()
            .field(),
        "backoff cap"
    );
    assert_eq!(
        Backoff::new(ms(10), ms(5), Jitter::Full)
            .build()
            .unwrap_err()
            .field(),
        "backoff base"
    );
    assert!(
        Backoff::new(ms(1), Duration::from_secs(31 * 24 * 3600), Jitter::Full)
            .build()
            .is_err()
    );
    assert!(
        Backoff::new(Duration::ZERO, ms(5), Jitter::Full)
            .build()
            .is_ok()
    );
}

#[test]
fn full_jitter_stays_within_zero_and_the_exponential() {
    let b = Backoff::new(ms(50), Duration::from_secs(2), Jitter::Full);
    for seed in 0..50 {
        let mut rng = RetryRng::seeded(seed);
        for n in 0..8 {
            let exp = b.exponential(n, false);
            let d = b.delay(n, Duration::ZERO, false, &mut rng);
            assert!(d <= exp, "seed {seed} n {n}: {d:?} > {exp:?}");
            assert!(d <= Duration::from_secs(2));
        }
    }
    // Not degenerate: over many draws the delays spread over the range.
    let mut rng = RetryRng::seeded(99);
    let draws: Vec<Duration> = (0..1000)
        .map(|_| b.delay(0, Duration::ZERO, false, &mut rng))
        .collect();
    assert!(draws.iter().any(|d| *d < ms(5)));
    assert!(draws.iter().any(|d| *d > ms(45)));
}

#[test]
fn equal_jitter_stays_within_half_and_the_exponential() {
    let b = Backoff::new(ms(50), Duration::from_secs(2), Jitter::Equal);
    for seed in 0..50 {
        let mut rng = RetryRng::seeded(seed);
        for n in 0..8 {
            let exp = b.exponential(n, false);
            let d = b.delay(n, Duration::ZERO, false, &mut rng);
            assert!(
                d >= exp / 2 && d <= exp,
                "seed {seed} n {n}: {d:?} vs {exp:?}"
            );
        }
    }
}

#[test]
fn decorrelated_jitter_stays_between_base_and_three_times_the_previous_capped() {
    let base = ms(50);
    let cap = Duration::from_secs(2);
    let b = Backoff::new(base, cap, Jitter::Decorrelated);
    for seed in 0..50 {
        let mut rng = RetryRng::seeded(seed);
        let mut previous = Duration::ZERO;
        for n in 0..20 {
            let d = b.delay(n, previous, false, &mut rng);
            let upper = (previous.max(base) * 3).min(cap);
            assert!(
                d >= base && d <= upper,
                "seed {seed} n {n}: {d:?} not in [{base:?}, {upper:?}]"
            );
            previous = d;
        }
    }
    // The first draw is in [base, 3·base].
    let mut rng = RetryRng::seeded(3);
    let d = b.delay(0, Duration::ZERO, false, &mut rng);
    assert!(d >= base && d <= base * 3);
    // With a throttle, the throttle base is the floor.
    let d = b.delay(0, Duration::ZERO, true, &mut rng);
    assert!(d >= Duration::from_secs(1) && d <= cap);
}

#[test]
fn the_same_seed_gives_the_same_sequence() {
    for jitter in [Jitter::Full, Jitter::Equal, Jitter::Decorrelated] {
        let b = Backoff::new(ms(50), Duration::from_secs(20), jitter);
        let run = |seed| {
            let mut rng = RetryRng::seeded(seed);
            let mut previous = Duration::ZERO;
            (0..10)
                .map(|n| {
                    previous = b.delay(n, previous, false, &mut rng);
                    previous
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42), "{jitter:?}");
        assert_ne!(run(42), run(43), "{jitter:?}");
    }
    // A seeded source hands out the same generators in the same order.
    let a = RngSource::seeded(5);
    let b = RngSource::seeded(5);
    for _ in 0..3 {
        let (mut x, mut y) = (a.next_rng(), b.next_rng());
        assert_eq!(
            x.between(Duration::ZERO, Duration::from_secs(1)),
            y.between(Duration::ZERO, Duration::from_secs(1))
        );
    }
    let mut r = RetryRng::seeded(1);
    assert_eq!(r.between(ms(5), ms(5)), ms(5));
    assert_eq!(r.between(ms(5), ms(1)), ms(5));
    let u = r.unit();
    assert!((0.0..1.0).contains(&u));
}
