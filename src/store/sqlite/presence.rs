//! Presences on one machine (see `store::Presence`): a file per presence, locked by the keeper
//! that shows it, in a folder beside the database (`<database file>-presences/`).
//!
//! The kernel releases a file lock (`flock`) when its process ends, however it ended; a writer
//! holding SQLite's write lock (`BEGIN IMMEDIATE` in a backup, another application, a `sqlite3`
//! shell) does not touch it. A claim that finds a stale record looks at its holder's presence
//! file before taking it: a file locked by someone is a live keeper's, and the record is left to
//! it. A file that is missing is a presence not shown (judged by the TTL); one that is there but
//! unlocked belongs to a process that died.
//!
//! A keeper makes a presence's file under a temporary name, locks it, then renames it into place,
//! so a file found under its name was locked when it got there; it removes the file before it lets
//! go of its lock. The files of a process that died stay; the next keeper session on the file
//! removes those it can lock. An in-memory database has no presences (every holder is in its one
//! process).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::path::{Path, PathBuf};

use crate::store::{Presence, StoreError};

/// Leftover files of dead processes removed per session opened, at most.
const SWEEP: usize = 1000;

/// What a claim learns of a stale record's holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Holder {
    /// Its presence is shown: it lives; the record is left to it.
    Alive,
    /// Its presence is not shown (or cannot be read): judged by the TTL.
    Unknown,
}

/// The folder of presence files of the database at `database` (a file path), or `None` for an
/// in-memory database.
pub(super) fn folder(database: &Path) -> Option<PathBuf> {
    let text = database.to_string_lossy();
    if text.is_empty()
        || text == ":memory:"
        || text.starts_with("file:")
        || text.contains("mode=memory")
    {
        return None;
    }
    // Every process must name the same folder, whatever its working directory.
    let database = std::fs::canonicalize(database).ok()?;
    let mut name = database.file_name()?.to_os_string();
    name.push("-presences");
    Some(database.with_file_name(name))
}

/// Whether the holder of a lease of `presence` lives, as its file says.
pub(super) fn holder(folder: &Path, presence: Presence) -> Holder {
    let file = match File::open(folder.join(file_name(presence))) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Holder::Unknown,
        Err(e) => {
            tracing::warn!(error = %e, "sqlite: a presence file could not be read; judged by the TTL");
            return Holder::Unknown;
        }
    };
    match file.try_lock_shared() {
        // Nobody holds it: its keeper's process ended (the file is swept later).
        Ok(()) => Holder::Unknown,
        Err(TryLockError::WouldBlock) => Holder::Alive,
        Err(TryLockError::Error(e)) => {
            tracing::warn!(error = %e, "sqlite: a presence file could not be locked; judged by the TTL");
            Holder::Unknown
        }
    }
}

fn file_name(presence: Presence) -> String {
    format!("{:08x}", presence.get())
}

/// The presences a keeper session shows: a locked file each.
pub(super) struct Presences {
    folder: PathBuf,
    shown: std::sync::Mutex<BTreeMap<Presence, File>>,
}

impl Presences {
    /// The presences of the database at `folder`'s database; sweeps the files of processes that
    /// died.
    pub(super) fn new(folder: PathBuf) -> Self {
        sweep(&folder);
        Presences {
            folder,
            shown: std::sync::Mutex::new(BTreeMap::new()),
        }
    }

    /// Shows exactly `live` from now on (see `IdempotencyStore::show_presences`).
    pub(super) fn show(&self, live: &[Presence]) -> Result<(), StoreError> {
        let mut shown = crate::util::lock::lock(&self.shown);
        let gone: Vec<Presence> = shown
            .keys()
            .filter(|p| !live.contains(p))
            .copied()
            .collect();
        for presence in gone {
            // Removed before its lock goes: a claim never finds it unlocked under its name.
            let _ = std::fs::remove_file(self.folder.join(file_name(presence)));
            shown.remove(&presence);
        }
        // A file removed under its keeper (the folder cleaned by hand or by a tidier of temporary
        // files) is made again.
        if cfg!(unix) {
            shown.retain(|presence, file| same_file(file, &self.folder.join(file_name(*presence))));
        }
        let mut failed = None;
        for presence in live {
            if shown.contains_key(presence) {
                continue;
            }
            match self.publish(*presence) {
                Ok(file) => {
                    shown.insert(*presence, file);
                }
                Err(e) => failed = Some(e),
            }
        }
        match failed {
            Some(e) => Err(StoreError::new("sqlite presences", e)),
            None => Ok(()),
        }
    }

    /// Makes the locked file of `presence`: under a temporary name, locked, then renamed.
    fn publish(&self, presence: Presence) -> io::Result<File> {
        std::fs::create_dir_all(&self.folder)?;
        let name = file_name(presence);
        let temporary = self.folder.join(format!(
            "{name}.{:016x}.tmp",
            crate::store::Presence::generate().get()
        ));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temporary)?;
        let locked = file.try_lock().map_err(|e| match e {
            TryLockError::WouldBlock => io::Error::from(io::ErrorKind::WouldBlock),
            TryLockError::Error(e) => e,
        });
        if let Err(e) = locked.and_then(|()| std::fs::rename(&temporary, self.folder.join(&name))) {
            let _ = std::fs::remove_file(&temporary);
            return Err(e);
        }
        Ok(file)
    }
}

impl Drop for Presences {
    fn drop(&mut self) {
        let shown = std::mem::take(&mut *crate::util::lock::lock(&self.shown));
        for presence in shown.keys() {
            let _ = std::fs::remove_file(self.folder.join(file_name(*presence)));
        }
    }
}

/// Removes the files in `folder` that no process holds (their keepers died), up to [`SWEEP`].
fn sweep(folder: &Path) {
    let Ok(entries) = std::fs::read_dir(folder) else {
        return;
    };
    for entry in entries.flatten().take(SWEEP) {
        let path = entry.path();
        let Ok(file) = OpenOptions::new().read(true).open(&path) else {
            continue;
        };
        if file.try_lock().is_ok() && same_file(&file, &path) {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// Whether `path` still names the file open as `file` (not one renamed into its place since).
#[cfg(unix)]
fn same_file(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(open), Ok(named)) => open.ino() == named.ino() && open.dev() == named.dev(),
        _ => false,
    }
}

#[cfg(not(unix))]
fn same_file(_file: &File, _path: &Path) -> bool {
    false
}
