//! What the description writes, checked on documents built here: every guarded operation gets the
//! layer's contract as the layer is set, nothing else is touched, and the result is a valid
//! OpenAPI 3.1 document whose examples are valid problems.

#[path = "../../tests/common/openapi.rs"]
#[allow(unreachable_pub)]
mod validate;

use http::Method;
use serde_json::{Value, json};
use utoipa::openapi::path::{Operation, ParameterBuilder, ParameterIn};
use utoipa::openapi::response::Response;
use utoipa::openapi::schema::{ObjectBuilder, Type};
use utoipa::openapi::{
    ContentBuilder, HttpMethod, Info, OpenApi, PathItem, PathsBuilder, Required,
};

use crate::{ErrorKind, IdempotencyLayer, IdempotencyLayerBuilder, MemoryStore};

fn answering(status: &str) -> Operation {
    let mut operation = Operation::new();
    operation
        .responses
        .responses
        .insert(status.into(), Response::new("Done").into());
    operation
}

/// `POST /checkout` (201) and `GET /checkout` (200); `PUT` and `DELETE /orders/{id}`; `POST
/// /refund`.
fn document() -> OpenApi {
    let mut checkout = PathItem::new(HttpMethod::Post, answering("201"));
    checkout.get = Some(answering("200"));
    let mut orders = PathItem::new(HttpMethod::Put, answering("200"));
    orders.delete = Some(answering("204"));
    let paths = PathsBuilder::new()
        .path("/checkout", checkout)
        .path("/orders/{id}", orders)
        .path("/refund", PathItem::new(HttpMethod::Post, answering("200")))
        .build();
    OpenApi::new(Info::new("Checkout", "1.0.0"), paths)
}

fn layer() -> IdempotencyLayerBuilder<MemoryStore> {
    IdempotencyLayer::builder(MemoryStore::new())
}

fn documented(builder: IdempotencyLayerBuilder<MemoryStore>) -> Value {
    let mut openapi = document();
    let layer = builder.build().expect("layer");
    // `/checkout` and `/refund` take POST; `/orders/{id}` PUT and DELETE.
    let documented = layer.openapi().document(&mut openapi);
    assert!(documented > 0 && documented <= 4, "{documented}");
    serde_json::to_value(&openapi).expect("json")
}

