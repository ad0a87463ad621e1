//! `RunOnce` outside HTTP, on the memory store, a real PostgreSQL and a real Redis: a closure runs once per
//! scope, later calls get its recorded output, duplicates while it runs get `InProgress`, another
//! input gets `KeyReuse`, an error releases, a holder that stopped is retaken once, and
//! the consumer example charges every message once.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum_idempotency::Fingerprint;

/// The transaction a Postgres run-once closure writes through.
#[cfg(feature = "postgres")]
type OnceTx = axum_idempotency::once::OnceTransaction<axum_idempotency::store::PostgresStore>;
use axum_idempotency::once::{OnceError, RunOnce};
use axum_idempotency::store::{ClaimOutcome, ClaimRequest, IdempotencyStore, RecordKey};
use serde_json::json;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

/// The in-progress TTL of these tests: twice the Postgres store's operation timeout here, at least.
const TTL: Duration = Duration::from_millis(1000);

type Outcome<T> = Result<T, OnceError<String>>;

fn scope(key: &str) -> RecordKey {
    RecordKey {
        key: key.to_owned(),
        subject: "consumer".into(),
        endpoint: "queue orders".into(),
    }
}

fn fingerprint(input: u64) -> Fingerprint {
    Fingerprint::of_json(&json!({ "amount": input })).expect("serializes")
}

fn once<St: IdempotencyStore>(store: St) -> RunOnce<St> {
    RunOnce::builder(store)
        .in_progress_ttl(TTL)
        .build()
        .expect("valid settings")
}

/// A closure that counts its runs and returns `value`.
fn counted(
    runs: &Arc<AtomicUsize>,
    value: u64,
) -> impl FnOnce(axum_idempotency::IdempotencyContext) -> std::future::Ready<Result<u64, String>>
+ Send
+ 'static {
    let runs = runs.clone();
    move |_ctx| {
        runs.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(value))
    }
}

