//! Times as text, without a date library: the HTTP date of the expiry header (RFC 9110
//! IMF-fixdate, `Sun, 06 Nov 1994 08:49:37 GMT`) and RFC 3339 (`1994-11-06T08:49:37Z`) for
//! inspection. Whole seconds, UTC; times before 1970 are written as 1970.

use std::fmt::Write;
use std::time::{SystemTime, UNIX_EPOCH};

/// Year, month, day, hour, minute, second and weekday (0 = Sunday) of `t`, in UTC.
fn civil(t: SystemTime) -> (i64, u32, u32, u32, u32, u32, usize) {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's days-from-civil, inverted.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    // 1970-01-01 was a Thursday.
    let weekday = ((days + 4).rem_euclid(7)) as usize;
    (
        year,
        month,
        day,
        (rem / 3600) as u32,
        (rem % 3600 / 60) as u32,
        (rem % 60) as u32,
        weekday,
    )
}

/// `t` as an HTTP date (IMF-fixdate).
pub(crate) fn http_date(t: SystemTime) -> String {
    const DAYS: [&str; 7] = ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"];
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let (y, mo, d, h, mi, s, wd) = civil(t);
    let mut out = String::with_capacity(29);
    let _ = write!(
        out,
        "{}, {:02} {} {:04} {:02}:{:02}:{:02} GMT",
        DAYS[wd],
        d,
        MONTHS[(mo as usize).saturating_sub(1) % 12],
        y,
        h,
        mi,
        s
    );
    out
}

/// `t` as RFC 3339, in UTC, to the second.
pub fn rfc3339(t: SystemTime) -> String {
    let (y, mo, d, h, mi, s, _) = civil(t);
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn known_dates() {
        let t = UNIX_EPOCH + Duration::from_secs(784_111_777);
        assert_eq!(http_date(t), "Sun, 06 Nov 1994 08:49:37 GMT");
        assert_eq!(rfc3339(t), "1994-11-06T08:49:37Z");
        assert_eq!(http_date(UNIX_EPOCH), "Thu, 01 Jan 1970 00:00:00 GMT");
        // A leap day, and the last second of a year.
        let leap = UNIX_EPOCH + Duration::from_secs(1_709_208_000);
        assert_eq!(rfc3339(leap), "2024-02-29T12:00:00Z");
        let end = UNIX_EPOCH + Duration::from_secs(1_767_225_599);
        assert_eq!(http_date(end), "Wed, 31 Dec 2025 23:59:59 GMT");
        assert_eq!(
            rfc3339(UNIX_EPOCH - Duration::from_secs(5)),
            "1970-01-01T00:00:00Z"
        );
    }
}
