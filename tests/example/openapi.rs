//! The checkout example's `GET /openapi.json`, fetched over HTTP from the example's process:
//! a valid OpenAPI 3.1 document in which every route behind the idempotency layer, and only those,
//! carries the layer's contract, and whose key parameter says what the running layer does.
#![cfg(all(feature = "postgres", feature = "openapi"))]

use axum::http::StatusCode;
use serde_json::Value;

use crate::common::openapi::validate;
use crate::e2e::{http, serve_memory_with};

const GUARDED: [&str; 2] = ["/checkout", "/refund"];

/// The route keyed by the body's `request_id` rather than a header.
const KEYED_BY_BODY: &str = "/v2/checkout";

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
    let served = serve_memory_with(0, &[]).await;
    let addr = served.addr;

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
            let by_body = method == "post" && path == KEYED_BY_BODY;
            let key = key_parameter(operation);
            assert_eq!(key.is_some(), is_guarded, "{method} {path}");
            let layer_conflict = responses["409"]["headers"].get("Retry-After").is_some();
            assert_eq!(layer_conflict, is_guarded || by_body, "{method} {path}");
            // Tombstones are on: an expired key's 410 is documented.
            let gone = responses["410"]["content"]["application/problem+json"]["examples"]
                .get("idempotency_key_expired")
                .is_some();
            assert_eq!(gone, is_guarded || by_body, "{method} {path}");
            if by_body {
                // The key is a field of the body, documented in its schema, required.
                let schema = &operation["requestBody"]["content"]["application/json"]["schema"];
                let key = &schema["allOf"][1];
                assert_eq!(key["required"][0], "request_id", "{schema:#}");
                assert_eq!(
                    key["properties"]["request_id"]["type"], "string",
                    "{schema:#}"
                );
                continue;
            }
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

/// Every route the document lists is exercised: unauthenticated, it answers the `401` the
/// document gives it, with every member its problem schema requires; authenticated, it answers a
/// status the document lists for it.
#[tokio::test]
async fn every_documented_route_answers_as_documented() {
    let served = serve_memory_with(0, &[]).await;
    let addr = served.addr;
    let doc = http(addr, "GET", "/openapi.json", "alice", None, "")
        .await
        .json();
    let problem = &doc["components"]["schemas"]["CheckoutProblem"];
    let required: Vec<&str> = problem["required"]
        .as_array()
        .expect("the example's problem lists its members")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(required.contains(&"detail") && required.contains(&"instance"));
    assert_eq!(
        doc["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
    let mut exercised = 0;
    for (path, item) in doc["paths"].as_object().expect("paths") {
        let concrete = path.replace("{key}", "no-such-key");
        for (method, operation) in item.as_object().expect("path item") {
            if method == "parameters" {
                continue;
            }
            let responses = &operation["responses"];
            let upper = method.to_uppercase();
            let body = r#"{"amount":100}"#;
            let key = Some("openapi-route");

            let refused = http(addr, &upper, &concrete, "", key, body).await;
            assert_eq!(refused.status, StatusCode::UNAUTHORIZED, "{method} {path}");
            let documented = &responses["401"]["content"]["application/problem+json"]["schema"];
            let own = |s: &Value| s["$ref"] == "#/components/schemas/CheckoutProblem";
            let choices = documented["anyOf"].as_array().cloned().unwrap_or_default();
            assert!(
                own(documented) || choices.iter().any(own),
                "{method} {path} documents its 401: {documented:#}"
            );
            let answer = refused.json();
            for member in &required {
                assert!(answer.get(*member).is_some(), "{member} of {answer:#}");
            }

            let served = http(addr, &upper, &concrete, "alice", key, body).await;
            let status = served.status.as_str().to_owned();
            assert!(
                responses.get(&status).is_some(),
                "{method} {path} answered {status}, which its document does not list: {:?}",
                served.json()
            );
            exercised += 1;
        }
    }
    assert_eq!(exercised, 7, "every documented operation");
}