async fn first_call_runs_and_later_calls_get_its_output<St: IdempotencyStore>(store: St) {
    let once = once(store);
    let runs = Arc::new(AtomicUsize::new(0));
    let first: Outcome<u64> = once
        .run(scope("m1"), fingerprint(1), counted(&runs, 7))
        .await;
    assert_eq!(first.expect("ran"), 7);
    for _ in 0..3 {
        // Another closure, another value: not run, the recorded output is returned.
        let later: Outcome<u64> = once
            .run(scope("m1"), fingerprint(1), counted(&runs, 99))
            .await;
        assert_eq!(later.expect("replayed"), 7);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // Read back as another type: the record is not that type's.
    let other: Outcome<String> = once
        .run(scope("m1"), fingerprint(1), |_| async {
            Ok("never".to_owned())
        })
        .await;
    assert!(matches!(other, Err(OnceError::Decode(_))), "{other:?}");
}

async fn a_call_while_it_runs_is_in_progress_and_another_input_is_a_mismatch<
    St: IdempotencyStore,
>(
    store: St,
) {
    let once = once(store);
    let gate = Arc::new(Semaphore::new(0));
    let entered = Arc::new(Semaphore::new(0));
    let running = {
        let (once, gate, entered) = (once.clone(), gate.clone(), entered.clone());
        tokio::spawn(async move {
            let out: Outcome<u64> = once
                .run(scope("m2"), fingerprint(2), move |_| async move {
                    entered.add_permits(1);
                    let _ = gate.acquire().await;
                    Ok(42)
                })
                .await;
            out
        })
    };
    let _ = entered.acquire().await.expect("the closure started");
    let runs = Arc::new(AtomicUsize::new(0));
    let duplicate: Outcome<u64> = once
        .run(scope("m2"), fingerprint(2), counted(&runs, 1))
        .await;
    assert!(
        matches!(duplicate, Err(OnceError::InProgress)),
        "{duplicate:?}"
    );
    let other: Outcome<u64> = once
        .run(scope("m2"), fingerprint(3), counted(&runs, 1))
        .await;
    assert!(matches!(other, Err(OnceError::KeyReuse)), "{other:?}");
    gate.add_permits(1);
    assert_eq!(running.await.expect("task").expect("ran"), 42);
    let other: Outcome<u64> = once
        .run(scope("m2"), fingerprint(3), counted(&runs, 1))
        .await;
    assert!(matches!(other, Err(OnceError::KeyReuse)), "{other:?}");
    let replay: Outcome<u64> = once
        .run(scope("m2"), fingerprint(2), counted(&runs, 1))
        .await;
    assert_eq!(replay.expect("replayed"), 42);
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

async fn an_error_or_a_panic_releases_and_the_next_call_runs<St: IdempotencyStore>(store: St) {
    let once = once(store);
    let failed: Outcome<u64> = once
        .run(scope("m3"), fingerprint(3), |_| async {
            Err("card declined".to_owned())
        })
        .await;
    assert!(matches!(&failed, Err(OnceError::Failed(e)) if e == "card declined"));
    let panicked: Outcome<u64> = once
        .run(scope("m3"), fingerprint(3), |_| async { panic!("a bug") })
        .await;
    assert!(matches!(panicked, Err(OnceError::Panicked)), "{panicked:?}");
    let runs = Arc::new(AtomicUsize::new(0));
    let ok: Outcome<u64> = once
        .run(scope("m3"), fingerprint(3), counted(&runs, 5))
        .await;
    assert_eq!(ok.expect("ran again"), 5);
    let replay: Outcome<u64> = once
        .run(scope("m3"), fingerprint(3), counted(&runs, 6))
        .await;
    assert_eq!(replay.expect("replayed"), 5);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

async fn racing_callers_run_it_once_per_round<St: IdempotencyStore>(store: St) {
    const TASKS: usize = 16;
    const ROUNDS: u64 = 20;
    let once = once(store);
    for round in 0..ROUNDS {
        let runs = Arc::new(AtomicUsize::new(0));
        let start = Arc::new(tokio::sync::Barrier::new(TASKS));
        let mut tasks = JoinSet::new();
        for task in 0..TASKS as u64 {
            let (once, runs, start) = (once.clone(), runs.clone(), start.clone());
            tasks.spawn(async move {
                start.wait().await;
                loop {
                    let runs = runs.clone();
                    let out: Outcome<u64> = once
                        .run(scope(&format!("race-{round}")), fingerprint(round), {
                            move |_| async move {
                                runs.fetch_add(1, Ordering::SeqCst);
                                tokio::time::sleep(Duration::from_millis(5)).await;
                                Ok(round * 100 + task)
                            }
                        })
                        .await;
                    match out {
                        Ok(value) => return value,
                        Err(OnceError::InProgress) => {
                            tokio::time::sleep(Duration::from_millis(2)).await
                        }
                        Err(e) => panic!("round {round}: {e}"),
                    }
                }
            });
        }
        let mut values = Vec::new();
        while let Some(value) = tasks.join_next().await {
            values.push(value.expect("task"));
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1, "round {round}");
        assert!(
            values.windows(2).all(|w| w[0] == w[1]),
            "round {round}: every caller got the one output: {values:?}"
        );
    }
}

async fn a_holder_that_stopped_is_retaken_once_after_the_ttl<St: IdempotencyStore>(store: St) {
    let once = once(store.clone());
    // A claim made by another process, which died: its lease is never renewed.
    let dead = ClaimRequest::new(scope("m4"), fingerprint(4), TTL, Duration::from_secs(60));
    assert!(matches!(
        store.claim(&dead).await.expect("claim"),
        ClaimOutcome::Claimed { .. }
    ));
    let runs = Arc::new(AtomicUsize::new(0));
    let early: Outcome<u64> = once
        .run(scope("m4"), fingerprint(4), counted(&runs, 1))
        .await;
    assert!(matches!(early, Err(OnceError::InProgress)), "{early:?}");
    let retakes = Arc::new(AtomicUsize::new(0));
    // Waves a TTL apart: a store that marks a silent holder first (the SQL servers, Redis) takes
    // its record a TTL after the first claim that found it so (the first wave's).
    for _ in 0..2 {
        tokio::time::sleep(TTL + TTL / 5).await;
        let mut tasks = JoinSet::new();
        for task in 0..8u64 {
            let (once, runs, retakes) = (once.clone(), runs.clone(), retakes.clone());
            tasks.spawn(async move {
                let out: Outcome<u64> = once
                    .run(scope("m4"), fingerprint(4), move |ctx| async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        if ctx.is_retake() {
                            retakes.fetch_add(1, Ordering::SeqCst);
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        Ok(400 + task)
                    })
                    .await;
                out
            });
        }
        while let Some(out) = tasks.join_next().await {
            match out.expect("task") {
                Ok(_) | Err(OnceError::InProgress) => {}
                Err(e) => panic!("{e}"),
            }
        }
        if runs.load(Ordering::SeqCst) > 0 {
            break;
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "retaken once");
    assert_eq!(retakes.load(Ordering::SeqCst), 1, "and it says so");
    let value: Outcome<u64> = once
        .run(scope("m4"), fingerprint(4), counted(&runs, 0))
        .await;
    assert!((400..408).contains(&value.expect("replayed")));
    // The dead holder's late completion is fenced off.
    let late = store.release(&dead.key, dead.lease).await.expect("release");
    assert!(!late.is_done());
}

async fn a_caller_that_stops_waiting_cancels_neither_the_run_nor_its_record<
    St: IdempotencyStore,
>(
    store: St,
) {
    let once = once(store);
    let gate = Arc::new(Semaphore::new(0));
    let runs = Arc::new(AtomicUsize::new(0));
    let call = {
        let (gate, runs) = (gate.clone(), runs.clone());
        once.run(scope("m5"), fingerprint(5), move |_| async move {
            let _ = gate.acquire().await;
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<u64, String>(55)
        })
    };
    // The caller gives up (a shutdown timeout, a cancelled select!) while the closure waits.
    assert!(
        tokio::time::timeout(Duration::from_millis(100), call)
            .await
            .is_err()
    );
    let duplicate: Outcome<u64> = once
        .run(scope("m5"), fingerprint(5), counted(&runs, 0))
        .await;
    assert!(
        matches!(duplicate, Err(OnceError::InProgress)),
        "{duplicate:?}"
    );
    gate.add_permits(1);
    assert!(once.drain().wait(Duration::from_secs(10)).await);
    let replay: Outcome<u64> = once
        .run(scope("m5"), fingerprint(5), counted(&runs, 0))
        .await;
    assert_eq!(replay.expect("recorded"), 55);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

async fn a_run_past_the_maximum_hold_is_settled_as_timed_out<St: IdempotencyStore>(store: St) {
    let once = RunOnce::builder(store)
        .in_progress_ttl(TTL)
        .max_hold(TTL)
        .build()
        .expect("valid settings");
    let timed_out: Outcome<u64> = once
        .run(scope("m6"), fingerprint(6), |_| async {
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok(1)
        })
        .await;
    assert!(
        matches!(timed_out, Err(OnceError::TimedOut)),
        "{timed_out:?}"
    );
    let runs = Arc::new(AtomicUsize::new(0));
    let later: Outcome<u64> = once
        .run(scope("m6"), fingerprint(6), counted(&runs, 1))
        .await;
    assert!(matches!(later, Err(OnceError::TimedOut)), "{later:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0, "never runs again");
}

async fn json_inputs_are_fingerprinted_canonically<St: IdempotencyStore>(store: St) {
    let once = once(store);
    let runs = Arc::new(AtomicUsize::new(0));
    let input: serde_json::Value = serde_json::from_str(r#"{"id":7,"amount":100}"#).expect("json");
    let reordered: serde_json::Value =
        serde_json::from_str(r#"{ "amount": 100, "id": 7 }"#).expect("json");
    let first: Outcome<String> = once
        .run_json(scope("m7"), &input, {
            let runs = runs.clone();
            move |ctx| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok(ctx.derived_key())
            }
        })
        .await;
    let key = first.expect("ran");
    assert_eq!(key.len(), 64);
    let again: Outcome<String> = once
        .run_json(scope("m7"), &reordered, |_| async { Ok(String::new()) })
        .await;
    assert_eq!(again.expect("replayed"), key);
    let changed: Outcome<String> = once
        .run_json(scope("m7"), &json!({"id": 7, "amount": 101}), |_| async {
            Ok(String::new())
        })
        .await;
    assert!(matches!(changed, Err(OnceError::KeyReuse)), "{changed:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// With a wait, a call that finds the scope in progress gets the holder's output when it is
/// recorded, without running; one whose holder fails gets `InProgress`, and the next call runs.
async fn a_waiting_call_gets_the_holders_output<St: IdempotencyStore>(store: St) {
    let once = RunOnce::builder(store)
        .in_progress_ttl(TTL)
        .wait(Duration::from_secs(2))
        .build()
        .expect("valid settings");
    let runs = Arc::new(AtomicUsize::new(0));
    for (key, fails) in [("m8", false), ("m9", true)] {
        let holder = {
            let (once, runs) = (once.clone(), runs.clone());
            tokio::spawn(async move {
                let out: Outcome<u64> = once
                    .run(scope(key), fingerprint(8), move |_| async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        if fails {
                            Err("declined".to_owned())
                        } else {
                            Ok(88)
                        }
                    })
                    .await;
                out
            })
        };
        tokio::time::sleep(Duration::from_millis(80)).await;
        let waiter: Outcome<u64> = once
            .run(scope(key), fingerprint(8), counted(&runs, 1))
            .await;
        let holder = holder.await.expect("task");
        if fails {
            assert!(matches!(holder, Err(OnceError::Failed(_))), "{holder:?}");
            assert!(matches!(waiter, Err(OnceError::InProgress)), "{waiter:?}");
        } else {
            assert_eq!(holder.expect("ran"), 88);
            assert_eq!(waiter.expect("the holder's output"), 88);
        }
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "a waiter never runs the closure"
    );
}

/// Each test above on every store: `once::memory::…` and `once::postgres::…`.
macro_rules! on_every_store {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(axum_idempotency::MemoryStore::new()).await;
                }
            )*
        }

        #[cfg(feature = "postgres")]
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::postgres().await).await;
                }
            )*
        }

        #[cfg(feature = "redis")]
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::redis()).await;
                }
            )*
        }
    };
}