fn key_parameters(operation: &Value) -> Vec<&Value> {
    operation["parameters"]
        .as_array()
        .map(|all| {
            all.iter()
                .filter(|p| p["in"] == "header")
                .filter(|p| {
                    p["name"]
                        .as_str()
                        .is_some_and(|n| n.eq_ignore_ascii_case("idempotency-key"))
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn guarded_operations_get_the_layers_contract_and_the_document_stays_valid() {
    let doc = documented(
        layer()
            .require_key(true)
            .min_key_length(16)
            .tombstones(std::time::Duration::from_secs(3600)),
    );
    validate::validate(&doc).expect("a valid OpenAPI 3.1 document");
    if std::env::var_os("SHOW_OPENAPI").is_some() {
        println!("{doc:#}");
    }

    let post = &doc["paths"]["/checkout"]["post"];
    let keys = key_parameters(post);
    assert_eq!(keys.len(), 1, "{post:#}");
    assert_eq!(keys[0]["name"], "Idempotency-Key");
    assert_eq!(keys[0]["required"], true);
    assert_eq!(keys[0]["schema"]["minLength"], 16);
    assert_eq!(keys[0]["schema"]["maxLength"], 255);
    // Every status the layer answers with itself, and no other.
    let mut statuses: Vec<String> = ErrorKind::ALL
        .iter()
        .map(|k| k.status().as_str().to_owned())
        .collect();
    statuses.push("201".into());
    statuses.sort();
    statuses.dedup();
    let documented: Vec<&String> = post["responses"]
        .as_object()
        .expect("responses")
        .keys()
        .collect();
    assert_eq!(documented, statuses.iter().collect::<Vec<_>>());
    for status in ["400", "409", "413", "422", "429", "503"] {
        let problem = &post["responses"][status]["content"]["application/problem+json"];
        assert_eq!(
            problem["schema"]["$ref"], "#/components/schemas/IdempotencyProblem",
            "{status}"
        );
    }
    for (status, retry) in [("409", true), ("503", true), ("429", true), ("422", false)] {
        let headers = &post["responses"][status]["headers"];
        assert_eq!(headers.get("Retry-After").is_some(), retry, "{status}");
    }
    let examples = &post["responses"]["400"]["content"]["application/problem+json"]["examples"];
    assert!(examples.get("missing_idempotency_key").is_some());
    assert_eq!(
        post["responses"]["409"]["content"]["application/problem+json"]["examples"]["in_progress"]
            ["value"]["retryAfterSeconds"],
        2
    );
    let created = &post["responses"]["201"]["headers"];
    for header in [
        "Idempotent-Replayed",
        "Idempotency-Replay",
        "Idempotency-Expires",
    ] {
        assert!(created.get(header).is_some(), "{header}: {created:#}");
    }
    assert!(doc["components"]["schemas"]["IdempotencyProblem"].is_object());

    // The layer's other methods (POST, PATCH by default): PUT and DELETE pass through it.
    for (path, method) in [
        ("/checkout", "get"),
        ("/orders/{id}", "put"),
        ("/orders/{id}", "delete"),
    ] {
        let operation = &doc["paths"][path][method];
        assert!(key_parameters(operation).is_empty(), "{method} {path}");
        assert!(
            operation["responses"].get("409").is_none(),
            "{method} {path}"
        );
        let ok = operation["responses"]
            .as_object()
            .and_then(|r| r.values().next())
            .expect("a response");
        assert!(ok.get("headers").is_none(), "{method} {path}");
    }
}

#[test]
fn the_description_follows_the_layers_settings() {
    let doc = documented(
        layer()
            .methods([Method::PUT, Method::DELETE])
            .replay_header("x-replayed")
            .expiry_header(false),
    );
    validate::validate(&doc).expect("valid");
    assert!(key_parameters(&doc["paths"]["/checkout"]["post"]).is_empty());
    let put = &doc["paths"]["/orders/{id}"]["put"];
    let keys = key_parameters(put);
    assert_eq!(keys.len(), 1);
    // Optional, as the layer is set by default: no answer says it is missing.
    assert_eq!(keys[0]["required"], false);
    assert_eq!(keys[0]["schema"]["minLength"], 1);
    let bad_request = &put["responses"]["400"];
    assert!(
        bad_request["content"]["application/problem+json"]["examples"]
            .get("missing_idempotency_key")
            .is_none()
    );
    assert!(
        !bad_request["description"]
            .as_str()
            .expect("description")
            .contains("missing_idempotency_key")
    );
    let headers = &put["responses"]["200"]["headers"];
    assert!(headers.get("X-Replayed").is_some(), "{headers:#}");
    assert!(headers.get("Idempotent-Replayed").is_none());
    assert!(headers.get("Idempotency-Expires").is_none());
    assert!(
        doc["paths"]["/orders/{id}"]["delete"]["responses"]["204"]["headers"]
            .get("X-Replayed")
            .is_some()
    );
}

#[test]
fn applying_it_twice_changes_nothing() {
    let layer = layer().require_key(true).build().expect("layer");
    let mut openapi = document();
    layer.openapi().document(&mut openapi);
    let once = serde_json::to_value(&openapi).expect("json");
    layer.openapi().document(&mut openapi);
    assert_eq!(serde_json::to_value(&openapi).expect("json"), once);
}

#[test]
fn only_the_paths_the_layer_is_on() {
    let layer = layer().build().expect("layer");
    let mut openapi = document();
    assert_eq!(
        layer.openapi().paths(["/checkout"]).document(&mut openapi),
        1
    );
    // A path not written as the document writes it documents nothing, and says so.
    assert_eq!(
        layer
            .openapi()
            .paths(["/orders/:id"])
            .document(&mut openapi),
        0
    );
    let doc = serde_json::to_value(&openapi).expect("json");
    assert_eq!(key_parameters(&doc["paths"]["/checkout"]["post"]).len(), 1);
    assert!(key_parameters(&doc["paths"]["/refund"]["post"]).is_empty());
    assert!(
        doc["paths"]["/refund"]["post"]["responses"]
            .get("409")
            .is_none()
    );
}

#[test]
fn what_the_operation_says_already_is_kept() {
    let mut operation = answering("201");
    let own = ContentBuilder::new().build();
    let own_problem = ContentBuilder::new()
        .schema(Some(ObjectBuilder::new().schema_type(Type::Object)))
        .build();
    operation.responses.responses.insert(
        "409".into(),
        Response::builder()
            .description("Order locked")
            .content("application/problem+json", own_problem)
            .into(),
    );
    operation.responses.responses.insert(
        "400".into(),
        Response::builder()
            .description("Invalid order")
            .content("application/json", own)
            .into(),
    );
    // Written by hand, in lower case and optional: the layer's rule replaces it.
    operation.parameters = Some(vec![
        ParameterBuilder::new()
            .name("idempotency-key")
            .parameter_in(ParameterIn::Header)
            .build()
            .into(),
    ]);
    let mut openapi = OpenApi::new(
        Info::new("Checkout", "1.0.0"),
        PathsBuilder::new()
            .path("/checkout", PathItem::new(HttpMethod::Post, operation))
            .build(),
    );
    let layer = layer().require_key(true).build().expect("layer");
    layer.openapi().document(&mut openapi);
    let doc = serde_json::to_value(&openapi).expect("json");
    validate::validate(&doc).expect("valid");
    let post = &doc["paths"]["/checkout"]["post"];
    let keys = key_parameters(post);
    assert_eq!(keys.len(), 1, "{post:#}");
    assert_eq!(keys[0]["required"], true);
    let bad_request = &post["responses"]["400"];
    assert_eq!(bad_request["description"], "Invalid order");
    assert!(bad_request["content"].get("application/json").is_some());
    assert!(
        bad_request["content"]
            .get("application/problem+json")
            .is_some()
    );
    // The operation's own problem and the layer's: either may answer a 409.
    let conflict = &post["responses"]["409"];
    assert_eq!(conflict["description"], "Order locked");
    let either = &conflict["content"]["application/problem+json"]["schema"]["anyOf"];
    assert_eq!(either[0]["type"], "object", "{conflict:#}");
    assert_eq!(either[1]["$ref"], "#/components/schemas/IdempotencyProblem");
    let examples = &conflict["content"]["application/problem+json"]["examples"];
    assert!(examples.get("in_progress").is_some());
    assert!(conflict["headers"].get("Retry-After").is_some());
    // And once only.
    let once = serde_json::to_value(&openapi).expect("json");
    layer.openapi().document(&mut openapi);
    assert_eq!(serde_json::to_value(&openapi).expect("json"), once);
}

#[test]
fn one_operation_with_its_components() {
    let layer = layer().build().expect("layer");
    let mut operation = answering("200");
    let mut components = utoipa::openapi::Components::new();
    layer
        .openapi()
        .document_operation(&mut operation, &mut components);
    assert!(components.schemas.contains_key(super::PROBLEM_SCHEMA));
    let keys = operation.parameters.as_ref().expect("parameters");
    assert_eq!(keys.len(), 1);
    assert!(matches!(&keys[0], utoipa::openapi::RefOr::T(key) if key.required == Required::False));
    assert!(operation.responses.responses.contains_key("422"));
}

#[test]
fn every_example_and_every_answer_of_the_layer_fits_the_problem_schema() {
    let doc = documented(
        layer()
            .require_key(true)
            .tombstones(std::time::Duration::from_secs(3600)),
    );
    let schema = &doc["components"]["schemas"]["IdempotencyProblem"];
    let mut seen = 0;
    for (status, response) in doc["paths"]["/checkout"]["post"]["responses"]
        .as_object()
        .expect("responses")
    {
        let Some(examples) =
            response["content"]["application/problem+json"]["examples"].as_object()
        else {
            continue;
        };
        for (code, example) in examples {
            let value = &example["value"];
            validate::check_schema(schema, value).unwrap_or_else(|e| panic!("{code}: {e}"));
            assert_eq!(value["status"].to_string(), *status);
            assert_eq!(value["error"], *code);
            seen += 1;
        }
    }
    assert_eq!(seen, ErrorKind::ALL.len());
    // The layer's own answers, retryable or not.
    let types = crate::layer::ProblemTypes::default();
    for kind in ErrorKind::ALL {
        for retry in [None, Some(3)] {
            let body = types.body(kind, "detail", retry, "urn:axum-idempotency:problem:0");
            let body: Value = serde_json::from_str(&body).expect("json");
            validate::check_schema(schema, &body).unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        }
    }
    // And the check bites: a problem without its code is refused.
    let mut missing = json!({"type": "https://example.com/e", "title": "t", "status": 409,
        "detail": "d", "instance": "urn:x", "retryable": true});
    assert!(validate::check_schema(schema, &missing).is_err());
    missing["error"] = "in_progress".into();
    assert!(validate::check_schema(schema, &missing).is_ok());
}

#[test]
fn the_validator_refuses_a_broken_document() {
    let doc = documented(layer());
    validate::validate(&doc).expect("valid");
    let mut no_info = doc.clone();
    no_info.as_object_mut().expect("object").remove("info");
    assert!(validate::validate(&no_info).is_err());
    let mut bad_parameter = doc;
    bad_parameter["paths"]["/checkout"]["post"]["parameters"][0]["in"] = "body".into();
    assert!(validate::validate(&bad_parameter).is_err());
}

#[test]
fn errors_the_application_renders_have_no_problem_schema() {
    let doc = documented(layer().render_errors(|problem| problem.default_response()));
    validate::validate(&doc).expect("valid");
    let conflict = &doc["paths"]["/checkout"]["post"]["responses"]["409"];
    assert!(conflict.get("content").is_none(), "{conflict:#}");
    assert!(conflict["headers"].get("Retry-After").is_some());
    assert!(
        doc["components"]["schemas"]
            .get("IdempotencyProblem")
            .is_none()
    );
}

proptest::proptest! {
    /// Every key the document's pattern allows (within its length) is the key it says to the
    /// layer: accepted, and unchanged.
    #[test]
    fn every_key_the_pattern_allows_the_layer_takes_as_it_is(
        key in super::KEY_PATTERN
            .strip_prefix('^')
            .and_then(|p| p.strip_suffix('$'))
            .expect("an anchored pattern"),
    ) {
        proptest::prop_assume!(key.len() <= crate::layer::key::MAX_KEY_LEN);
        proptest::prop_assert_eq!(crate::layer::key::parse(key.as_bytes()), Ok(key.clone()));
    }
}

#[test]
fn the_expired_answer_is_documented_only_with_tombstones() {
    let without = documented(layer());
    let with = documented(layer().tombstones(std::time::Duration::from_secs(60)));
    let post = |doc: &Value| doc["paths"]["/checkout"]["post"]["responses"]["410"].clone();
    assert!(post(&without).is_null(), "{without:#}");
    let gone = post(&with);
    assert_eq!(
        gone["content"]["application/problem+json"]["examples"]["idempotency_key_expired"]["value"]
            ["status"],
        410,
        "{gone:#}"
    );
}

#[test]
fn the_key_is_documented_where_the_layer_reads_it() {
    // Another header: that header, not the draft's.
    let doc = documented(layer().key_header("X-Request-Id"));
    let post = &doc["paths"]["/checkout"]["post"];
    let headers: Vec<&str> = post["parameters"]
        .as_array()
        .expect("parameters")
        .iter()
        .filter(|p| p["in"] == "header")
        .filter_map(|p| p["name"].as_str())
        .collect();
    assert!(headers.contains(&"X-Request-Id"), "{headers:?}");
    assert!(key_parameters(post).is_empty(), "{post:#}");

    // A body field: in the request's schema, beside what it was, and no header.
    let mut openapi = document();
    let checkout = openapi.paths.paths.get_mut("/checkout").expect("/checkout");
    checkout.post.as_mut().expect("post").request_body = Some(utoipa::openapi::RefOr::T(
        utoipa::openapi::request_body::RequestBodyBuilder::new()
            .content(
                "application/json",
                utoipa::openapi::ContentBuilder::new()
                    .schema(Some(utoipa::openapi::Ref::from_schema_name("Checkout")))
                    .build(),
            )
            .build(),
    ));
    let layer = layer()
        .require_key(true)
        .key_from_body("/meta/request_id")
        .build()
        .expect("layer");
    layer.openapi().document(&mut openapi);
    let doc = serde_json::to_value(&openapi).expect("json");
    validate::validate(&doc).expect("a valid OpenAPI 3.1 document");
    let post = &doc["paths"]["/checkout"]["post"];
    assert!(key_parameters(post).is_empty(), "{post:#}");
    let schema = &post["requestBody"]["content"]["application/json"]["schema"];
    let parts = schema["allOf"]
        .as_array()
        .expect("allOf of the body and the key");
    assert_eq!(parts.len(), 2, "{schema:#}");
    let key = &parts[1];
    assert_eq!(key["required"][0], "meta", "{key:#}");
    let field = &key["properties"]["meta"]["properties"]["request_id"];
    assert_eq!(field["type"], "string", "{key:#}");
    assert_eq!(field["maxLength"], 255);
}
