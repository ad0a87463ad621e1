//! `cfg(sql)`: on when any SQL store is (`postgres`, `sqlite`, `mysql`), so that what they share
//! is gated by one name, private to the crate, rather than by the list of the three.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(sql)");
    let sql = ["POSTGRES", "SQLITE", "MYSQL"]
        .iter()
        .any(|store| std::env::var_os(format!("CARGO_FEATURE_{store}")).is_some());
    if sql {
        println!("cargo::rustc-cfg=sql");
    }
    println!("cargo::rerun-if-changed=build.rs");
}