/// A Redis store under a key prefix of its own, with an operation timeout short enough for [`TTL`].
#[cfg(feature = "redis")]
fn redis() -> axum_idempotency::store::RedisStore {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let client = ::redis::Client::open(common::servers::redis_url()).expect("REDIS_URL");
    let prefix = format!(
        "idem_once:{}:{}:{}:",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_nanos(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    );
    axum_idempotency::store::RedisStore::new(client)
        .expect("store")
        .with_prefix(&prefix)
        .with_timeout(Duration::from_millis(400))
}

on_every_store!(
    first_call_runs_and_later_calls_get_its_output,
    a_call_while_it_runs_is_in_progress_and_another_input_is_a_mismatch,
    an_error_or_a_panic_releases_and_the_next_call_runs,
    racing_callers_run_it_once_per_round,
    a_holder_that_stopped_is_retaken_once_after_the_ttl,
    a_caller_that_stops_waiting_cancels_neither_the_run_nor_its_record,
    a_run_past_the_maximum_hold_is_settled_as_timed_out,
    json_inputs_are_fingerprinted_canonically,
    a_waiting_call_gets_the_holders_output,
);

/// A Postgres store in a schema of its own (the stores tests drop such schemas after an hour),
/// with an operation timeout short enough for [`TTL`].
#[cfg(feature = "postgres")]
async fn postgres() -> axum_idempotency::store::PostgresStore {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(20)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&common::servers::database_url())
        .await
        .expect("PostgreSQL must be running (see .ci/run)");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let schema = format!(
        "idem_t_{now}_{}_once{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&pool)
        .await
        .expect("create schema");
    let store =
        axum_idempotency::store::PostgresStore::with_table(pool, &format!("{schema}.records"))
            .expect("valid table name")
            .with_timeout(Duration::from_millis(400));
    store.migrate().await.expect("migrate");
    store
}

/// The consumer example, built with this test binary's features (so the library is not built
/// again), run to its end: every message charged once.
#[test]
fn the_consumer_example_charges_every_message_once() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut features = Vec::new();
    for (on, name) in [
        (cfg!(feature = "postgres"), "postgres"),
        (cfg!(feature = "sqlite"), "sqlite"),
        (cfg!(feature = "mysql"), "mysql"),
        (cfg!(feature = "redis"), "redis"),
        (cfg!(feature = "encryption"), "encryption"),
        (cfg!(feature = "metrics"), "metrics"),
        (cfg!(feature = "test-suite"), "test-suite"),
    ] {
        if on {
            features.push(name);
        }
    }
    let status = std::process::Command::new(&cargo)
        .args(["build", "--quiet", "--example", "consumer", "--features"])
        .arg(features.join(","))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("run cargo build");
    assert!(status.success(), "building the example failed");
    let exe = std::env::current_exe().expect("test binary");
    // target/<profile>/deps/<test>-<hash> -> target/<profile>/examples/consumer
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let output = std::process::Command::new(dir.join("examples").join("consumer"))
        .output()
        .expect("run the example");
    assert!(output.status.success(), "the example failed: {output:?}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let summary: serde_json::Value = stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str(line).ok())
        .unwrap_or_else(|| panic!("no JSON summary in {stdout:?}"));
    let messages = summary["messages"].as_u64().expect("messages");
    assert!(messages > 0);
    assert!(summary["deliveries"].as_u64().expect("deliveries") > messages);
    assert_eq!(summary["charges"].as_u64(), Some(messages), "{summary}");
    assert_eq!(summary["double_charges"].as_u64(), Some(0), "{summary}");
}

/// The builder refuses what the layer's builder refuses.
#[test]
fn settings_out_of_bounds_are_refused() {
    use axum_idempotency::MemoryStore;
    let refused = |b: axum_idempotency::once::RunOnceBuilder<MemoryStore>| match b.build() {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    };
    let b = || RunOnce::builder(MemoryStore::new());
    assert!(refused(b().in_progress_ttl(Duration::from_millis(10))).contains("in_progress_ttl"));
    assert!(refused(b().retention(Duration::from_millis(50))).contains("retention"));
    assert!(refused(b().max_hold(Duration::from_secs(1))).contains("max_hold"));
    assert!(refused(b().derived_key_secret("short")).contains("derived_key_secret"));
    assert!(b().in_progress_ttl(Duration::from_secs(1)).build().is_ok());
}

/// `run_in_transaction` on Postgres: the closure's effect and the record of its output commit
/// together; an error rolls the effect back and releases; a lease lost before the commit rolls the
/// effect back and answers `InProgress`; a store without Postgres refuses without running.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_in_the_transaction_commit_with_the_output() {
    let store = postgres().await;
    let table = store.table().to_owned();
    let effects = table.replace(".records", ".effects");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {effects} (message text NOT NULL)"
    )))
    .execute(store.pool())
    .await
    .expect("effects table");
    let count = |message: &'static str| {
        let (pool, effects) = (store.pool().clone(), effects.clone());
        async move {
            let (n,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM {effects} WHERE message = $1"
            )))
            .bind(message)
            .fetch_one(&pool)
            .await
            .expect("count");
            n
        }
    };
    let once = once(store.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let charge = |message: &'static str, fail: bool, steal: bool| {
        let (runs, effects, table) = (runs.clone(), effects.clone(), table.clone());
        let pool = store.pool().clone();
        move |_ctx, mut tx: OnceTx| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {effects} (message) VALUES ($1)"
            )))
            .bind(message)
            .execute(tx.conn().await.map_err(|e| e.to_string())?)
            .await
            .map_err(|e| e.to_string())?;
            if steal {
                // Another process retook the record meanwhile (its lease is not ours any more).
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "UPDATE {table} SET lease_token = 4242 WHERE idempotency_key = $1"
                )))
                .bind(message)
                .execute(&pool)
                .await
                .map_err(|e| e.to_string())?;
            }
            if fail {
                return Err("declined".to_owned());
            }
            Ok((format!("charged {message}"), tx))
        }
    };
    let first: Outcome<String> = once
        .run_in_transaction(scope("t1"), fingerprint(1), charge("t1", false, false))
        .await;
    assert_eq!(first.expect("ran"), "charged t1");
    assert_eq!(count("t1").await, 1);
    let again: Outcome<String> = once
        .run_in_transaction(scope("t1"), fingerprint(1), charge("t1", false, false))
        .await;
    assert_eq!(again.expect("replayed"), "charged t1");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(count("t1").await, 1, "the effect happened once");

    let failed: Outcome<String> = once
        .run_in_transaction(scope("t2"), fingerprint(2), charge("t2", true, false))
        .await;
    assert!(matches!(failed, Err(OnceError::Failed(_))), "{failed:?}");
    assert_eq!(count("t2").await, 0, "rolled back");
    let retried: Outcome<String> = once
        .run_in_transaction(scope("t2"), fingerprint(2), charge("t2", false, false))
        .await;
    assert_eq!(retried.expect("ran again"), "charged t2");
    assert_eq!(count("t2").await, 1);

    let stolen: Outcome<String> = once
        .run_in_transaction(scope("t3"), fingerprint(3), charge("t3", false, true))
        .await;
    assert!(matches!(stolen, Err(OnceError::InProgress)), "{stolen:?}");
    assert_eq!(count("t3").await, 0, "a lost lease commits nothing");

    // t1 once (its replay ran nothing), t2 twice, t3 once. (A store without transactions has no
    // `run_in_transaction` at all: the compiler refuses it.)
    assert_eq!(runs.load(Ordering::SeqCst), 4);
}

