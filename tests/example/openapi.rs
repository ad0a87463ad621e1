//! The checkout example's `GET /openapi.json`, fetched over HTTP from the example's own router:
//! a valid OpenAPI 3.1 document in which every route behind the idempotency layer, and only those,
//! carries the layer's contract, and whose key parameter says what the running layer does.
#![cfg(all(feature = "postgres", feature = "openapi"))]

use axum::http::StatusCode;
use axum_idempotency::MemoryStore;
use serde_json::Value;

use crate::common::openapi::validate;
use crate::e2e::{checkout, http, serve_layer, settings};

const GUARDED: [&str; 2] = ["/checkout", "/refund"];

fn key_parameter(operation: &Value) -> Option<&Value> {
    operation["parameters"].as_array()?.iter().find(|p| {
        p["in"] == "header"
            && p["name"]
                .as_str()
                .is_some_and(|n| n.eq_ignore_ascii_case("idempotency-key"))
    })
}

#[tokio::test]
async fn the_example_documents_the_layer_on_every_guarded_route() {
    let settings = settings(0);
    let idempotency = checkout::idempotency(MemoryStore::new(), &settings)
        .build()
        .expect("valid settings");
    let addr = serve_layer(idempotency, checkout::Ledger::memory(), settings).await;

    let served = http(addr, "GET", "/openapi.json", "alice", None, "").await;
    assert_eq!(served.status, StatusCode::OK);
    assert_eq!(served.headers["content-type"], "application/json");
    let doc = served.json();
    validate(&doc).expect("a valid OpenAPI 3.1 document");

    let mut guarded = 0;
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, operation) in item.as_object().expect("path item") {
            if method == "parameters" {
                continue;
            }
            let responses = &operation["responses"];
            let is_guarded = method == "post" && GUARDED.contains(&path.as_str());
            let key = key_parameter(operation);
            assert_eq!(key.is_some(), is_guarded, "{method} {path}");
            let layer_conflict = responses["409"]["headers"].get("Retry-After").is_some();
            assert_eq!(layer_conflict, is_guarded, "{method} {path}");
            if !is_guarded {
                continue;
            }
            guarded += 1;
            // The example's layer requires a key.
            assert_eq!(key.expect("key")["required"], true, "{path}");
            for status in ["400", "409", "422", "503"] {
                let schema = &responses[status]["content"]["application/problem+json"]["schema"];
                // The layer's problem, or either the example's own or the layer's (its 400).
                let layers = |s: &Value| s["$ref"] == "#/components/schemas/IdempotencyProblem";
                let choices = schema["anyOf"].as_array().cloned().unwrap_or_default();
                assert!(
                    layers(schema) || choices.iter().any(layers),
                    "{status} of {path}: {schema:#}"
                );
            }
            assert!(responses["503"]["headers"].get("Retry-After").is_some());
            let created = &responses["201"]["headers"];
            assert!(created.get("Idempotent-Replayed").is_some(), "{path}");
            assert!(created.get("Idempotency-Expires").is_some(), "{path}");
            // Its own documentation is kept beside the layer's.
            assert!(created.get("Location").is_some(), "{path}");
            assert!(responses.get("402").is_some(), "{path}");
        }
    }
    assert_eq!(guarded, GUARDED.len());

    // What the document says is what the layer does: a guarded route refuses a request without
    // a key, a route the layer is not on does not.
    for path in GUARDED {
        let answer = http(addr, "POST", path, "alice", None, r#"{"amount":100}"#).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{path}");
        assert_eq!(answer.json()["error"], "missing_idempotency_key", "{path}");
    }
    let charges = http(addr, "GET", "/charges", "alice", None, "").await;
    assert_eq!(charges.status, StatusCode::OK);
}
