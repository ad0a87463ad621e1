//! SQLite files for the tests: one per test, in a directory of the tests' own; files that earlier
//! runs left behind are removed after an hour.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// A path no other test uses.
pub fn fresh_path() -> PathBuf {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join("axum-idempotency-sqlite-tests");
    std::fs::create_dir_all(&dir).expect("the tests' directory");
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for entry in entries.flatten() {
            let old = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > Duration::from_secs(3600));
            if old {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos();
    dir.join(format!(
        "{}-{}-{now}.db",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    ))
}