/// An output whose `Serialize` panics.
#[derive(Debug)]
struct Boom;

impl serde::Serialize for Boom {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        panic!("the output's Serialize panicked on purpose")
    }
}

impl<'de> serde::Deserialize<'de> for Boom {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        serde::de::IgnoredAny::deserialize(d)?;
        Ok(Boom)
    }
}

/// The closure returned, so its effect happened: an output whose serialization panics settles the
/// scope (the call answers `Encode`, later ones `Decode`), and the closure never runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_serialization_never_runs_the_closure_again() {
    let once = once(axum_idempotency::MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    for _ in 0..3 {
        let runs = runs.clone();
        let out: Outcome<Boom> = once
            .run(scope("boom"), fingerprint(1), move |_| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok(Boom)
            })
            .await;
        assert!(
            matches!(out, Err(OnceError::Encode(_) | OnceError::Decode(_))),
            "{out:?}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the effect happened once");
}

/// A run whose lease was lost while it ran (another process retook the record) does not answer its
/// own output: the retaker's is the record's, and the call answers `InProgress`.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_lost_its_lease_answers_in_progress() {
    let store = postgres().await;
    let (pool, table) = (store.pool().clone(), store.table().to_owned());
    let once = once(store);
    let out: Outcome<u64> = once
        .run(scope("stolen"), fingerprint(1), move |_| async move {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "UPDATE {table} SET lease_token = 4242 WHERE idempotency_key = 'stolen'"
            )))
            .execute(&pool)
            .await
            .map_err(|e| e.to_string())?;
            Ok(5)
        })
        .await;
    assert!(matches!(out, Err(OnceError::InProgress)), "{out:?}");
}
