//! The store's two clocks. Calendar times (created, expires) are the wall clock's, microseconds
//! since the Unix epoch, as every process on the machine reads it. The age of a record in progress
//! (whether its holder stopped renewing it) is the machine's boot clock's instead, microseconds
//! since the machine booted (`CLOCK_BOOTTIME`, as `/proc/uptime` gives it): every process on one
//! machine reads the same, and an operator or NTP stepping the wall clock moves it neither forward
//! (which would make a live holder look dead) nor back (which would keep a dead one's key for as
//! long as the step). A record renewed under an earlier boot reads as renewed in the future: its
//! holder died with that boot, and it is stale. Where the boot clock cannot be read (not Linux, no
//! `/proc`), records keep none and are judged by the wall clock.

use std::time::{SystemTime, UNIX_EPOCH};

use super::micros;

/// The clocks, as one store reads them.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Clock {
    /// Added to the wall clock: a step of the machine's clock, for tests.
    wall_shift_us: i64,
}

impl Clock {
    /// Now, in microseconds since the Unix epoch.
    pub(super) fn wall_us(&self) -> i64 {
        let now = match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => micros(d),
            Err(_) => 0,
        };
        now.saturating_add(self.wall_shift_us)
    }

    /// Now, in microseconds since the machine booted; `None` where it cannot be read.
    pub(super) fn boot_us(&self) -> Option<i64> {
        boot_us()
    }

    /// This clock, its wall clock stepped by `shift` (forward, or back when `back`).
    #[cfg(any(test, feature = "test-suite"))]
    pub(super) fn stepped(self, shift: std::time::Duration, back: bool) -> Self {
        let shift = micros(shift);
        Clock {
            wall_shift_us: if back {
                self.wall_shift_us.saturating_sub(shift)
            } else {
                self.wall_shift_us.saturating_add(shift)
            },
        }
    }
}

/// `/proc/uptime`'s first field (seconds since boot, suspend included, to the hundredth) in
/// microseconds.
fn boot_us() -> Option<i64> {
    let text = std::fs::read_to_string("/proc/uptime").ok()?;
    let seconds = text.split_whitespace().next()?;
    let (whole, fraction) = seconds.split_once('.').unwrap_or((seconds, "0"));
    let whole: i64 = whole.parse().ok()?;
    let mut fraction_us: i64 = 0;
    for (at, digit) in fraction.chars().take(6).enumerate() {
        fraction_us += i64::from(digit.to_digit(10)?) * 10_i64.pow(5 - at as u32);
    }
    whole.checked_mul(1_000_000)?.checked_add(fraction_us)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_boot_clock_reads_and_moves_forward() {
        let Some(first) = boot_us() else {
            // Not Linux: the store falls back to the wall clock.
            return;
        };
        assert!(first > 0);
        std::thread::sleep(Duration::from_millis(30));
        let second = boot_us().expect("read once, read again");
        assert!(second >= first + 10_000, "{first} then {second}");
    }

    #[test]
    fn a_step_moves_the_wall_clock_only() {
        let clock = Clock::default();
        let stepped = clock.stepped(Duration::from_secs(3600), false);
        let difference = stepped.wall_us() - clock.wall_us();
        assert!(
            (3_599_000_000..3_601_000_000).contains(&difference),
            "{difference}"
        );
        let back = stepped.stepped(Duration::from_secs(7200), true);
        assert!(back.wall_us() < clock.wall_us() - 3_599_000_000);
    }
}
